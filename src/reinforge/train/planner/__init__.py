"""The memory plan, made before any weights load: the planner's arithmetic (here, `sizes`,
`rows`), what it is told and what the run takes from it (`memory`), and the token lengths it
sizes from (`lengths`). It may import `train.packing` (the LM head's chunk size),
`train.policy.lora` (an adapter bound on the meta device), `train.sft.demos` (reference
episodes' lengths) and the layers below `train`.

Memory planner: sizes the KV page pool, the training micro-batch token budget and gradient
checkpointing from the device's free memory, so the user never sets a memory fraction.

Pure arithmetic over numbers (no torch, except `free_device_memory`, which reads CUDA's free
memory). `plan_memory(inputs)` returns a `Plan` with a table of (item, bytes, note) rows for
`--dry-run`, or raises `ConfigError` naming the setting to change and to what.

The model's shape, the inputs and the sizes of every item, with their formulas, are in
`train.planner.sizes`; the rows of the `--dry-run` table in `train.planner.rows`. This module
chooses the plan and says what to change when none fits.

Phases share the device: the KV pool is allocated once and stays; gradients exist only while
training (they are freed after each optimizer step). So the plan must satisfy
    static + KV + gradients + head accumulator + logits chunk + T * activations/token <= usable
    static + KV + generation working set                                            <= usable
with usable = free - reserve (6% of free, at least 64 MiB: fragmentation and allocator slack).
Not counted: the [L, L] mask of the CPU packed path (`train.packing`, L*L bytes).

Choices, in order of preference (the first that fits wins; every choice can be overridden, and an
override that cannot fit is refused): no checkpointing with a micro-batch of at least 8192 tokens
and a KV pool for the whole step's rollout; the same with checkpointing; smaller micro-batches
(down to one full-length sequence); then a smaller KV pool (generation runs in waves). The
micro-batch never exceeds the step's rollout tokens or 16,384 tokens. Why 8192: below it small
models leave the GPU partly idle per micro-batch, while checkpointing costs about one extra
forward (a third more training compute) and keeps a wide margin against the estimate's error.
Why up to 16,384: a small model's update is bound by the host's per-layer work per micro-batch
until a micro-batch's kernels outlast it. Session 8 raised the cap to 32,768 when G1's update was
host-bound at 16,384 (train 3.08 -> 2.75 s on an H100); since session 15's Triton LM-head
reductions (fewer, cheaper calls per token) 16,384 is as fast within 3% on an H200 (update 1.56
vs 1.47-1.52 s) for 1.2 GiB less peak memory (5.28 vs 6.48 GiB); 8,192 is host-bound again
(2.23 s). `bench/RESULTS.md`, session 15.

LoRA generation (`rollout.lora_generation`, `engine.lora_merge`): "auto" decodes from a merged
copy of the adapted projections (plain linear layers: the speed of the base model) when the copy
fits beside the chosen KV pool in the generation phase, else applies the adapters at every step;
the KV pool is never shrunk for the copy. "merged" plans the copy in (the pool may shrink for it;
refused when nothing fits), "adapters" leaves it out. The copy is freed with the pool for the
update, so it never meets the training peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from reinforge.errors import ConfigError
from reinforge.train.planner.graph import plan_update_graph
from reinforge.train.planner.rows import report_rows
from reinforge.train.planner.sizes import (
    GOOD_MICRO_TOKENS,
    GRAPH_MICRO_TOKENS,
    LORA_BYTES_PER_PARAM,
    MAX_MICRO_TOKENS,
    OPTIMIZER_STATE_BYTES,
    PREFILL_CHUNK_TOKENS,
    RESERVE_FRACTION,
    RESERVE_MIN_BYTES,
    SAMPLING_SEQS,
    GiB,
    MiB,
    ModelShape,
    PlanInputs,
    Sizes,
    activation_bytes_per_token,
    compute_sizes,
    format_bytes,
    kv_in_training,
    lora_mergeable_params,
    lora_trainable_params,
    training_peak,
)

__all__ = [
    "DEFAULT_LORA_RANK",
    "GOOD_MICRO_TOKENS",
    "GRAPH_MICRO_TOKENS",
    "LORA_BYTES_PER_PARAM",
    "MAX_MICRO_TOKENS",
    "OPTIMIZER_STATE_BYTES",
    "PREFILL_CHUNK_TOKENS",
    "RESERVE_FRACTION",
    "RESERVE_MIN_BYTES",
    "SAMPLING_SEQS",
    "SETTING_CHECKPOINTING",
    "SETTING_KV",
    "SETTING_LORA_GENERATION",
    "SETTING_LORA_RANK",
    "SETTING_MAX_NEW_TOKENS",
    "SETTING_MICRO_TOKENS",
    "SETTING_UNSHARDED",
    "GiB",
    "MiB",
    "ModelShape",
    "Plan",
    "PlanInputs",
    "activation_bytes_per_token",
    "format_bytes",
    "free_device_memory",
    "kv_in_training",
    "lora_mergeable_params",
    "lora_trainable_params",
    "plan_memory",
    "training_peak",
    "unset_overrides",
]

DEFAULT_LORA_RANK = 16

SETTING_MICRO_TOKENS = "train.micro_batch_tokens"
SETTING_KV = "rollout.kv_cache_bytes"
SETTING_CHECKPOINTING = "model.gradient_checkpointing"
SETTING_LORA_RANK = "model.lora.rank"
SETTING_MAX_NEW_TOKENS = "rollout.max_new_tokens"
SETTING_UNSHARDED = "distributed.accumulate_unsharded"
SETTING_LORA_GENERATION = "rollout.lora_generation"


@dataclass(frozen=True)
class Plan:
    kv_cache_bytes: int
    kv_pages: int
    page_size: int
    micro_batch_tokens: int
    gradient_checkpointing: bool
    rows: tuple[tuple[str, int, str], ...]  # (item, bytes, note), for --dry-run
    accumulate_unsharded: bool = False  # FSDP only (`distributed.accumulate_unsharded`)
    lora_generation: str | None = None  # "merged" or "adapters" under LoRA (`lora_generation`)
    lora_generation_note: str = ""  # why, with the bytes
    keeps_update_graph: bool = False  # the update's CUDA graph kept across steps (`.graph`)

    def table(self) -> str:
        width = max(len(item) for item, _, _ in self.rows)
        return "\n".join(
            f"{item:<{width}}  {format_bytes(size):>10}  {note}".rstrip()
            for item, size, note in self.rows
        )


def plan_memory(x: PlanInputs) -> Plan:
    """The plan for `x`, or ConfigError saying which setting to change to what."""
    _check_inputs(x)
    s = compute_sizes(x)
    choice = _search(x, s)
    if choice is None:
        raise _refusal(x, s)
    checkpointing, tokens, pages = choice
    unsharded = _accumulate_unsharded(x, s, checkpointing, tokens, pages)
    mode, note = lora_generation(x, s, pages)
    if mode == "merged":
        s = replace(s, lora_copy_held=s.lora_copy)
    kv = pages * s.page_bytes(x.page_size)
    tokens, graph = plan_update_graph(x, s, tokens, checkpointing, kv)
    return Plan(
        kv_cache_bytes=kv,
        kv_pages=pages,
        page_size=x.page_size,
        micro_batch_tokens=tokens,
        gradient_checkpointing=checkpointing,
        rows=report_rows(x, s, checkpointing, tokens, pages, unsharded, note, graph),
        accumulate_unsharded=unsharded,
        lora_generation=mode,
        lora_generation_note=note,
        keeps_update_graph=graph.keeps,
    )


def lora_generation(x: PlanInputs, s: Sizes, pages: int) -> tuple[str | None, str]:
    """("merged" or "adapters", why) for a LoRA run with a KV pool of `pages`; (None, "") for full
    fine-tuning."""
    if x.lora_rank is None:
        return None, ""
    copy = format_bytes(s.lora_copy)
    if x.lora_generation == "adapters":
        return "adapters", f'{SETTING_LORA_GENERATION} = "adapters" (a merged copy: {copy})'
    if x.lora_generation == "merged":
        return "merged", f'{SETTING_LORA_GENERATION} = "merged": a copy of {copy}, planned in'
    kv = pages * s.page_bytes(x.page_size)
    room = s.usable - s.generation_fixed - kv
    if s.lora_copy <= room:
        return "merged", (
            f"the merged copy ({copy}) fits beside the KV pool ({format_bytes(kv)}) in "
            f"generation: {format_bytes(room)} free there"
        )
    return "adapters", (
        f"the merged copy ({copy}) does not fit beside the KV pool ({format_bytes(kv)}): "
        f"{format_bytes(max(room, 0))} free in generation, and the pool is not shrunk for it"
    )


def _accumulate_unsharded(
    x: PlanInputs, s: Sizes, checkpointing: bool, tokens: int, pages: int
) -> bool:
    """FSDP's micro-batches keep their layers gathered and sum gradients unsharded when that
    fits beside the chosen training peak (the micro-batch and the KV pool are never shrunk for
    it); a forced `true` that does not fit is refused, naming what would."""
    if x.accumulate_unsharded is False or (x.num_shards <= 1 and x.accumulate_unsharded is None):
        return False  # (one process has nothing to gather or reduce: nothing to choose)
    room = s.usable - training_peak(x, s, checkpointing, tokens, pages)
    fits = s.unsharded_accumulation <= room
    if x.accumulate_unsharded and not fits:
        raise ConfigError(
            f"{SETTING_UNSHARDED} = true needs {format_bytes(s.unsharded_accumulation)} more per "
            f"process during training (the gathered weights and a float32 gradient per "
            f"parameter) but {format_bytes(max(room, 0))} is left beside the training peak; set "
            f'{SETTING_UNSHARDED} = false, or leave it "auto" for the planner to choose'
        )
    return fits


def _check_inputs(x: PlanInputs) -> None:
    assert x.optimizer in OPTIMIZER_STATE_BYTES, x.optimizer
    assert min(x.prompt_len, x.response_len, x.samples_per_prompt, x.prompts_per_step) >= 1
    seq_len = x.prompt_len + x.response_len
    if x.micro_batch_tokens is not None and x.micro_batch_tokens < seq_len:
        raise ConfigError(
            f"{SETTING_MICRO_TOKENS} = {x.micro_batch_tokens} is shorter than one full sequence "
            f"(prompt {x.prompt_len} + {SETTING_MAX_NEW_TOKENS} {x.response_len} = {seq_len}); "
            f"use {SETTING_MICRO_TOKENS} >= {seq_len}, or leave it unset"
        )
    if x.kv_cache_bytes is not None:
        need = math.ceil(seq_len / x.page_size) * x.page_size * x.model.kv_bytes_per_token
        if x.kv_cache_bytes < need:
            raise ConfigError(
                f"{SETTING_KV} = {x.kv_cache_bytes} cannot hold one full sequence ({seq_len} "
                f"tokens need {need} bytes); use {SETTING_KV} >= {need}, or leave it unset"
            )


def _search(x: PlanInputs, s: Sizes) -> tuple[bool, int, int] | None:
    """(checkpointing, micro-batch tokens, KV pages) of the first stage that fits."""
    stages = [
        (False, "want", s.tokens_good),
        (True, "want", s.tokens_good),
        (False, "want", s.tokens_min),
        (True, "want", s.tokens_min),
        (False, "shrink", s.tokens_min),
        (True, "shrink", s.tokens_min),
    ]
    if x.gradient_checkpointing is None:  # never trade checkpointing for smaller batches
        stages = [st for st in stages if st[0] or (st[1] == "want" and st[2] == s.tokens_good)]
    else:
        stages = [st for st in stages if st[0] == x.gradient_checkpointing]
    page_bytes = s.page_bytes(x.page_size)
    for checkpointing, kv_mode, tokens_floor in stages:
        per_token = activation_bytes_per_token(x, checkpointing)
        if x.kv_cache_bytes is not None:
            pages = x.kv_cache_bytes // page_bytes
        elif kv_mode == "want":
            pages = s.kv_want_pages
        else:
            tokens = x.micro_batch_tokens or tokens_floor
            room = s.usable - s.generation_fixed
            if not x.kv_released_in_training:
                room = min(room, s.usable - s.training_fixed - tokens * per_token)
            pages = min(s.kv_want_pages, room // page_bytes)
            if pages < s.kv_min_pages:
                continue
        kv = pages * page_bytes
        if s.generation_fixed + kv > s.usable:
            continue
        room = s.usable - s.training_fixed - kv_in_training(x, kv)
        if x.micro_batch_tokens is not None:
            if x.micro_batch_tokens * per_token <= room:
                return checkpointing, x.micro_batch_tokens, pages
            continue
        tokens = min(s.tokens_max, room // per_token) if room > 0 else 0
        if tokens >= tokens_floor:
            return checkpointing, tokens, pages
    return None


def _refusal(x: PlanInputs, s: Sizes) -> ConfigError:
    free = format_bytes(x.free_bytes)
    if x.lora_generation == "merged" and x.lora_rank is not None:
        auto = replace(x, lora_generation="auto")
        if _search(auto, compute_sizes(auto)) is not None:
            return ConfigError(
                f'{SETTING_LORA_GENERATION} = "merged" needs {format_bytes(s.lora_copy)} beside '
                f"the weights and the KV pool during generation, which does not fit in {free} "
                f'with the rest of this job; use {SETTING_LORA_GENERATION} = "auto" (the planner '
                'chooses) or "adapters"'
            )
    overrides = {
        SETTING_MICRO_TOKENS: x.micro_batch_tokens,
        SETTING_KV: x.kv_cache_bytes,
        SETTING_CHECKPOINTING: x.gradient_checkpointing,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    if given and _search(unset_overrides(x), s) is not None:
        settings = ", ".join(f"{k} = {_toml(v)}" for k, v in given.items())
        return ConfigError(
            f"{settings} does not fit in {free} of free memory (with the rest of this job); "
            f"{_override_hint(x, s)}, or leave {' and '.join(given)} unset for the planner to "
            "choose"
        )
    need = _minimum_need(x, s)
    what = "full fine-tuning" if x.lora_rank is None else f"LoRA rank {x.lora_rank}"
    head = f"{what} of this model needs at least {format_bytes(need)} but {free} is free"
    fixes = []
    if x.lora_rank is None:
        lora = replace(unset_overrides(x), lora_rank=DEFAULT_LORA_RANK, lora_trainable_params=None)
        if _search(lora, compute_sizes(lora)) is not None:
            fixes.append(f"use LoRA ({SETTING_LORA_RANK} = {DEFAULT_LORA_RANK})")
    if s.static + s.grads < s.usable:
        tokens = _longest_response_that_fits(x)
        if tokens is not None:
            fixes.append(f"reduce {SETTING_MAX_NEW_TOKENS} to {tokens}")
    gpus = _gpus_needed(x, s)
    if gpus is not None:
        fixes.append(f"use {gpus} GPUs of this size (FSDP shards weights, grads, optimizer)")
    if not fixes:
        fixes.append(f"use a smaller model, or a shorter prompt and {SETTING_MAX_NEW_TOKENS}")
    return ConfigError(f"{head}; " + "; or ".join(fixes))


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def unset_overrides(x: PlanInputs) -> PlanInputs:
    return replace(
        x,
        micro_batch_tokens=None,
        kv_cache_bytes=None,
        gradient_checkpointing=None,
        lora_generation="auto",
    )


def _override_hint(x: PlanInputs, s: Sizes) -> str:
    checkpointing = x.gradient_checkpointing is not False
    per_token = activation_bytes_per_token(x, checkpointing)
    kv = (
        x.kv_cache_bytes
        if x.kv_cache_bytes is not None
        else s.kv_min_pages * s.page_bytes(x.page_size)
    )
    if x.micro_batch_tokens is not None:
        most = (s.usable - s.training_fixed - kv_in_training(x, kv)) // per_token
        if most >= s.tokens_min:
            return f"at most {SETTING_MICRO_TOKENS} = {most} fits"
    if x.kv_cache_bytes is not None:
        tokens = x.micro_batch_tokens or s.tokens_min
        most = s.usable - s.generation_fixed
        if not x.kv_released_in_training:
            most = min(most, s.usable - s.training_fixed - tokens * per_token)
        if most >= s.kv_min_pages * s.page_bytes(x.page_size):
            return f"at most {SETTING_KV} = {most} fits"
    if x.gradient_checkpointing is False:
        return f"{SETTING_CHECKPOINTING} = true fits"
    return "the combination is too large"


def _minimum_need(x: PlanInputs, s: Sizes) -> int:
    kv_min = s.kv_min_pages * s.page_bytes(x.page_size)
    training = s.training_fixed + s.tokens_min * activation_bytes_per_token(x, True)
    return max(training + kv_in_training(x, kv_min), s.generation_fixed + kv_min) + s.reserve


def _longest_response_that_fits(x: PlanInputs) -> int | None:
    base = unset_overrides(x)
    lo, hi = 0, x.response_len - 1  # lo: fits (0 = none found yet)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = replace(base, response_len=mid)
        if _search(trial, compute_sizes(trial)) is not None:
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def _gpus_needed(x: PlanInputs, s: Sizes) -> int | None:
    """GPUs of this size when FSDP shards weights, gradients and optimizer states (generation
    still gathers the full weights); None if no count up to 64 fits."""
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus <= x.num_shards:
            continue
        processes = max(x.num_shards, x.replicas)
        share = max(x.prompts_per_step * processes // gpus, 1)  # each GPU's prompts
        trial = replace(unset_overrides(x), num_shards=gpus, replicas=1, prompts_per_step=share)
        if _search(trial, compute_sizes(trial)) is not None:
            return gpus
    return None


def free_device_memory(device: str = "cuda") -> int | None:
    """Free bytes on a CUDA device now; None elsewhere (pass the budget explicitly)."""
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
