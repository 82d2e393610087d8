"""The policy's model as the trainer runs it: weights (all of them, or a base plus a LoRA adapter),
the attention implementation packed micro-batches use, gradient checkpointing as planned, and
optional compilation of the decoder layers.

LoRA (`model.lora.rank > 0`): the adapter is bound before the optimizer is built, so only its A/B
matrices train; checkpoints hold the adapter in PEFT's format (`adapter_config.json` +
`adapter_model.safetensors`), and the base it applies to is `model.path`, or, after an SFT stage,
`sft_final`: at the end of SFT its adapter is merged into the weights (saved as a full
checkpoint there) and RL starts a fresh adapter on top, so the KL reference (the base with the
adapter disabled) is the policy as RL started, as it is for full fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

from reinforge.checkpoint import TrainerState
from reinforge.checkpoint.files import checkpoints_dir
from reinforge.metrics import console
from reinforge.models.loading import load_model
from reinforge.train.packing.attention import select_packed_attention
from reinforge.train.policy.lora import lora_alpha
from reinforge.train.policy.moe import install_grouped_moe

SFT_FINAL = "sft_final"


def build_model(cfg, run_dir: Path, ckpt: Path | None, state: TrainerState, setup):
    """(model, the folder its weights came from): ready to train and to generate with."""
    lora = cfg.model.lora
    sft_final = checkpoints_dir(run_dir) / SFT_FINAL
    if lora.rank and state.sft_done and sft_final.exists():
        source = str(sft_final)
    elif lora.rank or ckpt is None:
        source = setup.source
    else:
        source = str(ckpt)
    checkpointing = setup.memory.gradient_checkpointing
    model = load_model(source, setup.device, setup.dtype, checkpointing)
    select_packed_attention(model, "auto")
    install_grouped_moe(model)  # MoE: grouped experts, LoRA through its factors, router log
    if lora.rank:
        adapter = ckpt if ckpt is not None and (ckpt / "adapter_config.json").exists() else None
        model = attach_adapter(cfg, model, adapter)
    else:
        num_params = sum(p.numel() for p in model.parameters())
        console.print(f"full fine-tuning: {num_params:,} trainable parameters")
    compile_ = cfg.train.compile
    auto = not cfg.model.lora.rank and next(model.parameters()).is_cuda
    if compile_ is True or (compile_ == "auto" and auto):
        compile_layers(model)
    return model, source


def attach_adapter(cfg, model, adapter: Path | None = None):
    """`model` wrapped with a fresh LoRA adapter, or with the one saved at `adapter`."""
    from reinforge.train.policy.lora import (
        adapters_in_base_dtype,
        apply_lora,
        load_adapter,
        lora_report,
    )

    lora = cfg.model.lora
    if adapter is None:
        model, report = apply_lora(
            model, lora.rank, lora_alpha(lora), lora.dropout, lora.target_modules
        )
    else:
        model = load_adapter(model, adapter, is_trainable=True)
        report = lora_report(model)
    adapters_in_base_dtype(model)
    console.print(report.summary())
    return model


def merge_adapter(model):
    """The base model with the adapter's update merged into its weights (in place)."""
    return model.merge_and_unload()


def compile_layers(model) -> None:
    """torch.compile each decoder layer; shapes vary from micro-batch to micro-batch."""
    for layer in model.get_decoder().layers:
        layer.compile(dynamic=True)
