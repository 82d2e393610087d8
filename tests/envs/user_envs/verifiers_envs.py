"""Environments written only with verifiers' own classes, as a user of that library writes them
(tests/test_verifiers.py plays them through `[task] name = "verifiers"`)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def exact(completion, answer) -> float:
    return float(completion[-1].content.strip() == answer)


def load_sums(num_rows: int = 40):
    """A single-turn environment: 'a+b=' answered with the number."""
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(5)]
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows[:num_rows]), rubric=vf.Rubric(funcs=[exact])
    )


class GuessEnv(vf.MultiTurnEnv):
    """Guess a digit; the environment answers "higher" or "lower" until it is found."""

    async def env_response(self, messages, state, **kwargs):
        guess = messages[-1].content.strip()
        state["guesses"] = state.get("guesses", 0) + 1
        if guess == state["answer"]:
            state["final_env_response"] = [{"role": "user", "content": "found"}]
            return state["final_env_response"]
        hint = "higher" if guess.isdigit() and int(guess) < int(state["answer"]) else "lower"
        return [{"role": "user", "content": hint}]


def found(state) -> float:
    return float(state.get("final_env_response") is not None)


def load_guess(max_turns: int = 4):
    rows = [{"question": "Guess my digit.", "answer": str(d)} for d in range(10)] * 3
    return GuessEnv(
        dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[found]), max_turns=max_turns
    )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def load_tool_env():
    rows = [{"question": "What is 2+3? Use the tool.", "answer": "5"}] * 12
    return vf.ToolEnv(
        dataset=Dataset.from_list(rows), tools=[add], rubric=vf.Rubric(funcs=[exact]), max_turns=3
    )
