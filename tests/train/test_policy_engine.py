"""The trainer's engine: `rollout.engine` chooses it, the memory plan sizes its KV pool (or
`rollout.kv_cache_bytes` does), and it never takes "all free memory"."""

from __future__ import annotations

import torch

from reinforge.config import TrainConfig, load_config
from reinforge.engine.block_manager import pages_to_run_at_once
from reinforge.engine.paged import PagedEngine
from reinforge.engine.pool_size import kv_bytes_per_block
from reinforge.engine.simple import SimpleEngine
from reinforge.models.loading import load_model, load_tokenizer, model_source
from reinforge.train.loop.session import policy_engine
from reinforge.train.planner.lengths import probe_lengths
from reinforge.train.planner.memory import plan_rows, plan_run

RUN = [
    "model.path=builtin:micro",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=6",
]


def micro(cfg):
    source = model_source(cfg.model.path, cfg.run.seed)
    tokenizer = load_tokenizer(source)
    return load_model(source, torch.device("cpu"), torch.float32), tokenizer


def test_the_plan_sizes_the_paged_pool_for_the_whole_rollout():
    cfg = load_config(TrainConfig, None, RUN)
    model, tokenizer = micro(cfg)
    lengths = probe_lengths(cfg, tokenizer)
    choice, _ = plan_run(cfg, tokenizer, lengths)
    assert choice.plan is not None and choice.kv_cache_bytes == choice.plan.kv_cache_bytes
    engine = policy_engine(cfg, model, tokenizer, choice.kv_cache_bytes)
    assert isinstance(engine, PagedEngine) and not engine.pool_grows
    assert engine.num_blocks == choice.plan.kv_pages
    rollout = cfg.rollout
    need = pages_to_run_at_once(
        [lengths.longest_prompt] * rollout.prompts_per_step,
        rollout.max_new_tokens,
        rollout.samples_per_prompt,
        16,
        engine.max_num_seqs,
    )
    assert engine.num_blocks >= need, "a step's rollout should fit without preemption"
    rows = dict(plan_rows(choice))
    assert rows["KV cache (paged engine)"].endswith("MiB")


def test_kv_cache_bytes_and_engine_settings_are_obeyed():
    budget = 3 * 2**20
    cfg = load_config(TrainConfig, None, [*RUN, f"rollout.kv_cache_bytes={budget}"])
    model, tokenizer = micro(cfg)
    choice, _ = plan_run(cfg, tokenizer, probe_lengths(cfg, tokenizer))
    assert choice.kv_cache_bytes == budget
    engine = policy_engine(cfg, model, tokenizer, choice.kv_cache_bytes)
    assert engine.num_blocks == budget // kv_bytes_per_block(model, 16)
    simple = load_config(TrainConfig, None, [*RUN, "rollout.engine=simple"])
    assert isinstance(policy_engine(simple, model, tokenizer, budget), SimpleEngine)


def test_a_lora_policy_generates_through_the_paged_forward():
    from reinforge.train.policy.model import attach_adapter

    cfg = load_config(TrainConfig, None, [*RUN, "model.lora.rank=4"])
    model, tokenizer = micro(cfg)
    peft_model = attach_adapter(cfg, model)
    engine = policy_engine(cfg, peft_model, tokenizer, None)
    assert isinstance(engine, PagedEngine) and engine.fallback is None
    assert engine.runner.model is peft_model.get_base_model()  # its LoRA layers, in place
