"""Sampling through the paged engine: the right distribution, the right logprobs, seeded
reproducibility, and every stop rule."""

from __future__ import annotations

import importlib.util
import math

import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine

from .conftest import hf_greedy, hf_logprobs

PROMPTS = [[5, 6, 7], list(range(20, 37))]


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper critical value at p = 0.001 (Wilson-Hilferty), when scipy is absent."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_first_token_follows_the_target_distribution(models, tokenizer):
    model, prompt = models["qwen2"], PROMPTS[1]
    temperature, top_k, n = 0.8, 6, 4000
    engine = PagedEngine(model, tokenizer, block_size=4, max_num_seqs=n)
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, n=n, seed=7)
    (completions,) = engine.generate([prompt], params)

    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits / temperature, -1)
    support = logprobs.topk(top_k).indices.tolist()
    target = torch.softmax(logprobs[support].double(), -1)
    first = [c.token_ids[0] for c in completions]
    assert set(first) <= set(support)
    observed = torch.tensor([first.count(t) for t in support], dtype=torch.float64)
    expected = target * n
    assert expected.min() > 5, "the test needs every cell populated"
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    if importlib.util.find_spec("scipy") is not None:
        from scipy.stats import chi2

        assert chi2.sf(statistic, top_k - 1) > 1e-3, (observed, expected)
    else:
        assert statistic < chi_square_critical(top_k - 1), (observed, expected)
    # the logprob is the sampled id's under the temperature, before top-k filtering
    got = torch.tensor([c.logprobs[0] for c in completions])
    torch.testing.assert_close(got, logprobs[torch.tensor(first)], atol=1e-5, rtol=0)


def test_sampled_logprobs_match_teacher_forcing_and_seed_reproduces(models, tokenizer):
    model = models["qwen3"]
    engine = PagedEngine(model, tokenizer, block_size=4)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, n=4, seed=1, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    for prompt, group in zip(PROMPTS, outputs):
        assert len({tuple(c.token_ids) for c in group}) > 1, "samples of a group should differ"
        for completion in group:
            ref = hf_logprobs(model, prompt, completion.token_ids, temperature=0.7)
            torch.testing.assert_close(torch.tensor(completion.logprobs), ref, atol=1e-4, rtol=0)
    again = engine.generate(PROMPTS, params)
    other = engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 2}))
    token_ids = lambda out: [[c.token_ids for c in g] for g in out]  # noqa: E731
    assert token_ids(again) == token_ids(outputs) != token_ids(other)


def test_stop_ids_strings_eos_and_max_tokens(models, tokenizer):
    model, prompt = models["llama"], PROMPTS[1]
    engine = PagedEngine(model, tokenizer, block_size=4)
    greedy = dict(temperature=0.0, max_new_tokens=16)
    full = hf_greedy(model, prompt, 16)
    assert tokenizer.eos_token_id not in full  # so the runs below stop where we ask

    (capped,) = engine.generate([prompt], SamplingParams(**{**greedy, "max_new_tokens": 5}))
    assert capped[0].token_ids == full[:5] and capped[0].finish_reason == "length"

    stop_id = full[6]
    (by_id,) = engine.generate([prompt], SamplingParams(**greedy, stop_token_ids=(stop_id,)))
    cut = full.index(stop_id) + 1
    assert by_id[0].token_ids == full[:cut] and by_id[0].finish_reason == "stop"

    index = next(i for i in range(3, 16) if tokenizer.decode(full[i : i + 1]).isalnum())
    stop = tokenizer.decode(full[index : index + 1])
    (by_str,) = engine.generate([prompt], SamplingParams(**greedy, stop_strings=(stop,)))
    got = by_str[0].token_ids
    assert got == full[: len(got)] and by_str[0].finish_reason == "stop"
    assert stop in tokenizer.decode(got) and stop not in tokenizer.decode(got[:-1])

    eos_tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    eos_tokenizer.eos_token = tokenizer.convert_ids_to_tokens(full[4])
    eos_engine = PagedEngine(model, eos_tokenizer, block_size=4)
    (by_eos,) = eos_engine.generate([prompt], SamplingParams(**greedy))
    assert by_eos[0].token_ids == full[: full.index(full[4]) + 1]
    assert by_eos[0].finish_reason == "stop"
    (ignored,) = eos_engine.generate([prompt], SamplingParams(**greedy, ignore_eos=True))
    assert ignored[0].token_ids == full and ignored[0].finish_reason == "length"
