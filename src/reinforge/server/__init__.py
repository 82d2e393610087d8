"""An OpenAI-compatible HTTP server over the generation engine (`reinforge serve MODEL`).

`serve(model_path, host, port, engine)` loads a model and runs uvicorn; `create_app(served)`
builds the FastAPI app around a `ServedModel` from `load_served_model` (tests and embedders use
these two). Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`.
`ServerLimits` caps what one request may ask (body size, prompts x n).
The HTTP layer needs the `serve` extra (`pip install 'reinforge[serve]'`); the names are
imported when first used, so `ServedModel` and `load_served_model` (what `reinforge eval`
loads a model with) work on the base install.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "create_app": "reinforge.server.app",
    "serve": "reinforge.server.loading",
    "ServedModel": "reinforge.server.backend",
    "load_served_model": "reinforge.server.loading",
    "ServerLimits": "reinforge.server.limits",
}

__all__ = ["ServedModel", "ServerLimits", "create_app", "load_served_model", "serve"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'reinforge.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
