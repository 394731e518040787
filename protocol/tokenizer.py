"""kvswitch's built-in deterministic tokenizer, shared by engine_sim and the router.

Real deployments pass the model's own tokenizer to the router (`--tokenizer`); tests, the demo and
benchmarks use this one so that no model download is needed and the router and the simulated
engine always agree on token ids.

Vocabulary (VOCAB_SIZE ids, fixed forever since ids are cached and hashed):
- 0..255: raw UTF-8 bytes, so any text encodes;
- 256..259: the specials <|bos|>, <|eos|>, <|im_start|>, <|im_end|>;
- then common English words, each with a leading space;
- then procedural pseudo-words (" ka", " kabe", ...) filling the rest, so any sequence of ids from
  260 up decodes to text that re-encodes to the same ids.

Encoding splits text like GPT-2 (an optional space and a run of word characters, runs of spaces, or
one other character), emits a piece's id when the piece is in the vocabulary and its UTF-8 bytes
otherwise, and recognises the specials. Decoding concatenates the pieces' bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cache

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "BuiltinTokenizer",
    "apply_chat_template",
    "vocabulary_pieces",
]

VOCAB_SIZE = 32000
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 256, 257, 258, 259
SPECIAL_TOKENS = {"<|bos|>": BOS_ID, "<|eos|>": EOS_ID, "<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID}
_COMMON = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will can more other what "
    "about up out them into only some could time these two may first then do any like my now over such "
    "our man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still "
    "see own men work long here get both between life being under never day same another know while "
    "last might us great old year off come since against go came right used take three system model "
    "token cache prefix request router worker decode prefill latency memory block hello world question "
    "answer user assistant please explain why what where data value test"
).split()
_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"
_SPLIT = re.compile(r"<\|(?:bos|eos|im_start|im_end)\|>| ?\w+| +|\s|.", re.DOTALL)


@cache
def vocabulary_pieces() -> tuple[bytes, ...]:
    out: list[bytes] = [bytes([b]) for b in range(256)]
    out += [s.encode() for s in SPECIAL_TOKENS]
    seen = set(out)
    # Only space-led words: then any sequence of word ids decodes to text that re-encodes to it.
    words = [(" " + word).encode() for word in _COMMON]
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    i = 0
    while len(out) < VOCAB_SIZE:
        if words:
            piece = words.pop(0)
        else:
            n, parts = i, []
            while True:
                parts.append(syllables[n % len(syllables)])
                n //= len(syllables)
                if n == 0:
                    break
            piece = (" " + "".join(parts)).encode()
            i += 1
        if piece not in seen:
            seen.add(piece)
            out.append(piece)
    return tuple(out)


@cache
def _index() -> Mapping[str, int]:
    # Keyed by str: every piece from 256 up is ASCII, so no per-piece UTF-8 encode on the hot path.
    return {piece.decode(): i for i, piece in enumerate(vocabulary_pieces()) if i >= 256}


class BuiltinTokenizer:
    """Deterministic, reversible, dependency-free. See the module docstring."""

    name = "kvswitch-builtin"
    vocab_size = VOCAB_SIZE
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self) -> None:
        _index()  # build the vocabulary now (~50 ms), not inside a server's first request

    def encode(self, text: str) -> list[int]:
        get = _index().get
        ids: list[int] = []
        append = ids.append
        for piece in _SPLIT.findall(text):
            tid = get(piece)
            if tid is not None:
                append(tid)
            else:
                ids.extend(piece.encode())
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        pieces = vocabulary_pieces()
        buf = bytearray()
        for tid in ids:
            if not 0 <= tid < VOCAB_SIZE:
                raise ValueError(f"token id {tid} is outside the vocabulary [0, {VOCAB_SIZE})")
            if skip_special and BOS_ID <= tid <= IM_END_ID:
                continue
            buf += pieces[tid]
        return buf.decode("utf-8", errors="replace")

    def piece(self, tid: int) -> str:
        return vocabulary_pieces()[tid].decode("utf-8", errors="replace")


def apply_chat_template(messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True) -> str:
    """ChatML, the template the built-in tokenizer's specials are named after."""
    parts: list[str] = []
    for msg in messages:
        role = msg.get("role")
        content = msg.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError("every message needs a string 'role'")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        if not isinstance(content, str):
            raise ValueError("every message needs a string 'content' (or a list of text parts)")
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
