"""An OpenAI-compatible HTTP server over the generation engine (`reinforge serve MODEL`).

`serve(model_path, host, port, engine)` loads a model and runs uvicorn; `create_app(served)`
builds the FastAPI app around a `ServedModel` from `load_served_model` (tests and embedders use
these two). Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`. `ServerLimits`
caps what one request may ask (body size, prompts x n).
Needs the `serve` extra: `pip install 'reinforge[serve]'`.
"""

from reinforge.server.app import create_app, serve
from reinforge.server.backend import ServedModel, load_served_model
from reinforge.server.limits import ServerLimits

__all__ = ["ServedModel", "ServerLimits", "create_app", "load_served_model", "serve"]
