"""`decode_many`: the texts `tokenizer.decode` gives, one backend call where that is the same."""

from __future__ import annotations

import random

import pytest

from reinforge.engine.detokenize import TextsAhead, batch_decodes_alike, decode_many, is_byte_level
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


class Growing:
    """A sequence as the decode loop leaves it: committed ids, maybe one pending, finished."""

    def __init__(self, ids: list[int], length: int):
        self.all, self.length = ids, length
        self.output_ids: list[int] = []
        self.num_pending = 0
        self.is_finished = False

    def step(self, t: int) -> None:
        """After step t's commit: t ids committed, step t+1's id pending (until the end)."""
        self.output_ids = list(self.all[: min(t, self.length)])
        self.is_finished = t >= self.length
        self.num_pending = 0 if self.is_finished else 1
        if not self.is_finished:
            self.output_ids.append(-1)  # PENDING: never decoded


def text_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Ids of mixed text (multi-byte characters cut across the one-byte tokens), raw bytes that
    are no UTF-8 and special tokens."""
    words = ["héllo", "日本語", " 🎉", "ok", "\n", "Ωmega", " ", "x"]
    ids: list[int] = []
    while len(ids) < length:
        r = rng.random()
        if r < 0.7:
            ids += tokenizer.encode(rng.choice(words), add_special_tokens=False)
        elif r < 0.9:
            ids.append(rng.randrange(len(tokenizer)))
        else:
            ids.append(rng.choice(tokenizer.all_special_ids))
    return ids[:length]


@pytest.mark.parametrize("build", [build_tokenizer, lambda: build_word_tokenizer(500)])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_texts_decoded_during_the_loop_equal_decode(build, chunk):
    """Sequences of different lengths grow step by step; `advance` runs after every step; the
    texts equal `decode` of the whole ids, cut characters, bad bytes and special tokens alike."""
    tokenizer = build()
    rng = random.Random(chunk)
    seqs = []
    for _ in range(24):
        length = rng.randrange(0, 90)
        ids = (
            text_ids(tokenizer, rng, length)
            if is_byte_level(tokenizer)
            else [rng.randrange(len(tokenizer)) for _ in range(length)]
        )
        seqs.append(Growing(ids, length))
    ahead = TextsAhead(tokenizer, seqs, per_call=5, chunk=chunk)
    assert ahead.partial == is_byte_level(tokenizer)
    for t in range(1, 91):
        for seq in seqs:
            seq.step(t)
        ahead.advance()
    want = [tokenizer.decode(seq.all, skip_special_tokens=True) for seq in seqs]
    assert ahead.texts() == want
    assert any("\ufffd" in w for w in want) == is_byte_level(tokenizer)  # cut bytes were there
    total = sum(seq.length for seq in seqs)
    assert ahead.num_decoded > total // 2  # most were decoded before the end


def test_byte_level_parts_are_kept_only_on_a_characters_end():
    """A part whose text would end inside a character (U+FFFD) waits for its next ids."""
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("a日本", add_special_tokens=False)  # 1 + 3 + 3 one-byte tokens
    seq = Growing(ids, len(ids))
    ahead = TextsAhead(tokenizer, [seq], per_call=1, chunk=1)
    seq.step(3)  # "a" and two bytes of 日
    ahead.advance()
    assert ahead.done == [0] and ahead.parts == [[]]
    seq.step(4)  # 日 whole
    ahead.advance()
    assert ahead.done == [4] and ahead.parts == [["a日"]]
    seq.step(len(ids))
    assert ahead.texts() == ["a日本"]


def test_texts_ahead_does_nothing_where_decode_is_the_tokenizers_own():
    tokenizer = build_word_tokenizer(500)
    tokenizer.clean_up_tokenization_spaces = True  # `decode` is no longer the backend's alone
    seqs = [Growing([5, 6, 7], 3)]
    ahead = TextsAhead(tokenizer, seqs)
    seqs[0].step(3)
    ahead.advance()
    assert not ahead.enabled and ahead.num_decoded == 0
    assert ahead.texts() == [tokenizer.decode([5, 6, 7], skip_special_tokens=True)]
