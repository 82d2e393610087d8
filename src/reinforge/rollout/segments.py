"""An agent episode's token records joined into sequences (segments), never re-rendered.

Records (`server.recording.Record`: one choice of one request, prompt ids and sampled ids) are
taken in the order they finished. A record whose prompt starts with a segment's ids so far (its
prompt and everything after it), token for token, extends that segment: the prompt's ids past
the segment enter with loss mask 0 and logprob 0.0 (tool results, user turns, the template's turn
markers), the sampled ids with mask 1 and their logprobs. Any other record starts a new segment
with its prompt as the segment's prompt.

A request (all its choices) is a history break when its prompt extends no record of an earlier
request: the agent rewrote what it sends (summarised, dropped or edited turns, changed tools).
The further choices of an `n > 1` request start segments of their own without being breaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Segment:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # the last record's
    num_records: int = 0
    text: str = ""  # the last record's visible text

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.ids

    def extend(self, record) -> None:
        between = record.prompt_ids[len(self.prompt_ids) + len(self.ids) :]
        self.ids += between + record.completion_ids
        self.loss_mask += [0] * len(between) + [1] * len(record.completion_ids)
        self.logprobs += [0.0] * len(between) + list(record.logprobs)
        self.finish_reason, self.text = record.finish_reason, record.text
        self.num_records += 1


def assemble(records: list) -> tuple[list[Segment], int]:
    """(the segments of an episode's records, the number of history breaks)."""
    segments: list[Segment] = []
    num_breaks = 0
    seen_breaks: set[int] = set()
    for i, record in enumerate(records):
        target = next(
            (s for s in reversed(segments) if _starts_with(record.prompt_ids, s.all_ids)), None
        )
        if target is None:
            target = Segment(list(record.prompt_ids))
            segments.append(target)
        target.extend(record)
        earlier = [r for r in records[:i] if r.request_index < record.request_index]
        if (
            earlier
            and record.request_index not in seen_breaks
            and not any(_starts_with(record.prompt_ids, r.ids) for r in earlier)
        ):
            seen_breaks.add(record.request_index)
            num_breaks += 1
    return segments, num_breaks


def _starts_with(ids: list[int], prefix: list[int]) -> bool:
    return len(ids) >= len(prefix) and ids[: len(prefix)] == prefix
