"""Benchmark prompts: random words of the shape tokenizer (`model.path = "shape:..."`), scored as
the TRL peer scores them (shared/peers/trl_grpo.py: the completion text's length mod 7), so
reinforge and the peer do the same work on the same kind of data. It measures speed; the
reward carries no meaning."""

from __future__ import annotations

import random

from reinforge.tasks.procedural import ProceduralTasks
from reinforge.types import Message, Task


class RandomTokensTasks(ProceduralTasks):
    name = "random_tokens"

    def _make(self, rng: random.Random, task_id: str) -> Task:
        words = [f"t{rng.randrange(self.cfg.vocab_words)}" for _ in range(self.cfg.prompt_tokens)]
        solution = " ".join(f"t{rng.randrange(self.cfg.vocab_words)}" for _ in range(8))
        return Task(
            id=task_id,
            messages=(Message("user", " ".join(words)),),
            answer="",
            solution=solution,
            info={"key": task_id},  # ids never repeat across the two streams
        )

    def reward(self, completion: str, task: Task) -> float:
        return (len(completion) % 7) / 6.0
