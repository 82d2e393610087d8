"""Arithmetic with a tool: the question names its numbers (`a = 35, b = 33. What is a*b?`), the
model may call a calculator (or the sandboxed python tool) that has those names in scope, read
the result, and answer with the number alone.

`calculator(expression)` evaluates integer arithmetic in-process by walking the expression's
syntax tree (numbers, the episode's named values, + - *, unary minus, parentheses; nothing else
is evaluated, and results are capped in size), so it is safe and costs microseconds. The python
tool (envs/sandbox.py) is the slower, general choice; its program starts with the named values
assigned (`a = 35`).

Why named values: a call can then be written without copying digits across the conversation
(`calculator("a*b")`), as a notebook's cells use the variables a data set was loaded into. A
model may still write the numbers out (`calculator("35*33")`). Small models learn the first in
minutes; copying numbers through a long JSON call is a skill they pick up far more slowly.

`ArithmeticToolEnv` is a `ToolEnv` that puts the task's values in scope around each step (the
tools are shared by every episode and take only the model's arguments, as in html_env).
`ToolArithmeticTasks` is the task source: questions from a seeded stream, a held-out split of
its own. `demonstration` is the scripted policy behind the SFT reference episodes: for a seeded
share of tasks it calls the tool and answers with what the tool said, for the rest it answers at
once; RL then has to find out that the tool pays.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

from reinforge.envs.base import EnvState, StepResult
from reinforge.envs.tool_env import ToolEnv
from reinforge.envs.tools import ToolOutput
from reinforge.tasks.arithmetic import digit_overlap
from reinforge.tasks.procedural import ProceduralTasks
from reinforge.types import Message, Task

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 60  # beyond this a product of products is a denial of service, not a sum
NAMES = ("a", "b")
# A compare question's threshold t lies within this fraction of the result. Wider, and a rough
# estimate of a*b from the leading digits settles most questions (at +-50% one within 20% of the
# result is right 80% of the time): the calculator would hardly pay. At 5% only the exact
# product does; a guess is right half the time.
COMPARE_SPREAD = 0.05
_INTEGER = re.compile(r"-?\d+")

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_OP_NODES = {"+": ast.Add, "-": ast.Sub, "*": ast.Mult}
_COMPARISONS = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}
_SCOPE: ContextVar[Mapping[str, int]] = ContextVar(
    "reinforge_calculator_scope", default=MappingProxyType({})
)

# The tool itself is described by its schema, which the model's chat template renders.
INSTRUCTIONS = {"value": "Reply with the number alone.", "compare": "Reply yes or no."}


@contextmanager
def values_in_scope(values: Mapping[str, int]) -> Iterator[None]:
    """Run the arithmetic tools with `values` (name -> integer) in scope."""
    token = _SCOPE.set(dict(values))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def calculator(expression: str) -> str | ToolOutput:
    """Evaluate an integer arithmetic expression, or compare two of them (true or false).

    Args:
        expression: Integers and the question's named values combined with +, -, * and
            parentheses, e.g. "a*b" or "(12+3)*45"; or one comparison, e.g. "a*b > t".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return ToolOutput(
            f"Error: the expression is longer than {MAX_EXPRESSION_CHARS} characters.",
            is_error=True,
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        if isinstance(tree.body, ast.Compare) and len(tree.body.ops) == 1:
            return _compare(tree.body, _SCOPE.get())
        return str(_evaluate(tree.body, _SCOPE.get()))
    except (SyntaxError, ValueError) as e:
        return ToolOutput(f"Error: {e}", is_error=True)


def _compare(node: ast.Compare, scope: Mapping[str, int]) -> str:
    compare = _COMPARISONS.get(type(node.ops[0]))
    if compare is None:
        raise ValueError("compare with <, <=, >, >=, == or !=")
    is_true = compare(_evaluate(node.left, scope), _evaluate(node.comparators[0], scope))
    return "true" if is_true else "false"


def _evaluate(node: ast.AST, scope: Mapping[str, int]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name) and node.id in scope:
        return scope[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, scope)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, scope), _evaluate(node.right, scope)
        value = _OPERATORS[type(node.op)](left, right)
        if len(str(abs(value))) > MAX_RESULT_DIGITS:
            raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits")
        return value
    if isinstance(node, ast.Name):
        known = ", ".join(sorted(scope)) or "none"
        raise ValueError(f"unknown name {node.id!r}; the named values are: {known}")
    shown = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
    raise ValueError(f"{shown!r} is not integer arithmetic; use integers with + - * and ( )")


def python_with_values(run_python: Callable[[str], Any]) -> Callable[[str], Any]:
    """The sandboxed python tool (`make_python_tool`), its program prefixed by assignments of
    the named values in scope."""

    def python(code: str) -> Any:
        """Run a Python program in a fresh sandbox and return what it printed.

        The question's named values are assigned before your program runs. Each call starts a
        new interpreter, so nothing persists between calls; there is no network. Print the
        values you need.

        Args:
            code: A complete Python program, e.g. "print(a*b)".
        """
        prelude = "".join(f"{name} = {value}\n" for name, value in _SCOPE.get().items())
        return run_python(prelude + code)

    return python


def tool_call_text(tool: str, expression: str) -> str:
    """A Hermes tool call (Qwen2.5 / Qwen3's format) computing `expression` with `tool`."""
    argument = (
        f'"expression": "{expression}"'
        if tool == "calculator"
        else f'"code": "print({expression})"'
    )
    return f'<tool_call>\n{{"name": "{tool}", "arguments": {{{argument}}}}}\n</tool_call>'


class ArithmeticToolEnv(ToolEnv):
    """A `ToolEnv` whose tools see the task's named values (`task.info["values"]`)."""

    name = "tool_arithmetic"

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        with values_in_scope(state.task.info["values"]):
            return super().step(state, assistant)


class ToolArithmeticTasks(ProceduralTasks):
    """`cfg`: a `ToolArithmeticTaskConfig` (digits, operations, tool, demo_tool_fraction)."""

    name = "tool_arithmetic"

    def _make(self, rng: random.Random, task_id: str) -> Task:
        c = self.cfg

        def operand() -> int:
            digits = rng.randint(c.min_digits, c.max_digits)
            return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

        values = {name: operand() for name in NAMES}
        op = rng.choice(c.operations)
        result = _OPERATORS[_OP_NODES[op]](values["a"], values["b"])
        expression, question, answer = f"a{op}b", f"What is a{op}b?", str(result)
        if c.question == "compare":
            values["t"] = round(result * rng.uniform(1 - COMPARE_SPREAD, 1 + COMPARE_SPREAD))
            expression, question = f"{expression} > t", f"Is a{op}b above t?"
            answer = "yes" if result > values["t"] else "no"
        shown = ", ".join(f"{name} = {value}" for name, value in values.items())
        return Task(
            id=task_id,
            messages=(Message("user", f"{shown}. {question} {INSTRUCTIONS[c.question]}"),),
            answer=answer,
            info={"key": shown, "expression": expression, "values": values},
        )

    def reward(self, completion: str, task: Task) -> float:
        given = completion.strip().removesuffix(".").lower()
        if given == task.answer:
            return 1.0
        if not self.cfg.partial_credit or not _INTEGER.fullmatch(given):
            return 0.0
        return self.cfg.partial_credit * digit_overlap(given, task.answer)

    def demonstration(self, state: EnvState) -> str:
        """The scripted reference policy's next assistant message in this episode."""
        task = state.task
        if state.messages[-1].role == "tool":  # answer with what the tool said
            said = state.messages[-1].content.strip()
            return {"true": "yes", "false": "no"}.get(said, said)
        calls_tool = random.Random(f"{task.id}/demo").random() < self.cfg.demo_tool_fraction
        if calls_tool:
            return tool_call_text(self.cfg.tool, task.info["expression"])
        return task.answer
