"""PPO's critic in the trainer: a value head (`algorithms.value.ValueHead`) over the policy's final
hidden states, with no second model.

The head reads the hidden states *detached*: the value loss trains the head alone, so the policy's
weights get exactly the policy loss's gradient (no value-loss coefficient to balance against it)
and the head can have its own learning rate (`algorithm.value_lr`, its own AdamW parameter group).
The price is a critic that is a linear probe of the policy's features. The head is float32 and is
saved with every checkpoint (`algorithm_state.pt`).
"""

from __future__ import annotations

import torch

from reinforge.algorithms.value import ValueHead


def build_value_head(model, device) -> ValueHead:
    return ValueHead(model.config.hidden_size).to(device=device, dtype=torch.float32)


def head_values(head: ValueHead, hidden_STH: torch.Tensor) -> torch.Tensor:
    """Values [S, T] from final hidden states; gradient reaches the head only."""
    return head(hidden_STH.detach().float())
