"""Logprobs in vLLM 0.32's shapes, with the numbers drawn from the sampler's synthetic distribution
(engine_sim/sampler.py): deterministic, and consistent with the text (the emitted token is the
best-ranked one it was allowed to emit).

A position is vLLM's dict for one token: the token itself first (with its rank), then the top k
(`{token_id: (logprob, rank)}`, insertion-ordered; a token in both appears once, first). From it:
- completions (`logprobs: k`): {text_offset, token_logprobs, tokens, top_logprobs}, top_logprobs
  holding the first k + 1 entries of each position keyed by decoded text (vLLM's quirk: k + 1);
- chat (`logprobs: true, top_logprobs: k`): {content: [{token, logprob, bytes, top_logprobs:
  [{token, logprob, bytes}] x the first k entries]}]};
- prompt logprobs (`prompt_logprobs: k`, or `echo` with logprobs): None for the first prompt token,
  then {"token_id": {logprob, rank, decoded_token}} per position.
Prompt positions have their own ranking (the same recipe on a separate stream of the sampler), with
the actual prompt token placed at a rank from 1 to 16 (a pure function of the token and position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

from engine_sim.sampler import MAX_RANKS, Sampler
from protocol.tokenizer import BuiltinTokenizer

__all__ = [
    "MAX_LOGPROBS",
    "Position",
    "chat_logprobs",
    "completion_logprobs",
    "prompt_logprobs_json",
    "prompt_positions",
    "sampled_position",
]

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
_PROMPT_STREAM = 1 << 62  # the sampler choice index prompt rankings are drawn from
_PROMPT_RANKS = 16
_tokenizer = BuiltinTokenizer()

Position = dict[int, tuple[float, int]]


def decoded(token_id: int, as_id: bool = False) -> str:
    """A token as vLLM's logprobs name it: its own decoded text, or `token_id:N`."""
    return f"token_id:{token_id}" if as_id else _tokenizer.decode([token_id])


def sampled_position(sampler: Sampler, index: int, token: int, k: int) -> Position:
    ranked = sampler.logprobs(index, MAX_RANKS)
    rank = next((r for r, (t, _) in enumerate(ranked, 1) if t == token), MAX_RANKS)
    out: Position = {token: (ranked[rank - 1][1], rank)}
    for r, (t, lp) in enumerate(ranked[:k], 1):
        out[t] = (lp, r)
    return out


def prompt_positions(prompt: Sequence[int], k: int) -> list[Position | None]:
    """vLLM's prompt logprobs: nothing for the first token, then each prompt token and the top k."""
    sampler = Sampler(prompt, choice=_PROMPT_STREAM)
    out: list[Position | None] = [None]
    for i in range(1, len(prompt)):
        token = prompt[i]
        rank = 1 + xxhash.xxh3_64_intdigest(token.to_bytes(4, "little"), seed=i) % _PROMPT_RANKS
        others = [t for t in sampler.ranked(i, k + 1) if t != token][:k]
        order = [*others[: rank - 1], token, *others[rank - 1 :]]
        pos: Position = {token: (sampler.rank_logprob(i, rank), rank)}
        for r, t in enumerate(order[:k], 1):
            pos[t] = (sampler.rank_logprob(i, r), r)
        out.append(pos)
    return out


def completion_logprobs(
    tokens: Sequence[int], positions: Sequence[Position | None], k: int, offset: int = 0, as_ids: bool = False
) -> dict[str, Any]:
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    names: list[str] = []
    top: list[dict[str, float] | None] = []
    last_len = 0
    for token, pos in zip(tokens, positions, strict=True):
        name = decoded(token, as_ids)
        names.append(name)
        if pos is None:
            token_logprobs.append(None)
            top.append(None)
        else:
            token_logprobs.append(max(pos[token][0], -9999.0))
            top.append({decoded(t, as_ids): max(lp, -9999.0) for i, (t, (lp, _)) in enumerate(pos.items()) if k >= i})
        text_offset.append(offset if not text_offset else text_offset[-1] + last_len)
        last_len = len(name)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": names, "top_logprobs": top}


def _entry(token: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    name = decoded(token, as_ids)
    return {"token": name, "logprob": max(logprob, -9999.0), "bytes": list(name.encode("utf-8", errors="replace"))}


def chat_logprobs(
    tokens: Sequence[int], positions: Sequence[Position | None], k: int, as_ids: bool = False
) -> dict[str, Any]:
    content = []
    for token, pos in zip(tokens, positions, strict=True):
        if pos is None:
            content.append({**_entry(token, -9999.0, as_ids), "top_logprobs": []})
            continue
        top = [_entry(t, lp, as_ids) for i, (t, (lp, _)) in enumerate(pos.items()) if k and i < k]
        content.append({**_entry(token, pos[token][0], as_ids), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(positions: Sequence[Position | None]) -> list[dict[str, dict[str, Any]] | None]:
    return [
        None
        if pos is None
        else {str(t): {"logprob": lp, "rank": rank, "decoded_token": decoded(t)} for t, (lp, rank) in pos.items()}
        for pos in positions
    ]
