"""The device side of the paged engine: the KV pool tensor and one forward per scheduled step.

Everything that touches tensors lives here; the scheduler hands over a `Batch` of sequences with
their page tables and gets back the last-position logits of each group's leader.
"""

from __future__ import annotations

import torch

from reinforge.engine.attention import AttentionMetadata, select_attention_backend
from reinforge.engine.qwen_forward import ModelShape, forward
from reinforge.engine.scheduler import Batch
from reinforge.engine.sequence import Sequence

DEFAULT_CPU_KV_BYTES = 64 * 2**20
DEFAULT_GPU_FREE_FRACTION = 0.5  # of free memory when no budget is given (the planner's job later)


def kv_bytes_per_block(model, block_size: int) -> int:
    shape = ModelShape.from_config(model.config)
    dtype = next(model.parameters()).dtype
    return shape.num_layers * 2 * block_size * shape.num_kv_heads * shape.head_dim * dtype.itemsize


def num_blocks_for_budget(model, block_size: int, kv_cache_bytes: int | None) -> int:
    """Pages that fit in `kv_cache_bytes`; by default a modest CPU budget, or a fraction of the
    accelerator's free memory."""
    if kv_cache_bytes is None:
        device = next(model.parameters()).device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_bytes = int(free * DEFAULT_GPU_FREE_FRACTION)
        else:
            kv_cache_bytes = DEFAULT_CPU_KV_BYTES
    num_blocks = kv_cache_bytes // kv_bytes_per_block(model, block_size)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_bytes={kv_cache_bytes} is below one KV page "
            f"({kv_bytes_per_block(model, block_size)} bytes); raise it"
        )
    return num_blocks


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        self.shape = ModelShape.from_config(model.config)
        param = next(model.parameters())
        self.device = param.device
        self.backend = select_attention_backend(self.device)
        s = self.shape
        self.kv_cache = torch.zeros(
            (s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim),
            dtype=param.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Computes the step and returns logits [len(batch.groups), vocab]."""
        self._copy_blocks(batch.block_copies)
        prepare = self._prepare_prefill if batch.is_prefill else self._prepare_decode
        input_ids, positions, meta, logits_indices = prepare(batch.leaders)
        return forward(
            self.model,
            input_ids,
            positions,
            self.kv_cache,
            meta,
            logits_indices,
            self.backend,
            self.shape,
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = (torch.tensor(x, device=self.device) for x in zip(*copies))
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _prepare_prefill(self, seqs: list[Sequence]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += (seq.slot(p, self.block_size) for p in range(start, end))
            query_lens.append(end - start)
        logits_indices = torch.tensor(query_lens).cumsum(0) - 1
        return self._tensors(seqs, input_ids, positions, slots, query_lens, logits_indices, True)

    def _prepare_decode(self, seqs: list[Sequence]):
        for seq in seqs:
            assert seq.num_cached_tokens == seq.num_tokens - 1, "decode writes one token"
        positions = [seq.num_tokens - 1 for seq in seqs]
        slots = [seq.slot(p, self.block_size) for seq, p in zip(seqs, positions)]
        input_ids = [seq.last_token_id for seq in seqs]
        logits_indices = torch.arange(len(seqs))
        return self._tensors(
            seqs, input_ids, positions, slots, [1] * len(seqs), logits_indices, False
        )

    def _tensors(self, seqs, input_ids, positions, slots, query_lens, logits_indices, is_prefill):
        max_pages = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (max_pages - len(seq.block_table)) for seq in seqs]
        context_lens = [seq.num_tokens for seq in seqs]

        def to_device(values) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=to_device(slots),
            block_tables=to_device(tables),
            context_lens=to_device(context_lens),
            query_lens=query_lens,
            context_lens_host=context_lens,
        )
        return to_device(input_ids), to_device(positions), meta, to_device(logits_indices)
