"""What one request may ask of the server, and the checks that hold a request to it before any
work is spent on it.

- The body: at most `max_request_bytes` (`reinforge serve --max-request-mb`), refused with 413
  by `BodyLimit` from the Content-Length header, or while the body arrives when it has none,
  before any of it is parsed.
- The work: at most `max_completions` completions (prompts x n) per request
  (`--max-completions-per-request`), refused with 400.
- The prompt: a text that cannot fit the context whatever it tokenizes to (more characters than
  the context's tokens times the longest token's length) is refused with 400 before the
  tokenizer sees it; a slow tokenizer would otherwise spend minutes on a 20 MB prompt.

Every refusal is an OpenAI error body naming the limit and the flag that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from reinforge.server.protocol import RequestError, error_body

if TYPE_CHECKING:  # the serve extra, which app.py checks for
    from starlette.responses import JSONResponse
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

MIB = 2**20


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 8 * MIB
    """Largest request body (`--max-request-mb`); 8 MiB holds a 128k-token chat many times."""
    max_completions: int = 256
    """Most completions one request may ask for: prompts x n (`--max-completions-per-request`)."""

    def __post_init__(self) -> None:
        assert self.max_request_bytes > 0 and self.max_completions > 0, self

    def check_completions(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_completions:
            raise RequestError(
                f"this request asks for {num_prompts * n} completions ({num_prompts} prompt(s) "
                f"x n = {n}); this server gives at most {self.max_completions} per request "
                "(reinforge serve --max-completions-per-request): send fewer prompts or a "
                "smaller n, or split the request",
                "n",
                code="too_many_completions",
            )


def too_large(size: int, limit: int) -> JSONResponse:
    from starlette.responses import JSONResponse

    message = (
        f"the request body is {_mib(size)} or more; this server takes at most {_mib(limit)} "
        "(reinforge serve --max-request-mb): send a smaller request, or start the server with "
        f"--max-request-mb {max(2 * limit // MIB, 1)}"
    )
    return JSONResponse(error_body(message, code="request_too_large"), status_code=413)


class BodyLimit:
    """ASGI middleware: read the whole body (refusing it with 413 once it passes the limit),
    then hand its chunks to the app as they came. FastAPI would read it whole anyway; joining
    the chunks is left to the worker thread the route hands them to (`read_body`), so the event
    loop never copies a large body."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(int(declared), self.max_bytes)(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while not messages or messages[-1].get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending it all
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await too_large(size, self.max_bytes)(scope, receive, send)
                return
            messages.append(message)
        messages.reverse()

        async def replay() -> Message:
            return messages.pop() if messages else await receive()  # then: a disconnect

        await self.app(scope, replay, send)


async def read_body(request) -> list[bytes]:
    """The body's chunks, unjoined (a route joins them in its worker thread: `join_body`)."""
    return [chunk async for chunk in request.stream() if chunk]


def join_body(chunks: list[bytes]) -> bytes:
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def max_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for, bounded from above by its
    vocabulary strings' UTF-8 lengths (byte-level and SentencePiece spellings of a token are
    never shorter than the text it covers)."""
    return max(len(str(token).encode("utf-8")) for token in tokenizer.get_vocab())


def check_text_fits(num_chars: int, max_chars_per_token: int, context: int, param: str) -> None:
    min_tokens = -(-num_chars // max_chars_per_token)
    if min_tokens >= context:
        raise RequestError(
            f"{param} holds {num_chars} characters; at most {max_chars_per_token} characters "
            f"per token that is at least {min_tokens} tokens, and the model's context is "
            f"{context} tokens; shorten {param}",
            param,
        )


def _mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB" if size >= MIB else f"{size} bytes"
