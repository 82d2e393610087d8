"""Loading a model and its tokenizer for any command: `model.path` resolved to a loadable folder
(building a built-in or shape model on first use, checking a local path), the device and dtype
that `run.device` / `run.dtype` name, the tokenizer (with its chat template) and the HF model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reinforge.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    from reinforge.distributed import is_launched, local_rank

    if is_launched() and name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank())  # one GPU per process, as torchrun numbers them
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"run.device = {name!r} but CUDA is not available here; use run.device = 'auto' or 'cpu'"
        )
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"run.device = {name!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:0'"
        ) from None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def model_source(path: str, seed: int) -> str:
    """A loadable folder or hub name for `model.path` (building a built-in model on first use)."""
    from reinforge.models.location import check_model_location
    from reinforge.models.shapes import is_shape, shape_source
    from reinforge.models.tiny import builtin_path, is_builtin

    if is_builtin(path):
        return str(builtin_path(path.split(":", 1)[1], seed))
    if is_shape(path):
        return str(shape_source(path, seed))
    check_model_location(path)
    return path


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    if not matches_saved_pipeline(tok, source):
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(source)
    if not tok.chat_template:
        raise ConfigError(
            f"the tokenizer at {source!r} has no chat template; set model.tokenizer to one that has "
            "(e.g. the instruct variant of the model)"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def matches_saved_pipeline(tok, source: str) -> bool:
    """False when transformers 5's AutoTokenizer swapped the folder's own `tokenizer.json` model
    for the one its `model_type` implies (it builds a byte-level BPE Qwen2Tokenizer for a
    word-level tokenizer saved beside a qwen2 config, and then encodes every word to nothing)."""
    import json

    saved = Path(source) / "tokenizer.json"
    backend = getattr(tok, "backend_tokenizer", None)
    if not saved.is_file() or backend is None:
        return True
    saved_type = json.loads(saved.read_text())["model"].get("type")
    return saved_type is None or saved_type == type(backend.model).__name__


def load_model(
    source: str, device: torch.device, dtype: torch.dtype, gradient_checkpointing: bool = False
):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from reinforge.distributed import is_distributed
    from reinforge.engine.layout import fuse_projections
    from reinforge.models.shapes import build_shape_model, is_shape_folder

    hf_logging.disable_progress_bar()
    if is_shape_folder(source):
        model = build_shape_model(source, device, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
    if not is_distributed():  # (sharding wrappers take each parameter on its own)
        fuse_projections(model)  # q/k/v and gate/up back to back: one product each in decode
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    return model
