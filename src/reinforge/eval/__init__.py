"""Evaluation: `evaluate` (here) scores a policy on held-out tasks through the rollout package,
`metrics` holds the estimators (pass@k, mean@n) and `run` the `reinforge eval` command. `eval`
and `eval.metrics` may import `rollout`, `engine`, `envs` and below; `eval.run`, a command's
module, also `models`, `server` and `config`.

Scoring a policy on held-out tasks: n samples per task, the task's own reward, and the metrics
of `eval.metrics` (unbiased pass@k, mean@n, accuracy by data source, lengths, truncation).

One function for both uses: validation during training (`[eval] before_train / every`, over the
trainer's own model) and `reinforge eval` (over a loaded checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reinforge import faults
from reinforge.engine.base import Engine
from reinforge.envs.env_tasks import ENV_REWARD, single_turn_tasks
from reinforge.eval.metrics import Sample, summarize_eval
from reinforge.faults import RewardErrors
from reinforge.rollout.sampling import sampling_params
from reinforge.rollout.trajectories import episode_metrics, play
from reinforge.types import Trajectory


@dataclass
class EvalResult:
    metrics: dict[str, float]  # summarize_eval's: pass@k, mean@n, truncation_rate, lengths, ...
    table: str  # the same numbers as a text table
    samples: list[dict]  # one row per sample: task, completion, reward, length, finish reason
    num_tasks: int
    samples_per_task: int
    # How the episodes went (tool-call rate, win rate, turns, ...: rollout/trajectories.py),
    # each reward component's mean (`reward_<name>`) and failed reward calls
    episode_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        """Fraction of samples that are correct (pass@1)."""
        return self.metrics["pass@1"]

    @property
    def reward_mean(self) -> float:
        return self.metrics[f"mean@{self.samples_per_task}"]

    @property
    def response_len(self) -> float:
        return self.metrics["response_len/mean"]

    @property
    def truncation_rate(self) -> float:
        return self.metrics["truncation_rate"]


def evaluate(
    engine: Engine,
    tokenizer,
    task_source,
    tasks,
    max_new_tokens: int,
    seed: int = 0,
    *,
    samples_per_task: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> EvalResult:
    """`samples_per_task` episodes of each task through the rollout training runs (a task
    source without an env plays as a single turn), greedy at temperature 0. A sample passes on
    the task's own verdict ("env") when the scorer has one, else on its weighted reward; a
    reward component that fails scores 0 and is counted (`reward_errors`)."""
    assert tasks, "evaluate needs at least one task"
    env_tasks = single_turn_tasks(task_source)
    params = sampling_params(
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        n=samples_per_task,
        seed=seed,
    )
    errors = RewardErrors()
    with faults.suspended():
        groups = play(engine, tokenizer, env_tasks, tasks, samples_per_task, params, errors)
    samples, rows = [], []
    for group in groups:
        source = str(group.task.info.get("data_source", env_tasks.name))
        episodes = [t for t in group.trajectories if t.segment == 0]  # an agent's: one each
        samples.append([eval_sample(t, source) for t in episodes])
        rows += [sample_row(t.task, t.completion, t.reward, source, t.rewards) for t in episodes]
    summary = summarize_eval(samples)
    details = {**episode_metrics(groups), **errors.metrics()}
    return EvalResult(summary.metrics, summary.table, rows, len(tasks), samples_per_task, details)


def eval_sample(t: Trajectory, source: str) -> Sample:
    """An episode as evaluation counts it: the task's verdict (a pass when at least 1: a right
    answer, a won game), its length the ids the model generated (env replies excluded)."""
    num_generated = sum(t.completion.loss_mask or [1] * len(t.completion.token_ids))
    verdict = t.rewards.get(ENV_REWARD, t.reward)
    return Sample(verdict, num_generated, t.completion.finish_reason, source)


def sample_row(
    task, completion, reward: float, data_source: str, rewards: dict[str, float] | None = None
) -> dict:
    return {
        "task_id": task.id,
        "data_source": data_source,
        "prompt": task.messages[-1].content,
        "answer": task.answer,
        "completion": completion.text,
        "reward": reward,
        "rewards": rewards or {},
        "num_tokens": len(completion.token_ids),
        "finish_reason": completion.finish_reason,
    }


def logged_metrics(result: EvalResult) -> dict[str, float]:
    """What a training run logs of an evaluation: the four headline numbers under their long-
    standing names, and pass@k for k > 1 and per-source accuracy prefixed `eval_` (mean@n is
    `eval_reward`)."""
    headline = {
        "eval_accuracy": result.accuracy,
        "eval_reward": result.reward_mean,
        "eval_response_len": result.response_len,
        "eval_truncation_rate": result.truncation_rate,
    }
    rest = {
        f"eval_{key}": value
        for key, value in result.metrics.items()
        if key.startswith("pass@") and key != "pass@1"
    }
    episodes = {f"eval_{key}": value for key, value in result.episode_metrics.items()}
    return {**headline, **rest, **episodes}
