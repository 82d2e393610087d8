"""The simple engine against HF generate on the built-in micro model (float32)."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reinforge.engine.base import SamplingParams
from reinforge.engine.simple import SimpleEngine
from reinforge.models.tiny import builtin_path

from .conftest import scramble


def micro():
    path = builtin_path("micro", 0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    scramble(model, seed=1)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def test_greedy_equals_hf_generate():
    model, tok = micro()
    prompts = [tok.encode("12+3="), tok.encode("hello there, 7*8"), tok.encode("x")]
    engine = SimpleEngine(model, tok)
    outs = engine.generate(
        prompts, SamplingParams(max_new_tokens=12, temperature=0.0, n=2, ignore_eos=True)
    )
    for prompt, (a, b) in zip(prompts, outs):
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )[0, len(prompt) :].tolist()
        assert a.token_ids == ref and b.token_ids == ref
        assert a.finish_reason == "length" and len(a.logprobs) == 12


def test_logprobs_match_teacher_forcing_and_stop_rules():
    model, tok = micro()
    engine = SimpleEngine(model, tok)
    prompt = tok.encode("abc")
    (outs,) = engine.generate(
        [prompt], SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=5, ignore_eos=True)
    )
    for c in outs:
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        ref = lp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    first = outs[0].token_ids
    stop_id = first[2]
    again = engine.generate(
        [prompt],
        SamplingParams(
            max_new_tokens=8,
            temperature=1.0,
            n=3,
            seed=5,
            stop_token_ids=(stop_id,),
            ignore_eos=True,
        ),
    )[0][0]
    cut = first.index(stop_id) + 1  # same seed, same draws: stops at the first occurrence
    assert again.token_ids == first[:cut] and again.finish_reason == "stop"
    (capped,) = engine.generate(
        [prompt], SamplingParams(max_new_tokens=2, temperature=1.0, seed=5, ignore_eos=True)
    )
    assert len(capped[0].token_ids) == 2 and capped[0].finish_reason == "length"
