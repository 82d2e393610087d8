"""Arithmetic with a tool: the model may call a calculator (or the sandboxed python tool), read
the result, and answer with the number alone.

`calculator(expression)` evaluates integer arithmetic in-process by walking the expression's
syntax tree (numbers, + - *, unary minus, parentheses; nothing else is evaluated, and results
are capped in size), so it is safe and costs microseconds. `make_python_tool` (envs/sandbox.py)
is the slower, general choice.

`ToolArithmeticTasks` is the task source: `a op b` questions from a seeded stream, a held-out
split of its own. `demonstration` is the scripted policy behind the SFT reference episodes:
for a seeded share of tasks it calls the tool and answers with what the tool said, for the rest
it answers at once; training then has to find out that the tool pays.
"""

from __future__ import annotations

import ast
import operator
import random

from reinforge.envs.base import EnvState
from reinforge.envs.tools import ToolOutput
from reinforge.tasks.procedural import ProceduralTasks
from reinforge.types import Message, Task

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 60  # beyond this a product of products is a denial of service, not a sum

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

# The tool itself is described by its schema, which the model's chat template renders.
INSTRUCTIONS = "Reply with the number alone."


def calculator(expression: str) -> str | ToolOutput:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: Integers combined with +, -, * and parentheses, e.g. "(12+3)*45".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return ToolOutput(
            f"Error: the expression is longer than {MAX_EXPRESSION_CHARS} characters.",
            is_error=True,
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return str(_evaluate(tree.body))
    except (SyntaxError, ValueError) as e:
        return ToolOutput(f"Error: {e}", is_error=True)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if len(str(abs(value))) > MAX_RESULT_DIGITS:
            raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits")
        return value
    shown = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
    raise ValueError(f"{shown!r} is not integer arithmetic; use integers with + - * and ( )")


def tool_call_text(tool: str, expression: str) -> str:
    """A Hermes tool call (Qwen2.5 / Qwen3's format) computing `expression` with `tool`."""
    argument = (
        f'"expression": "{expression}"'
        if tool == "calculator"
        else f'"code": "print({expression})"'
    )
    return f'<tool_call>\n{{"name": "{tool}", "arguments": {{{argument}}}}}\n</tool_call>'


class ToolArithmeticTasks(ProceduralTasks):
    """`cfg`: a `ToolArithmeticTaskConfig` (digits, operations, tool, demo_tool_fraction)."""

    name = "tool_arithmetic"

    def _make(self, rng: random.Random, task_id: str) -> Task:
        c = self.cfg

        def operand() -> int:
            digits = rng.randint(c.min_digits, c.max_digits)
            return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

        a, b, op = operand(), operand(), rng.choice(c.operations)
        expression = f"{a}{op}{b}"
        return Task(
            id=task_id,
            messages=(Message("user", f"{expression}=? {INSTRUCTIONS}"),),
            answer=str(_OPERATORS[_OP_NODES[op]](a, b)),
            info={"key": expression, "expression": expression},
        )

    def reward(self, completion: str, task: Task) -> float:
        return float(completion.strip().removesuffix(".") == task.answer)

    def demonstration(self, state: EnvState) -> str:
        """The scripted reference policy's next assistant message in this episode."""
        task = state.task
        if state.messages[-1].role == "tool":  # answer with what the tool printed
            return state.messages[-1].content.strip()
        calls_tool = random.Random(f"{task.id}/demo").random() < self.cfg.demo_tool_fraction
        if calls_tool:
            return tool_call_text(self.cfg.tool, task.info["expression"])
        return task.answer


_OP_NODES = {"+": ast.Add, "-": ast.Sub, "*": ast.Mult}
