"""Open-ended continuous batching on the paged engine: requests join while others decode.

`PagedEngine.generate` is a closed call: its prompts go in together and it returns when the last
finishes. `ContinuousSession` runs the same steps (the paged engine's own launch, overlap and
commit) over a queue instead: between two steps it admits the requests that arrived (their
groups wait in the scheduler like any other and are prefilled at the next prefill step) and hands
back each request's completions the step its last sequence finishes, so an agent goes on to its
tool and its next turn while the others still decode. The session ends when nothing runs and
nothing waits.

Each sequence finishes by its own request's settings (token budget, stop ids and strings); the
sampler settings (temperature, top-p, top-k, min-p) are one per session: the agent endpoint sets
the rollout's on every request. Requests with other sampler settings wait for a later session.
The pool must not grow during a session, so the paged engine needs a fixed pool (on CUDA, or
`num_blocks` / `kv_cache_bytes` given); the rope table and page tables are sized once for
`max_len` tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from reinforge.engine.base import SamplingParams
from reinforge.engine.block_manager import BlockManager
from reinforge.engine.paged import PagedEngine, StepTimers
from reinforge.engine.scheduler import Scheduler
from reinforge.engine.sequence import Sequence
from reinforge.types import Completion
from reinforge.watchdog import beat


def supports_sessions(engine) -> bool:
    return (
        isinstance(engine, PagedEngine)
        and engine.fallback is None
        and not getattr(engine, "pool_grows", True)
    )


def sampler_key(params: SamplingParams) -> tuple:
    return (params.temperature, params.top_p, params.top_k, params.min_p, params.ignore_eos)


@dataclasses.dataclass
class Admitted:
    """A request inside the session: its groups, and what to call with their completions (or
    with the error that refused it)."""

    groups: list[list[Sequence]]
    done: Callable[[list[list[Completion]] | Exception], None]


class ContinuousSession:
    def __init__(self, engine: PagedEngine, sampler: SamplingParams, max_len: int):
        assert supports_sessions(engine)
        self.engine, self.sampler = engine, sampler
        self.key = sampler_key(sampler)
        self.scheduler = Scheduler(
            BlockManager(engine.num_blocks, engine.block_size),
            engine.max_num_seqs,
            engine.max_num_batched_tokens,
        )
        self.admitted: list[Admitted] = []
        self.timers = StepTimers()
        self.num_groups = 0
        self.inflight = None
        engine.runner.restore()
        engine.runner.ensure_max_len(max_len)
        engine.runner.begin_generate()

    def admit(self, prompts: list[list[int]], params: SamplingParams, done) -> None:
        """Queue a request (`params.n` samples of each prompt); `done` gets its completions."""
        assert sampler_key(params) == self.key, "one sampler setting per session"
        groups = []
        try:
            for prompt in prompts:
                group = self.engine._new_group(self.num_groups, prompt, params)
                self.num_groups += 1
                max_new = self.engine.runner.max_model_len - len(prompt)
                assert params.max_new_tokens <= max_new, "the session's max_len holds it"
                self.scheduler.add(group)  # refuses a request larger than the whole pool
                groups.append(group)
        except ValueError as error:
            for group in groups:  # none of them ran yet: out of the queue again
                self.scheduler.waiting.remove(group)
            done(error)
            return
        self.admitted.append(Admitted(groups, done))

    def step(self) -> bool:
        """One step of the engine loop; False when nothing runs or waits (the session is over)."""
        engine, scheduler = self.engine, self.scheduler
        ahead = engine._launch_ahead(scheduler, self.inflight, self.sampler, self.timers)
        if self.inflight is not None:
            engine._commit(scheduler, self.inflight, _finish_rule(engine), self.timers)
            beat()
            self._hand_back()
        self.inflight = ahead or engine._launch_next(scheduler, self.sampler, self.timers)
        return self.inflight is not None

    def _hand_back(self) -> None:
        still = []
        for request in self.admitted:
            if all(seq.is_finished for group in request.groups for seq in group):
                request.done(self.engine._completions(request.groups))
            else:
                still.append(request)
        self.admitted = still


def _finish_rule(engine: PagedEngine) -> Callable[[Sequence], str | None]:
    """`PagedEngine._finish_rule` with each sequence's own request settings."""
    eos = engine.tokenizer.eos_token_id

    def finish_reason(seq: Sequence) -> str | None:
        p = seq.params
        last = seq.output_ids[-1]
        if last in p.stop_token_ids or (not p.ignore_eos and eos is not None and last == eos):
            return "stop"
        if p.stop_strings and engine._hit_stop_string(seq, p.stop_strings):
            return "stop"
        if len(seq.output_ids) >= p.max_new_tokens:
            return "length"
        return None

    return finish_reason
