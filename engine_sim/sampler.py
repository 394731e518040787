"""Deterministic "sampling": the token a simulated model emits at each output position, and the
distribution it pretends to have drawn it from.

Output token i of a request is a pure function of (prompt token ids, the request's `seed`, its
choice index among `n`, i), so two identical requests produce identical text (like greedy
decoding), a request recomputed after preemption continues where it was, and the text reads as
words: every id is one of the built-in tokenizer's pieces that starts with a space (ids >=
WORD_MIN, never a special, never EOS). The sim therefore never stops on EOS; it finishes on
`max_tokens` or the context limit ("length"), or on a `stop` string or `stop_token_ids` ("stop").
`ignore_eos` is accepted and has nothing to do.

The distribution behind position i (what logprobs report): a ranked list of distinct word ids
whose first entry is the token `token(i)` returns, with probability p1 in [0.4, 0.95) (a pure
function of the same inputs) and the rest of the mass falling geometrically from rank to rank:
p_r = (1 - p1) * (1 - Q) * Q^(r-2) for r >= 2 (Q = 0.6), so the ranks are strictly ordered and
the probabilities sum to 1. A token that may not be emitted yet (a stop token id before `min_tokens`) is passed
over for the next rank, as a masked logit would be; logprobs still show the raw ranking, as vLLM's
default `raw_logprobs` does.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Sequence
from functools import cache

import xxhash

from protocol.tokenizer import VOCAB_SIZE, BuiltinTokenizer

__all__ = ["MAX_RANKS", "WORD_MIN", "Sampler", "word_ids"]

WORD_MIN = 300
MAX_RANKS = 21  # vLLM's max_logprobs (20) plus the sampled token
_xxh = xxhash.xxh3_64_intdigest
_u64 = struct.Struct("<Q")
_u64x2 = struct.Struct("<QQ")
_PROB_SALT = 0x70726F62  # separates the p1 draw from the rank draws
_Q = 0.6


@cache
def word_ids() -> tuple[int, ...]:
    tok = BuiltinTokenizer()
    return tuple(i for i in range(WORD_MIN, VOCAB_SIZE) if tok.piece(i).startswith(" ") and tok.piece(i)[1:].isalpha())


class Sampler:
    __slots__ = ("_key", "_words")

    def __init__(self, prompt_token_ids: Sequence[int], seed: int | None = None, choice: int = 0) -> None:
        raw = struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)
        key = _xxh(raw, seed=(seed or 0) & 0xFFFF_FFFF_FFFF_FFFF)
        self._key = _xxh(_u64.pack(choice), seed=key) if choice else key
        self._words = word_ids()

    def token(self, index: int) -> int:
        words = self._words
        return words[_xxh(_u64.pack(index), seed=self._key) % len(words)]

    def token_avoiding(self, index: int, banned: Collection[int]) -> int:
        """The best-ranked token of position `index` not in `banned`."""
        return next(t for t in self.ranked(index, MAX_RANKS) if t not in banned)

    def ranked(self, index: int, k: int) -> list[int]:
        """The `k` best tokens of position `index`, best first; the first is `token(index)`."""
        words = self._words
        out = [self.token(index)]
        rank = 1
        while len(out) < k:
            t = words[_xxh(_u64x2.pack(index, rank), seed=self._key) % len(words)]
            rank += 1
            if t not in out:
                out.append(t)
        return out

    def rank_logprob(self, index: int, rank: int) -> float:
        """The logprob of the token ranked `rank` (from 1) at position `index`."""
        p1 = 0.4 + 0.55 * (_xxh(_u64x2.pack(index, _PROB_SALT), seed=self._key) / 2**64)
        if rank == 1:
            return math.log(p1)
        return math.log1p(-p1) + math.log1p(-_Q) + (rank - 2) * math.log(_Q)

    def logprobs(self, index: int, k: int) -> list[tuple[int, float]]:
        """(token, logprob) of the `k` best tokens of position `index`, best first."""
        return [(t, self.rank_logprob(index, r)) for r, t in enumerate(self.ranked(index, k), 1)]
