"""The OpenAI request bodies the server accepts, validated once by pydantic.

Unknown fields are ignored (clients send many we have no use for, such as `user` or `store`);
known fields we cannot honour (penalties, logit bias, `echo`, JSON response formats, forced tool
choice) are rejected when set, so a request never silently means something else here.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_N = 128  # completions per prompt in one request
MAX_TOP_LOGPROBS = 20


class RequestError(Exception):
    """A request the client must change; becomes an OpenAI error body with `status`."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(
    message: str,
    param: str | None = None,
    code: str | None = None,
    type: str = "invalid_request_error",
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions. `None` means the default."""

    model: str
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension; 0 or -1 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM extension
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and any(s == "" for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("must not hold empty strings")
        return stop

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        if value not in (None, 0.0):
            raise ValueError("not supported by this server; leave it at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("not supported by this server; leave it empty")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")  # passed to the chat template as given
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCallIn(_Body):
    name: str
    arguments: str  # a JSON object, as the OpenAI API sends it

    @field_validator("arguments")
    @classmethod
    def _arguments_are_a_json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        return arguments


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[dict[str, Any]] | None) -> str | None:
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"only text content parts are supported; got type {part.get('type')!r}"
                )
            texts.append(part["text"])
        return "".join(texts)

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role!r} message needs content")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: tool-call arguments as objects, as HF
        templates (Qwen, Llama) render them with `tojson`; 'developer' is a system message."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content or "",
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments or "{}"),
                    },
                }
                for call in self.tool_calls
            ]
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _auto_or_none(cls, choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if choice not in (None, "auto", "none"):
            raise ValueError("only 'auto' and 'none' are supported (no forced tool calls)")
        return choice

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError("only {'type': 'text'} is supported (no JSON mode or schemas)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("needs logprobs = true")
        return top_logprobs

    @property
    def should_parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("is an empty list; give text or token ids")
        return prompt

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value and not (info.field_name == "best_of" and value == (info.data.get("n") or 1)):
            raise ValueError("not supported by this server")
        return value

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return self.prompt  # type: ignore[return-value]
