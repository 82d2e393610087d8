"""One sequence the paged engine is generating: its tokens, its KV pages and its state.

Plain Python, no tensors. A group is the `n` sequences sampled from one prompt; they share the
prompt's KV pages until each writes its own tokens.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from reinforge.engine.base import SamplingParams

_seq_ids = itertools.count()
PENDING = -1  # an output token sampled on the device and not read back yet


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # no KV in the pool: (re)computed by a prefill
    RUNNING = enum.auto()  # KV of all tokens but the last is in the pool
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    group_id: int = 0
    sample_index: int = 0  # which of the group's n samples
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # sampler logprob of each output id
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # physical page of each logical page
    num_cached_tokens: int = 0  # leading tokens whose K/V is written in the pool
    finish_reason: str | None = None
    sample_seed: int = 0  # key of the sampler's draws (`sampling.row_uniform`)
    num_pending: int = 0  # trailing output tokens still `PENDING` (a step in flight)
    # pages outlive the finish (a session continues or forks the sequence; it frees them)
    keep_pages: bool = False
    # the sampler's entropy of each of the first `entropy_window` output positions, read from the
    # logits it samples from (no extra forward)
    entropy_window: int = 0
    entropies: list[float] = field(default_factory=list)
    # routing replay: the experts each computed position was routed to (`moe.RouteRecord`), when
    # the engine records them
    routes: Any = None
    # the trainer's records: which host row holds each computed position's residual streams
    # (`records.HiddenRows`), when the engine keeps them
    hidden: Any = None

    def __post_init__(self) -> None:
        assert self.prompt_ids, "an empty prompt has no position to sample from"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int, logprob: float) -> None:
        self.output_ids.append(token_id)
        self.logprobs.append(logprob)

    def slot(self, position: int, block_size: int) -> int:
        """Flat index into the pool (`page * block_size + offset`) of the token at `position`."""
        return self.block_table[position // block_size] * block_size + position % block_size


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size
