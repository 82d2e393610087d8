"""`build_engine`: the one place the trainer, `reinforge eval` and the server choose an engine."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from reinforge.engine.base import SamplingParams
from reinforge.engine.factory import build_engine
from reinforge.engine.paged import PagedEngine
from reinforge.engine.pool_size import kv_bytes_per_block
from reinforge.engine.simple import SimpleEngine
from reinforge.errors import ConfigError


def gpt2(tokenizer):
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2, eos_token_id=eos
    )
    return GPT2LMHeadModel(config).eval()


def test_auto_takes_the_paged_engine_where_supported(models, tokenizer):
    engine = build_engine(models["qwen2"], tokenizer, "auto")
    assert isinstance(engine, PagedEngine) and engine.fallback is None
    assert isinstance(build_engine(models["qwen2"], tokenizer, "simple"), SimpleEngine)


def test_auto_falls_back_with_a_warning_and_paged_refuses(tokenizer):
    model = gpt2(tokenizer)
    with pytest.warns(UserWarning, match=r"rollout\.engine = 'auto': architecture 'gpt2'"):
        engine = build_engine(model, tokenizer, "auto", setting="rollout.engine")
    assert isinstance(engine, SimpleEngine)
    with pytest.raises(ConfigError, match=r"rollout\.engine = 'paged', but .*'gpt2'.*'simple'"):
        build_engine(model, tokenizer, "paged", setting="rollout.engine")
    with pytest.raises(ConfigError, match=r"engine = 'vllm' is unknown; use one of"):
        build_engine(model, tokenizer, "vllm")


def test_a_kv_budget_sizes_the_pool_and_stops_it_growing(models, tokenizer):
    model = models["qwen2"]
    budget = 10 * kv_bytes_per_block(model, 16)
    engine = build_engine(model, tokenizer, "paged", kv_cache_bytes=budget)
    assert engine.num_blocks == 10 and not engine.pool_grows
    prompts = [list(range(10 * i, 10 * i + 20)) for i in range(6)]
    params = SamplingParams(max_new_tokens=20, n=4, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert engine.num_blocks == 10  # the sequences took turns in the pool it was given
    assert engine.stats.extra["kv_blocks_peak"] <= 10
    assert all(len(c.token_ids) == 20 for g in outputs for c in g)


def test_without_a_budget_the_cpu_pool_grows_to_run_everything_at_once(models, tokenizer):
    engine = build_engine(models["qwen2"], tokenizer, "paged")
    assert engine.pool_grows
    # 40 prompts x 8 samples of 40 + 60 tokens, 32 groups at once (256 sequences): 32 x (2
    # shared + 8 x 5 own) = 1,344 pages
    prompts = [list(range(i, i + 40)) for i in range(40)]
    engine.generate(prompts, SamplingParams(max_new_tokens=61, n=8, ignore_eos=True))
    assert engine.num_blocks == 32 * (2 + 8 * 5)
    assert engine.stats.extra["num_preemptions"] == 0
    assert engine.stats.extra["kv_blocks_peak"] == engine.num_blocks
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, n=2))
    assert engine.num_blocks == 32 * (2 + 8 * 5), "a smaller request keeps the pool"


def test_the_config_and_the_cli_offer_the_factorys_engines():
    import typing

    from reinforge.cli.models import ENGINES as CLI_ENGINES
    from reinforge.config import RolloutSection
    from reinforge.engine.factory import ENGINES

    assert typing.get_args(RolloutSection.model_fields["engine"].annotation) == ENGINES
    assert CLI_ENGINES is ENGINES
