"""`decode_many`: the texts `tokenizer.decode` gives, one backend call where that is the same."""

from __future__ import annotations

import random

import pytest

from reinforge.engine.detokenize import batch_decodes_alike, decode_many
from reinforge.models.shapes import build_word_tokenizer
from reinforge.models.tiny import build_tokenizer


def random_ids(tokenizer, count: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    special = list(tokenizer.all_special_ids)
    out = []
    for _ in range(count):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 60))]
        if ids and rng.random() < 0.5:  # special tokens inside and at the end
            ids.insert(rng.randrange(len(ids)), rng.choice(special))
            ids.append(rng.choice(special))
        out.append(ids)
    return out


@pytest.mark.parametrize("build", [build_tokenizer, lambda: build_word_tokenizer(500)])
@pytest.mark.parametrize("skip", [True, False])
def test_one_backend_call_gives_what_decode_gives(build, skip):
    tokenizer = build()
    assert batch_decodes_alike(tokenizer)  # the fast path is the one under test
    ids = random_ids(tokenizer)
    # byte-level pieces that are not whole UTF-8 characters decode to U+FFFD in both ways
    want = [tokenizer.decode(x, skip_special_tokens=skip) for x in ids]
    assert decode_many(tokenizer, ids, skip_special_tokens=skip) == want
    assert any(want) and len(set(want)) > 1


def test_a_tokenizer_that_cleans_up_spaces_decodes_one_at_a_time():
    tokenizer = build_word_tokenizer(500)
    tokenizer.clean_up_tokenization_spaces = True
    assert not batch_decodes_alike(tokenizer)
    ids = random_ids(tokenizer)
    want = [tokenizer.decode(x) for x in ids]
    assert decode_many(tokenizer, ids) == want


def test_a_class_with_its_own_decode_decodes_one_at_a_time():
    base = type(build_word_tokenizer(10))

    class Shouting(base):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens, **kwargs).upper()

    tokenizer = build_word_tokenizer(500)
    tokenizer.__class__ = Shouting
    assert not batch_decodes_alike(tokenizer)
    ids = random_ids(tokenizer, count=5)
    assert decode_many(tokenizer, ids) == [tokenizer.decode(x) for x in ids]
    assert any(t != t.lower() for t in decode_many(tokenizer, ids))


def test_any_object_with_a_decode_method_works():
    class Letters:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

    assert not batch_decodes_alike(Letters())
    assert decode_many(Letters(), [[0, 1], [], [25]]) == ["ab", "", "z"]


def test_a_forked_child_decodes_too():
    """A child forked after the parent decoded (as env workers and servers fork) decodes the same
    texts, without waiting on anything of the parent's."""
    import multiprocessing

    tokenizer = build_word_tokenizer(500)
    ids = random_ids(tokenizer, count=70)
    want = [tokenizer.decode(x) for x in ids]
    assert decode_many(tokenizer, ids) == want  # the parent decoded first
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        got = pool.apply_async(decode_many, (tokenizer, ids)).get(timeout=60)
    assert got == want
