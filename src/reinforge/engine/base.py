"""The generation interface the trainer, evaluator and server program against.

An engine takes token ids (never text) and returns token ids with the sampler's logprob of each,
so trajectories record exactly what the model saw and produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from reinforge.types import Completion


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1  # completions per prompt
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    ignore_eos: bool = False  # benchmarks force full-length completions
    # Prompt i of this call samples as prompt first_prompt_index + i of a batch split across
    # calls (the ranks of a distributed run): the paged engine keys each sequence's noise by
    # (seed, prompt index, sample index), so the split changes no sample.
    first_prompt_index: int = 0

    def __post_init__(self) -> None:
        assert self.max_new_tokens >= 1 and self.n >= 1 and self.temperature >= 0
        assert self.first_prompt_index >= 0


@dataclass
class GenerationStats:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions, in order."""
        ...

    @property
    def stats(self) -> GenerationStats:
        """Counters of the last `generate` call."""
        ...

    def release_memory(self) -> None:
        """Give back what generation holds besides the weights (the KV pool, decode graphs)
        until the next `generate`, which takes it again: a trainer sharing the device calls
        this before its update."""
        ...
