"""Many completions' texts in one call: what `tokenizer.decode` gives each, decoded together.

A rollout ends with every completion decoded for its reward, while the GPU waits. One
`tokenizer.decode` per completion costs Python work per token (transformers converts the ids,
then calls the Rust tokenizer). A transformers fast tokenizer decodes a batch in one call of its
Rust backend (`decode_batch`). Measured on G1's 256 completions x 512 tokens (the qwen2.5-0.5b
shape's tokenizer): 43-45 ms one at a time, 19-25 ms in one call on this project's 2-core CPU,
25 ms on a 16-core H200 host (s26b). Threads do not help: tokenizers 0.23's `decode_batch` holds
the GIL and runs serially (two threads of 128 rows: 25.7 ms, one call of 256: 24.0 ms, session
26), so this module makes one call (session 25 split it over a thread pool; that bought nothing).

`decode_many` takes that path only where it is the same function as `decode`: a transformers fast
tokenizer whose `decode` / `_decode` are the library's own (not overridden by its class) and
whose `clean_up_tokenization_spaces` is off (then `_decode` is the backend's `decode` and
nothing else). Any other tokenizer decodes one completion at a time, exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

# the modules whose `decode` / `_decode` are transformers' own for fast tokenizers (4.x: _fast;
# 5.x: _tokenizers)
_BASE_MODULES = {"transformers.tokenization_utils_base"}
_FAST_MODULES = {
    "transformers.tokenization_utils_fast",
    "transformers.tokenization_utils_tokenizers",
}


def decode_many(
    tokenizer, ids: Sequence[Sequence[int]], skip_special_tokens: bool = False
) -> list[str]:
    """`[tokenizer.decode(x, skip_special_tokens=...) for x in ids]`, in one backend call where
    that is the same thing (see the module's docstring)."""
    if len(ids) > 1 and batch_decodes_alike(tokenizer):
        rows = [x if isinstance(x, list) else list(x) for x in ids]
        return tokenizer.backend_tokenizer.decode_batch(
            rows, skip_special_tokens=skip_special_tokens
        )
    return [tokenizer.decode(x, skip_special_tokens=skip_special_tokens) for x in ids]


def batch_decodes_alike(tokenizer) -> bool:
    """Whether the backend's `decode_batch` gives what this tokenizer's `decode` gives."""
    cls = type(tokenizer)
    decode, inner = getattr(cls, "decode", None), getattr(cls, "_decode", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (
        backend is not None
        and hasattr(backend, "decode_batch")
        and getattr(decode, "__module__", None) in _BASE_MODULES
        and getattr(inner, "__module__", None) in _FAST_MODULES
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )


def is_byte_level(tokenizer) -> bool:
    """Whether the backend's decoder is byte-level alone (GPT-2's scheme: Qwen, Llama 3,
    DeepSeek): a text is its tokens' bytes, concatenated, read as UTF-8 with each invalid part
    replaced. Then the ids split where the text so far is whole UTF-8 decode as the two parts'
    texts, joined."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


class TextsAhead:
    """The completions' texts, decoded while the device computes: `advance` is called where the
    decode loop would wait for a step (the next one queued behind it), and decodes a few
    sequences' ids at a time; `texts` decodes what is left. G1's 256 x 512 ids took the host
    24-34 ms after the last decode step, with the device idle (s28b).

    A finished sequence is decoded whole. A running one, with a byte-level decoder, in settled
    parts: `chunk` ids or more, kept when their text does not end in U+FFFD (the replacement a
    character cut at the part's end gets; a whole one can still come). Every kept part then ends
    on a character's end, so the next starts on one, and the parts' texts, joined, are the whole
    ids' text. Only where `decode_many` takes the backend's batch path (the same function as
    `decode`); otherwise `advance` does nothing and `texts` is `decode_many`."""

    def __init__(self, tokenizer, seqs: list, per_call: int = 16, chunk: int = 16):
        self.tokenizer, self.seqs = tokenizer, seqs
        self.per_call, self.chunk = per_call, chunk
        self.enabled = batch_decodes_alike(tokenizer)
        self.partial = self.enabled and is_byte_level(tokenizer)
        self.done = [0] * len(seqs)  # ids decoded into `parts`
        self.parts: list[list[str]] = [[] for _ in seqs]
        self.cursor = 0
        self.num_decoded = 0  # ids decoded by `advance`

    def advance(self) -> None:
        """Decode the next `per_call` sequences' finished or settled ids, in one backend call."""
        if not self.enabled or not self.seqs:
            return
        picked: list[tuple[int, int]] = []  # (sequence, end)
        n = len(self.seqs)
        for _ in range(min(self.per_call, n)):
            i = self.cursor
            self.cursor = (i + 1) % n
            seq = self.seqs[i]
            if seq.is_finished:
                end = len(seq.output_ids)
            elif self.partial:
                end = len(seq.output_ids) - seq.num_pending
                if end - self.done[i] < self.chunk:
                    continue
            else:
                continue
            if end > self.done[i]:
                picked.append((i, end))
        if not picked:
            return
        rows = [self.seqs[i].output_ids[self.done[i] : end] for i, end in picked]
        texts = self.tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=True)
        for (i, end), text in zip(picked, texts, strict=True):
            if self.seqs[i].is_finished or not text.endswith("\ufffd"):
                self.parts[i].append(text)
                self.num_decoded += end - self.done[i]
                self.done[i] = end

    def texts(self) -> list[str]:
        """Every sequence's text (all finished): its kept parts and the rest, decoded now."""
        assert all(seq.is_finished for seq in self.seqs)
        rest = decode_many(
            self.tokenizer,
            [seq.output_ids[d:] for seq, d in zip(self.seqs, self.done, strict=True)],
            skip_special_tokens=True,
        )
        return ["".join(parts) + tail for parts, tail in zip(self.parts, rest, strict=True)]
