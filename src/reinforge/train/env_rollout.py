"""RL and evaluation on env tasks: multi-turn episodes (train/episodes.py) as trajectories.

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

from pathlib import Path

from reinforge.engine.base import Engine, SamplingParams
from reinforge.envs.sources import EnvTasks
from reinforge.eval import EvalResult, sample_row
from reinforge.eval_metrics import Sample, summarize_eval
from reinforge.metrics import read_metrics
from reinforge.train.common import eos_ids
from reinforge.train.episodes import Episode, EpisodeLimits, check_episode, run_episodes
from reinforge.types import Completion, Group, Task, Trajectory

# Episode ends as the trainer's completions know them: cut by a limit is "length".
FINISH_REASONS = {"done": "stop", "context": "length", "max_turns": "length"}

# Counters every episode reports, whatever its env: how the episode ran.
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
}
RATES = {
    "tool_calls": "tool_call_rate",
    "win": "win_rate",
    "draw": "draw_rate",
    "loss": "loss_rate",
    "forfeit": "forfeit_rate",
}
MEANS = {"turns": "turns_per_episode", "tool_calls": "tool_calls_per_episode"}


def env_rollout(
    cfg, policy, env_tasks: EnvTasks, batch_tasks: list[Task], seed: int
) -> list[Group]:
    """`rollout.samples_per_prompt` scored episodes of each task, as groups."""
    r = cfg.rollout
    params = SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p,
        stop_token_ids=tuple(eos_ids(policy.tokenizer)),
        stop_strings=tuple(r.stop_strings),
        seed=seed,
    )
    return play(
        policy.engine, policy.tokenizer, env_tasks, batch_tasks, r.samples_per_prompt, params
    )


def play(
    engine: Engine,
    tokenizer,
    env_tasks: EnvTasks,
    tasks: list[Task],
    samples_per_task: int,
    params: SamplingParams,
) -> list[Group]:
    """`samples_per_task` episodes of each task as scored trajectories, one group per task
    (`params.max_new_tokens` is each turn's budget)."""
    limits = episode_limits(env_tasks, params.max_new_tokens, engine)
    tools = tools_to_render(env_tasks)
    episode_groups = run_episodes(
        engine,
        tokenizer,
        env_tasks.env,
        tasks,
        samples_per_task,
        params,
        limits,
        render_tools=tools is not None,
    )
    return [
        Group(task, [to_trajectory(tokenizer, env_tasks, e, tools) for e in episodes])
        for task, episodes in zip(tasks, episode_groups)
    ]


def episode_limits(env_tasks: EnvTasks, max_new_tokens: int, engine) -> EpisodeLimits:
    """Per-turn budget `max_new_tokens`; the episode's context: task.max_context, else the
    model's."""
    max_context = env_tasks.cfg.max_context or engine.model.config.max_position_embeddings
    return EpisodeLimits(env_tasks.cfg.max_turns, max_new_tokens, max_context)


def tools_to_render(env_tasks: EnvTasks) -> list[dict] | None:
    return env_tasks.tool_schemas if env_tasks.cfg.render_tools else None


def to_trajectory(tokenizer, env_tasks: EnvTasks, e: Episode, tools) -> Trajectory:
    """An episode as the trainer's trajectory: completion = every id after the prompt, with its
    loss mask; reward and its components from the scorer; counters as metrics."""
    assert len(e.completion_ids) == len(e.loss_mask) == len(e.logprobs), "ragged episode"
    last = next((m.content for m in reversed(e.state.messages) if m.role == "assistant"), "")
    reward, components = env_tasks.scorer.score(e.rewards, last, e.task)
    metrics = dict.fromkeys((*env_tasks.counters, *EPISODE_COUNTERS), 0.0)
    metrics.update({k: float(v) for k, v in e.metrics.items()})
    metrics["turns"] = float(e.num_turns)
    metrics["token_mismatch"] = float(check_episode(tokenizer, e, tools) is not None)
    completion = Completion(
        token_ids=e.completion_ids,
        logprobs=e.logprobs,
        finish_reason=FINISH_REASONS[e.finish_reason],
        text=tokenizer.decode(e.completion_ids, skip_special_tokens=False),
        loss_mask=e.loss_mask,
    )
    return Trajectory(
        e.task,
        e.prompt_ids,
        completion,
        reward=reward,
        is_correct=e.rewards.get("reward", 0.0) >= 1.0,
        rewards=components,
        metrics=metrics,
    )


def episode_metrics(groups: list[Group]) -> dict[str, float]:
    """How a step's episodes went (see the module docstring); {} for single-turn trajectories."""
    trajs = [t for g in groups for t in g.trajectories if t.metrics]
    if not trajs:
        return {}
    n = len(trajs)
    keys = {k for t in trajs for k in t.metrics}
    out = {SUMMED[k]: sum(t.metrics.get(k, 0.0) for t in trajs) for k in keys & SUMMED.keys()}
    for k in keys & RATES.keys():
        out[RATES[k]] = sum(t.metrics.get(k, 0.0) > 0 for t in trajs) / n
    for k in keys & MEANS.keys():
        out[MEANS[k]] = sum(t.metrics.get(k, 0.0) for t in trajs) / n
    components = {k for t in trajs for k in t.rewards}
    for k in sorted(components):
        out[f"reward_{k}"] = sum(t.rewards.get(k, 0.0) for t in trajs) / n
    masks = [t.completion.loss_mask or [] for t in trajs]
    out["assistant_tokens_per_episode"] = sum(sum(m) for m in masks) / n
    return out


def evaluate_episodes(
    engine: Engine, tokenizer, env_tasks: EnvTasks, tasks: list[Task], params: SamplingParams
) -> EvalResult:
    """Held-out scoring of an env task: `params.n` episodes per task (greedy at temperature 0),
    through the same code as training; pass@k and mean@n over the episodes' rewards, and how
    the episodes went (`EvalResult.episode_metrics`)."""
    groups = play(engine, tokenizer, env_tasks, tasks, params.n, params)
    samples, rows = [], []
    for group in groups:
        samples.append([eval_sample(t, env_tasks.name) for t in group.trajectories])
        rows += [
            sample_row(t.task, t.completion, t.reward, env_tasks.name) for t in group.trajectories
        ]
    summary = summarize_eval(samples)
    return EvalResult(
        summary.metrics, summary.table, rows, len(tasks), params.n, episode_metrics(groups)
    )


def eval_sample(t: Trajectory, source: str) -> Sample:
    """An episode as evaluation counts it: its training reward (a pass when at least 1: a right
    answer, a won game), its length the ids the model generated (env replies excluded)."""
    num_generated = sum(t.completion.loss_mask or [])
    return Sample(t.reward, num_generated, t.completion.finish_reason, source)


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
