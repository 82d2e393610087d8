"""Loading a model to serve, and serving it over HTTP (`reinforge serve MODEL`).

Apart from the app (`app.py`) and the served model (`backend.py`) because loading reads run
folders and checkpoints through the trainer's helpers: the in-process endpoint of agent tasks
(`rollout/agents.py`) serves the trainer's own engine and must not import them.
"""

from __future__ import annotations

import logging

from reinforge.engine.factory import ENGINES, build_engine
from reinforge.errors import ConfigError
from reinforge.server.backend import ServedModel
from reinforge.server.limits import ServerLimits

log = logging.getLogger("reinforge.server")


def load_served_model(
    model_path: str,
    engine: str = "auto",
    *,
    device: str = "auto",
    dtype: str = "auto",
    served_model_name: str | None = None,
    max_model_len: int | None = None,
) -> ServedModel:
    """Load `model_path` (a model or checkpoint folder, a run directory, `RUN_DIR/step_N`, a hub
    name or `builtin:NAME`; see `reinforge.models.inference`) behind the chosen engine:
    'paged' (continuous batching, Qwen2/Qwen3/Llama), 'simple' (any causal LM), or 'auto'
    (paged when the architecture has a paged forward, else simple)."""
    if engine not in ENGINES:
        raise ConfigError(f"engine = {engine!r} is unknown; use one of {list(ENGINES)}")
    from reinforge.models.inference import load_inference_model, resolve_model
    from reinforge.models.loading import resolve_device, resolve_dtype

    torch_device = resolve_device(device)
    model, tokenizer = load_inference_model(
        resolve_model(model_path), torch_device, resolve_dtype(dtype, torch_device)
    )
    chosen = build_engine(model, tokenizer, engine, setting="engine")
    context = model.config.max_position_embeddings
    if max_model_len is not None and max_model_len > context:
        raise ConfigError(
            f"max_model_len = {max_model_len} exceeds the model's context of {context} tokens; "
            f"set it to at most {context}"
        )
    return ServedModel(
        chosen, model, tokenizer, served_model_name or model_path, max_model_len or context
    )


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    engine: str = "auto",
    *,
    device: str = "auto",
    dtype: str = "auto",
    served_model_name: str | None = None,
    tool_parser: str = "auto",
    max_model_len: int | None = None,
    log_level: str = "info",
    limits: ServerLimits | None = None,
) -> None:
    """Load `model_path` and serve it over HTTP until interrupted (`reinforge serve MODEL`)."""
    from reinforge.envs.parsers import get_parser
    from reinforge.server.app import create_app  # without the serve extra: a ConfigError saying so

    if tool_parser != "auto":
        get_parser(tool_parser)  # a bad name fails before the model loads
    served = load_served_model(
        model_path,
        engine,
        device=device,
        dtype=dtype,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
    )
    log.info(
        "serving %r with %s (context %d tokens) on http://%s:%d/v1",
        served.name,
        type(served.engine).__name__,
        served.max_model_len,
        host,
        port,
    )
    app = create_app(served, tool_parser, limits)
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
