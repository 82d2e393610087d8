"""The engine's side of the memory pool it shares with a trainer's captured update
(`ModelRunner.share_memory`, `train.loop.graphs.share_memory`).

Everything the engine puts there is allocated on the capture stream: the caching allocator
hands a freed block out again only on the stream it was allocated on, and the update's capture
runs on that stream.

- `pool_block`: the KV pool and the decode graphs' logits rows as one block, so both are
  released before the update and come back at the same address after it (a separate logits
  buffer would stay allocated through the update: G1, 78 MB at 256 rows).
- `MempoolPrefills`: a prefill's activations allocated in the mempool, where the update's memory
  is free while the engine generates (G1: ~0.14 GiB of prefill inside the ~0.7 GiB beside the KV
  pool), and the allocator peaks those prefills set, so the step's peak can leave them out (the
  mempool's reserved bytes already count that memory: `train.loop.graphs.held_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from reinforge.engine.cuda_graphs import capture_stream


def pool_block(
    shape: tuple[int, ...], logits_shape: tuple[int, int], dtype, device, mempool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(KV pool of `shape`, logits rows of `logits_shape` or None when it has no rows), views of
    one zeroed block in `mempool`. Zeroed on the current stream, after whatever last used the
    memory (in a shared pool it holds the last update's activations)."""
    kv_numel = math.prod(shape)
    rows, vocab = logits_shape
    with torch.cuda.stream(capture_stream()), torch.cuda.use_mem_pool(mempool):
        block = torch.empty(kv_numel + rows * vocab, dtype=dtype, device=device)
    block.zero_()
    logits = block[kv_numel:].view(rows, vocab) if rows else None
    return block[:kv_numel].view(shape), logits


class MempoolPrefills:
    """Runs prefills in a shared mempool and keeps the allocator peaks they set: each peak a
    prefill raised, mapped to the peak before it."""

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}

    def run(self, mempool, device, prefill: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`prefill()` (returning logits) with its allocations in `mempool`, on the capture
        stream, ordered after and before the current stream's work. Out of memory there, the
        default pool's cached blocks go back to the device and it runs once more (the mempool
        grows only from memory no pool caches; a prefill only rewrites the same K/V)."""
        before = torch.cuda.max_memory_allocated(device)
        stream, current = capture_stream(), torch.cuda.current_stream()
        stream.wait_stream(current)

        def attempt() -> torch.Tensor:
            with torch.cuda.stream(stream), torch.cuda.use_mem_pool(mempool):
                return prefill()

        try:
            logits = attempt()
        except torch.OutOfMemoryError:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            logits = attempt()
        current.wait_stream(stream)
        logits.record_stream(current)  # (read on this stream: its block waits for that)
        after = torch.cuda.max_memory_allocated(device)
        if after > before:
            self.peaks[after] = before
        return logits

    def peak_outside(self, peak: int) -> int:
        """`peak` (the allocator's `max_memory_allocated`) without what these prefills allocated
        in the mempool (nothing else was allocated during them): walks each recorded peak back
        to the one before it. Forgets the records (call it where the allocator's peak is reset)."""
        while peak in self.peaks:
            peak = self.peaks[peak]
        self.peaks.clear()
        return peak
