"""The runs: `rl.train` and `rl.rl_step` (rollout, advantages, update, log, save), the
`reinforge sft` run (`sft_run`), the session both build on (`session`: setup, the SFT phase,
checkpoints), the learner and its update, the advantage step, diagnostics, the disaggregated
mode and the non-finite policy. It may import the other `train` packages and every layer below
`train`; they never import it."""
