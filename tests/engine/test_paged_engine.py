"""The paged engine against transformers on tiny real models (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.engine.simple import SimpleEngine

from .conftest import FAMILIES, build_model, hf_greedy, hf_logprobs

# lengths below, at and across page boundaries (block_size 4 in these tests)
PROMPTS = [[5, 6, 7], list(range(10, 18)), list(range(20, 37)), list(range(40, 73))]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(models, tokenizer, family):
    model = models[family]
    engine = PagedEngine(model, tokenizer, block_size=4)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, n=3)
    outputs = engine.generate(PROMPTS, params)
    for prompt, completions in zip(PROMPTS, outputs):
        expected = hf_greedy(model, prompt, 16)
        expected_lps = hf_logprobs(model, prompt, expected)
        assert len(completions) == 3
        for completion in completions:
            assert completion.token_ids == expected
            got_lps = torch.tensor(completion.logprobs)
            torch.testing.assert_close(got_lps, expected_lps, atol=1e-4, rtol=0)
    assert engine.stats.num_generated_tokens == sum(len(c.token_ids) for g in outputs for c in g)
    assert engine.stats.extra["num_prefill_tokens"] == sum(map(len, PROMPTS))  # once per group


def test_preemption_in_tiny_pool_matches_unconstrained_run(models, tokenizer):
    model = models["qwen2"]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, n=3)
    roomy = PagedEngine(model, tokenizer, block_size=4)
    # the longest request needs ceil((33 + 12 - 1) / 4) = 11 pages; 12 forces preemption
    tight = PagedEngine(model, tokenizer, block_size=4, num_blocks=12)
    expected = roomy.generate(PROMPTS, params)
    got = tight.generate(PROMPTS, params)
    assert roomy.stats.extra["num_preemptions"] == 0
    assert tight.stats.extra["num_preemptions"] > 0
    assert tight.stats.extra["kv_blocks_peak"] <= 12
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]


def test_request_larger_than_pool_is_a_clear_error(models, tokenizer):
    engine = PagedEngine(models["qwen2"], tokenizer, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="whole pool has 4"):
        engine.generate([list(range(1, 20))], SamplingParams(max_new_tokens=4))


def test_weights_are_read_in_place(micro_dir, tokenizer):
    model = build_model("qwen2", micro_dir, tokenizer, seed=1)
    engine = PagedEngine(model, tokenizer, block_size=4)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = engine.generate(PROMPTS, params)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([PROMPTS[2] + before[2][0].token_ids])
    model(ids, labels=ids).loss.neg().backward()  # push away from what it generated
    optimizer.step()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.bias.mul_(3.0)

    after = engine.generate(PROMPTS, params)
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
    for prompt, group in zip(PROMPTS, after):
        assert group[0].token_ids == hf_greedy(model, prompt, 12)


def test_prompt_pages_are_shared_by_the_samples(models, tokenizer):
    engine = PagedEngine(models["qwen2"], tokenizer, block_size=16)
    prompts = [list(range(10 * i, 10 * i + 40)) for i in range(4)]  # 2 full pages + 8 tokens
    engine.generate(prompts, SamplingParams(max_new_tokens=8, n=8, ignore_eos=True))
    extra = engine.stats.extra
    print(
        f"\n4 prompts x 8 samples, peak KV pages: shared {extra['kv_blocks_peak']:.0f}, "
        f"unshared {extra['kv_blocks_peak_unshared']:.0f}"
    )
    # per prompt: 2 shared full pages + 8 own copies of the partial page, vs 8 x 3 pages
    assert extra["kv_blocks_peak"] == 4 * (2 + 8) < extra["kv_blocks_peak_unshared"] == 4 * 8 * 3
    assert extra["num_prefill_tokens"] == 4 * 40


def test_unsupported_architecture_falls_back_with_warning(tokenizer):
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=320,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = GPT2LMHeadModel(config).eval()
    with pytest.warns(UserWarning, match="'gpt2' has no paged forward.*falling back"):
        engine = PagedEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=5, n=2, seed=3)
    got = engine.generate([[5, 6, 7], [8, 9]], params)
    expected = SimpleEngine(model, tokenizer).generate([[5, 6, 7], [8, 9]], params)
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
    assert engine.stats.num_generated_tokens == sum(len(c.token_ids) for g in got for c in g)


def common_tokens(outputs, count: int) -> tuple[int, ...]:
    from collections import Counter

    tokens = Counter(t for group in outputs for c in group for t in c.token_ids[2:])
    return tuple(t for t, _ in tokens.most_common(count))


@pytest.mark.parametrize("num_blocks", [None, 14])
def test_running_one_step_ahead_changes_nothing(models, tokenizer, num_blocks, monkeypatch):
    """Decodes queued before the previous step is read back: sequences that stop at a stop id
    (found one step late) and preemption give exactly the step-by-step results."""
    model = models["qwen2"]
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=num_blocks)
    free_run = engine.generate(PROMPTS, SamplingParams(max_new_tokens=14, temperature=0.0, n=3))
    stops = common_tokens(free_run, 2)
    # greedy only: the CPU sampler draws from one generator for the whole batch, so its samples
    # depend on which rows a step holds (the device sampler's do not: see test_gpu_engine)
    for temperature in (0.0,):
        params = SamplingParams(
            max_new_tokens=14, temperature=temperature, n=3, stop_token_ids=stops, seed=3
        )
        ahead = engine.generate(PROMPTS, params)
        assert engine.stats.extra["num_overlapped_steps"] > 0
        monkeypatch.setattr(PagedEngine, "overlap", False)
        in_step = engine.generate(PROMPTS, params)
        assert engine.stats.extra["num_overlapped_steps"] == 0
        monkeypatch.setattr(PagedEngine, "overlap", True)
        assert [[c.token_ids for c in g] for g in ahead] == [
            [c.token_ids for c in g] for g in in_step
        ]
        for got, expected in zip(ahead, in_step):  # batch shapes differ: float rounding may
            for a, b in zip(got, expected):
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        lengths = {len(c.token_ids) for g in ahead for c in g}
        assert len(lengths) > 1 and all(c.finish_reason for g in ahead for c in g)


def test_more_samples_than_max_num_seqs_take_turns(models, tokenizer):
    model = models["qwen2"]
    engine = PagedEngine(model, tokenizer, block_size=4, max_num_seqs=4)
    prompts = PROMPTS[:2]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0, n=10))
    for prompt, group in zip(prompts, outputs):
        assert [c.token_ids for c in group] == [hf_greedy(model, prompt, 6)] * 10
    # each prompt prefilled once per turn of at most 4 samples: 3 turns
    assert engine.stats.extra["num_prefill_tokens"] == 3 * sum(map(len, prompts))


@pytest.mark.parametrize("num_blocks", [None, 64])
def test_released_pool_comes_back_for_the_next_generate(models, tokenizer, num_blocks):
    """What a trainer does around its update: release the pool, then generate again; the pool
    returns at its size and the outputs are those of an engine that never released."""
    model = models["qwen2"]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, n=2)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=num_blocks)
    first = engine.generate(PROMPTS, params)
    size = engine.num_blocks
    restored = engine.totals["gen_restore_s"]
    engine.release_memory()
    assert engine.runner.released and engine.runner.kv_cache is None
    engine.release_memory()  # twice is harmless
    again = engine.generate(PROMPTS, params)
    assert not engine.runner.released and engine.num_blocks == size
    assert engine.runner.kv_cache.shape[2] == size
    assert engine.totals["gen_restore_s"] > restored  # the trainer logs each step's share
    assert engine.totals["gen_engine_s"] > engine.totals["gen_restore_s"]  # all of generate
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in first]
    SimpleEngine(model, tokenizer).release_memory()  # the protocol's no-op


def test_the_peak_without_prefills_in_the_mempool_walks_back_through_each(micro_dir, tokenizer):
    """`peak_outside_prefills`: each prefill run in a shared mempool that raised the allocator's
    peak recorded (raised to, before); the peak read back walks those records to the last peak
    no such prefill set, any later peak of other work stands, and the records are forgotten."""
    model = build_model("qwen2", micro_dir, tokenizer)
    runner = PagedEngine(model, tokenizer, block_size=4, num_blocks=64).runner
    assert runner.peak_outside_prefills(123) == 123  # no prefill in a mempool: as it was
    runner.prefills.peaks.update({900: 700, 700: 500})  # two prefills, each a new peak
    assert runner.peak_outside_prefills(900) == 500
    assert runner.peak_outside_prefills(900) == 900  # forgotten after a read
    runner.prefills.peaks.update({900: 700})
    assert runner.peak_outside_prefills(950) == 950  # later work peaked higher: it stands
    assert runner.logits_area is None and runner.kv_bytes_in_mempool == 0  # (no mempool here)


@pytest.mark.parametrize("word_tokenizer", [False, True])
def test_texts_decoded_while_steps_run_equal_decode(
    micro_dir, tokenizer, word_tokenizer, monkeypatch
):
    """The decode loop decodes texts in parts while a queued step is not done (forced here: every
    step reads as not done): the completions' texts equal `decode` of their ids, with the tiny
    byte-level tokenizer and the shape models' word tokenizer, through sampled stops."""
    from reinforge.engine.step_sampling import LaunchedStep
    from reinforge.models.shapes import build_word_tokenizer

    from .conftest import build_model

    if word_tokenizer:
        tokenizer = build_word_tokenizer(len(tokenizer))
    model = build_model("qwen2", micro_dir, tokenizer)
    monkeypatch.setattr(LaunchedStep, "ready", lambda self: False)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=512)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, n=3, seed=2, stop_token_ids=[7])
    groups = engine.generate([list(range(5, 12)), list(range(30, 41))], params)
    assert engine.stats.extra["num_overlapped_steps"] > 0
    assert engine.totals["gen_texts_ahead_ids"] > 0
    for group in groups:
        for c in group:
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert len({c.text for group in groups for c in group}) > 3
