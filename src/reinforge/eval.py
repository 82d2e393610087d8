"""Scoring a policy on held-out tasks: n samples per task, the task's own reward, and the metrics
of `eval_metrics` (unbiased pass@k, mean@n, accuracy by data source, lengths, truncation).

One function for both uses: validation during training (`[eval] before_train / every`, over the
trainer's own model) and `reinforge eval` (over a loaded checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reinforge.engine.base import Engine, SamplingParams
from reinforge.envs.sources import EnvTasks
from reinforge.eval_metrics import Sample, summarize_eval
from reinforge.train.common import eos_ids, render_prompt

NUM_EXAMPLES = 8  # samples kept as examples for logs and reports


@dataclass
class EvalResult:
    metrics: dict[str, float]  # summarize_eval's: pass@k, mean@n, truncation_rate, lengths, ...
    table: str  # the same numbers as a text table
    samples: list[dict]  # one row per sample: task, completion, reward, length, finish reason
    num_tasks: int
    samples_per_task: int
    # Env tasks: how the episodes went (tool-call rate, win rate, turns, ...: env_rollout.py)
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

    @property
    def examples(self) -> list[dict]:
        return self.samples[:NUM_EXAMPLES]


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
    """Generate `samples_per_task` completions of each task and score them with the source's
    reward; greedy at temperature 0."""
    assert tasks, "evaluate needs at least one task"
    prompts = [render_prompt(tokenizer, t.messages) for t in tasks]
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        n=samples_per_task,
        stop_token_ids=tuple(eos_ids(tokenizer)),
        seed=seed,
    )
    if isinstance(task_source, EnvTasks):  # multi-turn episodes, through the code RL runs
        from reinforge.train.env_rollout import evaluate_episodes

        return evaluate_episodes(engine, tokenizer, task_source, tasks, params)
    outputs = engine.generate(prompts, params)
    groups, rows = [], []
    for task, completions in zip(tasks, outputs, strict=True):
        source = str(task.info.get("data_source", task_source.name))
        group = []
        for c in completions:
            reward = task_source.reward(c.text, task)
            group.append(Sample(reward, len(c.token_ids), c.finish_reason, source))
            rows.append(sample_row(task, c, reward, source))
        groups.append(group)
    summary = summarize_eval(groups)
    return EvalResult(summary.metrics, summary.table, rows, len(tasks), samples_per_task)


def sample_row(task, completion, reward: float, data_source: str) -> dict:
    return {
        "task_id": task.id,
        "data_source": data_source,
        "prompt": task.messages[-1].content,
        "answer": task.answer,
        "completion": completion.text,
        "reward": reward,
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
