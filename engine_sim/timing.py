"""How long one engine step takes on an H200, from the measured profiles in `engine_sim/profiles/`.

The model (docs/engine_sim.md states it with its error against the measurements):

- prefill-only step, one chunk of `n` new tokens over `c` cached ones: bilinear interpolation of the
  `prefill[]` table of h200.json in (n, c), linear extrapolation past its edges, and clamped below at
  the table's smallest n (launch overhead is a floor);
- decode-only step of `B` sequences with mean context `ctx`: bilinear interpolation of `decode[]` in
  (B, ctx) (attention cost is linear in context, so the batch mean is what matters);
- mixed step (vLLM's chunked prefill: running decodes plus prefill chunks flattened into one batch):
  the decode step plus each chunk's marginal cost
  `marginal(n, c, B) = a·n + b·n·(c + n/2) + e·B·n`: one GEMM pass per token (a), causal attention
  over the cached and the chunk's own tokens (b), and the cost of widening a batch that already
  holds B decode tokens (e). a, b and e are least-squares fitted to h200_mixed.json, which measured
  exactly these marginals for Llama-3.1-8B. Other models scale the marginal by their prefill-table
  ratio to Llama-3.1-8B at the same (n, c).
- several prefill chunks and no decode: the first chunk as a prefill step, the rest as marginals.

All times are seconds of simulated (H200) time; the server divides them by `--speedup`.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from engine_sim.errors import SimConfigError

__all__ = [
    "PROFILES",
    "MarginalFit",
    "ModelProfile",
    "TimingModel",
    "fit_marginal",
    "load_profile",
]

PROFILES: tuple[str, ...] = ("h200:llama-3.1-8b", "h200:qwen2.5-32b")
_REFERENCE_MODEL = "llama-3.1-8b"  # the model h200_mixed.json measured


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    model: str
    kv_bytes_per_token: int
    params: int
    prefill: tuple[tuple[int, int, float], ...]  # (new_tokens, cached_tokens, seconds)
    decode: tuple[tuple[int, int, float], ...]  # (batch, context_tokens, seconds)


@dataclass(frozen=True, slots=True)
class MarginalFit:
    """marginal(n, c, B) = a·n + b·n·(c + n/2) + e·B·n, seconds."""

    a: float
    b: float
    e: float

    def __call__(self, n: int, c: int, batch: int) -> float:
        return n * (self.a + self.b * (c + n / 2) + self.e * batch)


class _Grid:
    """Bilinear interpolation on a (possibly ragged) grid: x rows, each with its own y points."""

    def __init__(self, points: Sequence[tuple[int, int, float]]) -> None:
        rows: dict[int, list[tuple[int, float]]] = {}
        for x, y, v in points:
            rows.setdefault(y, []).append((x, v))
        self._ys = sorted(rows)
        self._rows = [sorted(rows[y]) for y in self._ys]
        self._xs = [[p[0] for p in r] for r in self._rows]
        self._vs = [[p[1] for p in r] for r in self._rows]
        self._cols: dict[float, list[float]] = {}  # x -> each row's value at x (x repeats a lot)

    @staticmethod
    def _lerp(xs: Sequence[float], vs: Sequence[float], x: float, floor: bool) -> float:
        if x <= xs[0]:
            if floor or len(xs) == 1:
                return vs[0]
            i = 1
        elif x >= xs[-1]:
            i = len(xs) - 1
        else:
            i = bisect.bisect_right(xs, x)
        x0, x1, v0, v1 = xs[i - 1], xs[i], vs[i - 1], vs[i]
        return v0 + (v1 - v0) * (x - x0) / (x1 - x0)

    def __call__(self, x: float, y: float) -> float:
        col = self._cols.get(x)
        if col is None:
            if len(self._cols) > 65536:
                self._cols.clear()
            col = self._cols[x] = [self._lerp(xs, vs, x, floor=True) for xs, vs in zip(self._xs, self._vs, strict=True)]
        if len(col) == 1:
            return col[0]
        # Along y (context) the cost is close to linear, so extrapolate both ways but never below 0.
        return max(0.0, self._lerp(self._ys, col, y, floor=False))


def _read_json(name: str) -> Any:
    return json.loads(resources.files("engine_sim.profiles").joinpath(name).read_text())


@cache
def load_profile(name: str) -> ModelProfile:
    """`h200:llama-3.1-8b` or `h200:qwen2.5-32b` (PROFILES)."""
    if name not in PROFILES:
        raise SimConfigError("profile", name, "allowed values: " + ", ".join(PROFILES))
    gpu, model = name.split(":", 1)
    data = _read_json(f"{gpu}.json")
    for m in data["models"]:
        if m["model"] == model:
            return ModelProfile(
                name=name,
                model=model,
                kv_bytes_per_token=int(m["kv_bytes_per_token_bf16"]),
                params=int(m["params"]),
                prefill=tuple((p["new_tokens"], p["cached_tokens"], p["seconds"]) for p in m["prefill"]),
                decode=tuple((d["batch"], d["context_tokens"], d["seconds"]) for d in m["decode"]),
            )
    raise SimConfigError("profile", name, f"{gpu}.json has no model {model!r}")


def mixed_marginals() -> list[tuple[int, int, int, int, float]]:
    """(batch, context, chunk, cached, measured marginal seconds) from h200_mixed.json: each mixed
    step minus the decode-only step of the same batch and context (which cancels the eager floor)."""
    steps = _read_json("h200_mixed.json")["steps"]
    base = {(s["batch"], s["context_tokens"]): s["seconds"] for s in steps if s["chunk_tokens"] == 0}
    out = []
    for s in steps:
        key = (s["batch"], s["context_tokens"])
        if s["chunk_tokens"] and key in base:
            out.append((*key, s["chunk_tokens"], s["cached_tokens"], s["seconds"] - base[key]))
    return out


@cache
def fit_marginal() -> MarginalFit:
    rows = np.array(mixed_marginals(), dtype=float)
    batch, n, c, y = rows[:, 0], rows[:, 2], rows[:, 3], rows[:, 4]
    design = np.c_[n, n * (c + n / 2), batch * n]
    a, b, e = np.linalg.lstsq(design, y, rcond=None)[0]
    return MarginalFit(float(a), float(b), float(e))


class TimingModel:
    """Step durations for one model profile. Pure functions of the step's shape; no state."""

    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        self._prefill = _Grid(profile.prefill)
        self._decode = _Grid(profile.decode)
        self._fit = fit_marginal()
        self._ref = (
            None if profile.model == _REFERENCE_MODEL else _Grid(load_profile(f"h200:{_REFERENCE_MODEL}").prefill)
        )

    @classmethod
    def for_profile(cls, name: str) -> TimingModel:
        return cls(load_profile(name))

    def prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self._prefill(new_tokens, cached_tokens)

    def decode(self, batch: int, context_tokens: float) -> float:
        return self._decode(batch, context_tokens)

    def marginal(self, new_tokens: int, cached_tokens: int, batch: int) -> float:
        m = self._fit(new_tokens, cached_tokens, batch)
        if self._ref is not None:
            m *= self._prefill(new_tokens, cached_tokens) / self._ref(new_tokens, cached_tokens)
        return max(m, 0.0)

    def step(self, decode_batch: int, decode_context: float, chunks: Sequence[tuple[int, int]]) -> float:
        """One step: `decode_batch` sequences at mean context `decode_context`, plus prefill
        `chunks` of (new_tokens, cached_tokens)."""
        if decode_batch > 0:
            t = self._decode(decode_batch, decode_context)
            for n, c in chunks:
                t += self.marginal(n, c, decode_batch)
            return t
        if not chunks:
            return 0.0
        n0, c0 = chunks[0]
        t = self._prefill(n0, c0)
        for n, c in chunks[1:]:
            t += self.marginal(n, c, 0)
        return t

    def transfer(self, tokens: int, gbytes_per_s: float) -> float:
        """KV transfer of `tokens` tokens over a link of `gbytes_per_s` GB/s."""
        return tokens * self.profile.kv_bytes_per_token / (gbytes_per_s * 1e9)
