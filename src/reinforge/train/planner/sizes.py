"""The memory planner's arithmetic (`train.planner`): the model's shape, what a plan is sized
from, and the bytes each item of a plan takes: weights, gradients, optimizer and LoRA states,
gathered FSDP layers, activations per token, the logits chunk, the KV cache and generation's
working set. Pure arithmetic over numbers, no torch.

Formulas (bytes; P params, d = dtype bytes of the weights, h hidden, I intermediate, q = heads *
head_dim, kv = kv_heads * head_dim, V vocab, Ly layers, r LoRA rank, c logits chunk tokens)
- weights                 P * d (bf16: 2)
- full fine-tune          gradients P * d; AdamW states P * s with s = 4 (bf16 states), 8 (fp32
                          states) or 12 (fp32 states + fp32 master weights); the chunked LM head
                          sums its weight gradient straight into the parameter's gradient in one
                          process (nothing extra), into a [V, h] buffer of the weights' dtype
                          under FSDP (V * h * d; `train.packing.logprobs`)
- LoRA                    A/B are float32 (PEFT's default): weights, gradients and AdamW states
                          are 4 + 4 + 8 = 16 per trainable parameter; "all-linear" has
                          r * Ly * (7h + 2q + 2kv + 3I) of them (q,k,v,o,gate,up,down: r*(in+out))
- activations per token   one decoder layer saves, without checkpointing,
                          a = 8h + 4dh + d(3q + 2kv) + 4dI
                          (two RMSNorms keep a float32 copy of their input (4h each) and their
                          output (dh each); attention keeps q, k, v, its output and the output's
                          contiguous copy; SwiGLU keeps gate, up, silu(gate) and their product).
                          LoRA on all linear layers adds the seven rank-r intermediates, 7dr:
                          its adapters compute in the base's dtype on the layer's own input
                          (`train.policy.lora.adapters_in_base_dtype`), so no float32 copy of an
                          input is saved (the formula before session 17 counted one,
                          4(5h + q + I) + 28r per token and layer: on G2's 7B it made the plan's
                          activations 1.6x those without LoRA, while the measured peak was 0.83x
                          of the plain estimate, and put checkpointing on for an 80 GB GPU).
                          Per token: (Ly + 1) * a without checkpointing (the + 1: the backward
                          of one layer holds gradients about the size of its activations);
                          Ly * d * h (each layer's input) + 2a (the layer being recomputed and
                          its gradients) with it; plus 4dh for the embedding output, the final
                          hidden state and their gradients. A CPU measurement of saved tensors
                          (bf16 Qwen2 layer) came to 97% of a, and 82% of a with LoRA.
- logits chunk            c * V * (d + 8): the chunk's matmul output and two float32 [c, V] buffers
                          (`train.packing.logprobs`); never the full [tokens, V] logits
- KV cache                2 * Ly * kv_heads * head_dim * d per token, in pages of `page_size`
                          tokens. A group's full prompt pages are shared by its n samples; each
                          sample owns its partial prompt page and its response pages
- generation working set  sampling logits for up to 256 sequences (2 float32 [256, V]) plus one
                          prefill chunk of 8192 tokens through one layer without grad
- LoRA generation copy    the adapted projections' weights merged with their adapters, d bytes
                          each (`engine.lora_merge`); "all-linear" on a dense model:
                          Ly * (2hq + 2h*kv + 3hI); held in generation only (freed with the pool)

Sharded (FSDP over N processes, `num_shards`; `prompts_per_step` is then one process's share):
weights, gradients, AdamW states and LoRA states are divided by N; training gathers two decoder
layers and the embeddings at a time (the layer running and the next, prefetched); generation
gathers all the weights, so it holds the full weights beside the process's own shard.

Replicated (`replicas` = N processes each holding the whole model, `distributed.strategy`):
one process's plan, plus a float32 bucket for averaging gradients over the processes
(`sharding.REDUCE_BUCKET_BYTES`, or all the trainable parameters x 4 B when fewer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from reinforge.sharding import REDUCE_BUCKET_BYTES
from reinforge.train.packing.logprobs import DEFAULT_CHUNK_SIZE

MiB = 1 << 20
GiB = 1 << 30
RESERVE_FRACTION = 0.06
RESERVE_MIN_BYTES = 64 * MiB
GOOD_MICRO_TOKENS = 8192
# The largest micro-batch the planner packs. Past it a micro-batch's kernels outlast its host
# work (per layer and micro-batch), so more tokens buy memory, not speed. Measured on G1 (H200,
# session 15, after the Triton LM-head reductions): 32,768 tokens 1.47-1.52 s update, 6.48 GiB
# peak; 16,384 1.56 s, 5.28 GiB; 8,192 2.23 s (host-bound), 4.62 GiB.
MAX_MICRO_TOKENS = 16384
# ... and where the update replays a kept CUDA graph, whose micro-batches cost no host work: there
# a smaller one costs no speed and its activations come out of the memory generation's KV pool
# takes in turn. G1 on an H100 (session 21, s21d, one call): 16,384 tokens 2.729 s step (update
# 1.582 s), 5.83 GiB peak; 12,288 2.740 s (1.583), 5.37 GiB; 8,192 2.862 s (1.668), 4.92 GiB.
# Since session 23 (the decode graphs' logits and the prefills in the shared mempool) 12,288
# peaks at 5.18 GiB on both kinds (s23b, s23e).
GRAPH_MICRO_TOKENS = 12288
SAMPLING_SEQS = 256
PREFILL_CHUNK_TOKENS = 8192
OPTIMIZER_STATE_BYTES = {"adamw_bf16": 4, "adamw_fp32": 8, "adamw_fp32_master": 12}
LORA_BYTES_PER_PARAM = 16  # float32 weight + gradient + two AdamW states


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
    # mixture of experts (0: dense): `intermediate_size` is then the width a token passes
    # through (top-k experts' plus a shared expert's), `num_params` counts every expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_active_params: int = 0  # parameters a token reads (from_hf_config; dense: num_params)

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
        model_type = config.get("model_type")
        has_bias = config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))
        per_layer = h * q + 2 * h * kv + q * h + 2 * h
        per_layer += (q + 2 * kv) if has_bias else 0
        per_layer += 2 * head_dim if model_type in ("qwen3", "qwen3_moe") else 0  # q/k norms
        embeddings = v * h * (1 if config.get("tie_word_embeddings", False) else 2)
        # transformers 5 saves `num_experts` as `num_local_experts`
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        moe_inter = config.get("moe_intermediate_size", 0)
        active_layer = per_layer + 3 * h * inter
        if experts:  # every layer sparse (decoder_sparse_step 1, no mlp_only_layers), as Qwen's
            shared = config.get("shared_expert_intermediate_size") or 0
            dense_part = per_layer + h * experts + 3 * h * shared + (h if shared else 0)
            inter = config["num_experts_per_tok"] * moe_inter + shared
            active_layer = dense_part + 3 * h * inter
            per_layer = dense_part + experts * 3 * h * moe_inter
        else:
            per_layer = active_layer
        return cls(
            num_experts=experts,
            num_experts_per_tok=config.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=moe_inter if experts else 0,
            num_active_params=embeddings + ly * active_layer + h,
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
    # LoRA decoding from a merged copy (`rollout.lora_generation`): "auto" lets the planner choose
    lora_generation: str = "auto"
    lora_mergeable_params: int | None = None  # default: all-linear (`lora_mergeable_params`)
    # `train.cuda_graphs`: "auto" keeps the update's graph across steps where it fits beside
    # generation, "run" keeps it, "off" (or "step") holds nothing while generating
    update_graph: str = "auto"


def format_bytes(size: int) -> str:
    sign = "-" if size < 0 else ""
    size = abs(size)
    if size >= GiB:
        return f"{sign}{size / GiB:.2f} GiB"
    return f"{sign}{size / MiB:.1f} MiB"


def lora_trainable_params(model: ModelShape, rank: int) -> int:
    """LoRA A/B parameters on every linear layer of the decoder (PEFT's "all-linear")."""
    m = model
    if m.num_experts:  # attention, the router, every expert's gate_up (PEFT: rank 2r) and down
        h, e, i = m.hidden_size, m.num_experts, m.moe_intermediate_size
        attention = 4 * h + 2 * m.q_dim + 2 * m.kv_dim
        return rank * m.num_layers * (attention + (h + e) + 2 * e * (h + 2 * i) + e * (i + h))
    in_plus_out = 7 * m.hidden_size + 2 * m.q_dim + 2 * m.kv_dim + 3 * m.intermediate_size
    return rank * m.num_layers * in_plus_out


def lora_mergeable_params(model: ModelShape) -> int:
    """Weights of the projections a merged LoRA copy holds under "all-linear": attention and a
    dense MLP (a mixture of experts' layers keep their adapters: `engine.lora_merge`)."""
    m = model
    attention = 2 * m.hidden_size * m.q_dim + 2 * m.hidden_size * m.kv_dim
    mlp = 0 if m.num_experts else 3 * m.hidden_size * m.intermediate_size
    return m.num_layers * (attention + mlp)


@dataclass(frozen=True)
class Sizes:
    """The bytes of each item of a plan for one `PlanInputs`, and the bounds (micro-batch tokens,
    KV pages) the plan is chosen within."""

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
    lora_copy: int  # a merged LoRA generation copy's bytes (0 without LoRA)
    lora_copy_held: int  # what of it generation is planned with (`lora_generation` "merged")
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
        """What generation holds besides the KV pool: the full weights, the working set, and a
        merged LoRA copy when planned with one."""
        return self.static + self.gathered_generation + self.generation + self.lora_copy_held

    def page_bytes(self, page_size: int) -> int:
        return page_size * self.kv_per_token


def compute_sizes(x: PlanInputs) -> Sizes:
    m, d, shards = x.model, x.model.dtype_bytes, x.num_shards
    assert shards == 1 or x.replicas == 1, "a model is either sharded or replicated"
    reserve = max(int(x.free_bytes * RESERVE_FRACTION), RESERVE_MIN_BYTES)
    weights = math.ceil(m.num_params * d / shards)
    trainable = m.num_params
    if x.lora_rank is not None:
        trainable = x.lora_trainable_params or lora_trainable_params(m, x.lora_rank)
    lora_copy = 0
    if x.lora_rank is not None:
        count = x.lora_mergeable_params
        lora_copy = d * (lora_mergeable_params(m) if count is None else count)
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
    if m.num_experts:  # the grouped products' k rows per token (engine.moe)
        prefill_per_token += (
            d * m.num_experts_per_tok * (4 * m.hidden_size + 3 * m.moe_intermediate_size)
        )
    prefill = min(PREFILL_CHUNK_TOKENS, num_seqs * seq_len) * prefill_per_token
    tokens_max = max(seq_len, min(num_seqs * seq_len, MAX_MICRO_TOKENS))
    gathered_training = unsharded_accumulation = 0
    if shards > 1:
        gathered_training = 2 * layer_bytes + m.vocab_size * m.hidden_size * d
        # every layer stays gathered (beyond the two counted) and each trainable parameter
        # has a float32 gradient sum, unsharded
        gathered_all = m.num_params * d - weights - gathered_training
        unsharded_accumulation = max(gathered_all, 0) + trainable * 4
    return Sizes(
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
        lora_copy=lora_copy,
        lora_copy_held=lora_copy if x.lora_generation == "merged" else 0,
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
    if m.num_experts:  # k rows per token: gathered inputs, gate/up, down, weighted, unsorted
        layer += d * m.num_experts_per_tok * (4 * h + 3 * m.moe_intermediate_size)
    if x.lora_rank is not None:  # A's output per adapted projection, in the compute dtype
        layer += 7 * d * x.lora_rank
    ends = 4 * d * h
    # The backward of one layer holds gradients about the size of that layer's activations.
    if checkpointing:
        return m.num_layers * d * h + 2 * layer + ends
    return (m.num_layers + 1) * layer + ends


def training_peak(x: PlanInputs, s: Sizes, checkpointing: bool, tokens: int, pages: int) -> int:
    kv = pages * s.page_bytes(x.page_size)
    activations = tokens * activation_bytes_per_token(x, checkpointing)
    return s.training_fixed + kv_in_training(x, kv) + activations
