"""A user's env outside the package, written against reinforge's public API alone: look a key up
in a table with a tool, then answer with its value. Used by tests/envs/test_user_env.py."""

from reinforge.envs import (
    EnvState,
    Message,
    ParseError,
    StepResult,
    call_tool,
    get_parser,
    make_tools,
)


def rows(seed: int = 0):
    return [
        {"prompt": f"What is the value of key k{i}?", "answer": f"v{i * 7 % 10}", "key": f"k{i}"}
        for i in range(40)
    ]


class LookupEnv:
    name = "lookup"
    counters = ("lookups", "bad_calls")
    reward_components = ("looked_up",)

    def __init__(self, table: dict[str, str], max_turns: int = 3, fail_on: str | None = None):
        self.table, self.max_turns, self.fail_on = table, max_turns, fail_on
        self.parse = get_parser("hermes")

        def lookup(key: str) -> str:
            """Read a value from the table.

            Args:
                key: The key, e.g. "k3".
            """
            return self.table.get(key, "no such key")

        self.tools = make_tools([lookup])
        self.tool_schemas = [tool.schema for tool in self.tools.values()]

    def reset(self, task):
        return EnvState(task=task, messages=list(task.messages), info={"looked_up": 0.0})

    def step(self, state, assistant):
        if self.fail_on and self.fail_on in state.task.messages[-1].content:
            raise RuntimeError(f"the env broke on {state.task.id}")
        state.messages.append(assistant)
        state.turn += 1
        calls = self.parse(assistant.content).items
        if not calls or state.turn >= self.max_turns:
            right = float(assistant.content.strip() == state.task.answer)
            rewards = {"reward": right, "looked_up": state.info["looked_up"]}
            return StepResult([], True, rewards=rewards, metrics={"lookups": 0.0})
        replies, metrics = [], {"lookups": 0.0, "bad_calls": 0.0}
        for call in calls:
            if isinstance(call, ParseError):
                metrics["bad_calls"] += 1
                continue
            metrics["lookups"] += 1
            state.info["looked_up"] = 1.0
            replies.append(Message("tool", call_tool(self.tools, call.name, call.arguments).text))
        replies = replies or [Message("tool", "Error: no well-formed call")]
        state.messages.extend(replies)
        return StepResult(replies, False, metrics=metrics)

    def demonstration(self, state):
        if state.turn == 0:
            key = state.task.info["key"]
            return f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'
        return state.messages[-1].content


def make_env(max_turns: int = 3, fail_on: str | None = None):
    table = {f"k{i}": f"v{i * 7 % 10}" for i in range(40)}
    return LookupEnv(table, max_turns, fail_on)


def not_an_env():
    return {"reset": "nope"}


def reset_returns_a_dict():
    env = make_env()
    env.reset = lambda task: {"messages": []}
    return env
