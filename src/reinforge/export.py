"""Export a checkpoint as a standalone HF model (or a PEFT adapter), checked before it is handed
over.

`export(source, out_dir, mode)` takes a run directory (its `checkpoints/latest`) or a checkpoint
folder: a full model (config.json + weights) or a LoRA adapter (adapter_config.json naming its
base). Modes:
- "merged" (default): a standalone model for either kind. A LoRA adapter is merged into its base
  loaded in float32 and the result saved in the base's dtype.
- "full": the same for a full-model checkpoint; refuses a LoRA one (use "merged").
- "adapter": the PEFT adapter alone; refuses a full-model checkpoint.
Every export holds the weights, config, generation config and the tokenizer with its chat
template, and nothing of the trainer's (optimizer, RNG, trainer state).

The check, before anything appears at `out_dir` (the export is written under a temporary name
and renamed into place only when it passes): reload the export with transformers (PEFT for an
adapter) and compare its next-token distributions on a few chat prompts with the trainer's model
(the checkpoint itself, or base + adapter for LoRA), as the largest KL divergence over prompt
positions. For LoRA it also checks the adapter changes the base model at all (all-zero B
matrices, an adapter that was never trained, are refused) and that the export kept most of that
change: a merge that silently returned the base, or a bfloat16 save that rounded small updates
away, fails with an `ExportError` that says which and what to do.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from reinforge.errors import ConfigError, RunFailure
from reinforge.models.inference import adapter_base, find_checkpoint

Mode = Literal["merged", "adapter", "full"]
MODES = ("merged", "adapter", "full")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECK_PROMPTS = (
    "What is 17 + 25?",
    "Write one sentence about rivers.",
    "Solve for x: 2x + 3 = 11. Put the final answer in \\boxed{}.",
)
# Largest KL(trainer || export) per position, by the dtype the weights are saved in: float32
# only reorders sums; 16-bit rounding of every weight moves a real model's distributions a bit.
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# The export must keep at least this share of the adapter's effect on the base (in KL terms:
# its distance to the trainer's model stays under (1 - share) of the base's).
MIN_KEPT_EFFECT = 0.5
TMP_PREFIX = ".tmp-export-"


class ExportError(RunFailure):
    """The export was written but does not reproduce the trainer's model; nothing was kept."""


@dataclass(frozen=True)
class ExportReport:
    out_dir: Path
    mode: str
    source: Path  # the checkpoint folder exported
    base: str | None  # the base model of a LoRA adapter
    dtype: str  # of the saved weights
    num_prompts: int
    max_kl: float  # largest KL(trainer's model || export) over prompt positions
    tolerance: float
    adapter_effect_kl: float | None  # LoRA: largest KL(trainer's model || base)

    def summary(self) -> str:
        effect = (
            f"; the adapter moves the base by KL {self.adapter_effect_kl:.2e}"
            if self.adapter_effect_kl is not None
            else ""
        )
        return (
            f"exported {self.source} as {self.mode} ({self.dtype}) to {self.out_dir}: "
            f"max KL to the trainer's model {self.max_kl:.2e} on {self.num_prompts} prompts "
            f"(tolerance {self.tolerance:.0e}){effect}"
        )


def export(
    source: str | Path,
    out_dir: str | Path,
    mode: Mode = "merged",
    base: str | None = None,
    dtype: str | None = None,
    tolerance: float | None = None,
    overwrite: bool = False,
    device: str = "cpu",
) -> ExportReport:
    """Write `source` (a run dir or checkpoint folder) to `out_dir` as `mode` and check it.

    `base` replaces the base model an adapter names (when it has moved); `dtype` the dtype the
    merged or full weights are saved in (default: the base's, or the checkpoint's).
    """
    if mode not in MODES:
        raise ConfigError(f"export mode {mode!r} is not one of {list(MODES)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"export dtype {dtype!r} is not one of {list(DTYPES)}")
    ckpt = resolve_checkpoint(Path(source))
    is_lora = (ckpt / "adapter_config.json").exists()
    if is_lora and mode == "full":
        raise ConfigError(f"{ckpt} is a LoRA adapter; export it with mode 'merged' or 'adapter'")
    if not is_lora and mode == "adapter":
        raise ConfigError(f"{ckpt} is a full model with no adapter; export it with mode 'full'")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"{out} exists and is not empty; choose another folder, or replace it with "
            "overwrite=True (`reinforge export --overwrite`)"
        )
    tmp = out.parent / f"{TMP_PREFIX}{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if is_lora:
            report = _export_lora(ckpt, tmp, mode, base, dtype, tolerance, torch.device(device))
        else:
            report = _export_full(ckpt, tmp, dtype, tolerance, torch.device(device))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _give_default_modes(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return dataclasses.replace(report, out_dir=out)


def _give_default_modes(folder: Path) -> None:
    """Every exported file readable as a file the user wrote is (0644 under the usual umask):
    safetensors writes its shards through a private temporary file (0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def resolve_checkpoint(source: Path) -> Path:
    """The checkpoint folder `source` names: itself, a run directory's latest checkpoint, or
    `RUN_DIR/step_N` (see `reinforge.models.inference.find_checkpoint`)."""
    ckpt = find_checkpoint(source)
    if ckpt is None:
        raise ConfigError(
            f"{source} is neither a run directory (with checkpoints/latest) nor a checkpoint "
            "folder (with config.json or adapter_config.json)"
        )
    return ckpt


def _export_full(
    ckpt: Path, tmp: Path, dtype: str | None, tolerance: float | None, device: torch.device
) -> ExportReport:
    tokenizer = _load_tokenizer(ckpt)
    prompts = render_check_prompts(tokenizer)
    model = _load_model(ckpt, "auto", device)
    save_dtype = DTYPES[dtype] if dtype else model.dtype
    model.to(save_dtype).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    reference = next_token_logprobs(model.float(), prompts)
    del model
    exported = _load_model(tmp, torch.float32, device)
    max_kl = _check_reproduces(
        reference, next_token_logprobs(exported, prompts), save_dtype, tolerance
    )
    _check_tokenizer(tmp, tokenizer, prompts)
    return ExportReport(
        out_dir=tmp,
        mode="full",
        source=ckpt,
        base=None,
        dtype=_dtype_name(save_dtype),
        num_prompts=len(prompts),
        max_kl=max_kl,
        tolerance=tolerance or DEFAULT_TOLERANCE[save_dtype],
        adapter_effect_kl=None,
    )


def _export_lora(
    ckpt: Path,
    tmp: Path,
    mode: str,
    base: str | None,
    dtype: str | None,
    tolerance: float | None,
    device: torch.device,
) -> ExportReport:
    from peft import PeftModel

    base_source = base or adapter_base(ckpt)
    tokenizer = _load_tokenizer(ckpt, fallback=base_source)
    prompts = render_check_prompts(tokenizer)
    save_dtype = DTYPES[dtype] if dtype else _config_dtype(base_source)
    model = PeftModel.from_pretrained(_load_model(base_source, torch.float32, device), str(ckpt))
    _check_adapter_not_zero(model, ckpt)
    reference = next_token_logprobs(model, prompts)
    with model.disable_adapter():
        base_logprobs = next_token_logprobs(model, prompts)
    effect = max_kl(reference, base_logprobs)
    if effect == 0.0:
        raise ExportError(f"the adapter at {ckpt} leaves the base model's outputs unchanged")
    if mode == "adapter":
        model.peft_config["default"].base_model_name_or_path = base_source
        model.save_pretrained(str(tmp))
        del model
        exported = PeftModel.from_pretrained(
            _load_model(base_source, torch.float32, device), str(tmp)
        )
        save_dtype = torch.float32  # adapter weights are saved as trained
    else:
        merged = model.merge_and_unload()
        merged.to(save_dtype).save_pretrained(tmp, safe_serialization=True)
        del model, merged
        exported = _load_model(tmp, torch.float32, device)
    tokenizer.save_pretrained(tmp)
    exported_logprobs = next_token_logprobs(exported, prompts)
    kl = _check_reproduces(reference, exported_logprobs, save_dtype, tolerance, effect)
    _check_tokenizer(tmp, tokenizer, prompts)
    return ExportReport(
        out_dir=tmp,
        mode=mode,
        source=ckpt,
        base=base_source,
        dtype=_dtype_name(save_dtype),
        num_prompts=len(prompts),
        max_kl=kl,
        tolerance=tolerance or DEFAULT_TOLERANCE[save_dtype],
        adapter_effect_kl=effect,
    )


def _check_reproduces(
    reference: list[torch.Tensor],
    exported: list[torch.Tensor],
    save_dtype: torch.dtype,
    tolerance: float | None,
    adapter_effect: float | None = None,
) -> float:
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[save_dtype]
    kl = max_kl(reference, exported)
    is_16bit = save_dtype != torch.float32
    hint = " Export with dtype='float32' to keep every update." if is_16bit else ""
    if adapter_effect is not None and kl >= (1 - MIN_KEPT_EFFECT) * adapter_effect:
        raise ExportError(
            f"the exported model lost the adapter: its KL to the trainer's model ({kl:.2e}) is "
            f"not far below the base model's ({adapter_effect:.2e}), so the export is (nearly) "
            f"the base model; the merge did not apply the adapter.{hint}"
        )
    if kl > tol:
        raise ExportError(
            f"the exported model does not reproduce the trainer's: max KL {kl:.2e} over "
            f"{len(reference)} prompts exceeds the tolerance {tol:.0e}.{hint}"
        )
    return kl


def _check_adapter_not_zero(peft_model, ckpt: Path) -> None:
    b_weights = [p for name, p in peft_model.named_parameters() if "lora_B" in name]
    assert b_weights, f"a PEFT model from {ckpt} with no LoRA B matrices"
    if all(not p.any() for p in b_weights):
        raise ExportError(
            f"the adapter at {ckpt} has all-zero LoRA B matrices, so it leaves the base model "
            "unchanged (a fresh adapter starts with B = 0): export a checkpoint after training"
        )


def _check_tokenizer(folder: Path, tokenizer, prompts: list[torch.Tensor]) -> None:
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(folder)
    if not reloaded.chat_template:
        raise ExportError(f"the tokenizer saved in {folder} lost its chat template")
    again = render_check_prompts(reloaded)
    if any(not torch.equal(a, b) for a, b in zip(prompts, again, strict=True)):
        raise ExportError(f"the tokenizer saved in {folder} renders the check prompts differently")


def render_check_prompts(tokenizer, prompts=CHECK_PROMPTS) -> list[torch.Tensor]:
    """Token ids of each prompt as a user message in the chat template, ready for a reply."""
    return [
        torch.tensor(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for p in prompts
    ]


@torch.no_grad()
def next_token_logprobs(model, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Log-probabilities of the next token at every position of each prompt, [T, V] each."""
    model.eval()
    device = next(model.parameters()).device
    return [
        model(input_ids=ids[None].to(device)).logits[0].float().log_softmax(-1).cpu()
        for ids in prompts
    ]


def max_kl(p_logprobs: list[torch.Tensor], q_logprobs: list[torch.Tensor]) -> float:
    """The largest KL(p || q) over all positions of all prompts."""
    return max(
        float((p.exp() * (p - q)).sum(-1).max())
        for p, q in zip(p_logprobs, q_logprobs, strict=True)
    )


def _load_model(source: str | Path, dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    model.to(device)  # type: ignore[arg-type]  # in place; transformers types .to oddly
    return model


def _load_tokenizer(ckpt: Path, fallback: str | None = None):
    from transformers import AutoTokenizer

    has_own = any((ckpt / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    source = str(ckpt) if has_own or fallback is None else fallback
    tokenizer = AutoTokenizer.from_pretrained(source)
    if not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer at {source} has no chat template, so the export could not be "
            "prompted as it was trained; save a tokenizer with one into the checkpoint"
        )
    return tokenizer


def _config_dtype(source: str) -> torch.dtype:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if value in DEFAULT_TOLERANCE else torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
