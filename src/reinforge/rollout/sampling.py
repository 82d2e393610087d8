"""Sampling settings: the one place a config's sampling choices become `SamplingParams`.

Training rollouts read `[rollout]`, evaluation `[eval]` (its temperature and top-p); both stop at
the tokenizer's EOS unless `rollout.ignore_eos` (benchmarks force full-length completions).
"""

from __future__ import annotations

from reinforge.data.chat import eos_ids
from reinforge.engine.base import SamplingParams


def sampling_params(
    tokenizer,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    n: int = 1,
    stop_strings: tuple[str, ...] | list[str] = (),
    ignore_eos: bool = False,
    seed: int = 0,
    first_prompt_index: int = 0,
) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        n=n,
        stop_token_ids=() if ignore_eos else tuple(eos_ids(tokenizer)),
        stop_strings=() if ignore_eos else tuple(stop_strings),
        seed=seed,
        ignore_eos=ignore_eos,
        first_prompt_index=first_prompt_index,
    )


def rollout_sampling(rollout, tokenizer, seed: int, first_prompt_index: int = 0) -> SamplingParams:
    """`[rollout]` as sampling settings: `samples_per_prompt` samples of each prompt, each turn
    at most `max_new_tokens`."""
    return sampling_params(
        tokenizer,
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        min_p=rollout.min_p,
        n=rollout.samples_per_prompt,
        stop_strings=rollout.stop_strings,
        ignore_eos=rollout.ignore_eos,
        seed=seed,
        first_prompt_index=first_prompt_index,
    )
