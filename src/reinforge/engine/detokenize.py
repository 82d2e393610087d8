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

import json
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
    return (_decoder_spec(tokenizer) or {}).get("type") == "ByteLevel"


# Decoders that turn each token into its text alone (the first token may be treated apart:
# WordPiece's missing space, Metaspace's dropped lead), and ByteFallback, which joins a run of
# byte tokens (`<0x..>`) into the characters they spell. After `Fuse` (every text joined into
# one) only a strip of the text's start keeps that.
_TOKENWISE = {"WordPiece", "Metaspace", "Replace", "Strip", "ByteFallback"}


def _decoder_spec(tokenizer) -> dict | None:
    """The backend's decoder as its JSON (`{"type": "none"}` without one: the backend joins
    the tokens with spaces), or None for a tokenizer without a backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return {"type": "none"}
    try:
        return json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None


def _chain(spec: dict) -> list[dict]:
    if spec.get("type") == "Sequence":
        return [d for inner in spec.get("decoders", []) for d in _chain(inner)]
    return [spec]


def is_tokenwise(tokenizer) -> bool:
    """Whether the backend's decoder gives each token's text alone, the first apart (module
    constant `_TOKENWISE`): WordPiece (BERT, the shape models' word tokenizer), SentencePiece's
    Metaspace and Llama 2's replace / byte-fallback / fuse / strip chain. Then ids split after a
    token that is not a byte token decode as the first part's text joined to the second's, the
    second decoded as it would be after any other token (behind an anchor token, cut off)."""
    spec = _decoder_spec(tokenizer)
    if spec is None:
        return False
    fused = False
    for d in _chain(spec):
        kind = d.get("type")
        if kind == "none":
            continue
        if fused:
            if not (kind == "Strip" and d.get("stop", 0) == 0):
                return False
        elif kind == "Fuse":
            fused = True
        elif kind not in _TOKENWISE:
            return False
    return True


class _Parts:
    """How a running sequence's ids are decoded in parts that join to its whole text.

    `bytes` (a byte-level decoder): a part is kept when its text does not end inside a character
    (U+FFFD). Otherwise (`is_tokenwise`): a part is kept when its last token read (special ones
    are skipped) is no byte token (a run of bytes is never cut), and every part after the one
    holding the text's first token is decoded behind `anchor` (a plain token whose text starts
    with a letter or digit), which is then cut off: the part's tokens decode as they do inside
    the whole."""

    def __init__(self, tokenizer, byte_level: bool):
        self.bytes = byte_level
        backend = tokenizer.backend_tokenizer
        self.backend = backend
        self.special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.byte_ids: set[int] = set()
        self.anchor: list[int] = []
        self.anchor_text = ""
        if byte_level:
            return
        for b in range(256):
            i = backend.token_to_id(f"<0x{b:02X}>")
            if i is not None:
                self.byte_ids.add(i)
        for i in range(min(backend.get_vocab_size(), 4096)):
            if i in self.special or i in self.byte_ids:
                continue
            text = backend.decode([i], skip_special_tokens=True)
            if text[:1].isalnum():
                self.anchor, self.anchor_text = [i], text
                return
        raise ValueError("no anchor token")  # (`TextsAhead` then decodes whole texts only)

    def row(self, ids: list[int], started: bool) -> list[int]:
        return self.anchor + ids if started and not self.bytes else ids

    def text(self, decoded: str, started: bool) -> str | None:
        """The part's own text from its decoded row; None when the anchor did not come back as
        it went in (then the sequence is decoded whole at the end)."""
        if not started or self.bytes:
            return decoded
        if not decoded.startswith(self.anchor_text):
            return None
        return decoded[len(self.anchor_text) :]

    def keep(self, text: str, ids: list[int]) -> bool:
        if self.bytes:
            return not text.endswith("\ufffd")
        # the last token read (special ones are skipped: bytes on both sides of one join)
        last = next((i for i in reversed(ids) if i not in self.special), None)
        return last not in self.byte_ids

    def starts(self, ids: list[int]) -> bool:
        """Whether `ids` hold a token the decode reads (not a skipped special one)."""
        return any(i not in self.special for i in ids)


class TextsAhead:
    """The completions' texts, decoded while the device computes: `advance_while` is called where
    the decode loop would wait for a step (the next one queued behind it), and decodes a few
    sequences' ids at a time until the step is done; `texts` decodes what is left. G1's 256 x 512 ids took the host
    24-36 ms after the last decode step, with the device idle (s28b, s29a).

    A finished sequence is decoded whole. A running one in settled parts of `chunk` ids or more
    where the decoder allows it (`_Parts`: byte-level decoders, and token-wise ones such as
    WordPiece and SentencePiece's): the parts' texts, joined, are the whole ids' text. Only where
    `decode_many` takes the backend's batch path (the same function as `decode`); otherwise
    `advance` does nothing and `texts` is `decode_many`."""

    def __init__(self, tokenizer, seqs: list, per_call: int = 16, chunk: int = 16):
        self.tokenizer, self.seqs = tokenizer, seqs
        self.per_call, self.chunk = per_call, chunk
        self.enabled = batch_decodes_alike(tokenizer)
        self.rule = _parts_rule(tokenizer) if self.enabled else None
        self.partial = self.rule is not None
        self.done = [0] * len(seqs)  # ids decoded into `parts`
        self.started = [False] * len(seqs)  # the decoded ids hold a token read (`_Parts`)
        self.parts: list[list[str]] = [[] for _ in seqs]
        self.cursor = 0
        self.num_decoded = 0  # ids decoded by `advance`

    def advance_while(self, ready) -> None:
        """`advance` until `ready()` (the step the loop waits for is done) or nothing is left
        to decode now: the host's time the loop would spend waiting, and none it would not
        (a loop whose host is slower than the device decodes its texts at the end, in one
        call)."""
        while not ready() and self.advance():
            pass

    def advance(self) -> bool:
        """Decode the next `per_call` sequences' finished or settled ids, in one backend call;
        whether a part was kept (a part that ends inside a character is not: its sequence waits
        for more ids)."""
        if not self.enabled or not self.seqs:
            return False
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
            return False
        ids = [self.seqs[i].output_ids[self.done[i] : end] for i, end in picked]
        texts = self._decode([i for i, _ in picked], ids)
        kept = False
        for (i, end), part, text in zip(picked, ids, texts, strict=True):
            if text is None:
                self._forget(i)
            elif self.seqs[i].is_finished or self.rule.keep(text, part):
                self.parts[i].append(text)
                self.num_decoded += end - self.done[i]
                self.done[i] = end
                self.started[i] = self.started[i] or self.rule is None or self.rule.starts(part)
                kept = True
        return kept

    def _decode(self, which: list[int], ids: list[list[int]]) -> list[str | None]:
        """Each `ids[k]`'s text as a part of sequence `which[k]`, in one backend call."""
        rule = self.rule
        if rule is None:  # finished sequences only: each decoded whole
            return self.tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=True)
        started = [self.started[i] for i in which]
        rows = [rule.row(x, s) for x, s in zip(ids, started, strict=True)]
        texts = rule.backend.decode_batch(rows, skip_special_tokens=True)
        return [rule.text(t, s) for t, s in zip(texts, started, strict=True)]

    def _forget(self, i: int) -> None:
        """Sequence i's parts dropped: decoded whole at the end."""
        self.num_decoded -= self.done[i]
        self.done[i], self.started[i], self.parts[i] = 0, False, []

    def texts(self) -> list[str]:
        """Every sequence's text (all finished): its kept parts and the rest, decoded now."""
        assert all(seq.is_finished for seq in self.seqs)
        if not self.enabled or not any(self.done):
            return decode_many(
                self.tokenizer, [seq.output_ids for seq in self.seqs], skip_special_tokens=True
            )
        which = list(range(len(self.seqs)))
        rest = self._decode(which, [s.output_ids[d:] for s, d in zip(self.seqs, self.done)])
        for i, tail in enumerate(rest):
            if tail is None:  # (the anchor lost: this one whole)
                self._forget(i)
                rest[i] = decode_many(
                    self.tokenizer, [self.seqs[i].output_ids], skip_special_tokens=True
                )[0]
        return ["".join(parts) + tail for parts, tail in zip(self.parts, rest, strict=True)]


_RULES: dict[int, tuple[object, _Parts | None]] = {}  # id(tokenizer) -> (tokenizer, rule)


def _parts_rule(tokenizer) -> _Parts | None:
    """The tokenizer's `_Parts`, or None where running sequences are not decoded in parts;
    built once per tokenizer (the anchor's search decodes up to a few thousand single ids)."""
    held = _RULES.get(id(tokenizer))
    if held is not None and held[0] is tokenizer:
        return held[1]
    rule = None
    if is_byte_level(tokenizer):
        rule = _Parts(tokenizer, byte_level=True)
    elif is_tokenwise(tokenizer):
        try:
            rule = _Parts(tokenizer, byte_level=False)
        except ValueError:
            rule = None
    if len(_RULES) >= 16:  # (tokenizers are few; tests make many)
        _RULES.clear()
    _RULES[id(tokenizer)] = (tokenizer, rule)
    return rule
