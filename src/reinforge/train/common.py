"""Loading the policy and tokenizer, devices and dtypes, prompt rendering.

`pad_batch` + `token_logprobs` are the plain path the trainer used before packing (`forward`):
full [B, L, V] logits over right-padded rows. Tests keep them as the reference the packed path
must reproduce."""

from __future__ import annotations

from dataclasses import dataclass
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

    from reinforge.models.shapes import build_shape_model, is_shape_folder

    hf_logging.disable_progress_bar()
    if is_shape_folder(source):
        model = build_shape_model(source, device, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    return model


@dataclass
class PaddedBatch:
    """Right-padded sequences; `targets_BT[b, t]` is the token predicted at position t, and
    `mask_BT` marks the targets that count in the loss."""

    input_ids_BL: torch.Tensor  # [B, L]
    attention_mask_BL: torch.Tensor  # [B, L]
    targets_BT: torch.Tensor  # [B, L-1]
    mask_BT: torch.Tensor  # [B, L-1] float


def pad_batch(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, device
) -> PaddedBatch:
    """Concatenate prompt and response ids; only response tokens are loss targets."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    mask = torch.zeros((len(seqs), L - 1))
    for b, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        ids[b, :n] = torch.tensor(p + r)
        attn[b, :n] = 1
        mask[b, len(p) - 1 : n - 1] = 1.0  # the target at t is token t+1
    return PaddedBatch(ids.to(device), attn.to(device), ids[:, 1:].to(device), mask.to(device))


def token_logprobs(
    model, batch: PaddedBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target token (and the per-position entropy) under `model`, [B, L-1]."""
    logits = model(
        input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False
    ).logits
    logits_BTV = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logprobs_BTV = torch.log_softmax(logits_BTV, dim=-1)
    chosen_BT = logprobs_BTV.gather(-1, batch.targets_BT[..., None]).squeeze(-1)
    entropy_BT = None
    if with_entropy:
        with torch.no_grad():
            entropy_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
    return chosen_BT, entropy_BT


def run_dir_of(cfg) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def device_memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak accelerator memory since the last call (GiB), then reset: one figure per step."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"gpu_peak_gib": peak}
