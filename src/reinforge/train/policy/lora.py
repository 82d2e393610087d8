"""LoRA adapters through PEFT, with the checks that make a silent no-op adapter impossible.

Contract
- `apply_lora(model, rank, alpha, dropout, target_modules)` wraps a HF causal LM in a PEFT
  `PeftModel` whose only trainable parameters are the LoRA A/B matrices, and returns it with a
  `LoraReport` (modules bound, trainable and total parameter counts). `target_modules` is PEFT's:
  "all-linear" (every linear layer but the LM head), a list of module-name suffixes such as
  ["q_proj", "v_proj"], or a regular expression matched against full module names.
- An adapter bound to zero modules is a user mistake: `ConfigError` naming
  `model.lora.target_modules`, the linear layers the model has, and a value that works. It is
  checked before wrapping (with PEFT's own matching rule) and again on the wrapped model.
- Adapters follow PEFT's defaults for the rest: B starts at zero (the wrapped model equals the
  base at step 0) and adapter weights are float32 even on a bf16 base (their AdamW updates are
  tiny next to the weights).
- Mixture-of-experts models (transformers' `qwen3_moe` / `qwen2_moe`: the experts are stacked
  parameters `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], the
  router `mlp.gate` a plain module): PEFT maps the pre-v5 names onto them (`target_parameters`,
  one `ParamWrapper` per stacked parameter, rank r per expert; gate_up_proj fuses two names, so
  it takes rank 2r and alpha 2 * alpha). "all-linear" therefore adapts attention, the router and
  every expert; a list names what it wants ("gate_proj", "up_proj", "down_proj" for the
  experts, "gate" for the router). PEFT takes no dropout on those parameters: a `ConfigError`.
- `save_adapter` / `load_adapter` use PEFT's format (adapter_config.json +
  adapter_model.safetensors), loadable by any PEFT user.
- `adapter_disabled(model)` is the base model inside a `with`: the KL reference costs no
  second copy of the weights.
- `adapters_in_base_dtype(model)`: on a bf16/fp16 base the adapters compute in that dtype
  (float32 weights cast per call, float32 gradients); the trainer applies it to every adapter.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from reinforge.errors import ConfigError

SETTING = "model.lora"
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraReport:
    num_bound_modules: int
    bound_modules: tuple[str, ...]  # full names, e.g. "model.layers.0.self_attn.q_proj"
    num_trainable_params: int
    num_total_params: int
    # the adapted projections a merged generation copy holds (`engine.lora_merge`)
    num_mergeable_params: int | None = None

    def summary(self) -> str:
        share = self.num_trainable_params / max(self.num_total_params, 1)
        return (
            f"LoRA bound to {self.num_bound_modules} modules "
            f"({', '.join(short_names(self.bound_modules))}); trainable "
            f"{self.num_trainable_params:,} of {self.num_total_params:,} parameters ({share:.2%})"
        )


def lora_alpha(lora) -> float:
    """`model.lora.alpha`, or twice the rank when unset."""
    return lora.alpha if lora.alpha is not None else 2.0 * lora.rank


def apply_lora(
    model,
    rank: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = ALL_LINEAR,
):
    """The model wrapped with a fresh trainable adapter, and what it bound. Returns
    (peft_model, report)."""
    from peft import LoraConfig, get_peft_model

    check_settings(rank, alpha, dropout)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    if dropout > 0 and has_stacked_experts(model):
        raise ConfigError(
            f"{SETTING}.dropout = {dropout}: PEFT's LoRA on the stacked expert weights and the "
            f"router of a mixture-of-experts model takes no dropout; use {SETTING}.dropout = 0.0"
        )
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # On a MoE model PEFT maps expert and router names onto parameters no module matches
    # ("gate_proj" -> mlp.experts.gate_up_proj): PEFT's own binding decides there.
    moe = has_stacked_experts(model)
    if not _is_all_linear(targets) and not moe and not _matching_modules(model, config):
        raise _no_binding_error(model, targets)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as error:  # PEFT: "Target modules ... not found in the base model"
        if not moe or "not found" not in str(error):
            raise
        raise _no_binding_error(model, targets) from error
    report = lora_report(peft_model)
    if report.num_bound_modules == 0:
        raise _no_binding_error(model, targets)
    return peft_model, report


LOW_PRECISION = (torch.bfloat16, torch.float16)


def adapters_in_base_dtype(peft_model) -> int:
    """Each LoRA linear layer of a bf16/fp16 base computes its adapter in the base's dtype: its
    forward runs under autocast (the float32 A and B are cast per call, [r, H] each, and their
    gradients come back in float32), and PEFT's cast of the layer's input to float32 is off.
    Without it every adapted projection copied its [T, H] input to float32 and ran A and B as
    float32 matmuls: on G2 (7b, rank 32, H100) copies, float32 GEMMs and the float32 adds and
    scales were 20 s of a 44 s update (bench/RESULTS.md, session 15). The weights and their
    AdamW states stay float32. Inside the layer, so a checkpointed layer's recomputation and
    every caller get the same arithmetic. Returns the number of layers changed (0 for a
    float32 base, where nothing changes)."""
    from peft.tuners.lora import Linear as LoraLinear

    changed = 0
    for module in peft_model.modules():
        if not isinstance(module, LoraLinear):
            continue
        base_dtype = module.get_base_layer().weight.dtype
        if base_dtype not in LOW_PRECISION:
            continue
        module.cast_input_dtype_enabled = False
        module.compute_dtype = base_dtype
        # bound to the module (a deep copy binds to the copy)
        module.forward = types.MethodType(_forward_in_compute_dtype, module)
        changed += 1
    return changed


def _forward_in_compute_dtype(self, x, *args, **kwargs):
    with torch.autocast(device_type=x.device.type, dtype=self.compute_dtype):
        return type(self).forward(self, x, *args, **kwargs)


def has_stacked_experts(model) -> bool:
    from reinforge.engine.moe import EXPERT_PARAMS

    return any(
        all(hasattr(module, p) for p in EXPERT_PARAMS) and name.endswith("experts")
        for name, module in model.named_modules()
    )


def bind_on_meta(
    source: str,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: str | Sequence[str] = ALL_LINEAR,
) -> LoraReport:
    """What `apply_lora` would bind on the model at `source`, from its config alone (a meta-device
    copy: no weights are read or allocated). Raises the same `ConfigError` for zero binding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    return apply_lora(model, rank, alpha, dropout, target_modules)[1]


def check_settings(rank: int, alpha: float, dropout: float) -> None:
    if rank < 1:
        raise ConfigError(
            f"{SETTING}.rank = {rank} must be at least 1; use e.g. {SETTING}.rank = 16"
        )
    if alpha <= 0:
        raise ConfigError(f"{SETTING}.alpha = {alpha} must be positive; use e.g. twice the rank")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{SETTING}.dropout = {dropout} must be in [0, 1); use e.g. 0.0")


def lora_report(peft_model) -> LoraReport:
    from peft.tuners.lora import LoraLayer

    from reinforge.engine.lora_merge import mergeable_params

    bound = tuple(
        _strip_wrapper_prefix(name)
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer)
    )
    params = list(peft_model.parameters())
    return LoraReport(
        num_bound_modules=len(bound),
        bound_modules=bound,
        num_trainable_params=sum(p.numel() for p in params if p.requires_grad),
        num_total_params=sum(p.numel() for p in params),
        num_mergeable_params=mergeable_params(peft_model),
    )


def linear_layer_names(model) -> list[str]:
    """The distinct last names of the model's linear layers, LM head excluded: what a list of
    `target_modules` can name."""
    head = model.get_output_embeddings()
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    return sorted(names)


def short_names(full_names: Sequence[str]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in full_names})


def save_adapter(peft_model, path: str | Path) -> Path:
    """The adapter alone, in PEFT's format."""
    peft_model.save_pretrained(str(path))
    return Path(path)


def load_adapter(base_model, path: str | Path, is_trainable: bool = False):
    """`base_model` wrapped with the adapter saved at `path`."""
    from peft import PeftModel

    if not (Path(path) / "adapter_config.json").exists():
        raise ConfigError(
            f"{SETTING}.adapter = {str(path)!r} holds no PEFT adapter (no adapter_config.json); "
            "use a folder written by save_adapter or PeftModel.save_pretrained"
        )
    return PeftModel.from_pretrained(base_model, str(path), is_trainable=is_trainable)


@contextmanager
def adapter_disabled(peft_model) -> Iterator:
    """The base model's forward inside the block (the KL reference), the adapter's after."""
    from peft import PeftModel

    assert isinstance(peft_model, PeftModel), "adapter_disabled needs a PEFT-wrapped model"
    with peft_model.disable_adapter():
        yield peft_model


def _matching_modules(model, config) -> list[str]:
    from peft.tuners.tuners_utils import check_target_module_exists

    return [
        name
        for name, module in model.named_modules()
        if name and not list(module.children()) and check_target_module_exists(config, name)
    ]


def _no_binding_error(model, targets) -> ConfigError:
    available = linear_layer_names(model)
    if has_stacked_experts(model):  # the names PEFT maps onto the router and the experts
        available = sorted({*available, "gate", "gate_proj", "up_proj", "down_proj"})
    example = [n for n in ("q_proj", "v_proj") if n in available] or available[:2]
    return ConfigError(
        f"{SETTING}.target_modules = {targets!r} binds the adapter to 0 modules; this model's "
        f"linear layers are {available}; use {SETTING}.target_modules = {ALL_LINEAR!r} or e.g. "
        f"{example}"
    )


def _strip_wrapper_prefix(name: str) -> str:
    return name.removeprefix("base_model.model.")


def _is_all_linear(targets) -> bool:
    return isinstance(targets, str) and targets.lower() == ALL_LINEAR
