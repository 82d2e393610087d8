"""Token ids to the text pieces a client sees, and OpenAI's stop-string rule.

A completion's text is the concatenation of its pieces, one per token, so the streamed chunks
and the whole response agree by construction. A token that ends inside a multi-byte character
gets an empty piece; the character appears with the token that completes it.
"""

from __future__ import annotations

_INCOMPLETE = "\ufffd"  # what decode() yields for a partial UTF-8 sequence


def token_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """The text each token adds, decoded in context (with special tokens skipped).

    Each step decodes a short window that starts one token before the emitted text ends, since
    some tokenizers (SentencePiece) decode a token differently at the start of a string.
    """
    pieces: list[str] = []
    prefix = read = 0  # ids[prefix:read] decode to text already emitted
    for end in range(1, len(token_ids) + 1):
        before = tokenizer.decode(token_ids[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[prefix:end], skip_special_tokens=True)
        if after.endswith(_INCOMPLETE) or not after.startswith(before):
            pieces.append("")
            continue
        pieces.append(after[len(before) :])
        prefix, read = read, end
    if read < len(token_ids):  # ends inside a character (cut by max_tokens): emit what decodes
        before = tokenizer.decode(token_ids[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[prefix:], skip_special_tokens=True)
        pieces[-1] = after[len(before) :] if after.startswith(before) else ""
    return pieces


def cut_at_stop(pieces: list[str], stops: tuple[str, ...]) -> list[str] | None:
    """The pieces up to (not including) the first stop string, the last one shortened; None when
    no stop string occurs. OpenAI returns the text before the stop string, without it."""
    text = "".join(pieces)
    found = [i for i in (text.find(s) for s in stops) if i != -1]
    if not found:
        return None
    cut = min(found)
    kept: list[str] = []
    start = 0  # offset of the next piece in the text
    for piece in pieces:
        if start >= cut:
            break
        kept.append(piece[: cut - start])
        start += len(piece)
    return kept
