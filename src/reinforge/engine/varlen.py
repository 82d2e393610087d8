"""torch's packed (varlen) flash attention, looked up once: `torch_varlen_attn()` is
`torch.nn.attention.varlen.varlen_attn` where torch has it (2.10 and later), else None, and
`varlen_options()` the keyword names it takes, which moved between torch releases (`is_causal`
in 2.10, `window_size` later), so callers read them off its signature.

Both the engine's packed prefill (`engine.triton_attention`) and the trainer's packed attention
(`train.packing.attention`) call it; this module imports only torch, so the trainer can use it
without importing Triton.
"""

from __future__ import annotations

import inspect

try:
    from torch.nn.attention.varlen import varlen_attn as _VARLEN_ATTN
except ImportError:  # torch < 2.10
    _VARLEN_ATTN = None
_OPTIONS = frozenset(inspect.signature(_VARLEN_ATTN).parameters) if _VARLEN_ATTN else frozenset()


# Plain reads of module constants, so torch.compile traces through them: the trainer's compiled
# decoder layers call these inside attention, and a `functools.cache` wrapper or
# `inspect.signature` there broke each layer's graph in three (s18f: dynamo's warnings).
def torch_varlen_attn():
    return _VARLEN_ATTN


def varlen_options() -> frozenset[str]:
    return _OPTIONS
