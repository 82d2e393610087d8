"""Engine sessions: forks and continuations on shared pages, and the sampler's entropy."""

from __future__ import annotations

import math

import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.engine.session import EngineSession

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def run_to_end(session: EngineSession) -> list:
    done = []
    while session.has_work():
        done += session.step()
    return done


def fresh(engine, prompt, max_new_tokens):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=max_new_tokens)
    return engine.generate([prompt], params)[0][0].token_ids


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("num_generated", [5, 7])  # the fork point mid-page, on a page edge
def test_fork_continues_as_a_fresh_sequence_and_shares_pages(
    models, tokenizer, family, num_generated
):
    engine = PagedEngine(models[family], tokenizer, block_size=4)
    prompt = list(range(30, 40))
    session = EngineSession(engine, GREEDY, max_len=64, num_blocks=32)
    (parent,) = session.add(prompt, [0], max_new_tokens=16)
    for _ in range(num_generated):  # prefill + decodes, one step in flight at most
        session.step()
    while parent.num_pending or len(parent.output_ids) < num_generated:
        session.step()
    position = len(prompt) + num_generated
    child = session.fork(parent, position, seed=1, max_new_tokens=6)
    shared = position - 1  # the last prefix id is computed again: its logits give the sample
    num_shared_pages = math.ceil(shared / 4)
    assert child.block_table == parent.block_table[:num_shared_pages]
    bm = session.block_manager
    assert all(bm.ref_counts[b] >= 2 for b in child.block_table)
    run_to_end(session)
    # pages stay shared up to the page the fork writes first: that one is the child's own
    full_pages = shared // 4
    assert child.block_table[:full_pages] == parent.block_table[:full_pages]
    assert child.block_table[full_pages] != parent.block_table[full_pages]
    expected = fresh(engine, parent.token_ids[:position], 6)
    assert child.output_ids == expected
    assert child.output_ids == parent.token_ids[position : position + 6]  # greedy: the same path
    session.release(parent)
    session.release(child)
    session.close()


def test_extend_computes_only_the_new_ids(models, tokenizer):
    engine = PagedEngine(models["qwen2"], tokenizer, block_size=4)
    session = EngineSession(engine, GREEDY, max_len=64, num_blocks=32)
    (first,) = session.add(list(range(50, 59)), [0], max_new_tokens=5)
    run_to_end(session)
    reply = [7, 8, 9]
    prefills_before = session.scheduler.num_prefill_tokens
    second = session.extend(first, reply, seed=0, max_new_tokens=6)
    history = first.token_ids + reply
    assert not first.block_table and second.block_table  # the pages moved over
    run_to_end(session)
    # the history's K/V stayed in the pool: only the reply (and the last sample) is computed
    assert session.scheduler.num_prefill_tokens - prefills_before == len(reply) + 1
    assert second.output_ids == fresh(engine, history, 6)
    session.release(second)
    session.close()


def test_entropy_comes_from_the_sampler_logits(models, tokenizer):
    model = models["qwen2"]
    engine = PagedEngine(model, tokenizer, block_size=4)
    params = SamplingParams(temperature=0.7, ignore_eos=True, seed=3)
    session = EngineSession(engine, params, max_len=64, num_blocks=32)
    prompt = list(range(60, 70))
    (seq,) = session.add(prompt, [5], max_new_tokens=8, entropy_window=3)
    run_to_end(session)
    assert len(seq.entropies) == 3
    with torch.no_grad():
        logits = model(torch.tensor([seq.token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + 2] / 0.7, -1)
    expected = -(logprobs.exp() * logprobs).sum(-1)
    assert seq.entropies == pytest.approx(expected.tolist(), rel=1e-3, abs=1e-4)
    session.release(seq)
    session.close()


def test_a_small_pool_reclaims_parked_pages(models, tokenizer):
    """Finished sequences keep their pages; new work that needs them takes them back."""
    engine = PagedEngine(models["qwen2"], tokenizer, block_size=4)
    session = EngineSession(engine, GREEDY, max_len=64, num_blocks=6)
    (a,) = session.add(list(range(10, 20)), [0], max_new_tokens=6)
    run_to_end(session)
    (b,) = session.add(list(range(20, 30)), [0], max_new_tokens=6)
    run_to_end(session)
    assert session.num_reclaimed >= 1 and not a.block_table
    c = session.extend(a, [3], seed=0, max_new_tokens=4)  # recomputed in full: same tokens
    run_to_end(session)
    assert c.output_ids == fresh(engine, [*a.token_ids, 3], 4)
    for seq in (b, c):
        session.release(seq)
    session.close()
