"""The RL algorithm library: pure tensor functions, chosen by name through `presets`.

  advantages  rewards -> advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++, EMA baseline, GAE)
  losses      LossInputs + PolicyLossSettings -> (loss, metrics): PPO clip, GSPO, CISPO; aggregation
  kl          KL estimators k1/k2/k3, as a loss term or a reward penalty
  value       PPO's value head and clipped value loss
  dapo        dynamic-sampling filter, overlong reward shaping, truncation mask
  mismatch    sampler/trainer mismatch KL and truncated importance sampling
  presets     PRESETS per paper, ADVANTAGES and POLICY_LOSSES registries

See docs/algorithms.md for formulas, defaults and papers.
"""
