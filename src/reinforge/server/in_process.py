"""The OpenAI endpoint agents talk to during training: `reinforge serve`'s app over the trainer's
own engine, on a loopback port of the training process.

`AgentEndpoint` starts uvicorn on a thread (a free port on 127.0.0.1) serving `create_app` of a
`RecordingModel`. Each episode has its own base URL, `http://127.0.0.1:PORT/episodes/<key>/v1`:
`EpisodeRouter` strips the prefix and sets `recording.current_episode` for the request, so every
request is recorded for the episode that sent it, whatever client the agent builds from the URL.
Requests run on the app's worker threads (as many as agents may run at once) and meet in the
`RequestBatcher`, which batches them into engine calls.

The endpoint lives as long as the engine: the engine reads the trainer's weights in place, so
each step's requests are answered by that step's policy with nothing to reload.
"""

from __future__ import annotations

import socket
import threading
import time

from reinforge.engine.base import SamplingParams
from reinforge.envs.parsers import get_parser
from reinforge.server.app import create_app, default_tool_parser
from reinforge.server.batching import RequestBatcher
from reinforge.server.limits import ServerLimits
from reinforge.server.recording import EpisodeRecords, RecordingModel, current_episode

PREFIX = "/episodes/"
MODEL_NAME = "policy"


class EpisodeRouter:
    """ASGI middleware: `/episodes/<key>/v1/...` -> `/v1/...` with the episode set; the app's
    worker-thread limit raised to `num_threads` on the first request."""

    def __init__(self, app, num_threads: int):
        self.app = app
        self.num_threads = num_threads
        self.is_sized = False

    async def __call__(self, scope, receive, send) -> None:
        if not self.is_sized:
            import anyio.to_thread

            limiter = anyio.to_thread.current_default_thread_limiter()
            limiter.total_tokens = max(limiter.total_tokens, self.num_threads)
            self.is_sized = True
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(PREFIX):
            key, _, rest = path[len(PREFIX) :].partition("/")
            scope = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode()}
            token = current_episode.set(key)
            try:
                await self.app(scope, receive, send)
            finally:
                current_episode.reset(token)
            return
        await self.app(scope, receive, send)


class AgentEndpoint:
    def __init__(self, engine, tokenizer, max_context: int, num_threads: int = 256):
        model = engine.model
        self.batcher = RequestBatcher(engine)
        parser = get_parser(default_tool_parser(tokenizer))
        self.served = RecordingModel(
            engine, model, tokenizer, MODEL_NAME, max_context, self.batcher, parser
        )
        # an agent's request carries its whole history: allow large bodies and n
        app = create_app(self.served, limits=ServerLimits(max_request_bytes=64 * 2**20))
        self._start(EpisodeRouter(app, num_threads))

    def _start(self, app) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=60)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="agent-endpoint",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            assert self._thread.is_alive(), "the agent endpoint's server stopped at start"
            assert time.monotonic() < deadline, "the agent endpoint did not start in 60 s"
            time.sleep(0.01)

    def configure(self, sampling: SamplingParams, max_context: int) -> None:
        """The sampling settings of the rollout about to run (its max_new_tokens is each
        request's budget) and the episode context."""
        self.served.configure(sampling, sampling.max_new_tokens, max_context)
        self.batcher.set_seed(sampling.seed)
        self.batcher.max_len = max_context

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}{PREFIX}{key}/v1"

    def open_episode(self, key: str, max_requests: int) -> EpisodeRecords:
        records = EpisodeRecords(key, max_requests)
        self.served.episodes[key] = records
        return records

    def close_episode(self, key: str) -> EpisodeRecords:
        records = self.served.episodes.pop(key)
        with records.lock:
            records.is_closed = True
        return records

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
        self.batcher.close()
