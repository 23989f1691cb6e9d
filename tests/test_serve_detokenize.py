"""Serving's incremental detokenisation and stop-string hold-back (`serving.detokenize`), on the smoke
tokenizer (`data/tokenizer`): streamed pieces concatenate to the full decode, one token at a time or
several per event, multi-byte characters split over tokens included; no stop string is ever sent."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.tokenizer import load_tokenizer
from tests.train_runs import ROOT
from valen_jax.serving.detokenize import IncrementalText, StopCut

TEXTS = ["The weather in Wellington is windy", "wéather ☃ in 東京 and Zürich", "a  b\n\n  c\t<0> <1000>"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "data/tokenizer")


def full(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def streamed(tokenizer, ids, per_event: int) -> list[str]:
    text, pieces = IncrementalText(tokenizer), []
    for end in range(per_event, len(ids) + per_event, per_event):
        pieces.append(text.add(ids[:end]))
    pieces.append(text.finish(ids))
    return pieces


@pytest.mark.parametrize("per_event", [1, 3])
def test_pieces_concatenate_to_the_full_decode(tokenizer, per_event):
    rng = np.random.default_rng(0)
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    rows += [rng.integers(0, len(tokenizer), size=40).tolist() for _ in range(20)]
    split = 0
    for ids in rows:
        pieces = streamed(tokenizer, ids, per_event)
        assert "".join(pieces) == full(tokenizer, ids)
        split += sum(1 for p in pieces[:-1] if p == "")
    assert split  # some event held text back (half a character), so the hold-back was exercised


def test_a_multibyte_character_is_never_sent_in_halves(tokenizer):
    ids = tokenizer.encode("☃東京", add_special_tokens=False)
    assert len(ids) > 3  # byte-level pieces: the characters span several tokens
    pieces = streamed(tokenizer, ids, 1)
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == "☃東京"


def test_stop_strings_are_held_back_and_cut():
    cut = StopCut(["STOP", "\n\n"])
    assert cut.feed("hello S") == "hello "  # "S" could start STOP
    assert cut.feed("T") == ""
    assert cut.feed("ay") == "STay"  # not a stop after all: released
    assert cut.feed(" end\n") == " end"
    assert cut.feed("\nmore") == "" and cut.stopped
    assert cut.feed("ignored") == ""
    plain = StopCut([])
    assert plain.feed("abc") == "abc" and plain.feed("d", final=True) == "d"
    tail = StopCut(["xyz"])
    assert tail.feed("ax") == "a" and tail.feed("", final=True) == "x"
