"""Engine timing profiles: measured latency tables named by WorkerInfo.timing_profile.

A profile name is `{table}:{model}`, e.g. `h200:llama-3.1-8b`: the table is
protocol/profiles/{table}.json (measured on an NVIDIA H200; see profiles/README.md for the
method), the model one of its `models`. Operators of real engines can point
`KVSWITCH_PROFILE_DIR` at a directory of their own tables in the same format.

Interpolation is piecewise linear on the measured grid and linear beyond its edges (prefill time
grows about linearly in new tokens at large sizes; decode in batch x context).
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PROFILE", "TimingProfile", "load_profile", "profile_names"]

DEFAULT_PROFILE = "h200:llama-3.1-8b"
_BUILTIN_DIR = Path(__file__).with_name("profiles")


def _profile_dirs() -> list[Path]:
    extra = os.environ.get("KVSWITCH_PROFILE_DIR")
    return ([Path(extra)] if extra else []) + [_BUILTIN_DIR]


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class _Grid:
    """seconds[row][col] measured at (rows[i], cols[j]); rows and cols ascending."""

    rows: list[float]
    cols: list[float]
    seconds: dict[float, tuple[list[float], list[float]]]  # row -> (cols, seconds) actually measured

    def at(self, row: float, col: float) -> float:
        per_row = [_interp(*self.seconds[r], col) for r in self.rows]
        return _interp(self.rows, per_row, row)


def _grid(points: list[dict[str, Any]], row_key: str, col_key: str) -> _Grid:
    by_row: dict[float, list[tuple[float, float]]] = {}
    for p in points:
        by_row.setdefault(float(p[row_key]), []).append((float(p[col_key]), float(p["seconds"])))
    seconds = {}
    for r, pts in by_row.items():
        pts.sort()
        seconds[r] = ([c for c, _ in pts], [s for _, s in pts])
    rows = sorted(seconds)
    cols = sorted({c for cs, _ in seconds.values() for c in cs})
    return _Grid(rows, cols, seconds)


@dataclass(frozen=True)
class TimingProfile:
    """Latencies of one model on one GPU. All times in seconds, for one engine, unscaled."""

    name: str
    kv_bytes_per_token: int
    _prefill: _Grid
    _decode: _Grid

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prefill of `new_tokens` on top of `cached_tokens` already in the cache (batch 1)."""
        if new_tokens <= 0:
            return 0.0
        return self._prefill.at(cached_tokens, new_tokens)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of `batch` sequences, each over `context_tokens` of cache."""
        if batch <= 0:
            return 0.0
        return self._decode.at(context_tokens, batch)

    def decode_stall_s(self, chunk_tokens: int, cached_tokens: int = 0) -> float:
        """What a prefill chunk adds to a step of running decodes (h200_mixed.json: the standalone
        prefill time minus the weight pass both already share, i.e. minus a 1-token step)."""
        if chunk_tokens <= 0:
            return 0.0
        return max(0.0, self.prefill_s(chunk_tokens, cached_tokens) - self.decode_s(1, cached_tokens or 1))

    def transfer_s(self, tokens: int, gbps: float) -> float:
        """KV of `tokens` moved over a link of `gbps` gigabytes per second."""
        return tokens * self.kv_bytes_per_token / (gbps * 1e9)


@cache
def load_profile(name: str = DEFAULT_PROFILE) -> TimingProfile:
    """`h200:llama-3.1-8b` -> its TimingProfile; ValueError naming the choices for an unknown one."""
    table, _, model = name.partition(":")
    for d in _profile_dirs():
        path = d / f"{table}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            for m in data.get("models", []):
                if m.get("model") == model:
                    return TimingProfile(
                        name=name,
                        kv_bytes_per_token=int(m["kv_bytes_per_token_bf16"]),
                        _prefill=_grid(m["prefill"], "cached_tokens", "new_tokens"),
                        _decode=_grid(m["decode"], "context_tokens", "batch"),
                    )
    raise ValueError(f"unknown timing profile {name!r}; known: {', '.join(profile_names())}")


def profile_names() -> list[str]:
    names: list[str] = []
    for d in _profile_dirs():
        for path in sorted(d.glob("*.json")):
            data = json.loads(path.read_text())
            names += [f"{path.stem}:{m['model']}" for m in data.get("models", []) if "model" in m]
    return names
