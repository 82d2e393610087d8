"""Multi-turn episodes without a barrier per turn, optionally branching where the model is unsure.

`episodes.run_episodes` runs turn by turn: every episode's turn t is generated, then every env
step of turn t runs, then turn t+1 is sent again as whole histories. Here each episode moves on
its own, over one engine session (`engine.session`):

- a group's first turn is one prompt with n samples (one prefill, pages shared);
- when an episode's turn ends, its env step goes to a thread at once, while the others keep
  generating; when the step returns, the env's reply ids are appended to the episode's sequence
  (`EngineSession.extend`): its history stays in the KV pool and only the reply is prefilled;
- with `branching` (`rollout/branching.py`), the next turn after an env reply records the
  sampler's entropy over its first tokens, and where it rose, branches fork the sequence
  there (history pages shared, nothing recomputed).

An episode's record is the same as in `run_episodes` (the same private steps build it:
`_record`, `_env_step`, `_take_step`): under greedy sampling both loops give the same ids. The
sampling noise of each turn is keyed by (seed + turn, task, sample) instead of by a turn's batch
position, so sampled runs differ from `run_episodes`' draw for draw (not in distribution).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine, sample_seed
from reinforge.engine.sequence import Sequence, num_blocks_for
from reinforge.engine.session import EngineSession
from reinforge.envs.base import Env
from reinforge.rollout import episodes as steps
from reinforge.rollout.branching import Branching, tools_called
from reinforge.rollout.episodes import Episode, EpisodeLimits
from reinforge.types import Task

TURN_SEED_STRIDE = 7919  # each turn's noise key: the sampling seed + this x the turn


@dataclass
class _Group:
    index: int  # the task's place in the call
    task: Task
    budget: int
    episodes: list[Episode] = field(default_factory=list)
    num_live: int = 0  # episodes not ended


@dataclass
class _Run:
    """An episode in flight: its group, its place there, its turn and current sequence."""

    episode: Episode
    group: _Group
    index: int
    turn: int = 0
    seq: Sequence | None = None
    initial_entropy: float | None = None
    is_probing: bool = False  # its current turn's entropy decides a branching


@dataclass
class LoopStats:
    seconds: float = 0.0
    seconds_busy: float = 0.0  # a step queued or running on the device
    num_generated_tokens: int = 0
    num_prefill_tokens: int = 0
    kv_blocks_peak: int = 0
    num_branches: int = 0
    num_filled: int = 0

    @property
    def idle_share(self) -> float:
        return 1.0 - self.seconds_busy / self.seconds if self.seconds else 0.0


def run_continuous(
    engine: PagedEngine,
    tokenizer,
    env: Env,
    tasks: list[Task],
    samples_per_task: int,
    params: SamplingParams,
    limits: EpisodeLimits,
    render_tools: bool = True,
    env_workers: int = 32,
    branching: Branching | None = None,
    stats: LoopStats | None = None,
) -> list[list[Episode]]:
    """`samples_per_task` episodes per task (the budget, when branching), each running as far as
    it can on its own; returned per task, parents before their branches."""
    loop = _Loop(engine, tokenizer, env, params, limits, render_tools, branching)
    stats = stats if stats is not None else LoopStats()
    with ThreadPoolExecutor(max(1, env_workers), thread_name_prefix="env") as pool:
        groups = loop.run(tasks, samples_per_task, pool, stats)
    return groups


class _Loop:
    def __init__(self, engine, tokenizer, env, params, limits, render_tools, branching):
        self.engine, self.tokenizer, self.env = engine, tokenizer, env
        self.params, self.limits, self.branching = params, limits, branching
        self.tools = getattr(env, "tool_schemas", None) if render_tools else None
        self.window = branching.entropy_window if branching is not None else 0
        self.owner: dict[int, _Run] = {}  # seq_id -> its episode's run
        self.probes: list[_Run] = []
        self.futures: dict[Future, _Run] = {}

    def run(self, tasks, samples_per_task, pool, stats: LoopStats) -> list[list[Episode]]:
        start = time.perf_counter()
        b = self.branching
        initial = min(b.initial_samples, samples_per_task) if b else samples_per_task
        self.session = EngineSession(
            self.engine, self.params, self.limits.max_context, self._pool_pages(tasks, initial)
        )
        self.stats = stats
        groups = [_Group(i, task, samples_per_task) for i, task in enumerate(tasks)]
        for group in groups:
            self._open(group, initial, self.window)
        bm = self.session.block_manager
        while self.session.has_work() or self.futures:
            finished = self.session.step() if self.session.has_work() else []
            stats.kv_blocks_peak = max(stats.kv_blocks_peak, bm.num_used_blocks)
            if self.probes:
                self._decide_probes()
            for seq in finished:
                run = self.owner.pop(seq.seq_id)
                steps._record(run.episode, self.engine._completion(seq))
                self.futures[pool.submit(steps._env_step, self.env, run.episode)] = run
            if self.futures and not self.session.has_work():
                wait(self.futures, return_when=FIRST_COMPLETED)  # the device idles on tools
            for future in [f for f in self.futures if f.done()]:
                self._after_env(self.futures.pop(future), future.result())
        self.session.close()
        stats.seconds += time.perf_counter() - start
        stats.seconds_busy += self.session.seconds_busy
        stats.num_generated_tokens += self.session.num_generated_tokens
        stats.num_prefill_tokens += self.session.scheduler.num_prefill_tokens
        return [group.episodes for group in groups]

    def _pool_pages(self, tasks, initial: int) -> int:
        """Off CUDA (a pool that grows): room for every episode at its longest; more work than
        fits takes parked pages back (`EngineSession`)."""
        lim, bs = self.limits, self.engine.block_size
        longest = min(lim.max_context, 256 + lim.max_turns * 2 * lim.max_tokens_per_turn)
        return len(tasks) * max(initial, 1) * num_blocks_for(longest, bs) * 2

    def _open(self, group: _Group, count: int, window: int) -> None:
        """`count` fresh episodes of the group's task; one prompt with `count` samples where they
        open alike."""
        runs = []
        renders: dict[str, list[int]] = {}
        for _ in range(count):
            e = steps._open(self.env, self.tokenizer, group.task, self.tools, renders)
            runs.append(_Run(e, group, len(group.episodes)))
            group.episodes.append(e)
        live = [r for r in runs if not r.episode.is_done and steps._fits(r.episode, self.limits)]
        group.num_live += len(live)
        alike = live and all(r.episode.prompt_ids == live[0].episode.prompt_ids for r in live)
        for unit in [live] if alike else [[r] for r in live]:
            e = unit[0].episode
            seeds = [self._seed(r) for r in unit]
            seqs = self.session.add(e.prompt_ids, seeds, steps._budget(e, self.limits), window)
            for r, seq in zip(unit, seqs):
                self._own(r, seq, probing=window > 0)

    def _seed(self, run: _Run) -> int:
        p = self.params
        turn_seed = p.seed + TURN_SEED_STRIDE * run.turn
        return sample_seed(turn_seed, p.first_prompt_index + run.group.index, run.index)

    def _own(self, run: _Run, seq: Sequence, probing: bool) -> None:
        run.seq = seq
        self.owner[seq.seq_id] = run
        run.is_probing = probing
        if probing:
            self.probes.append(run)

    def _after_env(self, run: _Run, stepped) -> None:
        e, lim = run.episode, self.limits
        num_before = len(e.completion_ids)
        steps._take_step(self.tokenizer, e, stepped, self.tools, run.turn)
        run.turn += 1
        if not e.is_done and run.turn >= lim.max_turns:
            e.is_done, e.finish_reason = True, "max_turns"
            e.metrics["finish_max_turns"] += 1
        if e.is_done or not steps._fits(e, lim):
            self._end(run)
            return
        branches = self.branching is not None and self.branching.branches_after(
            tools_called(self.env, e.turns[-1].text)
        )
        window = self.window if branches else 0
        env_ids = e.completion_ids[num_before:]
        assert run.seq is not None
        seq = self.session.extend(run.seq, env_ids, self._seed(run), steps._budget(e, lim), window)
        self._own(run, seq, probing=branches)

    def _end(self, run: _Run) -> None:
        assert run.seq is not None
        self.session.release(run.seq)
        group = run.group
        group.num_live -= 1
        missing = group.budget - len(group.episodes)
        if group.num_live == 0 and missing > 0:  # ARPO's fill: fresh samples of the prompt
            self.stats.num_filled += missing
            self._open(group, missing, 0)

    def _decide_probes(self) -> None:
        """Runs whose window of entropies is complete (or whose turn ended before it): the
        first turn's sets the episode's initial entropy; a turn after an env reply may branch."""
        b = self.branching
        assert b is not None
        still = []
        for run in self.probes:
            seq = run.seq
            if run.seq is None or not run.is_probing:
                continue
            assert seq is not None
            if len(seq.entropies) < self.window and not seq.is_finished:
                still.append(run)
                continue
            run.is_probing = False
            window = seq.entropies
            if run.initial_entropy is None:
                run.initial_entropy = sum(window) / len(window) if window else 0.0
                continue
            spare = run.group.budget - len(run.group.episodes)
            if spare > 0 and b.should_branch(window, run.initial_entropy):
                for _ in range(min(b.branch_size, spare)):
                    self._branch(run)
        self.probes = still

    def _branch(self, run: _Run) -> None:
        """A copy of the episode right after its last env reply, sampling its own turn from a
        fork of the sequence (the history's pages shared)."""
        e, group = run.episode, run.group
        assert e.state is not None and run.seq is not None
        state = dataclasses.replace(
            e.state, messages=list(e.state.messages), info=copy.deepcopy(e.state.info)
        )
        branch = Episode(
            e.task,
            state,
            e.prompt_ids,
            completion_ids=list(e.completion_ids),
            loss_mask=list(e.loss_mask),
            logprobs=list(e.logprobs),
            metrics=Counter(e.metrics) + Counter(branch_episodes=1),
            num_turns=e.num_turns,
            turns=list(e.turns),
            delta=copy.copy(e.delta),
            lineage=(run.index, len(e.completion_ids)),
        )
        new = _Run(
            branch, group, len(group.episodes), run.turn, initial_entropy=run.initial_entropy
        )
        group.episodes.append(branch)
        group.num_live += 1
        self.stats.num_branches += 1
        seq = run.seq
        child = self.session.fork(
            seq, seq.num_prompt_tokens, self._seed(new), seq.params.max_new_tokens
        )
        self._own(new, child, probing=False)
