"""AdamW with linear warmup and a constant, cosine or linear schedule.

The moment estimates have the dtype `optim.state_dtype` asks for. Where it is every trainable
parameter's own dtype (float32 on a CPU) this is `torch.optim.AdamW`; otherwise `MixedAdamW`:
float32 states for bfloat16 weights (each step computed in float32, rounded once into the
weight), or bfloat16 states to halve their memory. The memory planner counts the same bytes.
"""

from __future__ import annotations

import math

import torch

from reinforge.sharding import local_tensor

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float
) -> float:
    """Multiplier of the peak learning rate for the optimizer step with index `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    assert schedule == "cosine", schedule
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model,
    lr: float,
    betas,
    eps: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_ratio: float,
    extra_param_groups: list[dict] = (),
    state_dtype: torch.dtype = torch.float32,
):
    """AdamW over the model's trainable parameters (no decay on vectors), plus any extra groups
    (e.g. a value head with its own lr); one schedule scales every group's lr."""
    params = [p for p in model.parameters() if p.requires_grad]
    assert params, "no trainable parameters"
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        *extra_param_groups,
    ]
    all_params = [p for g in groups for p in g["params"]]
    if all(p.dtype == state_dtype for p in all_params):
        # On CUDA the fused kernel updates in place: the default multi-tensor path allocates
        # temporaries the size of the parameters (0.9 GiB at 0.5B bf16), which set the peak
        fused = all(p.is_cuda and type(p) is torch.nn.Parameter for p in all_params)
        optimizer = torch.optim.AdamW(
            groups, lr=lr, betas=tuple(betas), eps=eps, fused=True if fused else None
        )
    else:
        optimizer = MixedAdamW(groups, lr=lr, betas=tuple(betas), eps=eps, state_dtype=state_dtype)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup_steps, total_steps, schedule, min_ratio)
    )
    return optimizer, scheduler


class MixedAdamW(torch.optim.Optimizer):
    """`torch.optim.AdamW`'s update (decoupled weight decay, bias correction) with moment
    estimates in `state_dtype` whatever the parameters' dtype; the arithmetic runs in float32."""

    def __init__(self, params, lr: float, betas, eps: float, state_dtype: torch.dtype):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0})
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
                state["step"] += 1
                step = float(state["step"])
                # element-wise: on FSDP's DTensor shards, each rank updates its own part
                weight, avg, avg_sq = map(
                    local_tensor, (param, state["exp_avg"], state["exp_avg_sq"])
                )
                grad = local_tensor(param.grad).float()
                exp_avg = avg.float().lerp_(grad, 1.0 - beta1)
                exp_avg_sq = avg_sq.float().mul_(beta2)
                exp_avg_sq.addcmul_(grad, grad, value=1.0 - beta2)
                avg.copy_(exp_avg)
                avg_sq.copy_(exp_avg_sq)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
                updated = weight.float().mul_(1.0 - lr * weight_decay)
                updated.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
                weight.copy_(updated)

    def load_state_dict(self, state_dict: dict) -> None:
        """As `Optimizer.load_state_dict`, which casts every state to its parameter's dtype; the
        moments go back to `state_dtype` from the saved values, not from that cast. States are
        keyed as the saved groups list them: by position, or by parameter name (DCP)."""
        params = [p for g in self.param_groups for p in g["params"]]
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        param_of = dict(zip(keys, params, strict=True))
        super().load_state_dict(state_dict)
        for key, saved in state_dict["state"].items():
            param = param_of[key]
            for name in ("exp_avg", "exp_avg_sq"):
                self.state[param][name] = saved[name].to(
                    device=param.device, dtype=self.state_dtype
                )


def advance_schedule(scheduler) -> None:
    """Move the learning-rate schedule one step on, stepped or skipped: a step whose gradient
    was not finite (or zero) leaves the weights alone but still counts, so the schedule stays
    at the trainer's step. torch warns "lr_scheduler.step() before optimizer.step()" when the
    first steps were skipped so; that is this intended order, not a mistake."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        scheduler.step()
