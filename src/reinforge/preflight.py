"""Budgets checked before any model loads: context length, batch arithmetic, split sizes.

Reads only the tokenizer and the model's config.json, so a mistake costs seconds, not a load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reinforge.errors import ConfigError


@dataclass
class Preflight:
    rows: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def raise_if_failed(self) -> None:
        if self.errors:
            raise ConfigError("preflight failed:\n  " + "\n  ".join(self.errors))


def run_preflight(cfg) -> Preflight:
    from reinforge.models.loading import load_tokenizer, model_source
    from reinforge.train.planner.lengths import model_context, probe_lengths

    pf = Preflight()
    context, context_from = model_context(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_source(cfg.model.path, cfg.run.seed))
    lengths = probe_lengths(cfg, tokenizer)
    longest = lengths.longest_prompt
    pf.rows.append(("model context", f"{context} ({context_from})"))
    pf.rows.append(("longest prompt", f"{longest} tokens (over {lengths.num_probed} tasks probed)"))

    gen_budget = getattr(getattr(cfg, "rollout", None), "max_new_tokens", None)
    budgets = [("rollout.max_new_tokens", gen_budget)] if gen_budget else []
    eval_tokens = cfg.eval.max_new_tokens or gen_budget or 32
    budgets.append(("eval.max_new_tokens", eval_tokens))
    if longest >= context:  # no max_new_tokens can help: the prompts themselves are too long
        pf.errors.append(
            f"the longest prompt ({longest} tokens) leaves no room to answer in the model "
            f"context ({context}; {context_from}): shorten the task's prompts below {context} "
            f"tokens with room for the answer (a shorter task.system_prompt, task.question_after "
            f"for reasoning-gym questions, smaller task settings), or use a model with a longer "
            f"context (builtin:small takes 1024 tokens)"
        )
    for name, new_tokens in budgets:
        total = longest + new_tokens
        pf.rows.append((f"prompt + {name}", f"{longest} + {new_tokens} = {total} of {context}"))
        if total > context and longest < context:
            pf.errors.append(
                f"longest prompt ({longest} tokens) + {name} ({new_tokens}) = {total} exceeds the model context "
                f"({context}); set {name} <= {context - longest}"
            )
    if cfg.sft.steps > 0 or type(cfg).__name__ == "SFTConfig":
        pf.rows.append(("sft", f"{cfg.sft.steps} steps x {cfg.sft.batch_size} examples"))
    if hasattr(cfg, "rollout"):
        _check_rl_batch(cfg, pf)
    _check_distributed(cfg, pf)
    _check_routing_replay(cfg, pf)
    _check_held_out(cfg, tokenizer, pf)
    if not pf.errors:  # the plan needs sequences that fit the context
        _check_memory(cfg, tokenizer, lengths, pf)
    return pf


def _check_routing_replay(cfg, pf: Preflight) -> None:
    """`algorithm.routing_replay` on a model whose config.json has no experts (the loaded model
    is checked again, with the engine: train.policy.moe.check_routing_replay)."""
    if not getattr(getattr(cfg, "algorithm", None), "routing_replay", False):
        return
    from transformers import AutoConfig

    from reinforge.models.loading import model_source
    from reinforge.train.policy.moe import dense_refusal

    config = AutoConfig.from_pretrained(model_source(cfg.model.path, cfg.run.seed))
    if not (getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)):
        pf.errors.append(dense_refusal(config.model_type))


def _check_held_out(cfg, tokenizer, pf: Preflight) -> None:
    from reinforge.tasks import task_source_for

    tasks = task_source_for(cfg, tokenizer)  # built once per process: the probe built it
    available = len(tasks.eval_tasks())
    wanted = cfg.eval.num_tasks
    if wanted and wanted > available:
        has_num_eval = "num_eval" in type(cfg.task).model_fields
        more = "raise task.num_eval" if has_num_eval else "hold out more"
        pf.errors.append(
            f"eval.num_tasks = {wanted} but the task has only {available} held-out tasks; set "
            f"eval.num_tasks <= {available} or {more}"
        )
    pf.rows.append(("held-out tasks", str(min(wanted or available, available))))
    if available == 0 and (cfg.eval.before_train or cfg.eval.every):
        pf.warnings.append(
            "the task has no held-out tasks, so there is no evaluation during training; hold "
            "some out with task.eval_fraction = 0.05, task.eval_path or task.eval_split"
        )
    elif not getattr(tasks, "can_score", True):
        pf.warnings.append(
            "the held-out tasks have no answers or no known reward, so only the SFT validation "
            "loss is measured; set task.columns.answer and task.reward to also score accuracy"
        )


def _check_memory(cfg, tokenizer, lengths, pf: Preflight) -> None:
    """LoRA binding (on a meta-device model) and the memory plan, before any weights load."""
    from reinforge.train.planner.memory import plan_rows, plan_run

    t = cfg.train
    if t.micro_batch_size is not None:
        meaning = (
            "ignored, as train.micro_batch_tokens is set"
            if t.micro_batch_tokens is not None
            else "read as a bound: micro-batches of at most micro_batch_size x the longest "
            "sequence tokens"
        )
        pf.warnings.append(
            f"train.micro_batch_size = {t.micro_batch_size} is deprecated (micro-batches are "
            f"packed by tokens) and is {meaning}; remove it to let the memory planner choose, "
            "or set train.micro_batch_tokens"
        )
    try:
        choice, report = plan_run(cfg, tokenizer, lengths)
    except ConfigError as e:
        pf.errors.append(str(e))
        return
    if report is not None:
        pf.rows.append(("LoRA", report.summary()))
    pf.rows += plan_rows(choice)


def _check_rl_batch(cfg, pf: Preflight) -> None:
    r = cfg.rollout
    seqs = r.prompts_per_step * r.samples_per_prompt
    pf.rows.append(
        (
            "per RL step",
            f"{r.prompts_per_step} prompts x {r.samples_per_prompt} samples = {seqs} sequences",
        )
    )
    a = cfg.algorithm
    overridden = [k for k, origin in a.origins().items() if origin.startswith("set")]
    pf.rows.append(
        (
            "algorithm",
            f"preset {a.name}"
            + (f", overridden: {', '.join(overridden)}" if overridden else ", as published")
            + ("; a value head is trained (GAE)" if a.uses_value_model else "")
            + ("; a frozen KL reference is kept" if a.uses_reference else ""),
        )
    )
    pf.rows.append(
        (
            "prompts consumed",
            f"{r.prompts_per_step * cfg.run.max_steps} over {cfg.run.max_steps} steps",
        )
    )
    if r.samples_per_prompt < 2:
        pf.errors.append(
            f"rollout.samples_per_prompt = {r.samples_per_prompt}: group-relative advantages need at least 2 samples "
            "per prompt (every advantage would be 0); set rollout.samples_per_prompt = 8"
        )


def _check_distributed(cfg, pf: Preflight) -> None:
    """The global batch under torchrun: every training process takes an equal share of a step's
    prompts (a prompt's samples stay on one process) and of an SFT batch."""
    from reinforge.distributed import env_local_world_size, env_train_size, env_world_size

    world = env_world_size()
    disaggregated = getattr(getattr(cfg, "distributed", None), "mode", "") == "disaggregated"
    if world <= 1:
        if disaggregated:
            pf.warnings.append(
                "distributed.mode = 'disaggregated' needs torchrun with 2 or more processes "
                "(the last rank generates, the others train); in one process it is ignored"
            )
        return
    trainers = env_train_size(cfg)
    g = cfg.distributed.generators if disaggregated else 1
    generating = "rank generates" if g == 1 else f"{g} ranks generate (distributed.generators)"
    how = (
        f"disaggregated: the last {generating} every rollout, {trainers} train on them up to "
        f"{cfg.distributed.staleness} step(s) behind (distributed.rollout_staleness)"
        if disaggregated
        else "each generates for its share of the prompts and trains"
    )
    pf.rows.append(
        (
            "processes",
            f"{world} (torchrun; {env_local_world_size()} per node): {how}; those that train "
            "hold a replica each or FSDP2 shards (distributed.strategy; see the plan below)",
        )
    )
    is_rl = hasattr(cfg, "rollout")
    batches = [("rollout.prompts_per_step", cfg.rollout.prompts_per_step)] if is_rl else []
    if not is_rl or cfg.sft.steps > 0:
        batches.append(("sft.batch_size", cfg.sft.batch_size))
    for setting, count in batches:
        if count % trainers:
            up, down = -(-count // trainers) * trainers, count // trainers * trainers
            pf.errors.append(
                f"{setting} = {count} does not divide among {trainers} training processes "
                f"(WORLD_SIZE {world}): each takes an equal share; set {setting} = {up}"
                + (f" (or {down})" if down else "")
                + f", or start a number of processes that divides {count}"
            )
    if is_rl and cfg.rollout.prompts_per_step % trainers == 0:
        r = cfg.rollout
        per = r.prompts_per_step // trainers
        pf.rows.append(
            (
                "per training process",
                f"{per} prompts x {r.samples_per_prompt} samples = "
                f"{per * r.samples_per_prompt} sequences a step (micro-batches: below)",
            )
        )
    unsupported = []
    if is_rl and cfg.algorithm.dynamic_sampling:
        unsupported.append(
            ("algorithm.dynamic_sampling = true", "algorithm.dynamic_sampling = false")
        )
    if is_rl and cfg.algorithm.uses_value_model:
        unsupported.append(("algorithm.name = 'ppo' (a value head)", "another algorithm"))
    if (not is_rl or cfg.sft.steps > 0) and cfg.model.lora.rank:
        unsupported.append(("SFT with LoRA (the adapter merge at its end)", "model.lora.rank = 0"))
    if disaggregated and is_rl and cfg.sft.steps > 0:
        unsupported.append(
            ("an SFT stage in the disaggregated mode", "a `reinforge sft` run first")
        )
    for what, instead in unsupported:
        pf.errors.append(
            f"{what} is not supported with several processes yet; use {instead}, or run on one "
            "process"
        )
    a = cfg.algorithm if is_rl else None
    if disaggregated and a and cfg.distributed.staleness and not (a.tis_cap or a.mis_high):
        pf.warnings.append(
            f"distributed.mode = 'disaggregated' trains on rollouts up to "
            f"{cfg.distributed.staleness} step(s) stale, and algorithm.tis_cap = 0 (no "
            "mis_high either) leaves that uncorrected; set algorithm.tis_cap = 2.0 "
            "(truncated importance sampling)"
        )
    if cfg.checkpoint.async_save:
        pf.warnings.append(
            "checkpoint.async_save = true: with several processes checkpoints are written "
            "synchronously (a sharded save is collective)"
        )
