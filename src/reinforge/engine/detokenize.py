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
