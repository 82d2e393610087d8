"""torch's packed (varlen) flash attention, looked up once: `torch_varlen_attn()` is
`torch.nn.attention.varlen.varlen_attn` where torch has it (2.10 and later), else None, and
`varlen_options()` the keyword names it takes, which moved between torch releases (`is_causal`
in 2.10, `window_size` later), so callers read them off its signature.

Both the engine's packed prefill (`engine.triton_attention`) and the trainer's packed attention
(`train.packing.attention`) call it; this module imports only torch, so the trainer can use it
without importing Triton.
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def torch_varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def varlen_options() -> frozenset[str]:
    return frozenset(inspect.signature(torch_varlen_attn()).parameters)
