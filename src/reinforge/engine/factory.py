"""The one place an engine is chosen and built: the trainer's rollouts and validation
(`rollout.engine`), `reinforge eval` and `reinforge serve` (`--engine`) all call `build_engine`.

- "paged": `PagedEngine` (continuous batching over a paged KV pool, shared prompt pages, CUDA
  graphs on a GPU), for the architectures with a paged forward (Qwen2/2.5, Qwen3, Llama; PEFT
  LoRA on their linear layers included). Asked for on any other model, it is a `ConfigError`.
- "simple": `SimpleEngine` (the model's own forward with transformers' KV cache): any causal LM.
- "auto": paged where it is supported, else simple, with a warning saying why.

Both read the model's parameters in place, so a trainer's optimizer step is seen by the next
generate. The KV pool of the paged engine takes `kv_cache_bytes` when given: a trainer passes the
memory planner's budget (`train.planner.memory`), since it shares the device with training; without
it the pool takes the accelerator's free memory less a reserve, or grows with the requests on a
CPU (`PagedEngine`).
"""

from __future__ import annotations

import warnings

from reinforge.engine.base import Engine
from reinforge.errors import ConfigError

ENGINES = ("auto", "paged", "simple")


def build_engine(
    model,
    tokenizer,
    choice: str = "auto",
    *,
    kv_cache_bytes: int | None = None,
    setting: str = "engine",
    lora_generation: str = "auto",
) -> Engine:
    """The engine `choice` names over `model`; `setting` is the config key or flag it came from,
    for error messages. `lora_generation`: how the paged engine decodes a LoRA model
    (`lora_merge`: "merged", "adapters", or "auto")."""
    from reinforge.engine.paged import PagedEngine
    from reinforge.engine.qwen_forward import unsupported_reason
    from reinforge.engine.simple import SimpleEngine

    if choice not in ENGINES:
        raise ConfigError(f"{setting} = {choice!r} is unknown; use one of {list(ENGINES)}")
    if choice == "simple":
        return SimpleEngine(model, tokenizer)
    reason = unsupported_reason(model)
    if reason is None:
        return PagedEngine(
            model, tokenizer, kv_cache_bytes=kv_cache_bytes, lora_generation=lora_generation
        )
    if choice == "paged":
        raise ConfigError(
            f"{setting} = 'paged', but {reason}; use {setting} = 'auto' (the simple engine for "
            "this model) or 'simple'"
        )
    warnings.warn(
        f"{setting} = 'auto': {reason}; generating with the simple engine (the model's own "
        "forward: correct, without paged KV or shared prompt pages, slower)",
        stacklevel=2,
    )
    return SimpleEngine(model, tokenizer)
