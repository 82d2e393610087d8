"""`decode_many`: the texts `tokenizer.decode` gives, one backend call where that is the same."""

from __future__ import annotations

import random

import pytest

from reinforge.engine.detokenize import (
    TextsAhead,
    batch_decodes_alike,
    decode_many,
    is_byte_level,
    is_tokenwise,
)
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


def grow_and_decode(tokenizer, ahead: TextsAhead, seqs: list[Growing], steps: int) -> list[str]:
    """`steps` decode steps with `advance` after each; the texts equal `decode` of the whole
    ids (asserted), which are returned."""
    for t in range(1, steps + 1):
        for seq in seqs:
            seq.step(t)
        ahead.advance()
    want = [tokenizer.decode(seq.all, skip_special_tokens=True) for seq in seqs]
    assert ahead.texts() == want
    return want


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
    assert ahead.partial  # byte-level (the tiny tokenizer) and token-wise (the word one)
    want = grow_and_decode(tokenizer, ahead, seqs, 90)
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


def decoder_tokenizer(decoder):
    """A fast tokenizer over words, WordPiece and SentencePiece pieces, byte tokens (`<0x..>`)
    and special tokens, with `decoder` (None: the backend joins the tokens with spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "the",
        "##ing",
        "##s",
        "\u2581the",
        "\u2581cat",
        "\u2581",
        "ab",
        ".",
        "\u2581.",
        ",",
        "'",
    ]
    vocab = {w: i for i, w in enumerate(words)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    vocab.update({"[UNK]": len(vocab), "[PAD]": len(vocab) + 1, "[EOS]": len(vocab) + 2})
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if decoder is not None:
        core.decoder = decoder
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def decoders_by_name():
    from tokenizers import decoders

    return {
        "wordpiece": decoders.WordPiece(prefix="##", cleanup=True),
        "metaspace": decoders.Metaspace(),
        # Llama 2's
        "sentencepiece": decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        ),
        "none": None,
        "ctc": decoders.CTC(),  # joins repeats: no parts
        "bpe": decoders.BPEDecoder(),  # the last token's suffix apart: no parts
        # a replace over the joined text: its pattern may span two parts
        "fuse-replace": decoders.Sequence([decoders.Fuse(), decoders.Replace("the", "THE")]),
    }


@pytest.mark.parametrize("name", list(decoders_by_name()))
@pytest.mark.parametrize("chunk", [1, 4])
def test_token_wise_decoders_parts_join_to_the_whole_text(name, chunk):
    """Running sequences decoded in parts (behind an anchor token after the first) give
    `decode`'s text: leading spaces and pieces, WordPiece's glued subwords, runs of byte tokens
    (whole characters and invalid UTF-8 alike) and special tokens at any place, the first
    token read included. Decoders whose tokens' texts depend on their neighbours (CTC, BPE's
    last token, a replace over the joined text) decode whole sequences only."""
    tokenizer = decoder_tokenizer(decoders_by_name()[name])
    assert batch_decodes_alike(tokenizer)
    tokenwise = name not in {"ctc", "bpe", "fuse-replace"}
    assert is_tokenwise(tokenizer) == tokenwise
    special = list(tokenizer.all_special_ids)
    utf8 = [b for ch in "日本é" for b in ch.encode()]
    rng = random.Random(chunk)
    seqs = []
    for _ in range(30):
        ids: list[int] = []
        length = rng.randrange(0, 70)
        if rng.random() < 0.3:
            ids += [rng.choice(special) for _ in range(rng.randrange(1, 4))]  # specials first
        while len(ids) < length:
            r = rng.random()
            if r < 0.15:  # a run of byte tokens: characters, or bytes no UTF-8 reads
                run = utf8[: rng.randrange(1, len(utf8))] if r < 0.1 else [0xFF, 0x80]
                ids += [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in run]
            elif r < 0.25:
                ids.append(rng.choice(special))
            else:
                ids.append(rng.randrange(11))
        seqs.append(Growing(ids[:length], length))
    ahead = TextsAhead(tokenizer, seqs, per_call=7, chunk=chunk)
    assert ahead.partial == tokenwise
    want = grow_and_decode(tokenizer, ahead, seqs, 70)
    assert len(set(want)) > 10
    if tokenwise:
        assert any(len(parts) > 2 for parts in ahead.parts)  # in parts, not whole at the end
        assert ahead.num_decoded > sum(seq.length for seq in seqs) // 2


def test_a_run_of_byte_tokens_is_never_cut():
    """A part ending on a byte token waits for its next ids: the run's bytes may spell one
    character with the bytes that follow."""
    tokenizer = decoder_tokenizer(decoders_by_name()["sentencepiece"])
    byte = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "日".encode()]
    ids = [4, *byte, 3]  # "▁cat", 日's three bytes, "▁the"
    seq = Growing(ids, len(ids))
    ahead = TextsAhead(tokenizer, [seq], per_call=1, chunk=1)
    seq.step(3)  # "▁cat" and two of the bytes
    ahead.advance()
    assert ahead.done == [0]
    seq.step(4)
    ahead.advance()  # the run's last byte is still a byte token: its run may go on
    assert ahead.done == [0]
    seq.step(5)
    ahead.advance()
    assert ahead.done == [5] and ahead.parts == [["cat日 the"]]
    assert ahead.texts() == ["cat日 the"] == [tokenizer.decode(ids)]


def test_advance_while_decodes_only_while_the_step_is_not_done():
    """The loop's wait: nothing when the step is done already (a host slower than the device
    decodes at the end, in one call); while it is not, part after part until nothing is left
    to decode, then it returns."""
    tokenizer = build_word_tokenizer(500)
    rng = random.Random(3)
    seqs = [Growing([rng.randrange(490) for _ in range(40)], 40) for _ in range(12)]
    ahead = TextsAhead(tokenizer, seqs, per_call=3, chunk=4)
    for seq in seqs:
        seq.step(20)
    ahead.advance_while(lambda: True)  # done: the host goes straight on
    assert ahead.num_decoded == 0
    polls = []

    def busy_for(n):
        def ready():
            polls.append(1)
            return len(polls) > n

        return ready

    ahead.advance_while(busy_for(2))  # two calls of 3 sequences, then the step is done
    assert len(polls) == 3 and sorted(ahead.done) == [0] * 6 + [20] * 6
    polls.clear()
    ahead.advance_while(busy_for(10**6))  # never done: returns when nothing is left
    assert sorted(ahead.done) == [20] * 12 and len(polls) < 10
    for seq in seqs:
        seq.step(40)
    assert ahead.texts() == [tokenizer.decode(seq.all, skip_special_tokens=True) for seq in seqs]


def test_advance_while_returns_when_a_part_waits_for_a_characters_end():
    """A part that ends inside a character is not kept: with the step never done, the loop
    returns instead of decoding that part again and again."""
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("ab日", add_special_tokens=False)  # 2 + 3 one-byte tokens
    seq = Growing(ids, len(ids))
    ahead = TextsAhead(tokenizer, [seq], per_call=1, chunk=1)
    seq.step(4)  # "ab" and two bytes of 日
    ahead.advance_while(lambda: False)
    assert ahead.done == [0]
    seq.step(len(ids))
    assert ahead.texts() == ["ab日"]
