from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.tokenizer import BOS_ID, VOCAB_SIZE, BuiltinTokenizer, apply_chat_template

tok = BuiltinTokenizer()


def test_common_words_are_single_tokens() -> None:
    assert len(tok.encode(" the cache")) == 2


def test_specials_are_recognised() -> None:
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == 258
    assert tok.decode(ids) == "user"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user"


@given(st.text(max_size=200))
def test_any_text_round_trips(text: str) -> None:
    if "<|" in text:
        return
    assert tok.decode(tok.encode(text)) == text


@given(st.lists(st.integers(260, VOCAB_SIZE - 1), max_size=100))
def test_word_ids_round_trip_through_text(ids: list[int]) -> None:
    assert tok.encode(tok.decode(ids)) == ids


def test_encoding_is_deterministic_and_pinned() -> None:
    assert tok.encode("Hello world, the cache") == [72, 101, 108, 108, 111, 364, 44, 260, 403]


def test_out_of_vocabulary_id_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([VOCAB_SIZE])


def test_chat_template_is_chatml() -> None:
    text = apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert BOS_ID not in tok.encode(text)


def test_chat_template_accepts_text_parts_and_refuses_bad_messages() -> None:
    assert "ab" in apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}])
    with pytest.raises(ValueError, match="role"):
        apply_chat_template([{"content": "x"}])
    with pytest.raises(ValueError, match="content"):
        apply_chat_template([{"role": "user", "content": 5}])


def test_every_piece_above_the_bytes_is_ascii_and_unique() -> None:
    """The encoder looks pieces up as str; that is only exact if they are ASCII and distinct."""
    pieces = [tok.piece(i) for i in range(256, VOCAB_SIZE)]
    assert all(p.isascii() for p in pieces)
    assert len(set(pieces)) == len(pieces)
