"""Countdown: reach a target from given numbers with + - * / and parentheses, each number used
exactly once. Every task is generated from an expression, so a solution always exists."""

from __future__ import annotations

import ast
import random
from collections import Counter
from fractions import Fraction

from reinforge.tasks.procedural import ProceduralTasks
from reinforge.types import Message, Task

MAX_EXPRESSION_CHARS = 200


def evaluate(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and the integer literals of an arithmetic expression, or None if it is not a
    plain expression of integers, + - * / and parentheses (or divides by zero)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(
            node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)
        ):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if right == 0:
                raise ZeroDivisionError
            return left / right
        raise ValueError("not allowed")

    try:
        return walk(tree.body), numbers
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def extract_expression(completion: str) -> str:
    """The completion's first line, without a trailing `= target` the model may add."""
    line = completion.strip().split("\n", 1)[0]
    return line.split("=", 1)[0].strip()


class CountdownTasks(ProceduralTasks):
    name = "countdown"

    def _make(self, rng: random.Random, task_id: str) -> Task:
        while True:
            numbers = [rng.randint(1, self.cfg.max_number) for _ in range(self.cfg.num_numbers)]
            expr = str(numbers[0])
            for n in numbers[1:]:
                op = rng.choice("+-*/")
                expr = f"({expr}){op}{n}" if rng.random() < 0.5 and op in "*/" else f"{expr}{op}{n}"
            result = evaluate(expr)
            if result is not None and result[0].denominator == 1 and result[0] >= 0:
                break
        target = int(result[0])
        shown = sorted(numbers)
        key = f"{shown}->{target}"
        prompt = f"Use {' '.join(map(str, shown))} to make {target}."
        return Task(
            id=task_id,
            messages=(Message("user", prompt),),
            answer=str(target),
            solution=expr,
            info={"key": key, "numbers": shown, "target": target},
        )

    def reward(self, completion: str, task: Task) -> float:
        result = evaluate(extract_expression(completion))
        if result is None:
            return 0.0
        value, used = result
        if Counter(used) != Counter(task.info["numbers"]):
            return 0.0
        return 1.0 if value == task.info["target"] else 0.0
