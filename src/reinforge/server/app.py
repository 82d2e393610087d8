"""The HTTP layer: OpenAI routes over one `ServedModel`, and OpenAI-shaped errors for every bad
request (never a traceback, never FastAPI's own `{"detail": ...}`).

Invalid requests answer 400 (including malformed JSON and values out of range), an unknown
model 404 with code "model_not_found", unknown routes 404, a body past the size limit 413
(`reinforge.server.limits`), anything unexpected 500 with the error logged here. The event loop
only reads bodies: parsing, chat rendering, tokenizing, generation (one request at a time, the
model's lock) and building the response run in a worker thread, so `/v1/models` and `/health`
answer while any request runs. Streams are sent once the
completions are done: the engine returns whole completions, so a stream is the same result cut
into per-token chunks, ending with `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from reinforge.engine.base import SamplingParams
from reinforge.envs.parsers import Parser, get_parser
from reinforge.errors import ConfigError
from reinforge.server.backend import ServedModel
from reinforge.server.limits import BodyLimit, ServerLimits, join_body, read_body
from reinforge.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    SamplingRequest,
    error_body,
)
from reinforge.server.responses import (
    Header,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
)

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
except ImportError as e:  # an optional extra: say how to install it
    raise ConfigError(
        "the HTTP server (`reinforge serve`, `reinforge.server.create_app`) needs fastapi and "
        "uvicorn; install them with `pip install 'reinforge[serve]'` (the other commands, "
        "`reinforge eval` among them, do not)"
    ) from e

log = logging.getLogger("reinforge.server")
BodyT = TypeVar("BodyT", bound=BaseModel)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's /v1/completions; chat fills the context


def create_app(
    served: ServedModel, tool_parser: str = "auto", limits: ServerLimits | None = None
) -> FastAPI:
    """The FastAPI app serving `served`. `tool_parser` names a parser in
    `reinforge.envs.parsers.PARSERS`; 'auto' reads the chat template's tool-call markers.
    `limits`: what one request may ask (`ServerLimits`' defaults when None)."""
    parser = get_parser(
        tool_parser if tool_parser != "auto" else default_tool_parser(served.tokenizer)
    )
    limits = limits or ServerLimits()
    app = FastAPI(title="reinforge", summary=f"OpenAI-compatible server for {served.name}")
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(served)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        _check_model(served, model_id)
        return _model_card(served)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)  # whole and within the size limit (BodyLimit)
        return await run_in_threadpool(answer_chat, served, parser, limits, body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        return await run_in_threadpool(answer_completion, served, limits, body)

    return app


def answer_chat(served: ServedModel, parser: Parser, limits: ServerLimits, body: list[bytes]):
    """One /v1/chat/completions request, start to end, in a worker thread."""
    request = parse_body(ChatCompletionRequest, join_body(body))
    _check_model(served, request.model)
    limits.check_completions(1, request.n or 1)
    served.check_text(sum(len(m.content or "") for m in request.messages), "messages")
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
    prompt = served.render_chat([m.to_template() for m in request.messages], tools)
    served.check_prompt(prompt, "messages")
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    max_tokens = request.max_completion_tokens or request.max_tokens
    params = sampling_params(request, served.max_new_tokens(prompt, max_tokens, param))
    num_top = (request.top_logprobs or 0) if request.logprobs else 0
    [outputs] = served.generate([prompt], params, num_top)
    header = Header.new("chatcmpl", served.name)
    chosen_parser = parser if request.should_parse_tools else None
    with_logprobs = bool(request.logprobs)
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        chunks = chat_chunks(
            header,
            outputs,
            len(prompt),
            served.tokenizer,
            chosen_parser,
            with_logprobs,
            include_usage,
        )
        return _sse(chunks)
    return chat_response(
        header, outputs, len(prompt), served.tokenizer, chosen_parser, with_logprobs
    )


def answer_completion(served: ServedModel, limits: ServerLimits, body: list[bytes]):
    """One /v1/completions request, start to end, in a worker thread."""
    request = parse_body(CompletionRequest, join_body(body))
    _check_model(served, request.model)
    limits.check_completions(len(request.prompts), request.n or 1)
    for p in request.prompts:
        if isinstance(p, str):
            served.check_text(len(p), "prompt")
    prompts = [served.encode(p) if isinstance(p, str) else list(p) for p in request.prompts]
    max_tokens = request.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    for prompt in prompts:
        served.check_prompt(prompt, "prompt")
        served.max_new_tokens(prompt, max_tokens, "max_tokens")
    params = sampling_params(request, max_tokens)
    groups = served.generate(prompts, params, request.logprobs or 0)
    outputs = [g for group in groups for g in group]  # choice index = prompt * n + sample
    header = Header.new("cmpl", served.name)
    num_prompt_tokens = sum(map(len, prompts))
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        chunks = completion_chunks(
            header, outputs, num_prompt_tokens, served.tokenizer, request.logprobs, include_usage
        )
        return _sse(chunks)
    return completion_response(
        header, outputs, num_prompt_tokens, served.tokenizer, request.logprobs
    )


def parse_body(model: type[BodyT], body: bytes) -> BodyT:
    """The request body validated as `model`; pydantic's errors become the 400 FastAPI's own
    validation gives (`validation_message`)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        located = [{**err, "loc": ("body", *err["loc"])} for err in errors]
        raise RequestValidationError(located) from None


def default_tool_parser(tokenizer) -> str:
    """The parser for the tool-call format the chat template writes; 'hermes' when unsure."""
    template = str(tokenizer.chat_template or "")
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" not in template and "<|start_header_id|>" in template:
        return "llama3_json"
    return "hermes"


def sampling_params(request: SamplingRequest, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(request.top_k or 0, 0),
        min_p=request.min_p or 0.0,
        n=request.n or 1,
        stop_strings=request.stop_strings,
        seed=secrets.randbits(63) if request.seed is None else request.seed,
    )


def _check_model(served: ServedModel, name: str) -> None:
    if name != served.name:
        raise RequestError(
            f"the model {name!r} does not exist; this server serves {served.name!r}",
            "model",
            status=404,
            code="model_not_found",
        )


def _model_card(served: ServedModel) -> dict[str, Any]:
    return {
        "id": served.name,
        "object": "model",
        "created": 0,
        "owned_by": "reinforge",
        "max_model_len": served.max_model_len,
    }


def _sse(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    def events() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), type=kind)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        message = f"internal server error ({type(exc).__name__}); see the server log"
        return JSONResponse(error_body(message, type="server_error"), status_code=500)


def validation_message(errors: Any) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, and the first bad parameter as OpenAI's `param`
    (e.g. `messages[0].role`)."""
    lines: list[str] = []
    params: list[str] = []
    for error in errors:
        if error["type"] == "json_invalid":
            reason = error.get("ctx", {}).get("error", error["msg"])
            return f"the request body is not valid JSON ({reason})", None
        if tuple(error["loc"]) == ("body",):
            return "the request body must be a JSON object (Content-Type: application/json)", None
        param = _param_name(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        line = f"{param}: {message}" if param else message
        if line not in lines:
            lines.append(line)
            params.append(param)
    return "; ".join(lines[:4]), (params[0] or None) if params else None


def _param_name(loc: tuple[Any, ...]) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union branch tags are dropped."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool"):
            continue  # pydantic's union branch labels such as 'list[int]'
        else:
            name += f".{part}" if name else part
    return name
