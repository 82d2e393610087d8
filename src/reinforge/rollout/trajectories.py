"""Episodes (rollout/episodes.py) as the trainer's trajectories, and how a step's episodes went.

A trajectory of an episode is its exact record, token-in/token-out: the opening prompt's ids,
then every assistant turn's sampled ids (loss mask 1, the sampler's logprobs) and every env
reply's ids (loss mask 0, logprob 0.0) as one completion. The trainer's forward scores the
completion as it stands, so its logprobs line up with the sampler's position by position, and
the loss mask keeps env tokens out of the loss and the KL (`advantage_step.build_step_batch`).

The reward is the episode's (`EnvTasks.scorer`: the env's verdict and any weighted extra
components); an episode that hit the context or turn limit is reported as truncated
(finish_reason "length"), so `algorithm.mask_truncated` applies to it as to a cut completion.

Per step, `episode_metrics` reports how the episodes went: tool-call rate, malformed and
unknown-tool calls, turns per episode, context overflows, template re-renders, token-in/
token-out mismatches, win / draw / loss rates, and each reward component.
"""

from __future__ import annotations

import sys
from pathlib import Path

from reinforge.data.chat import eos_ids
from reinforge.engine.base import Engine, SamplingParams
from reinforge.envs.agent_task import AgentTasks
from reinforge.envs.env_tasks import EnvTasks
from reinforge.errors import RunFailure
from reinforge.faults import RewardErrors
from reinforge.metrics import read_metrics
from reinforge.rollout.agents import play_agents
from reinforge.rollout.branching import Branching, shared_lengths
from reinforge.rollout.continuous import run_continuous
from reinforge.rollout.episodes import Episode, EpisodeLimits, check_episode, run_episodes
from reinforge.types import Completion, Group, Task, Trajectory

# Episode ends as the trainer's completions know them: cut by a limit is "length"; an env error
# is "stop" with every id out of the loss (episodes._fail).
FINISH_REASONS = {"done": "stop", "context": "length", "max_turns": "length", "env_error": "stop"}

# Counters every multi-turn episode reports, whatever its env: how the episode ran.
EPISODE_COUNTERS = ("finish_context", "template_rerenders_history", "turn_truncated")

# Step metric <- episode counter. Counts are summed over the step's episodes (as `reinforge
# report` totals them); rates are the share of episodes where the counter is non-zero; means are
# per episode. A metric appears when the env reports its counter.
SUMMED = {
    "malformed_calls": "malformed_calls",
    "unknown_tool_calls": "unknown_tool_calls",
    "invalid_arguments": "invalid_arguments",
    "tool_errors": "tool_errors",
    "tool_timeouts": "tool_timeouts",
    "skipped_calls": "skipped_calls",
    "illegal_moves": "illegal_moves",
    "malformed_moves": "malformed_moves",
    "finish_context": "context_overflows",
    "template_rerenders_history": "template_rerenders",
    "turn_truncated": "turn_truncations",
    "token_mismatch": "token_mismatches",
    "env_errors": "env_errors",
}
RATES = {
    "tool_calls": "tool_call_rate",
    "win": "win_rate",
    "draw": "draw_rate",
    "loss": "loss_rate",
    "forfeit": "forfeit_rate",
}
MEANS = {"turns": "turns_per_episode", "tool_calls": "tool_calls_per_episode"}
# Counters kept on trajectories but not logged (how episodes ended is in the rates above); any
# other counter an env reports (a user env's `counters`) is logged summed, under its own name.
UNLOGGED = {"finish_done", "finish_max_turns", "max_turns_reached"}


def play(
    engine: Engine,
    tokenizer,
    env_tasks: EnvTasks,
    tasks: list[Task],
    samples_per_task: int,
    params: SamplingParams,
    errors: RewardErrors | None = None,
    env_workers: int = 32,
    continuous: bool = False,
    branching: Branching | None = None,
) -> list[Group]:
    """`samples_per_task` episodes of each task as scored trajectories, one group per task
    (`params.max_new_tokens` is each turn's budget; a turn's env steps on `env_workers` threads).
    Reward components that fail are counted in `errors`; an env that raises fails its episode
    (`env_errors`). `continuous` (multi-turn, paged engine): episodes without a barrier per turn
    (`rollout.continuous`); `branching`: ARPO's branching over them, `samples_per_task` the
    budget per task. An agent task's episodes are the user's agent's (rollout/agents.py)."""
    if isinstance(env_tasks, AgentTasks):  # evaluation of an agent task: the agent plays
        return play_agents(engine, tokenizer, env_tasks, tasks, samples_per_task, params, errors)
    limits = episode_limits(env_tasks, params.max_new_tokens, engine)
    tools = tools_to_render(env_tasks)
    args = (engine, tokenizer, env_tasks.env, tasks, samples_per_task, params, limits)
    if branching is not None or (continuous and runs_continuous(engine, env_tasks)):
        check_branching(engine, env_tasks)
        episode_groups = run_continuous(*args, tools is not None, env_workers, branching=branching)
    else:
        episode_groups = run_episodes(
            *args,
            render_tools=tools is not None,
            env_workers=1 if env_tasks.is_single_turn else env_workers,
        )
    check_env_errors(env_tasks.name, [e for g in episode_groups for e in g])
    errors = errors if errors is not None else RewardErrors()
    groups = [
        Group(task, [to_trajectory(tokenizer, env_tasks, e, tools, errors) for e in episodes])
        for task, episodes in zip(tasks, episode_groups)
    ]
    if branching is not None and branching.attribution == "hard":
        for group, episodes in zip(groups, episode_groups):
            if all(e.lineage[0] is None for e in episodes):
                continue  # no branch: nothing shared past the prompt
            shared = shared_lengths([e.lineage for e in episodes])
            for traj, row in zip(group.trajectories, shared):
                traj.shared_tokens = tuple(row)
    return groups


def runs_continuous(engine, env_tasks: EnvTasks) -> bool:
    """Multi-turn tasks on the paged engine's own forward run without a barrier per turn."""
    return not env_tasks.is_single_turn and getattr(engine, "fallback", True) is None


def check_branching(engine, env_tasks: EnvTasks) -> None:
    if not runs_continuous(engine, env_tasks):
        what = "a single-turn task" if env_tasks.is_single_turn else "an engine without forks"
        raise ValueError(
            f"rollout.branching.enabled=true needs a multi-turn env task on the paged engine "
            f'(rollout.engine = "paged", a Qwen2/2.5, Qwen3 or Llama model); task '
            f"{env_tasks.name!r} runs on {what}. Set rollout.branching.enabled=false"
        )


_said_env_error = False


def check_env_errors(name: str, episodes: list[Episode]) -> None:
    """An env that failed every episode is a bug to stop on; one that failed some is said once
    (they are counted per step as `env_errors`)."""
    global _said_env_error
    failed = [e for e in episodes if e.error is not None]
    if failed and len(failed) == len(episodes):
        raise RunFailure(
            f"the env of task {name!r} failed all {len(episodes)} episodes; the first: "
            f"{failed[0].error}. Fix the env (an exception in reset or step fails its episode)"
        )
    if failed and not _said_env_error:
        _said_env_error = True
        print(
            f"warning: the env of task {name!r} failed an episode ({failed[0].error}); such "
            "episodes score 0, stay out of the loss and are counted in env_errors",
            file=sys.stderr,
        )


def episode_limits(env_tasks: EnvTasks, max_new_tokens: int, engine) -> EpisodeLimits:
    """Per-turn budget `max_new_tokens`; the episode's context: task.max_context, else the
    model's."""
    max_context = env_tasks.max_context or engine.model.config.max_position_embeddings
    return EpisodeLimits(env_tasks.max_turns, max_new_tokens, max_context)


def tools_to_render(env_tasks: EnvTasks) -> list[dict] | None:
    return env_tasks.tool_schemas if env_tasks.render_tools else None


def to_trajectory(
    tokenizer, env_tasks: EnvTasks, e: Episode, tools, errors: RewardErrors
) -> Trajectory:
    """An episode as the trainer's trajectory: completion = every id after the prompt, with its
    loss mask; reward and its components from the scorer; counters as metrics. A single turn
    keeps the engine's completion as it is."""
    assert len(e.completion_ids) == len(e.loss_mask) == len(e.logprobs), "ragged episode"
    last = next((m.content for m in reversed(e.messages) if m.role == "assistant"), "")
    reward, components = env_tasks.scorer.score(e.rewards, last, e.task, e.metrics, errors)
    if env_tasks.is_single_turn:
        metrics = {k: float(v) for k, v in e.metrics.items() if k == "env_errors"}
    else:
        metrics = dict.fromkeys((*env_tasks.counters, *EPISODE_COUNTERS), 0.0)
        metrics.update({k: float(v) for k, v in e.metrics.items()})
        metrics["turns"] = float(e.num_turns)
        metrics["token_mismatch"] = float(check_episode(tokenizer, e, tools) is not None)
    if len(e.turns) == 1 and e.finish_reason == "done" and e.loss_mask == [1] * len(e.loss_mask):
        completion = e.turns[0]  # one turn, nothing from the env after it
    else:
        completion = _episode_completion(tokenizer, e)
    return Trajectory(
        e.task,
        e.prompt_ids,
        completion,
        reward=reward,
        is_correct=components.get("env", e.reward) >= 1.0,
        rewards=components,
        metrics=metrics,
    )


def _episode_completion(tokenizer, e: Episode) -> Completion:
    ids, mask, logprobs = e.completion_ids, e.loss_mask, e.logprobs
    if not ids:  # the env failed before the model spoke: one EOS, out of the loss
        ids, mask, logprobs = eos_ids(tokenizer)[:1] or [0], [0], [0.0]
    return Completion(
        token_ids=ids,
        logprobs=logprobs,
        finish_reason=FINISH_REASONS[e.finish_reason],
        text=tokenizer.decode(ids, skip_special_tokens=False),
        loss_mask=mask,
        # the last turn was sampled after the whole history before it: its recorded routes
        # cover every position up to its last token (routing replay)
        routes=e.turns[-1].routes if e.turns else None,
        # the engine's records of the last turn's sequence (its whole history, where the
        # session computed it): the trainer checks them against these ids before using them
        hidden=e.turns[-1].hidden if e.turns else None,
    )


def episode_metrics(groups: list[Group]) -> dict[str, float]:
    """How a step's episodes went (see the module docstring) and the mean of each reward
    component (`reward_<name>`); single-turn trajectories report their components alone."""
    everything = [t for g in groups for t in g.trajectories]
    out = {}
    for k in sorted({k for t in everything for k in t.rewards}):
        out[f"reward_{k}"] = sum(t.rewards.get(k, 0.0) for t in everything) / len(everything)
    trajs = [t for t in everything if t.metrics]
    if not trajs:
        return out
    n = len(trajs)
    keys = {k for t in trajs for k in t.metrics}
    out |= {SUMMED[k]: sum(t.metrics.get(k, 0.0) for t in trajs) for k in keys & SUMMED.keys()}
    for k in keys & RATES.keys():
        out[RATES[k]] = sum(t.metrics.get(k, 0.0) > 0 for t in trajs) / n
    for k in keys & MEANS.keys():
        out[MEANS[k]] = sum(t.metrics.get(k, 0.0) for t in trajs) / n
    for k in keys - SUMMED.keys() - RATES.keys() - MEANS.keys() - UNLOGGED:  # an env's own
        out[k] = sum(t.metrics.get(k, 0.0) for t in trajs)
    if any(t.metrics.get("turns") for t in trajs):
        masks = [t.completion.loss_mask or [] for t in trajs]
        out["assistant_tokens_per_episode"] = sum(sum(m) for m in masks) / n
    return out


def tool_use_notes(run_dir: Path) -> list[str]:
    """The summary's warning when an env task offered tools and no RL step ever saw one called
    (a tool env whose tools are never called trains nothing about them, silently otherwise)."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "tool_call_rate" in r]
    rows = [r for r in rows if r.get("phase", "rl") == "rl"]
    if not rows or any(r["tool_call_rate"] > 0 for r in rows):
        return []
    malformed = sum(r.get("malformed_calls", 0.0) for r in rows)
    return [
        f"TOOLS WERE NEVER CALLED: tool_call_rate was 0 in all {len(rows)} RL steps "
        f"({malformed:g} malformed calls). Check that the chat template shows the tools "
        "(task.render_tools), that task.parser matches the model's tool-call format, or warm "
        "the model up with an SFT stage (sft.steps) on demonstrations that call them"
    ]
