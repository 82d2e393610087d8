"""Algorithm presets and the registries the loop picks from by name (no if/elif on names).

A preset is the combination of choices its paper used. Config fields take their defaults from
`PRESETS[name]`; the loop then looks up `ADVANTAGES[preset["advantage"]]` and
`POLICY_LOSSES[preset["loss"]]`. The token-level estimators are not in `ADVANTAGES`: "gae" needs
the value model (`value_model = True`) and runs `advantages.gae_advantages`; "reinforce_pp_token"
runs `advantages.reinforce_pp_token_advantages` (train/loop/advantage_step.py wires both).

The preset data itself lives in `table.py` (plain data, no torch, so the config layer can read
it); it is re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reinforge.algorithms.advantages import (
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from reinforge.algorithms.losses import (
    LossInputs,
    PolicyLossSettings,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
)
from reinforge.algorithms.table import PRESETS, Preset

__all__ = ["ADVANTAGES", "POLICY_LOSSES", "PRESETS", "Preset"]

# (rewards [G, N], scale, eps) -> [G, N]; or (rewards [B], scale, eps, group_sizes) -> [B]
AdvantageFn = Callable[..., torch.Tensor]
PolicyLossFn = Callable[[LossInputs, PolicyLossSettings], tuple[torch.Tensor, dict]]

ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
