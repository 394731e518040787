"""Mooncake-format traces and the token synthesis that turns them (and synthetic workloads) into prompts.

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`: one
hash id per 512-token block; equal ids are equal tokens, so requests with equal leading ids share a
prefix. Prompts are described here as *segments*, `(segment id, length)` pairs: a segment id always
expands to the same token stream (a PCG64 generator seeded with the synthesis seed and the id, ids in
[260, 32000) so every token is a word of the built-in tokenizer), cut to the length asked. Because the
stream of an id does not depend on the length, a segment cut short is a prefix of the same segment
at full length, and equal ids at equal positions give identical token blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import msgspec
import numpy as np

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TOKEN_HIGH",
    "TOKEN_LOW",
    "Segment",
    "TokenSynth",
    "TraceError",
    "TraceRecord",
    "load_trace",
    "selected_records",
    "shipped_trace",
]

MOONCAKE_BLOCK_TOKENS = 512
TOKEN_LOW, TOKEN_HIGH = 260, 32000  # after the 256 byte tokens and 4 specials; below VOCAB_SIZE
Segment = tuple[int, int]  # (segment id, number of tokens)


class TraceError(ValueError):
    """A trace file that cannot be replayed; names the file and line."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{path}:{line}: {reason}")


class _RawRecord(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace. `arrival_s` is the timestamp in seconds from the trace's start."""

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def segments(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS, max_input_len: int | None = None) -> list[Segment]:
        """The prompt as segments: one per hash id of `block_tokens` tokens, the last cut so the
        prompt is `input_length` scaled by `block_tokens / 512` (exact at 512), then cut to at
        most `max_input_len` tokens (leading blocks kept, so prefix sharing survives)."""
        scale = block_tokens / MOONCAKE_BLOCK_TOKENS
        total = min(max(1, round(self.input_length * scale)), block_tokens * len(self.hash_ids))
        if max_input_len is not None:
            total = min(total, max_input_len)
        out: list[Segment] = []
        for hash_id in self.hash_ids:
            if total <= 0:
                break
            take = min(block_tokens, total)
            out.append((hash_id, take))
            total -= take
        return out


def load_trace(
    path: str | Path, *, limit: int | None = None, duration_s: float | None = None, start_s: float = 0.0
) -> list[TraceRecord]:
    """Read a Mooncake JSONL trace, in file order. `start_s`/`duration_s` select a time window and
    `limit` the first N requests of it; arrivals are rebased so the first selected one is at 0."""
    decoder = msgspec.json.Decoder(_RawRecord)
    records: list[TraceRecord] = []
    previous = -math.inf
    try:
        with Path(path).open("rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    raw = decoder.decode(line)
                except msgspec.DecodeError as exc:
                    raise TraceError(path, lineno, f"not a Mooncake record ({exc})") from exc
                _check(raw, path, lineno, previous)
                previous = raw.timestamp
                arrival = raw.timestamp / 1000.0
                if arrival < start_s:
                    continue
                if duration_s is not None and arrival >= start_s + duration_s:
                    break
                if limit is not None and len(records) >= limit:
                    break
                records.append(TraceRecord(arrival, raw.input_length, raw.output_length, tuple(raw.hash_ids)))
    except OSError as exc:  # a file not there or not readable
        raise ValueError(f"--trace {path}: {exc.strerror or exc}") from None
    if records:
        first = records[0].arrival_s
        records = [TraceRecord(r.arrival_s - first, r.input_length, r.output_length, r.hash_ids) for r in records]
    return records


def selected_records(
    path: str | Path, *, limit: int | None = None, duration_s: float | None = None, start_s: float = 0.0
) -> list[TraceRecord]:
    """load_trace's records, refused (ValueError) where none is selected: saying whether the file
    has none (no flag could select from it) or the --start/--duration/--limit window is empty."""
    records = load_trace(path, limit=limit, duration_s=duration_s, start_s=start_s)
    if not records:
        if not load_trace(path, limit=1):
            raise ValueError(f"no records in the trace file {path}")
        raise ValueError("the trace selection is empty (check --start/--duration/--limit)")
    return records


def _check(raw: _RawRecord, path: str | Path, lineno: int, previous: float) -> None:
    if raw.timestamp < 0:  # before the trace's start: it was dropped with no word, as before --start
        raise TraceError(path, lineno, f"timestamp {raw.timestamp:g} must be >= 0 (ms from the trace's start)")
    if raw.timestamp < previous:
        raise TraceError(path, lineno, f"timestamp {raw.timestamp} goes back in time (previous {previous})")
    if raw.output_length < 1:
        raise TraceError(path, lineno, f"output_length {raw.output_length} must be >= 1")
    if not raw.hash_ids:
        raise TraceError(path, lineno, "hash_ids is empty")
    if min(raw.hash_ids) < 0:
        raise TraceError(path, lineno, "hash_ids must be >= 0")
    blocks = len(raw.hash_ids)
    if not MOONCAKE_BLOCK_TOKENS * (blocks - 1) < raw.input_length <= MOONCAKE_BLOCK_TOKENS * blocks:
        raise TraceError(
            path, lineno, f"input_length {raw.input_length} does not fit {blocks} blocks of {MOONCAKE_BLOCK_TOKENS}"
        )


def shipped_trace() -> Path:
    """The Mooncake synthetic trace shipped with the package (see bench/traces/README.md)."""
    return Path(str(resources.files("bench") / "traces" / "mooncake_synthetic_trace.jsonl"))


class TokenSynth:
    """Expands segments to token ids, deterministically for a given `seed`.

    Streams are cached per id (least recently used first out, `cache_ids` of them) because a trace
    reuses most of its blocks; each stream is drawn at the longest length asked so far. `expand`
    keeps each stream also as a list of shared int objects, so a prompt is built by copying
    pointers and all prompts share one int object per token id (a full trace's prompts would
    otherwise allocate an int per token)."""

    def __init__(self, seed: int = 0, cache_ids: int = 8192) -> None:
        if seed < 0:
            raise ValueError(f"synthesis seed must be >= 0, got {seed}")
        self.seed = seed
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lists: dict[int, list[int]] = {}  # the cached streams as lists, same ids
        self._cache_ids = cache_ids

    def stream(self, segment_id: int, length: int) -> np.ndarray:
        """The first `length` tokens of the stream of `segment_id` (int32)."""
        if segment_id < 0 or length < 0:
            raise ValueError(f"segment ({segment_id}, {length}): id and length must be >= 0")
        cached = self._cache.get(segment_id)
        if cached is not None and len(cached) >= length:
            self._cache.move_to_end(segment_id)
            return cached[:length]
        rng = np.random.default_rng([self.seed, segment_id])
        drawn = rng.integers(TOKEN_LOW, TOKEN_HIGH, size=length, dtype=np.int32)
        self._cache[segment_id] = drawn
        self._lists.pop(segment_id, None)
        self._cache.move_to_end(segment_id)
        while len(self._cache) > self._cache_ids:
            gone, _ = self._cache.popitem(last=False)
            self._lists.pop(gone, None)
        return drawn

    def _list(self, segment_id: int, length: int) -> list[int]:
        cached = self._lists.get(segment_id)
        if cached is not None and len(cached) >= length:
            self._cache.move_to_end(segment_id)
            return cached
        drawn = self.stream(segment_id, length)
        full = self._cache[segment_id]
        out = self._lists[segment_id] = list(map(_INTS.__getitem__, full.tolist()))
        return out if len(drawn) == len(full) else out[: len(drawn)]

    def expand(self, segments: Sequence[Segment]) -> list[int]:
        out: list[int] = []
        for sid, n in segments:
            tokens = self._list(sid, n)
            out += tokens if len(tokens) == n else tokens[:n]
        return out


_INTS: list[int] = list(range(TOKEN_HIGH))
