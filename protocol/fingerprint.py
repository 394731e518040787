"""Tokenizer fingerprints: how a router knows its tokenizer is the one a worker's engine uses.

Both sides tokenize the same fixed probes and hash the ids: the shim through its engine (vLLM's
`/tokenize`, once with `PROBE_TEXT` and once with `PROBE_MESSAGES` through the chat template), the
router through its own tokenizer. Equal fingerprints mean equal ids for the probes' mix of ASCII,
digits, whitespace runs, accents, CJK and emoji, and the same chat template; engine_sim's built-in
vocabulary advertises `BUILTIN` instead. The probes are fixed forever: changing them changes every
fingerprint.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import cache

import xxhash

from protocol.tokenizer import BuiltinTokenizer, apply_chat_template

__all__ = ["BUILTIN", "PROBE_MESSAGES", "PROBE_TEXT", "builtin_fingerprint", "fingerprint"]

BUILTIN = "builtin"
PROBE_TEXT = (
    "kvswitch tokenizer probe: The quick brown fox jumps over the lazy dog 0123456789.\n"
    "  Indented\ttabs, URLs https://example.com/a?b=c&d=e, café naïve Ünïcödé, 東京の天気, "
    "emoji 🚀🔥, code `def f(x): return x**2` and <tags></tags>."
)
PROBE_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "Say hello, 世界!"},
)
_SEED = 0x6B76737769746368


def fingerprint(text_ids: Sequence[int], chat_ids: Sequence[int] | None) -> str:
    """`tok-` and 16 hex digits over the probe text's ids and, when the tokenizer has a chat
    template, the probe messages' ids (None: no template)."""
    h = xxhash.xxh3_64(seed=_SEED)
    h.update(struct.pack(f"<I{len(text_ids)}I", len(text_ids), *text_ids))
    if chat_ids is not None:
        h.update(struct.pack(f"<I{len(chat_ids)}I", len(chat_ids), *chat_ids))
    return f"tok-{h.hexdigest()}"


@cache
def builtin_fingerprint() -> str:
    """The fingerprint of protocol.tokenizer's built-in vocabulary, computed the way an engine's
    `/tokenize` is probed: the probe text as a prompt, the probe messages through its chat template
    with the generation prompt. A worker whose engine yields this advertises `BUILTIN` instead."""
    tok = BuiltinTokenizer()
    chat = apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True)
    return fingerprint(tok.encode(PROBE_TEXT), tok.encode(chat))
