"""How the paged engine's steps sample (`ModelRunner`'s base, `StepSampling`).

One token per sequence from a step's logits: on CUDA with Triton and no top-p / top-k / min-p,
the fused inverse-CDF sampler on the device (inside a decode graph where one replayed the step:
`cuda_graphs.DecodeGraphs`), else the keyed torch sampler (`sampling.sample_keyed`). A launched
step's results come back through `LaunchedStep`. Every draw
is keyed by the sequence's seed and position, never by the batch it runs in. The ids and
logprobs go to the host in two pinned buffers used in turn, so a step launched ahead never
overwrites the one being read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reinforge.engine import eager_inputs
from reinforge.engine.base import SamplingParams
from reinforge.engine.sampling import row_stats, row_uniform, sample_keyed
from reinforge.engine.scheduler import Batch
from reinforge.engine.sequence import Sequence


@dataclass
class LaunchedStep:
    """A step queued on the device; `result` waits for it and reads its tokens back."""

    batch: Batch
    ids: torch.Tensor  # on the device: the next step's input tokens
    host_ids: torch.Tensor
    host_logprobs: torch.Tensor
    event: torch.cuda.Event | None
    entropies: torch.Tensor | None = None  # per sequence, on the device, when asked for
    # routing replay: each computed token's experts [T, sparse layers, k] (on the host once the
    # step is done) and which positions of which sequences its rows are
    routes: torch.Tensor | None = None
    route_spans: list[tuple[list[Sequence], int, int]] | None = None

    def ready(self) -> bool:
        """Whether `result` would return without waiting for the device (none: always)."""
        return self.event is None or self.event.query()

    def result(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self.host_ids.tolist(), self.host_logprobs.tolist()

    def entropy_values(self) -> list[float] | None:
        """After `result`: the step's entropies (a small copy, the step already done)."""
        return None if self.entropies is None else self.entropies.tolist()


def uses_fused_sampler(params: SamplingParams) -> bool:
    return params.top_p >= 1.0 and params.top_k == 0 and params.min_p == 0.0


class StepSampling:
    """The sampling side of `ModelRunner` (its base): the sampler over a step's logits (on the
    device where it can), the sampler's entropies, and the results' copy to the host. Reads the
    runner's `is_fast_path`, `graphs`, `_graph_logits`, `device`, `max_num_seqs`."""

    @torch.inference_mode()
    def entropy(self, batch: Batch, logits_GV: torch.Tensor, temperature: float) -> torch.Tensor:
        """Entropy (nats) of the distribution each sequence samples from: the logits the sampler
        reads, scaled by the temperature (1 when greedy), before top-p / top-k / min-p."""
        sizes = [len(group) for group in batch.groups]
        logprobs_GV = torch.log_softmax(logits_GV.float() / (temperature or 1.0), dim=-1)
        entropy_G = -(logprobs_GV.exp() * logprobs_GV).sum(-1)
        if any(size > 1 for size in sizes):
            repeats = torch.tensor(sizes, device=entropy_G.device)
            entropy_G = entropy_G.repeat_interleave(repeats, output_size=sum(sizes))
        return entropy_G

    @torch.inference_mode()
    def sample(
        self,
        batch: Batch,
        logits_GV: torch.Tensor,
        params: SamplingParams,
        stats: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(ids, logprobs, stats) on the device: one token per sequence of the batch; every
        member of a group samples from its leader's logits. The noise of each draw is keyed by
        the sequence's `sample_seed` and position, never by the batch it runs in. `stats`: also
        each group's log-sum-exp and entropy of the distribution it samples from, [groups, 2]:
        the fused sampler's own in a decode (one more sum in its pass), `sampling.row_stats` in
        a prefill (a group's one row) and on a CPU; None for a GPU decode by another sampler
        (top-p / top-k / min-p, greedy), where a pass of its own over the step's logits would
        cost the decode more than the update saves (the update's head then computes them)."""
        leaders_GV = logits_GV
        if batch.is_prefill:  # (a decode's groups are one sequence each)
            sizes = [len(group) for group in batch.groups]
            if any(size > 1 for size in sizes):
                repeats = torch.tensor(sizes, device=logits_GV.device)
                logits_GV = logits_GV.repeat_interleave(repeats, dim=0, output_size=sum(sizes))
        stats_G2 = None
        if self.is_fast_path and uses_fused_sampler(params):
            from reinforge.engine import graph_rows, triton_sampling

            n = logits_GV.shape[0]
            if self._graph_logits:
                assert self.graphs is not None
                seeds = self.graphs.row(graph_rows.SEEDS, n)
                positions = self.graphs.row(graph_rows.OUTPUT_POSITIONS, n)
            else:
                seqs = batch.seqs
                seeds = eager_inputs.longs([seq.sample_seed for seq in seqs], self.device)
                positions = eager_inputs.longs([seq.num_output_tokens for seq in seqs], self.device)
            if params.temperature > 0.0:
                fused_stats = stats and not batch.is_prefill
                if fused_stats:
                    stats_G2 = torch.empty((n, 2), dtype=torch.float32, device=self.device)
                ids, lps = triton_sampling.sample_inverse_cdf(
                    logits_GV, params.temperature, seeds, positions, stats_out=stats_G2
                )
            else:
                ids, lps = triton_sampling.sample_gumbel(logits_GV, 0.0, seeds, positions)
        else:
            uniforms = [row_uniform(seq.sample_seed, seq.num_output_tokens) for seq in batch.seqs]
            ids, lps = sample_keyed(
                logits_GV,
                params.temperature,
                params.top_p,
                params.top_k,
                params.min_p,
                uniforms,
            )
        if stats and stats_G2 is None and (batch.is_prefill or not leaders_GV.is_cuda):
            stats_G2 = row_stats(leaders_GV, params.temperature)
        return ids, lps, stats_G2

    def _fetch(self, ids: torch.Tensor, logprobs: torch.Tensor):
        """Start copying the step's results to the host; (ids, logprobs, event) to wait on."""
        if self.device.type != "cuda":
            return ids, logprobs, None
        n = ids.shape[0]
        if len(self._host_results) < 2 or self._host_results[0][0].shape[0] < n:
            size = max(n, self.max_num_seqs)
            self._host_results = [
                (
                    torch.empty(size, dtype=torch.long, pin_memory=True),
                    torch.empty(size, dtype=torch.float32, pin_memory=True),
                    torch.cuda.Event(),
                )
                for _ in range(2)
            ]
            self._host_views = {}
        # two buffers (and events) in turn: a step launched ahead must not overwrite the one
        # being read (a step is read back before the one after the next is launched); their
        # views by row count, kept (a slow host's view and event calls took 15-30 us each, s29c)
        slot = self._num_fetches % 2
        self._num_fetches += 1
        views = self._host_views.get((slot, n))
        if views is None:
            host_ids, host_logprobs, _ = self._host_results[slot]
            views = self._host_views[(slot, n)] = (host_ids[:n], host_logprobs[:n])
        event = self._host_results[slot][2]
        views[0].copy_(ids, non_blocking=True)
        views[1].copy_(logprobs, non_blocking=True)
        event.record()
        return views[0], views[1], event
