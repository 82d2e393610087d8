"""The step's counts as divisors of the losses and their metrics."""

from __future__ import annotations

import torch


def at_least_one(count: float | torch.Tensor) -> float | torch.Tensor:
    """A step count (tokens or sequences) as a divisor: at least 1. A float, or a 0-d device tensor
    where the update replays a CUDA graph (`train.loop.graphs`), which cannot capture a
    comparison read back on the host: there it is clamped on the device."""
    return count.clamp(min=1.0) if isinstance(count, torch.Tensor) else max(count, 1.0)
