"""Every algorithm preset learns the built-in arithmetic task through the real loop (rollout,
score, reference and values, advantages, update) with the task's own reward, from one SFT warm
start per test session: configs/quickstart.toml's story at micro scale. SFT on reference solutions
half written as a sentence ("The answer is 7.") that the strict checker rejects leaves the model
answering that way about a third of the time; a few RL steps remove the habit and the reward rises.
Also: dynamic sampling drops and counts zero-signal groups; a value head and an EMA baseline
survive a checkpoint."""

from pathlib import Path

import pytest
import torch

from reinforge.algorithms.table import PRESETS
from reinforge.checkpoint import TrainerState, load_trainer_state
from reinforge.checkpoint.files import latest_checkpoint
from reinforge.config import SFTConfig, TrainConfig, load_config
from reinforge.eval import EvalResult, evaluate
from reinforge.rollout.sources import sample_groups
from reinforge.run import RunContext
from reinforge.tasks.arithmetic import ArithmeticTasks
from reinforge.train.loop import rl
from reinforge.train.loop.learner import build_learner
from reinforge.train.loop.sft_run import run_sft
from reinforge.train.policy.model import SFT_FINAL

from .test_rl_loop import DigitTasks, NullLogger, make_learner

# One-digit sums: an answer fits in 3 tokens (two digits, EOS); the sentence runs past the 4-token
# budget and, like any answer not led by the number, earns 0. Partial credit for the right digits
# of a wrong number. 16 held-out problems leave the training stream most of the 100 sums. Small
# micro-batches: on the CPU one packed batch of the whole step is slower (0.23 s vs 0.15 s a step).
ARITHMETIC = [
    "model.path=builtin:micro",
    "task.name=arithmetic",
    "task.min_digits=1",
    "task.max_digits=1",
    'task.operations=["+"]',
    "task.sentence_fraction=0.5",
    "task.partial_credit=0.5",
    "task.num_eval=16",
    "train.micro_batch_tokens=512",
    "run.num_threads=1",
    "log.tensorboard=false",
    "log.plot=false",
]
MAX_NEW_TOKENS = 4
NUM_RL_STEPS = 10
# what each preset needs to fit the 4-token budget; everything else is the preset's own. DAPO's
# overlong penalty then falls on truncated answers only.
FITS_THE_BUDGET = {"dapo": ["algorithm.overlong_buffer=1"]}
# Measured with run.seed 0-4 (SFT and RL), the first 8 presets: probe reward +0.085 to +0.27
# (median +0.20), answers cut off at the budget 0.37-0.39 -> at most 0.06. reinforce_pp_token
# (added later), measured at seed 0 only: +0.106 (0.327 -> 0.433), cut off 0.42 -> 0.04.
MIN_REWARD_GAIN = 0.05


@pytest.fixture(scope="session")
def sft_checkpoint(tmp_path_factory) -> Path:
    """The micro model after 400 SFT steps on the task (once per session, about a minute on 2 CPU
    cores), through the code `reinforge sft` runs."""
    out = tmp_path_factory.mktemp("sft-warm-start")
    cfg = load_config(
        SFTConfig,
        None,
        [
            *ARITHMETIC,
            "sft.steps=400",
            # The SFT start the bars were measured from. 400 steps at lr 1e-2 on the micro model
            # are chaotic: with shared prompts (equal in exact arithmetic; per-step losses and
            # gradient norms equal to 1e-7) the same run ends at probe accuracy 0.057 instead of
            # 0.191, and RL's 10 steps from there gain +0.03 to +0.05 (measured 2026-11-24). RL
            # below shares prompts as configured by default.
            "train.share_prompts=false",
            "sft.lr=1e-2",
            "sft.batch_size=32",
            "eval.before_train=false",
            "eval.num_tasks=1",
            "checkpoint.every=0",
        ],
    )
    ctx = RunContext(out / "sft", resume=False, overwrite=False, config_toml="")
    run_sft(cfg, ctx)
    return ctx.run_dir / "checkpoints" / SFT_FINAL


def probe_reward(policy, tasks) -> EvalResult:
    """The task's reward on 64 fixed training-stream prompts, 8 samples each at the rollout
    temperature, one sampling seed: run before and after RL, prompt difficulty and most sampling
    noise cancel out of the difference (rollout rewards come from fresh prompts every step)."""
    prompts = [tasks.train_task(1_000_000 + i) for i in range(64)]
    return evaluate(
        policy.engine,
        policy.tokenizer,
        tasks,
        prompts,
        MAX_NEW_TOKENS,
        seed=123,
        samples_per_task=8,
        temperature=1.0,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_learns_arithmetic_from_an_sft_start(name, sft_checkpoint, tmp_path):
    torch.manual_seed(0)
    cfg = load_config(
        TrainConfig,
        None,
        [
            *ARITHMETIC,
            f"model.path={sft_checkpoint}",
            f"algorithm.name={name}",
            *FITS_THE_BUDGET.get(name, []),
            "rollout.prompts_per_step=8",
            "rollout.samples_per_prompt=8",
            f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
            "optim.lr=1e-3",
            f"run.max_steps={NUM_RL_STEPS}",
        ],
    )
    learner = make_learner(cfg, tmp_path)
    assert (learner.reference is not None) == (PRESETS[name]["kl_coef"] > 0)
    assert (learner.value_head is not None) == PRESETS[name]["value_model"]
    tasks, state = ArithmeticTasks(cfg.task), TrainerState("rl", 0, 0)
    before = probe_reward(learner.policy, tasks)
    assert before.truncation_rate > 0.2  # SFT left the sentence habit for RL to remove
    for step in range(1, NUM_RL_STEPS + 1):
        metrics = rl.rl_step(cfg, learner, tasks, state, step, NullLogger())
        assert metrics["nonfinite_skipped"] == 0.0
    after = probe_reward(learner.policy, tasks)
    print(
        f"{name}: reward {before.reward_mean:.3f} -> {after.reward_mean:.3f}, accuracy "
        f"{before.accuracy:.3f} -> {after.accuracy:.3f}, cut off at the budget "
        f"{before.truncation_rate:.2f} -> {after.truncation_rate:.2f}"
    )
    assert after.reward_mean > before.reward_mean + MIN_REWARD_GAIN
    assert after.truncation_rate < before.truncation_rate / 2
    if PRESETS[name]["kl_coef"] > 0:
        assert "kl_ref" in metrics
    if PRESETS[name]["value_model"]:
        assert metrics["value_loss"] > 0 and "value_clip_frac" in metrics
    if PRESETS[name]["dynamic_sampling"]:
        assert metrics["sampling_rounds"] >= 1 and "dropped_groups" in metrics


def micro_cfg(*overrides: str) -> TrainConfig:
    """The micro model with the dense digit reward's settings (the tests below)."""
    return load_config(
        TrainConfig,
        None,
        [
            "model.path=builtin:micro",
            "rollout.prompts_per_step=8",
            "rollout.samples_per_prompt=8",
            "rollout.max_new_tokens=6",
            "optim.lr=1e-2",
            "train.micro_batch_tokens=4096",
            "run.max_steps=10",
            *overrides,
        ],
    )


class HalfFlatTasks(ArithmeticTasks):
    """Even-numbered training prompts earn 1.0 whatever the completion (a group with no signal);
    odd ones earn a completion-dependent reward (signal, almost surely)."""

    def reward(self, completion: str, task) -> float:
        if int(task.id.rsplit("-", 1)[1]) % 2 == 0:
            return 1.0
        return sum(map(ord, completion)) % 7 / 7


@pytest.mark.parametrize("max_rounds", [4, 1])
def test_dynamic_sampling_drops_flat_groups_and_counts_them(max_rounds):
    cfg = micro_cfg(
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "algorithm.dynamic_sampling=true",
        f"algorithm.max_sampling_rounds={max_rounds}",
    )
    from .test_rl_loop import make_policy

    policy, tasks = make_policy(cfg), HalfFlatTasks(cfg.task)
    state = TrainerState("rl", 0, 0)
    sampled, chosen, metrics = sample_groups(cfg, policy, tasks, state, step=1)
    flat = [len({t.reward for t in g.trajectories}) == 1 for g in chosen]
    counts = {k: metrics[k] for k in ("sampling_rounds", "dropped_groups", "filled_groups")}
    if max_rounds == 4:
        # round 1: 4 prompts, 2 flat; round 2 samples 2 missing / keep rate 1/2 = 4 prompts
        assert counts == {"sampling_rounds": 2.0, "dropped_groups": 4.0, "filled_groups": 0.0}
        assert len(sampled) == 8 and state.data_position == 8
        assert len(chosen) == 4 and not any(flat)
    else:  # capped after one round: the two flat groups fill the batch, and say so
        assert counts == {"sampling_rounds": 1.0, "dropped_groups": 2.0, "filled_groups": 2.0}
        assert len(chosen) == 4 and sum(flat) == 2 and state.data_position == 4


def test_value_head_and_ema_baseline_are_saved_and_restored(tmp_path):
    cfg = micro_cfg("algorithm.name=ppo", "run.max_steps=2")
    learner = make_learner(cfg, tmp_path)
    tasks, state = DigitTasks(cfg.task), TrainerState("rl", 0, 0)
    for step in (1, 2):
        rl.rl_step(cfg, learner, tasks, state, step, NullLogger())
        state.step = step
    ctx = RunContext(tmp_path / "ppo-run", resume=False, overwrite=False, config_toml="")
    rl.save_rl(ctx, cfg, learner, state)
    ckpt = latest_checkpoint(ctx.run_dir)
    resumed = build_learner(cfg, ctx, learner.policy, ckpt, load_trainer_state(ckpt))
    head, again = learner.value_head.state_dict(), resumed.value_head.state_dict()
    assert head["proj.weight"].abs().sum() > 0  # it trained
    assert all(torch.equal(head[k], again[k]) for k in head)
    saved_groups = learner.optimizer.state_dict()["param_groups"]
    assert [g["lr"] for g in resumed.optimizer.state_dict()["param_groups"]] == [
        g["lr"] for g in saved_groups
    ]

    ema_cfg = micro_cfg("algorithm.advantage=ema_baseline", "algorithm.kl_coef=0")
    learner = make_learner(ema_cfg, tmp_path / "ema")
    for step in (1, 2):
        rl.rl_step(ema_cfg, learner, tasks, state, step, NullLogger())
    baseline = learner.algorithm.estimator.baseline.value
    assert baseline != 0.0
    ema_ctx = RunContext(tmp_path / "ema-run", resume=False, overwrite=False, config_toml="")
    rl.save_rl(ema_ctx, ema_cfg, learner, TrainerState("rl", 2, state.data_position))
    ckpt = latest_checkpoint(ema_ctx.run_dir)
    resumed = build_learner(ema_cfg, ema_ctx, learner.policy, ckpt, load_trainer_state(ckpt))
    assert resumed.algorithm.estimator.baseline.value == baseline
