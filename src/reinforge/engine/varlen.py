"""torch's packed (varlen) flash attention, looked up once: `torch_varlen_attn()` is
`torch.nn.attention.varlen.varlen_attn` where torch has it (2.10 and later), else None, and
`varlen_options()` the keyword names it takes, which moved between torch releases (`is_causal`
in 2.10, `window_size` later), so callers read them off its signature.

Both the engine's packed prefill (`prefill_varlen`, below: when no sequence has a cached prefix
and the dtype is bf16/fp16; the reference SDPA loop otherwise) and the trainer's packed attention
(`train.packing.attention`) call it; this module imports no Triton, so the trainer can use it
without importing Triton.
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch

from reinforge.engine.attention import AttentionMetadata, prefill_sdpa

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


def varlen_causal(q_THD, k_TKD, v_TKD, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """torch's packed flash attention, causal within each segment (queries `cu_q`, keys `cu_k`:
    with more keys than queries the diagonal sits at the last key, as the trainer's shared
    prompts need). K/V heads fewer than the queries' are shared (`enable_gqa`) or repeated where
    the kernel cannot share them. Its keyword names moved between torch releases (`is_causal`
    in 2.10, `window_size` later): read off its signature."""
    options = varlen_options()
    kwargs: dict = {}
    if "window_size" in options:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q_THD.shape[1] != k_TKD.shape[1]:
        if "enable_gqa" in options:
            kwargs["enable_gqa"] = True
        else:
            repeats = q_THD.shape[1] // k_TKD.shape[1]
            k_TKD = k_TKD.repeat_interleave(repeats, dim=1)
            v_TKD = v_TKD.repeat_interleave(repeats, dim=1)
    if "scale" in options:
        kwargs["scale"] = scale
    else:
        assert math.isclose(scale, q_THD.shape[-1] ** -0.5), "varlen_attn has no scale argument"
    return torch_varlen_attn()(
        q_THD.contiguous(),
        k_TKD.contiguous(),
        v_TKD.contiguous(),
        cu_q,
        cu_k,
        max_q,
        max_k,
        **kwargs,
    )


def prefill_varlen(q_THD, k_TKD, v_TKD, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Packed causal prefill when every sequence computes its whole context this step (no cached
    prefix) and flash can take the dtype; the reference SDPA loop otherwise."""
    global _varlen_broken
    no_prefix = all(q == c for q, c in zip(meta.query_lens, meta.context_lens_host))
    if (
        no_prefix
        and not _varlen_broken
        and meta.cu_seqlens is not None
        and q_THD.dtype in (torch.bfloat16, torch.float16)
        and torch_varlen_attn() is not None
    ):
        max_len = max(meta.query_lens)
        try:
            cu = meta.cu_seqlens
            return varlen_causal(q_THD, k_TKD, v_TKD, cu, cu, max_len, max_len, scale)
        except (RuntimeError, TypeError) as error:  # its API moved between torch releases
            _varlen_broken = True
            warnings.warn(
                f"varlen_attn failed ({error}); prefill uses the SDPA loop from now on",
                stacklevel=2,
            )
    return prefill_sdpa(q_THD, k_TKD, v_TKD, k_cache, v_cache, meta, scale)


_varlen_broken = False
