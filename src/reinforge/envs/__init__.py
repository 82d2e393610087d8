"""Environments: the protocol every env speaks, the tool helpers, and the built-in envs.

The public API a user's env is written against (docs/environments.md):

- `Env` (the protocol: `reset(task) -> EnvState`, `step(state, assistant) -> StepResult`),
  `EnvState`, `StepResult`, `SingleTurnEnv`;
- tools: `make_tools` / `tool_schema` (typed functions with docstrings become OpenAI tool
  schemas), `call_tool` (runs a parsed call, never raises for what the model wrote),
  `ToolOutput`; `ToolEnv`, a ready tool-calling env over such functions;
- tool-call parsing: `get_parser("hermes" | "llama3_json" | "mistral")`, `ToolCall`,
  `ParseError`;
- the data it sees: `Message`, `Task` (from `reinforge.types`).
"""

from reinforge.envs.base import Env, EnvState, SingleTurnEnv, StepResult
from reinforge.envs.parsers import ParseError, ToolCall, get_parser
from reinforge.envs.tool_env import ToolEnv
from reinforge.envs.tools import ToolOutput, call_tool, make_tools, tool_schema
from reinforge.types import Message, Task

__all__ = [
    "Env",
    "EnvState",
    "Message",
    "ParseError",
    "SingleTurnEnv",
    "StepResult",
    "Task",
    "ToolCall",
    "ToolEnv",
    "ToolOutput",
    "call_tool",
    "get_parser",
    "make_tools",
    "tool_schema",
]
