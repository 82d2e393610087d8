"""Agent rollouts: the user's agent function, called per task and sample, against the in-process
OpenAI endpoint; its episodes assembled from the endpoint's token records (docs/agents.md).

`play_agents` is the agent task's `play`: for each task, `samples_per_task` calls of the agent
(at most `max_concurrent_agents` at once; async functions awaited on one event loop, sync ones
on threads), each with an `AgentContext` whose base URL is its episode's own. When a call ends,
its records become segments (`segments.assemble`), each a trajectory of the task's group with the
episode's reward, so agent episodes go through the same advantage and step-batch code as every
other task.

A call fails when it raises, runs past `task.agent_timeout_s`, made no request, or returned
something other than a finite number or a dict of them. A failed episode scores 0 with its
tokens out of the loss (`on_failure = "zero"`) or leaves its group (`"drop"`); failures are
counted per reason (`agent_failed_<reason>`), the first of each reason said once on stderr, and
the rollout stops with a `RunFailure` when more than `task.max_failed_agent_share` of them fail.
"""

from __future__ import annotations

import asyncio
import math
import sys
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from reinforge.data.chat import eos_ids, render_prompt
from reinforge.engine.base import Engine, SamplingParams
from reinforge.envs.agent_task import AgentTasks
from reinforge.errors import RunFailure
from reinforge.faults import RewardErrors
from reinforge.rollout.segments import Segment, assemble
from reinforge.types import Completion, Group, Task, Trajectory
from reinforge.watchdog import beat

FAILURES = ("raised", "timeout", "no_request", "bad_return")
DEFAULT_MAX_CONCURRENT_AGENTS = 64  # evaluation's; training reads rollout.max_concurrent_agents


@dataclass
class AgentContext:
    """What the agent function is called with (docs/agents.md)."""

    client: Any  # openai.OpenAI for a sync function, openai.AsyncOpenAI for an async one
    model: str
    base_url: str
    api_key: str
    task: Task
    sample_index: int

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self.task.messages]

    @property
    def answer(self) -> str:
        return self.task.answer

    @property
    def info(self) -> dict[str, Any]:
        return self.task.info


@dataclass
class AgentEpisode:
    task: Task
    records: list = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)
    failure: str | None = None  # one of FAILURES
    error: str = ""  # the traceback's last line, or what was returned


def play_agents(
    engine: Engine,
    tokenizer,
    agent_tasks: AgentTasks,
    tasks: list[Task],
    samples_per_task: int,
    params: SamplingParams,
    errors: RewardErrors | None = None,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT_AGENTS,
) -> list[Group]:
    """`samples_per_task` agent episodes of each task as scored trajectories, one group per task
    (`params.max_new_tokens` is each request's budget)."""
    endpoint = endpoint_for(engine, tokenizer)
    context = agent_tasks.max_context or engine.model.config.max_position_embeddings
    endpoint.configure(params, context)
    with ThreadPoolExecutor(1, thread_name_prefix="agents") as loop_thread:
        episodes = loop_thread.submit(
            asyncio.run, _run_all(endpoint, agent_tasks, tasks, samples_per_task, max_concurrent)
        ).result()
    check_failures(agent_tasks, [e for group in episodes for e in group])
    errors = errors if errors is not None else RewardErrors()
    groups = []
    for task, group in zip(tasks, episodes):
        trajectories = [
            t for e in group for t in to_trajectories(tokenizer, agent_tasks, e, errors)
        ]
        if trajectories:
            groups.append(Group(task, trajectories))
    if not groups:
        raise RunFailure(
            'every agent episode of the rollout failed and task.on_agent_failure = "drop" '
            'left no group to train on; fix the agent, or set on_agent_failure = "zero"'
        )
    return groups


_ENDPOINTS: dict[int, Any] = {}


def endpoint_for(engine: Engine, tokenizer):
    """The process's endpoint over `engine` (started on first use, kept while the engine lives)."""
    if id(engine) not in _ENDPOINTS:
        # (the agent extra is checked when the task is built: envs.agent_task.check_agent_extra)
        from reinforge.server.in_process import AgentEndpoint

        _ENDPOINTS[id(engine)] = (engine, AgentEndpoint(engine, tokenizer, 1 << 30))
    return _ENDPOINTS[id(engine)][1]


async def _run_all(endpoint, agent_tasks: AgentTasks, tasks, n: int, max_concurrent: int):
    gate = asyncio.Semaphore(max_concurrent)
    pool = None if agent_tasks.is_async else ThreadPoolExecutor(max_concurrent, "agent")
    try:
        runs = [
            [_run_one(endpoint, agent_tasks, task, k, gate, pool) for k in range(n)]
            for task in tasks
        ]
        flat = await asyncio.gather(*(run for group in runs for run in group))
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)  # a hung agent keeps its thread
    return [flat[i * n : (i + 1) * n] for i in range(len(tasks))]


async def _run_one(endpoint, agent_tasks: AgentTasks, task: Task, k: int, gate, pool):
    import openai

    async with gate:
        key = uuid.uuid4().hex
        endpoint.open_episode(key, agent_tasks.max_turns)
        endpoint.batcher.agent_started()
        url, timeout = endpoint.base_url(key), agent_tasks.timeout_s
        is_async = agent_tasks.is_async
        # plain HTTP to the loopback: no TLS context to build (the default costs ~0.1 s a client)
        http = (openai.DefaultAsyncHttpxClient if is_async else openai.DefaultHttpxClient)(
            verify=False, timeout=timeout
        )
        maker = openai.AsyncOpenAI if is_async else openai.OpenAI
        client = maker(
            base_url=url, api_key="reinforge", max_retries=0, timeout=timeout, http_client=http
        )
        ctx = AgentContext(client, "policy", url, "reinforge", task, k)
        episode = AgentEpisode(task)
        try:
            result = await asyncio.wait_for(_call(agent_tasks, ctx, pool), timeout)
            episode.rewards, episode.error = _as_rewards(result)
            episode.failure = "bad_return" if episode.error else None
        except asyncio.TimeoutError:
            episode.failure = "timeout"
            episode.error = f"the agent ran past task.agent_timeout_s = {timeout:g} s"
        except Exception as error:  # the agent's own failure: counted, never the step's
            episode.failure = "raised"
            episode.error = traceback.format_exception_only(error)[-1].strip()
        finally:
            beat()  # an episode ended: progress, for the hang watchdog
            endpoint.batcher.agent_finished()
            episode.records = list(endpoint.close_episode(key).records)
            await _close(http)
        if episode.failure is None and not episode.records:
            episode.failure, episode.error = "no_request", "the agent made no request"
        return episode


async def _call(agent_tasks: AgentTasks, ctx: AgentContext, pool):
    fn, kwargs = agent_tasks.agent, agent_tasks.agent_args
    if agent_tasks.is_async:
        return await fn(ctx, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(ctx, **kwargs))


async def _close(http) -> None:
    closed = http.aclose() if hasattr(http, "aclose") else http.close()
    if asyncio.iscoroutine(closed):
        await closed


def _as_rewards(result) -> tuple[dict[str, float], str]:
    """(the episode's reward components, "" or why the result is not a reward). A number is the
    "reward" (the env component); a dict's keys are components, "reward" among them (default:
    the sum of the others)."""
    if _is_number(result):
        return {"reward": float(result)}, ""
    if (
        isinstance(result, dict)
        and result
        and all(isinstance(k, str) and _is_number(v) for k, v in result.items())
    ):
        rewards = {k: float(v) for k, v in result.items()}
        rewards.setdefault("reward", sum(rewards.values()))
        return rewards, ""
    return {}, f"the agent returned {result!r:.80}, not a finite number or a dict of them"


def _is_number(value) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


_said: set[str] = set()


def check_failures(agent_tasks: AgentTasks, episodes: list[AgentEpisode]) -> None:
    """Say the first failure of each reason once; stop when too many of the rollout's failed."""
    failed = [e for e in episodes if e.failure is not None]
    for e in failed:
        if e.failure not in _said:
            _said.add(e.failure)
            print(
                f"warning: an agent of task {agent_tasks.name!r} failed ({e.failure}): {e.error}; "
                f"such episodes {'score 0' if agent_tasks.on_failure == 'zero' else 'are dropped'}"
                f" and are counted in agent_failed_{e.failure}",
                file=sys.stderr,
            )
    if episodes and len(failed) / len(episodes) > agent_tasks.max_failed_share:
        reasons = {r: sum(e.failure == r for e in failed) for r in FAILURES}
        counts = ", ".join(f"{r} {c}" for r, c in reasons.items() if c)
        raise RunFailure(
            f"{len(failed)} of {len(episodes)} agent calls failed ({counts}), more than "
            f"task.max_failed_agent_share = {agent_tasks.max_failed_share:g}; the first: "
            f"{failed[0].error}. Fix the agent {agent_tasks.agent_ref!r}, or raise "
            "task.max_failed_agent_share"
        )


def to_trajectories(
    tokenizer, agent_tasks: AgentTasks, e: AgentEpisode, errors: RewardErrors
) -> list[Trajectory]:
    """The episode's segments as trajectories with its reward; the first carries its counters."""
    if e.failure is not None and agent_tasks.on_failure == "drop":
        return []
    segments, num_breaks = assemble(e.records)
    if e.failure is not None:
        for s in segments:
            s.loss_mask = [0] * len(s.loss_mask)  # not the model's to learn from: out of the loss
        if not segments:
            segments = [_empty_segment(tokenizer, e.task)]
    last = segments[-1].text if e.records else ""
    counters = {"agent_requests": float(len({r.request_index for r in e.records}))}
    rewards = e.rewards if e.failure is None else {}  # a failed episode's own verdict is void
    reward, components = agent_tasks.scorer.score(rewards, last, e.task, counters, errors)
    metrics = {
        **counters,
        "agent_segments": float(len(segments)),
        "agent_history_breaks": float(num_breaks),
        **{f"agent_failed_{r}": float(e.failure == r) for r in FAILURES},
    }
    return [
        Trajectory(
            e.task,
            s.prompt_ids,
            _completion(tokenizer, s),
            reward=reward,
            is_correct=components.get("env", 0.0) >= 1.0,
            rewards=components,
            metrics=metrics if i == 0 else dict.fromkeys(metrics, 0.0),
            segment=i,
        )
        for i, s in enumerate(segments)
    ]


def _empty_segment(tokenizer, task: Task) -> Segment:
    """A failed episode without a request: the row's prompt and one EOS, out of the loss."""
    segment = Segment(render_prompt(tokenizer, task.messages))
    segment.ids, segment.loss_mask, segment.logprobs = eos_ids(tokenizer)[:1] or [0], [0], [0.0]
    return segment


def _completion(tokenizer, s: Segment) -> Completion:
    return Completion(
        token_ids=s.ids,
        logprobs=s.logprobs,
        finish_reason=s.finish_reason,
        text=tokenizer.decode(s.ids, skip_special_tokens=False),
        loss_mask=s.loss_mask,
    )
