"""Tiny real models for the engine tests: the built-in micro Qwen2 as saved on disk, and random
Qwen3 and Llama models of the same size built from their configs.

Weights are redrawn with a larger scale than the default init, so greedy decoding wanders over
the vocabulary (default-initialised tiny models just repeat their last token), which makes
token-for-token comparisons meaningful.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from reinforge.models.tiny import build_builtin

FAMILIES = ("qwen2", "qwen3", "llama", "llama3_rope")


def scramble(model, seed: int = 0, std: float = 0.2):
    """Redraw every parameter in place: matrices N(0, std), norm weights near 1, biases small."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() >= 2:
                param.copy_(noise * std)
            elif "norm" in name:
                param.copy_(1 + 0.2 * noise)
            else:
                param.copy_(0.2 * noise)
    return model.eval()


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro") / "model"
    build_builtin("micro", 0, path)
    return path


@pytest.fixture(scope="session")
def tokenizer(micro_dir):
    return AutoTokenizer.from_pretrained(micro_dir)


def build_model(family: str, micro_dir, tokenizer, seed: int = 0):
    if family == "qwen2":
        model = AutoModelForCausalLM.from_pretrained(micro_dir, dtype=torch.float32)
    else:
        common = dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
        torch.manual_seed(seed)
        if family == "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, **common))
        elif family == "llama":
            model = LlamaForCausalLM(LlamaConfig(rope_theta=500000.0, **common))
        else:  # Llama 3.1-style scaled RoPE, to check the rope comes from the model's own module
            rope = dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
            model = LlamaForCausalLM(LlamaConfig(rope_parameters=rope, **common))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return scramble(model, seed)


@pytest.fixture(scope="session")
def models(micro_dir, tokenizer):
    """Shared, read-only: tests that change weights build their own with `build_model`."""
    return {family: build_model(family, micro_dir, tokenizer) for family in FAMILIES}


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0):
    """Teacher-forced logprob of each completion token under `model` at `temperature`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def continued_after_stop(engine, prompt: list[int]):
    """A session's sequence that stopped at a stop id and was continued with three more ids
    while the step launched ahead of its finish (which computed its last token) was still in
    flight, run to its end: what the engine recorded for it must cover the whole history."""
    from reinforge.engine.base import SamplingParams
    from reinforge.engine.session import EngineSession

    greedy = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))
    ids = greedy[0][0].token_ids
    # the first id after the first that is new: sampling stops there, a few steps in
    stop = next(t for i, t in enumerate(ids) if i > 0 and t not in ids[:i])
    params = SamplingParams(temperature=0.0, stop_token_ids=(stop,), ignore_eos=True)
    session = EngineSession(engine, params, max_len=64)
    (seq,) = session.add(prompt, seeds=[5], max_new_tokens=8)
    while not seq.is_finished:
        session.step()
    assert seq.output_ids[-1] == stop and seq in session.inflight.batch.seqs
    longer = session.extend(seq, [40, 41, 42], seed=6, max_new_tokens=4)
    while session.has_work():
        session.step()
    session.close()
    return longer
