"""Many agents' requests, batched into engine calls.

`RequestBatcher.generate` is called from the server's worker threads, one per request, and blocks
until its completions are ready. One thread of the batcher takes every request waiting, runs them
as one `engine.generate` call per distinct setting (token budget, stop strings, n: agents that
run the same code ask alike, so usually one call), and hands each its completions. Requests that
arrive while a call runs wait for it to end and go together into the next.

Before a call starts the batcher gathers: it waits until every running agent (the count the
rollout keeps with `agent_started` / `agent_finished`) has a request waiting, or until no request
arrived for `gather_s`, so agents whose tools answer at about the same time share a call rather
than the first of them going alone.

On the paged engine with a fixed KV pool (on CUDA, or a pool size given) the calls are open
instead (`engine.continuous.ContinuousSession`): a request that arrives while others decode joins
at the next step (prefilled at the next prefill step, then decoded with the rest), and each
request gets its completions the step its last sequence finishes, so an agent's next turn does
not wait for the slowest of the others. Elsewhere (the simple engine, the CPU pool that grows per
call) each engine call is closed once it starts: a request arriving during it goes into the next.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from reinforge.engine.base import Engine, SamplingParams
from reinforge.engine.continuous import ContinuousSession, sampler_key, supports_sessions
from reinforge.types import Completion


@dataclass
class _Waiting:
    prompts: list[list[int]]
    params: SamplingParams
    done: Future = field(default_factory=Future)


class RequestBatcher:
    def __init__(self, engine: Engine, gather_s: float = 0.01, continuous: bool = True):
        self.engine = engine
        self.gather_s = gather_s
        self.is_continuous = continuous and supports_sessions(engine)
        self.max_len = 1 << 14  # the longest sequence a session holds (the endpoint sets it)
        self.lock = threading.Lock()  # held while the engine (or anything else) runs the model
        self.num_calls = 0
        self.num_requests = 0
        self._cond = threading.Condition()
        self._waiting: list[_Waiting] = []
        self._num_agents = 0
        self._last_arrival = 0.0
        self._seed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="agent-batcher", daemon=True)
        self._thread.start()

    def set_seed(self, seed: int) -> None:
        self._seed = seed

    def agent_started(self) -> None:
        with self._cond:
            self._num_agents += 1

    def agent_finished(self) -> None:
        with self._cond:
            self._num_agents -= 1
            self._cond.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions (blocking; any thread)."""
        item = _Waiting(prompts, params)
        with self._cond:
            assert not self._closed, "the batcher is closed"
            self._waiting.append(item)
            self._last_arrival = time.monotonic()
            self._cond.notify_all()
        return item.done.result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed and not self._waiting:
                    return
                self._gather()
                batch, self._waiting = self._waiting, []
            if self.is_continuous:
                self._run_session(batch)
            else:
                self._run(batch)

    def _gather(self) -> None:
        """Wait (holding the condition) until every running agent waits or arrivals pause."""
        while not self._closed and len(self._waiting) < self._num_agents:
            left = self._last_arrival + self.gather_s - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _run(self, batch: list[_Waiting]) -> None:
        calls: dict[SamplingParams, list[_Waiting]] = {}
        for item in batch:
            calls.setdefault(dataclasses.replace(item.params, seed=0), []).append(item)
        for params, items in calls.items():
            self.num_calls += 1
            self.num_requests += len(items)
            seed = self._seed * 1_000_003 + self.num_calls
            prompts = [p for item in items for p in item.prompts]
            try:
                with self.lock:
                    out = self.engine.generate(prompts, dataclasses.replace(params, seed=seed))
            except Exception as error:  # the engine's refusal (a prompt too long for the pool)
                for item in items:
                    item.done.set_exception(error)
                continue
            start = 0
            for item in items:
                item.done.set_result(out[start : start + len(item.prompts)])
                start += len(item.prompts)

    def _run_session(self, batch: list[_Waiting]) -> None:
        """One open call: `batch` and whatever arrives with the same sampler settings until
        nothing runs or waits; requests with other settings go back to the queue."""
        self.num_calls += 1
        key = sampler_key(batch[0].params)
        later: list[_Waiting] = []
        with self.lock:
            session = ContinuousSession(self.engine, batch[0].params, self.max_len)
            while True:
                for item in batch:
                    if sampler_key(item.params) != key:
                        later.append(item)
                        continue
                    self.num_requests += 1
                    seed = self._seed * 1_000_003 + self.num_requests
                    params = dataclasses.replace(item.params, seed=seed)
                    session.admit(item.prompts, params, _resolver(item.done))
                is_running = session.step()
                with self._cond:
                    batch, self._waiting = self._waiting, []
                if not is_running and not batch:
                    break
        if later:
            with self._cond:
                self._waiting = later + self._waiting
                self._cond.notify_all()


def _resolver(done: Future):
    def resolve(result) -> None:
        if isinstance(result, Exception):
            done.set_exception(result)
        else:
            done.set_result(result)

    return resolve
