"""The memory planner's choice of LoRA generation (`rollout.lora_generation`): a merged copy when
it fits beside the KV pool the plan chose, never at the pool's expense; the run's engine follows
the plan, and the choice is shown with its bytes."""

from __future__ import annotations

import dataclasses

import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.errors import ConfigError
from reinforge.train.planner import GiB, PlanInputs, lora_mergeable_params, plan_memory

from .test_planner import FREE_80GB, G2, M05, M7
from .test_policy_engine import RUN, micro


def rows_of(plan) -> dict[str, int]:
    return {item: size for item, size, _ in plan.rows}


def test_g2_on_80gb_merges_and_keeps_the_whole_rollouts_pool():
    x = PlanInputs(free_bytes=FREE_80GB, model=M7, lora_rank=32, **G2)
    plan = plan_memory(x)
    copy = 2 * lora_mergeable_params(M7)
    assert copy == 2 * 28 * (
        2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944
    )  # 13.0 GB = 12.15 GiB
    assert plan.lora_generation == "merged"
    assert "12.15 GiB" in plan.lora_generation_note and "fits beside the KV pool" in (
        plan.lora_generation_note
    )
    adapters = plan_memory(dataclasses.replace(x, lora_generation="adapters"))
    assert adapters.lora_generation == "adapters"
    assert plan.kv_pages == adapters.kv_pages == 32 * (16 + 8 * 64)
    assert plan.micro_batch_tokens == adapters.micro_batch_tokens
    rows, rows_adapters = rows_of(plan), rows_of(adapters)
    assert rows["LoRA generation copy"] == copy and rows_adapters["LoRA generation copy"] == 0
    peak = "peak, generation phase"
    assert rows[peak] == rows_adapters[peak] + copy
    assert "LoRA generation copy" in plan.table()


def test_tight_memory_keeps_the_adapters_and_the_pool():
    """24 GB: the pool is already smaller than the step's rollout; the copy would shrink it."""
    x = PlanInputs(free_bytes=24 * GiB, model=M7, lora_rank=32, **G2)
    plan = plan_memory(x)
    assert plan.lora_generation == "adapters"
    assert "does not fit beside the KV pool" in plan.lora_generation_note
    assert plan.kv_pages == plan_memory(dataclasses.replace(x, lora_generation="adapters")).kv_pages
    with pytest.raises(ConfigError, match=r'rollout\.lora_generation = "merged" needs 12\.15 GiB'):
        plan_memory(dataclasses.replace(x, lora_generation="merged"))


def test_forced_merged_is_planned_in_and_may_shrink_the_pool():
    x = PlanInputs(free_bytes=40 * GiB, model=M7, lora_rank=32, **G2)
    auto = plan_memory(x)
    assert auto.lora_generation == "adapters"  # the whole rollout's pool leaves no room
    forced = plan_memory(dataclasses.replace(x, lora_generation="merged"))
    assert forced.lora_generation == "merged" and forced.kv_pages < auto.kv_pages
    rows = rows_of(forced)
    assert rows["peak, generation phase"] <= 40 * GiB - rows["reserve"]


def test_full_finetuning_has_no_lora_choice():
    plan = plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, **G2))
    assert plan.lora_generation is None and "LoRA generation copy" not in plan.table()


def test_the_runs_engine_follows_the_plan():
    from reinforge.train.loop.session import policy_engine
    from reinforge.train.planner.lengths import probe_lengths
    from reinforge.train.planner.memory import plan_rows, plan_run
    from reinforge.train.policy.model import attach_adapter

    cfg = load_config(TrainConfig, None, [*RUN, "model.lora.rank=4"])
    model, tokenizer = micro(cfg)
    choice, report = plan_run(cfg, tokenizer, probe_lengths(cfg, tokenizer))
    assert report.num_mergeable_params == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    assert choice.lora_generation == "merged"  # a CPU's RAM holds the micro model's copy
    assert "LoRA generation" in dict(plan_rows(choice))
    peft_model = attach_adapter(cfg, model)
    engine = policy_engine(cfg, peft_model, tokenizer, None, choice.lora_generation)
    assert engine.lora_generation == "merged" and engine.runner.merged is not None
    forced = load_config(
        TrainConfig, None, [*RUN, "model.lora.rank=4", "rollout.lora_generation=adapters"]
    )
    choice, _ = plan_run(forced, tokenizer, probe_lengths(forced, tokenizer))
    assert choice.lora_generation == "adapters"
    with pytest.raises(ConfigError, match="lora_generation"):
        load_config(TrainConfig, None, [*RUN, "rollout.lora_generation=fused"])
