"""Token pieces and the stop-string cut, on the built-in byte-level tokenizer."""

from __future__ import annotations

import pytest

from reinforge.models.tiny import build_tokenizer
from reinforge.server.detokenize import cut_at_stop, token_pieces


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("text", ["Hello, world!", "héllo → 日本語 ok", "tail é"])
def test_pieces_concatenate_to_the_decoded_text(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text


def test_a_partial_character_waits_for_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode("aé")  # "é" is two bytes, so two byte-level tokens
    assert token_pieces(tokenizer, ids) == ["a", "", "é"]


def test_special_tokens_add_no_text(tokenizer):
    ids = [*tokenizer.encode("ok"), tokenizer.eos_token_id]
    assert token_pieces(tokenizer, ids) == ["o", "k", ""]


def test_text_cut_inside_a_character_still_shows_what_decodes(tokenizer):
    ids = tokenizer.encode("aé")[:2]
    assert "".join(token_pieces(tokenizer, ids)) == tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        ((",",), ["He", "llo"]),  # the stop string starts a piece
        (("lo",), ["He", "l"]),  # ... or sits inside one: the piece is shortened
        (("wor", "o,"), ["He", "ll"]),  # the earliest of several wins
        (("He",), []),
        (("xyz",), None),
    ],
)
def test_cut_at_stop(stops, expected):
    assert cut_at_stop(["He", "llo", ", wo", "rld"], stops) == expected


def test_cut_keeps_a_partial_character_before_the_stop():
    assert cut_at_stop(["a", "", "é", "!"], ("!",)) == ["a", "", "é"]
