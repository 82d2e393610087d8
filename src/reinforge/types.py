"""The few dataclasses shared across layers: tasks, completions, trajectories, batches.

Token-in/token-out: a trajectory holds the exact ids the model was given and produced, with the
sampler's logprob for each produced id. The trainer never re-tokenizes text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCallRecord:
    """A tool call of a recorded assistant message (OpenAI format): the function's name, its
    arguments as a dict, and the call's id when the data gives one."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    # Recorded conversations only (SFT data in the OpenAI format): an assistant message's tool
    # calls, and the id of the call a tool message answers. Generated turns keep their calls in
    # `content`, as the model wrote them.
    tool_calls: tuple[ToolCallRecord, ...] = ()
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The chat template's message (HF's format: tool-call arguments as a dict)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "type": "function",
                    **({"id": c.id} if c.id is not None else {}),
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class Task:
    """One verifiable problem: the prompt messages, the answer a reward checks, and optionally a
    reference solution (the response text SFT trains on)."""

    id: str
    messages: tuple[Message, ...]
    answer: str
    solution: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    logprobs: list[float]  # sampler logprob of each token in token_ids
    finish_reason: str  # "stop" (stop id or string) or "length" (max_new_tokens)
    text: str = ""
    # Multi-turn episodes: 1 where the sampler produced the id, 0 on env ids (tool outputs, game
    # boards), whose logprobs are 0.0 and which stay out of the loss. None: every id is sampled.
    loss_mask: list[int] | None = None
    # Routing replay (a mixture-of-experts model, `algorithm.routing_replay`): the experts the
    # engine routed each of the first P positions of prompt + token_ids to, a numpy integer array
    # [P, sparse layers, k] (uint8 up to 256 experts); P = every position whose output predicts a
    # sampled token. None when not recorded.
    routes: Any = None
    # The engine's records of this sequence's residual streams (`engine.records.HiddenRows`: the
    # host rows of every position of prompt + token_ids but the last), for the update's
    # forward; None when not recorded.
    hidden: Any = None


@dataclass
class Trajectory:
    """A prompt, one completion of it, and what it earned."""

    task: Task
    prompt_ids: list[int]
    completion: Completion
    reward: float = 0.0
    is_correct: bool = False
    advantage: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)  # components of `reward` (env tasks)
    metrics: dict[str, float] = field(default_factory=dict)  # episode counters (env tasks)
    # Branched episodes under hard attribution (rollout.branching): the leading completion tokens
    # this trajectory shares with each member of its group, in group order (-1: itself)
    shared_tokens: tuple[int, ...] = ()
    # An agent's episode whose history was rewritten becomes several sequences (rollout/agents.py):
    # this one's index among them; 0 for the first, or the only one
    segment: int = 0

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion.token_ids)


@dataclass
class Group:
    """The n trajectories sampled from one prompt; group-relative advantages live here."""

    task: Task
    trajectories: list[Trajectory]
