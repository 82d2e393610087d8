"""How large the paged engine's KV pool is: bytes per page, the transient memory a step needs
beside the pool, and the pages a byte budget (or, on CUDA, the free memory) holds."""

from __future__ import annotations

import torch

from reinforge.engine.qwen_forward import ModelShape

# With no budget given off CUDA, the pool grows to what each generate needs to run all its
# sequences at once (no preemption), up to this many bytes.
CPU_KV_GROWTH_LIMIT_BYTES = 2**30
# On an accelerator with no budget given, the pool takes the free memory minus this reserve for
# activations (prefill, logits, sampler, graph pool) and the allocator's fragmentation.
GPU_RESERVE_FRACTION = 0.05  # of total memory
GPU_RESERVE_BYTES = 2**30


def kv_bytes_per_block(model, block_size: int) -> int:
    shape = ModelShape.from_config(model.config)
    dtype = next(model.parameters()).dtype
    return shape.num_layers * 2 * block_size * shape.num_kv_heads * shape.head_dim * dtype.itemsize


def activation_bytes(model, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """An upper estimate of the step's transient memory: a full prefill's largest activations and
    float32 sampler temporaries over the logits of every sequence."""
    config = model.config
    shape = ModelShape.from_config(config)
    itemsize = next(model.parameters()).dtype.itemsize
    per_token = (
        3 * config.intermediate_size
        + 6 * config.hidden_size
        + 2 * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    )
    prefill = max_num_batched_tokens * per_token * itemsize
    logits = max_num_seqs * config.vocab_size * (2 * itemsize + 4 * 4)
    return prefill + logits


def num_blocks_for_budget(
    model,
    block_size: int,
    kv_cache_bytes: int | None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    held_bytes: int = 0,
) -> int:
    """Pages that fit in `kv_cache_bytes`; by default (CUDA only) the device's free memory less a
    reserve for activations (`GPU_RESERVE_*` + `activation_bytes`) and `held_bytes` (what the
    engine will allocate beside the pool: a merged LoRA copy)."""
    if kv_cache_bytes is None:
        device = next(model.parameters()).device
        assert device.type == "cuda", "off CUDA the pool grows with the requests (PagedEngine)"
        free, total = torch.cuda.mem_get_info(device)
        reserve = gpu_reserve_bytes(model, total, max_num_seqs, max_num_batched_tokens)
        kv_cache_bytes = int(free - reserve - held_bytes)
    num_blocks = kv_cache_bytes // kv_bytes_per_block(model, block_size)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_bytes={kv_cache_bytes} is below one KV page "
            f"({kv_bytes_per_block(model, block_size)} bytes); raise it, or free accelerator memory"
        )
    return num_blocks


def gpu_reserve_bytes(model, total: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """What a pool sized from free memory leaves to the rest of generation on an accelerator."""
    activations = activation_bytes(model, max_num_seqs, max_num_batched_tokens)
    return int(GPU_RESERVE_FRACTION * total + GPU_RESERVE_BYTES + activations)
