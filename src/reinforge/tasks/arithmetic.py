"""Multi-digit arithmetic: `a op b =`, answered with the number alone.

The checker is strict, as exact-match graders are: the completion must start with the number.
"""

from __future__ import annotations

import random
import re

from reinforge.tasks.procedural import ProceduralTasks
from reinforge.types import Message, Task

_NUMBER = re.compile(r"-?\d+")


def parse_answer(completion: str) -> str | None:
    """The first integer in the completion, or None. The model is trained to answer with the
    number alone, so anything before it (or no number at all) is simply wrong, not guessed at."""
    match = _NUMBER.match(completion.strip())
    return match.group(0) if match else None


class ArithmeticTasks(ProceduralTasks):
    name = "arithmetic"

    def _make(self, rng: random.Random, task_id: str) -> Task:
        c = self.cfg

        def operand() -> int:
            digits = rng.randint(c.min_digits, c.max_digits)
            low = 0 if digits == 1 else 10 ** (digits - 1)
            return rng.randint(low, 10**digits - 1)

        a, b, op = operand(), operand(), rng.choice(c.operations)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        key = f"{a}{op}{b}"
        as_sentence = rng.random() < c.sentence_fraction
        return Task(
            id=task_id,
            messages=(Message("user", f"{a}{op}{b}="),),
            answer=str(value),
            solution=f"The answer is {value}." if as_sentence else str(value),
            info={"key": key},
        )

    def reward(self, completion: str, task: Task) -> float:
        given = parse_answer(completion)
        if given == task.answer:
            return 1.0
        if given is None or self.cfg.partial_credit == 0.0:
            return 0.0
        return self.cfg.partial_credit * digit_overlap(given, task.answer)


def digit_overlap(given: str, answer: str) -> float:
    """Fraction of digit positions, aligned from the right, where `given` matches `answer`
    (a wrong sign earns nothing)."""
    if given.startswith("-") != answer.startswith("-"):
        return 0.0
    a, b = given.lstrip("-")[::-1], answer.lstrip("-")[::-1]
    return sum(x == y for x, y in zip(a, b)) / max(len(a), len(b))
