"""The run's memory plan, made before any weights load: what the planner (`train.planner`) is told,
the budget it plans in, and the choices the trainer takes from it.

- Budget: on CUDA the device's free memory now; on a CPU the machine's available RAM (Linux
  `MemAvailable`), where weights, activations and optimizer states live alike. Where neither can
  be read no plan is made: the trainer uses `DEFAULT_MICRO_TOKENS` and no checkpointing, and the
  plan says why.
- Choices: `train.micro_batch_tokens` and `model.gradient_checkpointing` when the config leaves
  them unset / "auto". Set values are planned with as given, and refused (naming what fits) when
  they cannot fit. The run reads the choices from its `RunSetup` (`train.loop.session`); the config
  keeps the values the user gave.
- KV cache: the paged engine's page pool is the plan's (`MemoryChoice.kv_cache_bytes`: the
  whole step's rollout when it fits beside training), or `rollout.kv_cache_bytes` when set (the
  planner plans around it). The engine never sizes itself from "all free memory" in a run: the
  trainer shares the device.
- Caps: on a CPU a chosen budget is capped at `CPU_MAX_MICRO_TOKENS`: past it micro-batches get
  no faster (their GEMMs already run at the cores' peak) and only take RAM; the deprecated
  `train.micro_batch_size` caps it at that many full-length sequences. Neither cap goes below
  one full sequence.
- The planner is told the AdamW state dtype (`optim.state_dtype`), the weight dtype, and for LoRA
  the exact trainable parameter count (`train.policy.lora.bind_on_meta`, which also refuses an adapter
  that binds nothing, before any weights load).
- Distributed (torchrun): the plan is one process's, with its share of the prompts; on a CPU
  the node's RAM is divided among its processes. `distributed.strategy` "auto" plans both ways
  (`plan_strategy`): replicated (the whole model, gradients and optimizer states on each
  process, plus a float32 all-reduce bucket) and FSDP (its shard of them, the full weights
  gathered for generation), and replicates unless that costs what the FSDP plan avoids:
  checkpointing, a smaller KV pool, or micro-batches under the planner's good size (8,192
  tokens) where FSDP's are larger. Without a plan: FSDP,
  the least memory.
- LoRA generation: `rollout.lora_generation` ("auto": the plan's choice of a merged generation
  copy or the adapters at every step, `MemoryChoice.lora_generation`; without a plan the engine
  decides from the free memory, `engine.lora_merge.resolve_mode`). The planner is told the exact
  size of the copy (`LoraReport.num_mergeable_params`).
- Resume: a run's micro-batch budget is saved in its checkpoints (`TrainerState`) and reused, so a
  resumed run splits its steps into the same micro-batches and stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from reinforge.config.envs import is_env_task
from reinforge.distributed import env_local_world_size, env_train_size
from reinforge.errors import ConfigError
from reinforge.train.planner import (
    GOOD_MICRO_TOKENS,
    ModelShape,
    Plan,
    PlanInputs,
    format_bytes,
    free_device_memory,
    plan_memory,
)
from reinforge.train.planner.lengths import Lengths

# The quickstart on 2 CPU cores, padded varlen attention (`train.packing.attention`): its SFT step (64
# sequences, 2,191 tokens) 0.79 s in micro-batches of 512 tokens, 0.75 s at 1,024, 0.73 s at 2,048,
# 0.74 s at 4,096; its RL step 2.85 s at 512, 2.65 s at 2,048 (matmuls at ~82 GFLOP/s, the cores'
# peak, in all of them). With the block-diagonal mask, 512 was best (0.96 s): L^2 attention.
CPU_MAX_MICRO_TOKENS = 2048
DEFAULT_MICRO_TOKENS = 8192
REQUIRED_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class MemoryChoice:
    micro_batch_tokens: int
    gradient_checkpointing: bool
    plan: Plan | None
    budget_note: str  # where the budget came from, or why there is no plan
    # the paged engine's KV pool: the plan's, `rollout.kv_cache_bytes` when set, else None (no
    # plan and no setting: the engine's own default)
    kv_cache_bytes: int | None = None
    num_shards: int = 1  # processes training together; the plan is one process's
    accumulate_unsharded: bool = False  # FSDP: see `sharding.accumulation`
    replicated: bool = False  # each process holds the whole model (`distributed.strategy`)
    # how the engine decodes a LoRA model: the plan's "merged" / "adapters", or the setting
    # ("auto" without a plan: the engine decides); `lora_generation_note` says why
    lora_generation: str = "auto"
    lora_generation_note: str = ""
    keeps_update_graph: bool = False  # the plan's room for a kept update graph (`Plan`)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step holds: prompts x samples sequences of prompt + response tokens."""

    prompt_len: int
    response_len: int
    samples_per_prompt: int
    prompts_per_step: int
    sft_response_len: int = 0  # an SFT stage's longest solution, when there is one

    @property
    def max_seq_len(self) -> int:
        """The longest sequence any phase packs: no micro-batch budget may be shorter."""
        return self.prompt_len + max(self.response_len, self.sft_response_len)


def choose_memory(
    cfg,
    model_config: dict,
    device,
    dtype_bytes: int,
    work: Workload,
    lora_trainable_params: int | None = None,
    resumed_micro_tokens: int | None = None,
    lora_mergeable_params: int | None = None,
) -> MemoryChoice:
    """The plan for this run (raises `ConfigError` when it cannot fit: before any load)."""
    t, checkpointing = cfg.train, cfg.model.gradient_checkpointing
    micro_tokens = t.micro_batch_tokens or resumed_micro_tokens
    forced_checkpointing = None if checkpointing == "auto" else bool(checkpointing)
    kv_bytes = getattr(getattr(cfg, "rollout", None), "kv_cache_bytes", None)
    unsharded = getattr(getattr(cfg, "distributed", None), "accumulate_unsharded", False)
    forced_unsharded = None if unsharded == "auto" else bool(unsharded)
    strategy = getattr(getattr(cfg, "distributed", None), "strategy", "fsdp")
    lora_mode = getattr(getattr(cfg, "rollout", None), "lora_generation", "auto")
    free, budget_note = memory_budget(device)
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in model_config]
    if free is None or missing:
        note = budget_note if free is None else f"the planner does not know this model ({missing})"
        tokens = micro_tokens or _capped(cfg, DEFAULT_MICRO_TOKENS, device, work)
        return MemoryChoice(
            max(tokens, work.max_seq_len),
            bool(forced_checkpointing),
            None,
            f"no plan: {note}",
            kv_bytes,
            accumulate_unsharded=bool(forced_unsharded),
            replicated=strategy == "replicate",  # "auto" without a plan: FSDP, the least memory
            lora_generation=lora_mode,
            lora_generation_note=_no_plan_note(lora_mode) if cfg.model.lora.rank else "",
        )
    rank = cfg.model.lora.rank or None
    shards = env_train_size(cfg)
    plan, replicated = plan_strategy(
        PlanInputs(
            free_bytes=free,
            model=ModelShape.from_hf_config(model_config, dtype_bytes),
            prompt_len=work.prompt_len,
            response_len=work.response_len,
            samples_per_prompt=work.samples_per_prompt,
            prompts_per_step=max(work.prompts_per_step // shards, 1),  # this process's share
            num_shards=shards,
            lora_rank=rank,
            lora_trainable_params=lora_trainable_params if rank else None,
            optimizer={"float32": "adamw_fp32", "bfloat16": "adamw_bf16"}[cfg.optim.state_dtype],
            micro_batch_tokens=micro_tokens,
            kv_cache_bytes=kv_bytes,
            gradient_checkpointing=forced_checkpointing,
            accumulate_unsharded=forced_unsharded,
            lora_generation=lora_mode,
            lora_mergeable_params=lora_mergeable_params if rank else None,
            update_graph={"auto": "auto", "run": "run", True: "run"}.get(
                cfg.train.cuda_graphs, "off"
            ),
        ),
        strategy,
    )
    tokens = micro_tokens or _capped(cfg, plan.micro_batch_tokens, device, work)
    if tokens < work.max_seq_len:
        raise ConfigError(
            f"train.micro_batch_tokens = {tokens} is shorter than the longest SFT sequence "
            f"({work.max_seq_len} tokens); use train.micro_batch_tokens >= {work.max_seq_len}"
        )
    return MemoryChoice(
        tokens,
        plan.gradient_checkpointing,
        plan,
        budget_note,
        plan.kv_cache_bytes,
        shards,
        plan.accumulate_unsharded,
        replicated,
        plan.lora_generation or lora_mode,
        plan.lora_generation_note,
        plan.keeps_update_graph,
    )


def _no_plan_note(mode: str) -> str:
    if mode == "auto":
        return "no memory plan: the engine decides from the free memory"
    return "rollout.lora_generation, set"


def plan_strategy(x: PlanInputs, strategy: str) -> tuple[Plan, bool]:
    """(the plan, whether the model is replicated) for `x` (planned as FSDP over
    `x.num_shards` processes) and `distributed.strategy`; see the module's docstring."""
    if x.num_shards <= 1:  # one process: nothing to choose ("replicate" is then the same)
        return plan_memory(x), strategy == "replicate"
    if strategy == "fsdp":
        return plan_memory(x), False
    replica = replace(x, num_shards=1, replicas=x.num_shards, accumulate_unsharded=None)
    if strategy == "replicate":
        try:
            return plan_memory(replica), True
        except ConfigError as error:
            raise ConfigError(
                f'distributed.strategy = "replicate" holds the whole model on each process, and '
                f'then: {error}. Or use distributed.strategy = "fsdp" (or "auto") to shard it'
            ) from None
    sharded = plan_memory(x)
    try:
        replicated = plan_memory(replica)
    except ConfigError:
        return sharded, False
    # a replica's lost host work (FSDP's per-layer hooks, the DTensor optimizer) outweighs a
    # somewhat smaller micro-batch, as long as it stays one that keeps the GPU busy
    as_good = (
        replicated.micro_batch_tokens >= min(sharded.micro_batch_tokens, GOOD_MICRO_TOKENS)
        and replicated.kv_pages >= sharded.kv_pages
        and (sharded.gradient_checkpointing or not replicated.gradient_checkpointing)
    )
    return (replicated, True) if as_good else (sharded, False)


def _capped(cfg, tokens: int, device, work: Workload) -> int:
    """A chosen budget under the CPU cap and the deprecated `train.micro_batch_size` (read as an
    upper bound of that many full-length sequences), never below one full sequence."""
    if str(device).startswith("cpu"):
        tokens = min(tokens, CPU_MAX_MICRO_TOKENS)
    if cfg.train.micro_batch_size is not None:
        tokens = min(tokens, cfg.train.micro_batch_size * work.max_seq_len)
    return max(tokens, work.max_seq_len)


def memory_budget(device) -> tuple[int | None, str]:
    """(bytes to plan in, where they came from); None where it cannot be read."""
    if str(device).startswith("cuda"):
        free = free_device_memory(str(device))
        return free, f"free memory of {device}: {format_bytes(free)}" if free else "CUDA unreadable"
    available = available_ram()
    if available is None:
        return None, "available RAM cannot be read on this system"
    processes = env_local_world_size()  # the processes of this node share its RAM
    if processes > 1:
        available //= processes
        note = f"available RAM / {processes} processes on this node (CPU training)"
        return available, f"{note}: {format_bytes(available)}"
    return available, f"available RAM (CPU training): {format_bytes(available)}"


def available_ram() -> int | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def workload(cfg, lengths: Lengths) -> Workload:
    """The step shape: RL's rollout for `reinforge train`, the SFT batch for `reinforge sft`."""
    prompt_len, longest_solution = lengths.longest_prompt, lengths.longest_solution
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None:
        new_tokens = rollout.max_new_tokens
        if is_env_task(cfg.task):  # an episode: every turn and env reply after the prompt
            assert lengths.episode_context is not None, "probe_lengths resolves it for env tasks"
            new_tokens = lengths.episode_context - prompt_len
        return Workload(
            prompt_len,
            new_tokens,
            rollout.samples_per_prompt,
            rollout.prompts_per_step,
            longest_solution if cfg.sft.steps else 0,
        )
    return Workload(prompt_len, longest_solution, 1, cfg.sft.batch_size)


def plan_run(cfg, tokenizer, lengths: Lengths, resumed_micro_tokens: int | None = None):
    """(MemoryChoice, LoraReport or None) for `cfg`, from the model's config.json alone."""
    from transformers import AutoConfig

    from reinforge.models.loading import model_source, resolve_device, resolve_dtype
    from reinforge.train.policy.lora import bind_on_meta, lora_alpha

    source = model_source(cfg.model.path, cfg.run.seed)
    device = resolve_device(cfg.run.device)
    dtype_bytes = resolve_dtype(cfg.run.dtype, device).itemsize
    lora = cfg.model.lora
    report = None
    if lora.rank:
        report = bind_on_meta(
            source, lora.rank, lora_alpha(lora), lora.dropout, lora.target_modules
        )
    choice = choose_memory(
        cfg,
        AutoConfig.from_pretrained(source).to_dict(),
        device,
        dtype_bytes,
        workload(cfg, lengths),
        report.num_trainable_params if report else None,
        resumed_micro_tokens,
        report.num_mergeable_params if report else None,
    )
    return choice, report


def plan_rows(choice: MemoryChoice) -> list[tuple[str, str]]:
    """Preflight rows: the budget, the choices, and the planner's table."""
    tokens = str(choice.micro_batch_tokens)
    if choice.plan is not None and choice.plan.micro_batch_tokens != choice.micro_batch_tokens:
        tokens += f" (the planner's {choice.plan.micro_batch_tokens}, capped: see train.memory)"
    rows = [
        ("memory budget", choice.budget_note),
        *sharding_rows(choice.num_shards, choice.replicated),
        ("micro-batch tokens", tokens),
        ("gradient checkpointing", "on" if choice.gradient_checkpointing else "off"),
        *(
            [("unsharded accumulation", "on" if choice.accumulate_unsharded else "off")]
            if choice.num_shards > 1 and not choice.replicated
            else []
        ),
        (
            "KV cache (paged engine)",
            format_bytes(choice.kv_cache_bytes)
            if choice.kv_cache_bytes is not None
            else "the engine's default (grows with the requests on a CPU)",
        ),
        *(
            [("LoRA generation", f"{choice.lora_generation} ({choice.lora_generation_note})")]
            if choice.lora_generation_note
            else []
        ),
    ]
    if choice.plan is not None:
        rows += [
            (f"plan: {item}", f"{format_bytes(size)} {note}".rstrip())
            for item, size, note in choice.plan.rows
        ]
    return rows


def sharding_rows(shards: int, replicated: bool = False) -> list[tuple[str, str]]:
    """What the plan assumes of a distributed run (none in one process)."""
    if shards <= 1:
        return []
    if replicated:
        return [
            (
                "sharding",
                f"none, replicated over {shards} processes (distributed.strategy): each holds the "
                "whole model, gradients and optimizer states, planned with its share of the "
                "prompts; gradients averaged once per step",
            )
        ]
    return [
        (
            "sharding",
            f"FSDP over {shards} processes: weights, gradients and optimizer states / {shards}, "
            "planned per process with its share of the prompts; generation gathers the full "
            "weights",
        )
    ]
