"""Scoring a policy on held-out tasks: greedy decoding, the task's own reward."""

from __future__ import annotations

from dataclasses import dataclass

from reinforge.engine.base import Engine, SamplingParams
from reinforge.train.common import eos_ids, render_prompt


@dataclass
class EvalResult:
    accuracy: float
    reward_mean: float
    response_len: float
    truncation_rate: float
    num_tasks: int
    examples: list[dict]


def evaluate(
    engine: Engine, tokenizer, task_source, tasks, max_new_tokens: int, seed: int = 0
) -> EvalResult:
    prompts = [render_prompt(tokenizer, t.messages) for t in tasks]
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        n=1,
        stop_token_ids=tuple(eos_ids(tokenizer)),
        seed=seed,
    )
    outs = engine.generate(prompts, params)
    rewards, lengths, truncated, examples = [], [], [], []
    for task, (c,) in zip(tasks, outs):
        r = task_source.reward(c.text, task)
        rewards.append(r)
        lengths.append(len(c.token_ids))
        truncated.append(c.finish_reason == "length")
        if len(examples) < 8:
            examples.append(
                {
                    "prompt": task.messages[-1].content,
                    "completion": c.text,
                    "answer": task.answer,
                    "reward": r,
                }
            )
    n = max(len(tasks), 1)
    return EvalResult(
        accuracy=sum(r >= 1.0 for r in rewards) / n,
        reward_mean=sum(rewards) / n,
        response_len=sum(lengths) / n,
        truncation_rate=sum(truncated) / n,
        num_tasks=len(tasks),
        examples=examples,
    )
