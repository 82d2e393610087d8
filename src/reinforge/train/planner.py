"""Memory planner: sizes the KV page pool, the training micro-batch token budget and gradient
checkpointing from the device's free memory, so the user never sets a memory fraction.

Pure arithmetic over numbers (no torch, except `free_device_memory`, which reads CUDA's free
memory). `plan_memory(inputs)` returns a `Plan` with a table of (item, bytes, note) rows for
`--dry-run`, or raises `ConfigError` naming the setting to change and to what.

Formulas (bytes; P params, d = dtype bytes of the weights, h hidden, I intermediate, q = heads *
head_dim, kv = kv_heads * head_dim, V vocab, Ly layers, r LoRA rank, c logits chunk tokens)
- weights                 P * d (bf16: 2)
- full fine-tune          gradients P * d; AdamW states P * s with s = 4 (bf16 states), 8 (fp32
                          states) or 12 (fp32 states + fp32 master weights); the chunked LM head
                          sums its weight gradient straight into the parameter's gradient in one
                          process (nothing extra), into a [V, h] buffer of the weights' dtype
                          under FSDP (V * h * d; `train.logprobs`)
- LoRA                    A/B are float32 (PEFT's default): weights, gradients and AdamW states
                          are 4 + 4 + 8 = 16 per trainable parameter; "all-linear" has
                          r * Ly * (7h + 2q + 2kv + 3I) of them (q,k,v,o,gate,up,down: r*(in+out))
- activations per token   one decoder layer saves, without checkpointing,
                          a = 8h + 4dh + d(3q + 2kv) + 4dI
                          (two RMSNorms keep a float32 copy of their input (4h each) and their
                          output (dh each); attention keeps q, k, v, its output and the output's
                          contiguous copy; SwiGLU keeps gate, up, silu(gate) and their product).
                          LoRA on all linear layers adds its float32 inputs and the rank-r
                          intermediates: 4(5h + q + I) + 28r.
                          Per token: (Ly + 1) * a without checkpointing (the + 1: the backward
                          of one layer holds gradients about the size of its activations);
                          Ly * d * h (each layer's input) + 2a (the layer being recomputed and
                          its gradients) with it; plus 4dh for the embedding output, the final
                          hidden state and their gradients. A CPU measurement of saved tensors
                          (bf16 Qwen2 layer) came to 97% of a, and 82% of a with LoRA.
- logits chunk            c * V * (d + 8): the chunk's matmul output and two float32 [c, V] buffers
                          (`train.logprobs`); never the full [tokens, V] logits
- KV cache                2 * Ly * kv_heads * head_dim * d per token, in pages of `page_size`
                          tokens. A group's full prompt pages are shared by its n samples; each
                          sample owns its partial prompt page and its response pages
- generation working set  sampling logits for up to 256 sequences (2 float32 [256, V]) plus one
                          prefill chunk of 8192 tokens through one layer without grad

Sharded (FSDP over N processes, `num_shards`; `prompts_per_step` is then one process's share):
weights, gradients, AdamW states and LoRA states are divided by N; training gathers two decoder
layers and the embeddings at a time (the layer running and the next, prefetched); generation
gathers all the weights, so it holds the full weights beside the process's own shard.

Replicated (`replicas` = N processes each holding the whole model, `distributed.strategy`):
one process's plan, plus a float32 bucket for averaging gradients over the processes
(`distributed.REDUCE_BUCKET_BYTES`, or all the trainable parameters x 4 B when fewer).

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
micro-batch never exceeds the step's rollout tokens or 32,768 tokens. Why 8192: below it small
models leave the GPU partly idle per micro-batch, while checkpointing costs about one extra
forward (a third more training compute) and keeps a wide margin against the estimate's error.
Why up to 32,768: a small model's update is bound by the host's per-layer work per micro-batch
(G1 on an H100 at 16,384: 1.9 s of host time for 1.4 s of kernels), so fewer, larger
micro-batches are faster (G1: train 3.08 -> 2.75 s, `bench/RESULTS.md` session 8).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from reinforge.distributed import REDUCE_BUCKET_BYTES
from reinforge.errors import ConfigError
from reinforge.train.logprobs import DEFAULT_CHUNK_SIZE

MiB = 1 << 20
GiB = 1 << 30
RESERVE_FRACTION = 0.06
RESERVE_MIN_BYTES = 64 * MiB
GOOD_MICRO_TOKENS = 8192
MAX_MICRO_TOKENS = 32768
SAMPLING_SEQS = 256
PREFILL_CHUNK_TOKENS = 8192
DEFAULT_LORA_RANK = 16
OPTIMIZER_STATE_BYTES = {"adamw_bf16": 4, "adamw_fp32": 8, "adamw_fp32_master": 12}
LORA_BYTES_PER_PARAM = 16  # float32 weight + gradient + two AdamW states

SETTING_MICRO_TOKENS = "train.micro_batch_tokens"
SETTING_KV = "rollout.kv_cache_bytes"
SETTING_CHECKPOINTING = "model.gradient_checkpointing"
SETTING_LORA_RANK = "model.lora.rank"
SETTING_MAX_NEW_TOKENS = "rollout.max_new_tokens"
SETTING_UNSHARDED = "distributed.accumulate_unsharded"


@dataclass(frozen=True)
class ModelShape:
    num_params: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config: Mapping, dtype_bytes: int = 2) -> ModelShape:
        """From a Qwen2/Qwen3/Llama-style HF config dict; parameters are counted from it."""
        h, v, ly = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", heads)
        head_dim = config.get("head_dim") or h // heads
        inter = config["intermediate_size"]
        q, kv = heads * head_dim, kv_heads * head_dim
        has_bias = config.get("attention_bias", config.get("model_type") == "qwen2")
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
        per_layer += (q + 2 * kv) if has_bias else 0
        per_layer += 2 * head_dim if config.get("model_type") == "qwen3" else 0  # q/k norms
        embeddings = v * h * (1 if config.get("tie_word_embeddings", False) else 2)
        return cls(
            num_params=embeddings + ly * per_layer + h,
            num_layers=ly,
            hidden_size=h,
            intermediate_size=inter,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=v,
            dtype_bytes=dtype_bytes,
        )


@dataclass(frozen=True)
class PlanInputs:
    """What the planner sizes from. The last three fields are overrides: None lets it choose."""

    free_bytes: int
    model: ModelShape
    prompt_len: int
    response_len: int
    samples_per_prompt: int
    prompts_per_step: int
    lora_rank: int | None = None  # None: full fine-tune
    lora_trainable_params: int | None = None  # default: all-linear at lora_rank
    optimizer: str = "adamw_fp32"
    page_size: int = 16
    logits_chunk_tokens: int = DEFAULT_CHUNK_SIZE
    micro_batch_tokens: int | None = None
    kv_cache_bytes: int | None = None
    gradient_checkpointing: bool | None = None
    num_shards: int = 1  # FSDP processes; prompts_per_step is then this process's share
    accumulate_unsharded: bool | None = None  # FSDP: gathered weights + float32 gradient sums
    replicas: int = 1  # processes each holding the whole model (num_shards is then 1)
    # The trainer frees the KV pool (and decode graphs) for its update on CUDA
    # (`Engine.release_memory`), so the pool and the training activations never coexist.
    kv_released_in_training: bool = True


@dataclass(frozen=True)
class Plan:
    kv_cache_bytes: int
    kv_pages: int
    page_size: int
    micro_batch_tokens: int
    gradient_checkpointing: bool
    rows: tuple[tuple[str, int, str], ...]  # (item, bytes, note), for --dry-run
    accumulate_unsharded: bool = False  # FSDP only (`distributed.accumulate_unsharded`)

    def table(self) -> str:
        width = max(len(item) for item, _, _ in self.rows)
        return "\n".join(
            f"{item:<{width}}  {format_bytes(size):>10}  {note}".rstrip()
            for item, size, note in self.rows
        )


def format_bytes(size: int) -> str:
    sign = "-" if size < 0 else ""
    size = abs(size)
    if size >= GiB:
        return f"{sign}{size / GiB:.2f} GiB"
    return f"{sign}{size / MiB:.1f} MiB"


def lora_trainable_params(model: ModelShape, rank: int) -> int:
    """LoRA A/B parameters on every linear layer of the decoder (PEFT's "all-linear")."""
    m = model
    in_plus_out = 7 * m.hidden_size + 2 * m.q_dim + 2 * m.kv_dim + 3 * m.intermediate_size
    return rank * m.num_layers * in_plus_out


# ---------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class _Sizes:
    usable: int
    reserve: int
    weights: int  # this process's shard of them
    lora_state: int  # LoRA weights + grads + AdamW states (this process's shard)
    grads: int
    optimizer: int
    head_grad: int
    gathered_generation: int  # the rest of the weights, gathered for generation (FSDP)
    gathered_training: int  # the layers gathered at once in training: one, and the next
    unsharded_accumulation: int  # FSDP, accumulating unsharded: all weights + float32 grad sums
    reduce_bucket: int  # replicated: the float32 bucket the gradients are averaged through
    logits_chunk: int
    generation: int
    kv_per_token: int
    kv_want_pages: int
    kv_min_pages: int
    tokens_min: int
    tokens_good: int
    tokens_max: int

    @property
    def static(self) -> int:
        return self.weights + self.optimizer + self.lora_state

    @property
    def training_fixed(self) -> int:
        fixed = self.static + self.grads + self.head_grad + self.logits_chunk
        return fixed + self.gathered_training + self.reduce_bucket

    @property
    def generation_fixed(self) -> int:
        """What generation holds besides the KV pool: the full weights, and the working set."""
        return self.static + self.gathered_generation + self.generation

    def page_bytes(self, page_size: int) -> int:
        return page_size * self.kv_per_token


def _sizes(x: PlanInputs) -> _Sizes:
    m, d, shards = x.model, x.model.dtype_bytes, x.num_shards
    assert shards == 1 or x.replicas == 1, "a model is either sharded or replicated"
    reserve = max(int(x.free_bytes * RESERVE_FRACTION), RESERVE_MIN_BYTES)
    weights = math.ceil(m.num_params * d / shards)
    trainable = m.num_params
    if x.lora_rank is not None:
        trainable = x.lora_trainable_params or lora_trainable_params(m, x.lora_rank)
    if x.lora_rank is None:
        grads = math.ceil(m.num_params * d / shards)
        optimizer = math.ceil(m.num_params * OPTIMIZER_STATE_BYTES[x.optimizer] / shards)
        head_grad = m.vocab_size * m.hidden_size * d if shards > 1 else 0
        lora_state = 0
    else:
        grads = optimizer = head_grad = 0
        lora_state = math.ceil(trainable * LORA_BYTES_PER_PARAM / shards)
    layer_bytes = (m.num_params - m.vocab_size * m.hidden_size) * d // max(m.num_layers, 1)
    num_seqs = x.prompts_per_step * x.samples_per_prompt
    seq_len = x.prompt_len + x.response_len
    shared_pages = x.prompt_len // x.page_size
    own_pages = math.ceil(
        (x.prompt_len - shared_pages * x.page_size + x.response_len) / x.page_size
    )
    sampling = 2 * min(num_seqs, SAMPLING_SEQS) * m.vocab_size * 4
    prefill_per_token = d * (2 * m.hidden_size + m.q_dim + 2 * m.kv_dim + 2 * m.intermediate_size)
    prefill = min(PREFILL_CHUNK_TOKENS, num_seqs * seq_len) * prefill_per_token
    tokens_max = max(seq_len, min(num_seqs * seq_len, MAX_MICRO_TOKENS))
    gathered_training = unsharded_accumulation = 0
    if shards > 1:
        gathered_training = 2 * layer_bytes + m.vocab_size * m.hidden_size * d
        # every layer stays gathered (beyond the two counted) and each trainable parameter
        # has a float32 gradient sum, unsharded
        gathered_all = m.num_params * d - weights - gathered_training
        unsharded_accumulation = max(gathered_all, 0) + trainable * 4
    return _Sizes(
        usable=x.free_bytes - reserve,
        reserve=reserve,
        weights=weights,
        lora_state=lora_state,
        grads=grads,
        optimizer=optimizer,
        head_grad=head_grad,
        gathered_generation=m.num_params * d - weights if shards > 1 else 0,
        gathered_training=gathered_training,
        unsharded_accumulation=unsharded_accumulation,
        reduce_bucket=min(REDUCE_BUCKET_BYTES, trainable * 4) if x.replicas > 1 else 0,
        logits_chunk=x.logits_chunk_tokens * m.vocab_size * (d + 8),
        generation=sampling + prefill,
        kv_per_token=m.kv_bytes_per_token,
        kv_want_pages=x.prompts_per_step * (shared_pages + x.samples_per_prompt * own_pages),
        kv_min_pages=math.ceil(seq_len / x.page_size),
        tokens_min=seq_len,
        tokens_good=min(tokens_max, max(seq_len, GOOD_MICRO_TOKENS)),
        tokens_max=tokens_max,
    )


def kv_in_training(x: PlanInputs, kv: int) -> int:
    """What of a `kv`-byte pool is still held during the update."""
    return 0 if x.kv_released_in_training else kv


def activation_bytes_per_token(x: PlanInputs, checkpointing: bool) -> int:
    m, d = x.model, x.model.dtype_bytes
    h, q, kv, inter = m.hidden_size, m.q_dim, m.kv_dim, m.intermediate_size
    layer = 8 * h + 4 * d * h + d * (3 * q + 2 * kv) + 4 * d * inter
    if x.lora_rank is not None:
        layer += 4 * (5 * h + q + inter) + 28 * x.lora_rank
    ends = 4 * d * h
    # The backward of one layer holds gradients about the size of that layer's activations.
    if checkpointing:
        return m.num_layers * d * h + 2 * layer + ends
    return (m.num_layers + 1) * layer + ends


# ---------------------------------------------------------------------------------------------
# Choosing


def plan_memory(x: PlanInputs) -> Plan:
    """The plan for `x`, or ConfigError saying which setting to change to what."""
    _check_inputs(x)
    s = _sizes(x)
    choice = _search(x, s)
    if choice is None:
        raise _refusal(x, s)
    checkpointing, tokens, pages = choice
    unsharded = _accumulate_unsharded(x, s, checkpointing, tokens, pages)
    return Plan(
        kv_cache_bytes=pages * s.page_bytes(x.page_size),
        kv_pages=pages,
        page_size=x.page_size,
        micro_batch_tokens=tokens,
        gradient_checkpointing=checkpointing,
        rows=_rows(x, s, checkpointing, tokens, pages, unsharded),
        accumulate_unsharded=unsharded,
    )


def training_peak(x: PlanInputs, s: _Sizes, checkpointing: bool, tokens: int, pages: int) -> int:
    kv = pages * s.page_bytes(x.page_size)
    activations = tokens * activation_bytes_per_token(x, checkpointing)
    return s.training_fixed + kv_in_training(x, kv) + activations


def _accumulate_unsharded(
    x: PlanInputs, s: _Sizes, checkpointing: bool, tokens: int, pages: int
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


def _search(x: PlanInputs, s: _Sizes) -> tuple[bool, int, int] | None:
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


def _refusal(x: PlanInputs, s: _Sizes) -> ConfigError:
    free = format_bytes(x.free_bytes)
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
        if _search(lora, _sizes(lora)) is not None:
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
    return replace(x, micro_batch_tokens=None, kv_cache_bytes=None, gradient_checkpointing=None)


def _override_hint(x: PlanInputs, s: _Sizes) -> str:
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


def _minimum_need(x: PlanInputs, s: _Sizes) -> int:
    kv_min = s.kv_min_pages * s.page_bytes(x.page_size)
    training = s.training_fixed + s.tokens_min * activation_bytes_per_token(x, True)
    return max(training + kv_in_training(x, kv_min), s.generation_fixed + kv_min) + s.reserve


def _longest_response_that_fits(x: PlanInputs) -> int | None:
    base = unset_overrides(x)
    lo, hi = 0, x.response_len - 1  # lo: fits (0 = none found yet)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = replace(base, response_len=mid)
        if _search(trial, _sizes(trial)) is not None:
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def _gpus_needed(x: PlanInputs, s: _Sizes) -> int | None:
    """GPUs of this size when FSDP shards weights, gradients and optimizer states (generation
    still gathers the full weights); None if no count up to 64 fits."""
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus <= x.num_shards:
            continue
        processes = max(x.num_shards, x.replicas)
        share = max(x.prompts_per_step * processes // gpus, 1)  # each GPU's prompts
        trial = replace(unset_overrides(x), num_shards=gpus, replicas=1, prompts_per_step=share)
        if _search(trial, _sizes(trial)) is not None:
            return gpus
    return None


def _rows(x: PlanInputs, s: _Sizes, checkpointing: bool, tokens: int, pages: int, unsharded: bool):
    m, d = x.model, x.model.dtype_bytes
    per_token = activation_bytes_per_token(x, checkpointing)
    kv = pages * s.page_bytes(x.page_size)
    total_seqs = x.prompts_per_step * x.samples_per_prompt
    seqs_held = min(total_seqs, pages * total_seqs // s.kv_want_pages)
    peak_training = training_peak(x, s, checkpointing, tokens, pages)
    if unsharded:
        peak_training += s.unsharded_accumulation
    generation_peak = s.generation_fixed + kv
    shards = x.num_shards
    per = f" / {shards} processes (FSDP shard)" if shards > 1 else ""
    if x.replicas > 1:
        per = f" (whole, on each of {x.replicas} processes)"
    rows = [
        ("free device memory", x.free_bytes, ""),
        ("reserve", s.reserve, f"{RESERVE_FRACTION:.0%} of free: fragmentation, allocator"),
        ("weights", s.weights, f"{m.num_params:,} params x {d} B{per}"),
    ]
    if shards > 1:
        rows += [
            ("gathered weights, generation", s.gathered_generation, "the other shards, gathered"),
            ("gathered weights, training", s.gathered_training, "two layers + embeddings"),
            (
                "unsharded accumulation",
                s.unsharded_accumulation if unsharded else 0,
                "all layers gathered + float32 gradient sums for the step: "
                + (
                    "on"
                    if unsharded
                    else f"off (would need {format_bytes(s.unsharded_accumulation)})"
                ),
            ),
        ]
    if x.replicas > 1:
        rows.append(
            (
                "gradient all-reduce bucket",
                s.reduce_bucket,
                "float32, gradients averaged over the processes once per step",
            )
        )
    if x.lora_rank is None:
        state_bytes = OPTIMIZER_STATE_BYTES[x.optimizer]
        rows += [
            ("gradients", s.grads, f"{m.num_params:,} x {d} B{per} (training phase only)"),
            ("optimizer states", s.optimizer, f"{x.optimizer}: {state_bytes} B/param{per}"),
            ("LM head grad buffer", s.head_grad, "[V, H] in the weights' dtype (FSDP only)"),
        ]
    else:
        trainable = x.lora_trainable_params or lora_trainable_params(m, x.lora_rank)
        rows.append(
            (
                "LoRA adapter + grads + AdamW",
                s.lora_state,
                f"rank {x.lora_rank}: {trainable:,} float32 params x {LORA_BYTES_PER_PARAM} B{per}",
            )
        )
    mode = "checkpointing on" if checkpointing else "checkpointing off"
    rows += [
        (
            "logits chunk",
            s.logits_chunk,
            f"{x.logits_chunk_tokens} tokens x {m.vocab_size:,} x {d + 8} B",
        ),
        (
            "activations",
            tokens * per_token,
            f"{tokens:,} tokens/micro-batch x {per_token:,} B ({mode})",
        ),
        (
            "KV cache",
            kv,
            f"{pages:,} pages x {x.page_size} tokens x {s.kv_per_token:,} B; "
            f"about {seqs_held} of {total_seqs} sequences at once"
            + ("; freed for the update" if x.kv_released_in_training else ""),
        ),
        ("generation working set", s.generation, "sampling logits + one prefill chunk"),
        ("peak, training phase", peak_training, ""),
        ("peak, generation phase", generation_peak, ""),
        ("headroom", s.usable - max(peak_training, generation_peak), "unused after the reserve"),
    ]
    return tuple(rows)


def free_device_memory(device: str = "cuda") -> int | None:
    """Free bytes on a CUDA device now; None elsewhere (pass the budget explicitly)."""
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
