"""A model to generate with, from whatever a user names: `builtin:NAME`, an HF folder or hub
name, a checkpoint folder (a full model, or a LoRA adapter, merged here into its base), a run
directory (its latest checkpoint), or a checkpoint of a run by name (`RUN_DIR/step_000040`,
`RUN_DIR/sft_final`).

`reinforge eval`, `reinforge serve` and `reinforge export` read their MODEL argument through
`find_checkpoint` / `resolve_model`, so the three accept the same things. An adapter is merged
into its base in float32 and only then cast to the serving dtype, so a small trained update is
not rounded away before it is applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reinforge.errors import ConfigError


@dataclass(frozen=True)
class ModelRef:
    source: str  # what from_pretrained loads: a folder or a hub name (an adapter's base)
    adapter: Path | None  # a LoRA checkpoint to merge into `source`
    checkpoint: Path | None  # the local checkpoint folder named, if any (holds the tokenizer)
    run_dir: Path | None  # the run the checkpoint belongs to, if any


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint folder `path` names, or None when it names nothing local (a hub name)."""
    from reinforge.checkpoint.files import checkpoints_dir, latest_checkpoint

    p = Path(path).expanduser()
    if checkpoints_dir(p).is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise ConfigError(f"run directory {p} has no finished checkpoint yet")
        return latest
    if (p / "config.json").exists() or (p / "adapter_config.json").exists():
        return p
    saved = checkpoints_dir(p.parent)
    if saved.is_dir():  # RUN_DIR/step_000040: a checkpoint of that run by its name
        if (saved / p.name / "trainer_state.json").exists():
            return saved / p.name
        names = sorted(c.name for c in saved.iterdir() if (c / "trainer_state.json").exists())
        raise ConfigError(f"run {p.parent} has no checkpoint {p.name!r}; it has {names}")
    if p.exists():
        raise ConfigError(
            f"{p} is neither a run directory (with checkpoints/) nor a model or checkpoint "
            "folder (with config.json or adapter_config.json)"
        )
    return None


def resolve_model(path: str, seed: int = 0) -> ModelRef:
    """Where the weights `path` names come from (building a built-in model on first use)."""
    from reinforge.models.tiny import builtin_path, is_builtin

    if is_builtin(path):
        return ModelRef(str(builtin_path(path.split(":", 1)[1], seed)), None, None, None)
    ckpt = find_checkpoint(path)
    if ckpt is None:
        check_hub_name(path)
        return ModelRef(path, None, None, None)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    if (ckpt / "adapter_config.json").exists():
        return ModelRef(adapter_base(ckpt), ckpt, ckpt, run_dir)
    return ModelRef(str(ckpt), None, ckpt, run_dir)


def check_hub_name(name: str) -> None:
    """A name that is no local folder must be a model on the hub (or in its cache)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{name!r} is not a local run, checkpoint or model folder, and no hub model of that "
            f"name loads ({type(e).__name__}: {str(e).splitlines()[0]}); give a run directory, "
            "a checkpoint folder, a model folder, or builtin:tiny"
        ) from None


def adapter_base(ckpt: Path) -> str:
    """The base model a LoRA checkpoint was trained on, checked to be there still."""
    config = json.loads((ckpt / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{ckpt}/adapter_config.json names no base model; pass the base")
    if base.startswith(("/", ".", "~")) and not Path(base).expanduser().exists():
        raise ConfigError(
            f"the adapter at {ckpt} was trained on {base}, which is not there any more; pass "
            "the base model's folder or hub name as the base"
        )
    return base


def load_inference_model(ref: ModelRef, device, dtype):
    """(model in eval mode without gradients, tokenizer) for `ref`."""
    import torch

    from reinforge.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(ref.checkpoint or ref.source))
    if ref.adapter is None:
        model = load_model(ref.source, device, dtype)
    else:
        from peft import PeftModel

        base = load_model(ref.source, device, torch.float32)
        model = PeftModel.from_pretrained(base, str(ref.adapter)).merge_and_unload().to(dtype)
    model.eval().requires_grad_(False)
    return model, tokenizer
