"""The engine timing model: how long one engine step takes. One model, two users: engine_sim charges
it for every step it runs, and the router's ttft_model policy predicts with the same functions.

Profiles. A name `{table}:{model}` (WorkerInfo.timing_profile, `--profile`) names the table
`protocol/profiles/{table}.json` and one of its `models`; `{table}:{model}@{S}x` (`TimingModel.for_profile`
and the names a shim registers, not `load_profile` or a sim's `--profile`) is that profile on an
engine S times as fast, every time divided by S: what a sim at `--speedup S` runs, and what `kvswitch
up` registers for it (`speed_profile`), so that routers predict its real speed. Only a name ending in `@`,
a plain decimal number (ASCII digits, at most one `.`) and `x` has a speed-up, and one only: a table or
model may have an `@` of its own (`h200@lab:llama-3.1-8b@10x`); S is in MIN_SPEEDUP..MAX_SPEEDUP
(0.001..1000000: `check_speedup`). `KVSWITCH_PROFILE_DIR` adds a directory
searched first, for operators' own tables in the same format (`load_profile` refuses a table the
model cannot use, naming the file and the key: `kv_bytes_per_token_bf16` must be >= 1, and every
row of a grid, the points at one `cached_tokens` or `context_tokens`, needs >= 2 points, a slope to
interpolate along). `h200.json` was measured on one
NVIDIA H200 (profiles/README.md has the method): batch-1 prefill by new x cached tokens, decode by
batch x context. `{table}_mixed.json` (h200_mixed.json: Llama-3.1-8B) measures mixed steps.

The model (seconds of engine time; every function is a pure function of the step's shape):
- prefill(n, c): one chunk of n new tokens over c cached ones, alone in a step: bilinear
  interpolation of the prefill table in (n, c), linear extrapolation past its edges, clamped below
  at the table's smallest n (launch overhead is a floor).
- decode(B, ctx): one step of B decodes at mean context ctx: bilinear interpolation of the decode
  table (attention cost is linear in context, so the batch mean is what matters).
- marginal(n, c, B) = a*n + b*n*(c + n/2) + e*B*n: what a prefill chunk adds to a step that already
  holds B decode tokens (vLLM's chunked prefill flattens both into one batch): one GEMM pass per
  token (a), causal attention over the cached and the chunk's own tokens (b), and widening a batch
  of B (e). a, b, e are least-squares fitted to the mixed table of the profile's model: each mixed
  step minus the decode-only step of the same batch and context, which cancels the eager-mode
  floor. For Llama-3.1-8B: a = 18.66 us/token, b = 1.881 ns/token^2, e = 43.99 ns/(token*seq). A
  model without its own mixed table scales that fit by its prefill-table ratio to the reference
  model (h200:llama-3.1-8b) at the same (n, c).
- step(B, ctx, chunks): decode(B, ctx) plus each chunk's marginal; with no decodes, the first
  chunk as a prefill step and the others as marginals.
- transfer(tokens, gbps): tokens x kv_bytes_per_token / link bandwidth.

What a scheduler with a token budget of max_num_batched_tokens makes of one prompt (vLLM v1: the
running decodes take one token each first, the prompt gets the rest of the budget, chunk by chunk):
- prefill_time(n, c, budget, B, ctx): the sum of those steps, ending with the one that samples the
  first token; this is exactly what engine_sim charges.
- stall(n, c, B, budget): the sum of those chunks' marginals: what the prompt delays each of the B
  running decodes by.
- scaled(f): the same model with every coefficient multiplied by f (a deliberately wrong profile).
- calibrated(k_d, k_p): decode steps times k_d, prefill work times k_p (one engine's fitted speed,
  router.calibration).

Error against the measurements (`python -m engine_sim.timing_report` prints the whole table):
- prefill and decode tables: 0.00% at every measured point (they are the interpolation nodes); in
  between, piecewise linear. A 16,384-token prompt chunked at 8,192 costs 608 ms against the
  table's 605 ms for one pass.
- mixed-step marginal: mean absolute error 2.05 ms over 48 points, max 7.7 ms; for 2,048-token
  chunks mean 4.2%, max 12.0%. Small chunks at B = 16-64, context 1,024 are off by up to 59% (a few
  ms): the eager profile's decode-only baselines there are noisy (its B = 16 baseline is slower than
  B = 64). The README's worked example (B = 128, context 4,096: +256 -> +6.5 ms, +1,024 -> +24.4,
  +2,048 -> +54.9) comes out at +6.3, +25.9, +53.7 ms.
- end to end (tests/engine_sim/test_timing.py): an isolated request's TTFT and inter-token latency
  as the simulator reports them match the profile within 10% at 1,024-16,384 prompt tokens.
"""

from __future__ import annotations

import bisect
import copy
import json
import math
import os
import re
import reprlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from protocol.errors import VariableError

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_PROFILE",
    "MAX_SPEEDUP",
    "MIN_SPEEDUP",
    "PROFILE_DIR_ENV",
    "MarginalFit",
    "ModelProfile",
    "TimingModel",
    "check_speedup",
    "fit_marginal",
    "load_profile",
    "mixed_marginals",
    "profile_dir",
    "profile_names",
    "speed_profile",
]

DEFAULT_PROFILE = "h200:llama-3.1-8b"
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's default for the API server on an H100/H200
_BUILTIN_DIR = Path(__file__).with_name("profiles")
PROFILE_DIR_ENV = "KVSWITCH_PROFILE_DIR"  # an operator's tables, searched before the built-in ones
# `{profile}@{S}x`: ASCII digits with at most one `.` (float() also reads ` 10`, `1_0`, `1e3`, `inf`)
_SPEED = re.compile(r"(.+)@([0-9]+(?:\.[0-9]+)?)x")
MIN_SPEEDUP, MAX_SPEEDUP = 1e-3, 1e6  # a profile's speed-up (`@{S}x`, `kvswitch up --speedup`)


def profile_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The directory KVSWITCH_PROFILE_DIR of `env` (os.environ) names, None when it is unset or
    empty; VariableError when it names no directory: its tables would go unread, and where one of
    them has a built-in table's name (h200.json), the built-in one would stand in for it without a
    word."""
    given = (os.environ if env is None else env).get(PROFILE_DIR_ENV)
    if not given:
        return None
    if not Path(given).is_dir():
        raise VariableError(
            PROFILE_DIR_ENV, f"= {given!r} names no directory: give the one that holds your timing tables"
        )
    return Path(given)


def _profile_dirs() -> list[Path]:
    extra = profile_dir()
    return ([extra] if extra is not None else []) + [_BUILTIN_DIR]


def _table_path(name: str) -> Path | None:
    for d in _profile_dirs():
        path = d / name
        if path.is_file():
            return path
    return None


def _read(path: Path) -> Any:
    """A table's JSON; ValueError naming the file when it cannot be read (an operator's table is
    read by every router's planner: any other error would fail each request that plans with it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise ValueError(f"timing table {path}: cannot read it: {exc}") from exc


def _listed(path: Path, key: str) -> list[dict[str, Any]]:
    """The table's `key` list of objects (`models`, a mixed table's `steps`); ValueError naming the
    file when it has none."""
    data = _read(path)
    rows = data.get(key) if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"timing table {path}: not a JSON object with a `{key}` list of objects")
    return rows


def _number(where: str, row: dict[str, Any], key: str, kind: type[int] | type[float] = int) -> Any:
    """`row[key]`, an integer (`kind` float: any finite number) >= 0; ValueError naming `where` and
    the key when it is missing or malformed. A whole float (`8.03e9`, `256.0`: how many tools write
    a count) is that integer."""
    if key not in row:
        raise ValueError(f"{where}: missing `{key}`")
    value = row[key]
    finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int and finite and isinstance(value, float) and value.is_integer():
        value = int(value)
    ok = finite and (isinstance(value, int) or kind is float)
    if not ok or value < 0:
        what = "an integer" if kind is int else "a finite number"
        raise ValueError(f"{where}: `{key}` must be {what} >= 0, got {reprlib.repr(value)}")
    return value


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One model's measured tables. Points are (new_tokens, cached_tokens, seconds) for prefill and
    (batch, context_tokens, seconds) for decode."""

    name: str
    table: str
    model: str
    kv_bytes_per_token: int
    params: int
    prefill: tuple[tuple[int, int, float], ...]
    decode: tuple[tuple[int, int, float], ...]


def profile_names() -> list[str]:
    """The profiles the tables name. A file that is no profile table (a `_mixed.json`, an operator's
    notes, a table that does not parse) names none; `load_profile` of its name says what is wrong."""
    names: list[str] = []
    for d in _profile_dirs():
        for path in sorted(d.glob("*.json")):
            try:
                models = _listed(path, "models")
            except ValueError:
                continue
            names += [f"{path.stem}:{m['model']}" for m in models if isinstance(m.get("model"), str)]
    return list(dict.fromkeys(names))


def _points(where: str, m: dict[str, Any], key: str, axes: tuple[str, str]) -> tuple[tuple[int, int, float], ...]:
    """One grid of a model's table; ValueError naming the key that is missing or malformed."""
    if key not in m:
        raise ValueError(f"{where}: missing `{key}`")
    rows = m[key]
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: `{key}` must be a non-empty list of points")
    points: dict[tuple[int, int], float] = {}
    for i, p in enumerate(rows):
        if not isinstance(p, dict):
            raise ValueError(f"{where}: `{key}[{i}]` is not an object")
        at = f"{where}: `{key}[{i}]`"
        x, y, seconds = _number(at, p, axes[0]), _number(at, p, axes[1]), _number(at, p, "seconds", float)
        if (x, y) in points:  # two values at one point: interpolating between them divides by zero
            raise ValueError(f"{where}: `{key}[{i}]` repeats {axes[0]} {x}, {axes[1]} {y}")
        points[x, y] = seconds
    _check_rows(where, key, axes, points)
    return tuple((x, y, v) for (x, y), v in points.items())


def _kv_bytes(where: str, m: dict[str, Any]) -> int:
    """`kv_bytes_per_token_bf16`, >= 1: an engine's KV pool is its free memory over it, and a 0 was
    a ZeroDivisionError in every sim that sized one and in the routers' admission."""
    value: int = _number(where, m, "kv_bytes_per_token_bf16")
    if value < 1:
        raise ValueError(f"{where}: `kv_bytes_per_token_bf16` must be an integer >= 1, got {value}")
    return value


def _check_rows(where: str, key: str, axes: tuple[str, str], points: dict[tuple[int, int], float]) -> None:
    """Every row of the grid (its points at one `axes[1]`) holds >= 2 points: one point has no slope
    to interpolate along, and _Grid divided by zero past it. Refused rather than read as a constant:
    a prefill or decode step that costs the same at any size is a model no engine follows, and the
    sims and the routers' admission would run on it with nothing said."""
    rows: dict[int, list[int]] = {}
    for x, y in points:
        rows.setdefault(y, []).append(x)
    for y, xs in rows.items():
        if len(xs) < 2:
            raise ValueError(
                f"{where}: `{key}` has one point at {axes[1]} {y} ({axes[0]} {xs[0]}); "
                f"each {axes[1]} needs >= 2 {axes[0]} values"
            )


@cache
def load_profile(name: str = DEFAULT_PROFILE) -> ModelProfile:
    """`h200:llama-3.1-8b` -> its tables; ValueError naming the known profiles for an unknown one,
    and the file and the key for a malformed one."""
    table, _, model = name.partition(":")
    path = _table_path(f"{table}.json") if table else None
    if path is not None:
        for m in _listed(path, "models"):
            if m.get("model") == model:
                where = f"timing table {path}, model {model!r}"
                return ModelProfile(
                    name=name,
                    table=table,
                    model=model,
                    kv_bytes_per_token=_kv_bytes(where, m),
                    params=_number(where, m, "params") if "params" in m else 0,
                    prefill=_points(where, m, "prefill", ("new_tokens", "cached_tokens")),
                    decode=_points(where, m, "decode", ("batch", "context_tokens")),
                )
    raise ValueError(f"unknown timing profile {name!r}; known: {', '.join(profile_names())}")


def check_speedup(speedup: float, what: str) -> None:
    """ValueError naming `what` unless MIN_SPEEDUP <= `speedup` <= MAX_SPEEDUP: past them a profile's
    times are no longer numbers (1 / 1e-320 is inf, and a router divided a backlog by a rate of 0)."""
    if not MIN_SPEEDUP <= speedup <= MAX_SPEEDUP:  # NaN too
        raise ValueError(
            f"{what} must be a number in {MIN_SPEEDUP}..{MAX_SPEEDUP:.0f} (times the profile's speed), got {speedup!r}"
        )


def speed_profile(name: str, speedup: float) -> str:
    """`name` on an engine `speedup` times as fast (`h200:llama-3.1-8b@10x`); `name` itself at 1."""
    check_speedup(speedup, "a profile's speed-up")
    if speedup == 1:
        return name
    return f"{name}@{repr(speedup).removesuffix('.0')}x"  # in the bounds, repr writes no exponent


def _split_speed(name: str) -> tuple[str, float]:
    """`h200:llama-3.1-8b@10x` -> ("h200:llama-3.1-8b", 10.0); a name that does not end in
    `@{S}x` (S a plain decimal number: digits, one `.`) is a profile's own name, at speed 1: a table
    or model may have an `@` in its name (`h200@lab:llama-3.1-8b`)."""
    match = _SPEED.fullmatch(name)
    if match is None:
        return name, 1.0
    factor = float(match[2])
    check_speedup(factor, f"timing profile {name!r}: the speed-up after '@'")
    return match[1], factor


@dataclass(frozen=True, slots=True)
class MarginalFit:
    """marginal(n, c, B) = a*n + b*n*(c + n/2) + e*B*n, seconds."""

    a: float
    b: float
    e: float

    def __call__(self, n: int, c: int, batch: int) -> float:
        return n * (self.a + self.b * (c + n / 2) + self.e * batch)


def mixed_marginals(table: str = "h200") -> list[tuple[int, int, int, int, float]]:
    """(batch, context, chunk, cached, measured marginal seconds) from `{table}_mixed.json`: each
    mixed step minus the decode-only step of the same batch and context; [] without such a file."""
    path = _table_path(f"{table}_mixed.json")
    if path is None:
        return []
    steps = []
    for i, s in enumerate(_listed(path, "steps")):
        at = f"timing table {path}: `steps[{i}]`"
        counts = tuple(_number(at, s, key) for key in ("batch", "context_tokens", "chunk_tokens", "cached_tokens"))
        steps.append((*counts, _number(at, s, "seconds", float)))
    base = {(b, ctx): secs for b, ctx, chunk, _, secs in steps if chunk == 0}
    return [(b, ctx, chunk, c, secs - base[b, ctx]) for b, ctx, chunk, c, secs in steps if chunk and (b, ctx) in base]


def _mixed_model(table: str) -> str | None:
    path = _table_path(f"{table}_mixed.json")
    if path is None:
        return None
    data = _read(path)
    if not isinstance(data, dict):
        raise ValueError(f"timing table {path}: not a JSON object")
    return str(data.get("model"))


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """min |X w - y| for a few columns: normal equations on unit-norm columns, Gaussian elimination
    with partial pivoting (kept free of numpy: every process imports protocol)."""
    k = len(rows[0])
    norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(k)]
    x = [[r[j] / norms[j] for j in range(k)] for r in rows]
    a = [[sum(r[i] * r[j] for r in x) for j in range(k)] + [sum(r[i] * y for r, y in zip(x, ys, strict=True))]
         for i in range(k)]  # fmt: skip
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(col + 1, k):
            f = a[i][col] / a[col][col]
            a[i] = [v - f * p for v, p in zip(a[i], a[col], strict=True)]
    w = [0.0] * k
    for i in reversed(range(k)):
        w[i] = (a[i][k] - sum(a[i][j] * w[j] for j in range(i + 1, k))) / a[i][i]
    return [w[j] / norms[j] for j in range(k)]


@cache
def fit_marginal(table: str = "h200") -> MarginalFit:
    """The marginal fitted to `{table}_mixed.json`."""
    rows = mixed_marginals(table)
    if not rows:
        raise ValueError(f"no mixed-step measurements for table {table!r} ({table}_mixed.json)")
    design = [(n, n * (c + n / 2), b * n) for b, _, n, c, _ in rows]
    try:
        a, b, e = _least_squares(design, [r[4] for r in rows])
    except ZeroDivisionError:
        path = _table_path(f"{table}_mixed.json")
        raise ValueError(f"timing table {path}: too few distinct steps to fit the marginal's three terms") from None
    return MarginalFit(a, b, e)


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
        """Along xs, >= 2 points (load_profile refuses a row with fewer)."""
        if x <= xs[0]:
            if floor:
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


def _chunks(new: int, cached: int, room: int) -> Iterator[tuple[int, int]]:
    """(chunk, cached before it) as a scheduler hands out `new` tokens `room` at a time."""
    done = 0
    while done < new:
        n = min(room, new - done)
        yield n, cached + done
        done += n


class TimingModel:
    """Step durations for one model profile (module docstring). Immutable; `scaled` makes a copy."""

    __slots__ = ("_decode", "_fit", "_prefill", "_ref", "decode_scale", "prefill_scale", "profile", "scale")

    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        self.scale = 1.0
        self.decode_scale = 1.0  # calibrated(): decode steps only
        self.prefill_scale = 1.0  # calibrated(): prefill steps and the marginals of prefill chunks
        self._prefill = _Grid(profile.prefill)
        self._decode = _Grid(profile.decode)
        own = _mixed_model(profile.table) == profile.model
        reference = load_profile(DEFAULT_PROFILE)
        self._fit = fit_marginal(profile.table if own else reference.table)
        self._ref = None if own else _Grid(reference.prefill)

    @classmethod
    def for_profile(cls, name: str = DEFAULT_PROFILE) -> TimingModel:
        """The shared model of a named profile, `@{S}x` at S times its speed (`scaled(1 / S)`);
        ValueError for an unknown name."""
        return _model(name)

    def scaled(self, factor: float) -> TimingModel:
        """This model with every coefficient (prefill, decode, marginal, transfer) times `factor`:
        `scaled(1.25)` is a profile 25% too slow."""
        if not factor > 0:
            raise ValueError(f"a timing model's scale must be > 0, got {factor!r}")
        out = copy.copy(self)
        out.scale = self.scale * factor
        return out

    def calibrated(self, decode: float, prefill: float) -> TimingModel:
        """This model with decode steps `decode` times as long and prefill work (prefill steps,
        the marginals of chunks) `prefill` times: one engine's speed fitted against this profile's
        shape (router.calibration). Transfers are the link's, not the engine's: unchanged."""
        if not (decode > 0 and prefill > 0):
            raise ValueError(f"calibration factors must be > 0, got {decode!r}, {prefill!r}")
        out = copy.copy(self)
        out.decode_scale = self.decode_scale * decode
        out.prefill_scale = self.prefill_scale * prefill
        return out

    # --- one step --------------------------------------------------------------------------------

    def prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        return self._prefill(new_tokens, cached_tokens) * self.prefill_scale * self.scale

    def decode(self, batch: int, context_tokens: float) -> float:
        if batch <= 0:
            return 0.0
        return self._decode(batch, context_tokens) * self.decode_scale * self.scale

    def marginal(self, new_tokens: int, cached_tokens: int, batch: int) -> float:
        return self._marginal(new_tokens, cached_tokens, batch) * self.prefill_scale * self.scale

    def _marginal(self, n: int, c: int, batch: int) -> float:
        if n <= 0:
            return 0.0
        m = self._fit(n, c, batch)
        if self._ref is not None:
            m *= self._prefill(n, c) / self._ref(n, c)
        return max(m, 0.0)

    def step(self, decode_batch: int, decode_context: float, chunks: Sequence[tuple[int, int]]) -> float:
        """One step: `decode_batch` sequences at mean context `decode_context`, plus prefill
        `chunks` of (new_tokens, cached_tokens)."""
        if decode_batch > 0:
            t = 0.0
            for n, c in chunks:
                t += self._marginal(n, c, decode_batch)
            return (
                self._decode(decode_batch, decode_context) * self.decode_scale + t * self.prefill_scale
            ) * self.scale
        if not chunks:
            return 0.0
        n0, c0 = chunks[0]
        t = self._prefill(n0, c0)
        for n, c in chunks[1:]:
            t += self._marginal(n, c, 0)
        return t * self.prefill_scale * self.scale

    def transfer(self, tokens: int, gbytes_per_s: float) -> float:
        """KV of `tokens` tokens over a link of `gbytes_per_s` GB/s."""
        return tokens * self.profile.kv_bytes_per_token / (gbytes_per_s * 1e9) * self.scale

    # --- what a scheduler makes of one prompt ----------------------------------------------------

    def prefill_time(
        self, new_tokens: int, cached_tokens: int, *, budget: int, decode_batch: int = 0, decode_context: float = 0.0
    ) -> float:
        """Seconds until a prompt's `new_tokens` (over `cached_tokens`) are computed and its first
        token sampled, on an engine whose `decode_batch` running decodes (mean context
        `decode_context`, one token longer each step) share every step's `budget`. Infinite when
        the decodes leave no room."""
        if new_tokens <= 0:
            return 0.0
        room = budget - decode_batch
        if room <= 0:
            return math.inf
        return sum(
            self.step(decode_batch, decode_context + k, [chunk])
            for k, chunk in enumerate(_chunks(new_tokens, cached_tokens, room))
        )

    def stall(self, new_tokens: int, cached_tokens: int, decode_batch: int, *, budget: int) -> float:
        """Seconds that prefilling the prompt adds to each of `decode_batch` running decodes: the
        marginals of its chunks. 0 with no decodes (or none of its chunks fit beside them)."""
        room = budget - decode_batch
        if decode_batch <= 0 or new_tokens <= 0 or room <= 0:
            return 0.0
        return sum(self.marginal(n, c, decode_batch) for n, c in _chunks(new_tokens, cached_tokens, room))


@cache
def _model(name: str) -> TimingModel:
    base, speedup = _split_speed(name)  # the base is a profile's own name: one speed-up, not one per `@`
    try:
        model = TimingModel(load_profile(base))
    except ValueError as exc:
        if "@" in base or ("@" in name and _SPEED.fullmatch(name) is None):  # `@ 10x`, `@10`, `@10x@2x`
            how = "a speed-up ends the name once: @{S}x, S digits with one '.', as @10x"
            raise ValueError(f"{exc} ({how})") from None
        raise
    return model if speedup == 1 else model.scaled(1 / speedup)
