"""Deterministic "sampling": the token a simulated model emits at each output position.

Output token i of a request is a pure function of (prompt token ids, the request's `seed`, i), so
two identical requests produce identical text (like greedy decoding), a request recomputed after
preemption continues where it was, and the text reads as words: every id is one of the built-in
tokenizer's pieces that starts with a space (ids >= WORD_MIN, never a special, never EOS). The
sim therefore never stops on EOS; it finishes on `max_tokens` or the context limit ("length"),
or on a `stop` string or `stop_token_ids` ("stop"). `ignore_eos` is accepted and has nothing to do.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import cache

import xxhash

from protocol.tokenizer import VOCAB_SIZE, BuiltinTokenizer

__all__ = ["WORD_MIN", "Sampler", "word_ids"]

WORD_MIN = 300
_xxh = xxhash.xxh3_64_intdigest
_u64 = struct.Struct("<Q")


@cache
def word_ids() -> tuple[int, ...]:
    tok = BuiltinTokenizer()
    return tuple(i for i in range(WORD_MIN, VOCAB_SIZE) if tok.piece(i).startswith(" ") and tok.piece(i)[1:].isalpha())


class Sampler:
    __slots__ = ("_key", "_words")

    def __init__(self, prompt_token_ids: Sequence[int], seed: int | None = None) -> None:
        raw = struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)
        self._key = _xxh(raw, seed=(seed or 0) & 0xFFFF_FFFF_FFFF_FFFF)
        self._words = word_ids()

    def token(self, index: int) -> int:
        words = self._words
        return words[_xxh(_u64.pack(index), seed=self._key) % len(words)]
