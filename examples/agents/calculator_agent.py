"""A tool-calling agent written only against the `openai` client: it offers a calculator, runs
the calls the model makes, and scores the final answer against the row's. Nothing in it knows
about reinforge; `configs/agent_calculator.toml` trains it.

Run it against any OpenAI-compatible server (`reinforge serve MODEL`, vLLM, OpenAI itself):

    python examples/agents/calculator_agent.py http://127.0.0.1:8000/v1 MODEL
"""

from __future__ import annotations

import ast
import json
import operator
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = (
    "Answer with the number alone. You may call the calculator tool first; "
    "then answer with its result."
)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
OPERATORS[ast.Div] = operator.truediv


def calculator(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers and + - * / are allowed")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else result)


def run(agent, max_steps: int = 3) -> float:
    """One episode: the question, up to `max_steps` model turns; 1.0 for the right number."""
    messages = [{"role": "system", "content": SYSTEM}, *agent.messages]
    text = ""
    for _ in range(max_steps):
        response = agent.client.chat.completions.create(
            model=agent.model, messages=messages, tools=TOOLS, max_tokens=64
        )
        message = response.choices[0].message
        text = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculator(str(expression))}
            )
    return float(text.strip() == agent.answer.strip())


if __name__ == "__main__":
    from types import SimpleNamespace

    base_url, model = sys.argv[1], sys.argv[2]
    question = {"role": "user", "content": "What is 17 * 23?"}
    context = SimpleNamespace(
        client=OpenAI(base_url=base_url, api_key="none"),
        model=model,
        messages=[question],
        answer="391",
    )
    print("reward", run(context))
