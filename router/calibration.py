"""Timing calibration: each worker's engine speed, fitted online from what its shim reports.

The router predicts engine times (TTFT on both paths and the stall a local prefill adds to
running decodes, in the ttft_model and slo_aware policies; admission's prefill rate) from a
timing profile. A profile is the *shape* of an engine's costs (how prefill grows with tokens and
context, decode with batch and context); this module fits, per worker, how fast its engine really
is against that shape:

    step seconds = k_d * decode(B, C) + k_p * prefill part (P prefill tokens)

`decode` and the prefill part come from the worker's profile, as the one timing model
(protocol.timing.TimingModel, what engine_sim charges) reads it (`WorkerInfo.timing_profile`;
`default_profile` when it registered none: a worker without a profile is calibrated, not
refused; one whose profile this router does not know gets no timing, and the policies say so).
(k_d, k_p) are fitted by least squares with exponential forgetting over windows of the engine's
busy time. Per interval between two of its LoadReports (differences of the reports' cumulative
counters, protocol.messages LoadReport):

    y   = t2 - t1                                      (t: engine_ts, else ts; between readings)
    S   = iterations, D = itl_count (decode tokens), P = iteration_tokens - G (prefill tokens)
    G   = generation_tokens, else D                    (a speculative step generates several
                                                        tokens per request, one ITL each; D for a
                                                        shim without the field, or a difference
                                                        outside [0, the step tokens])
    x_d = S * decode(D / S, C)                         (C = decode_context: the decoding requests'
                                                        mean prompt + output so far, as the shim
                                                        counts them)
    x_p = S * prefill(P / S, k + max(n - P / S, 0) / 2)   if D == 0 (a prefill-only engine), P / S <= mnbt
        = S * prefill_time(P / S, k, budget=mnbt)         if D == 0, P / S > mnbt (prompts counted whole)
        = P * marginal(n, k, D / S) / n                   else (prefill chunks inside decode steps)

where the worker's recent prompt averages n new and k cached tokens (prefill_computed_tokens,
prefix_hit_tokens and prefill_requests, summed over its last PROMPT_INTERVALS intervals in which
any moved: vLLM counts hits at scheduling and the rest at finish): a chunk
attends to the prompt's cached tokens and its earlier chunks, and on the profile's linear
marginal a prompt's chunks cost exactly what `marginal(n, k, B)` charges the whole prompt. An
engine that reports no prompt counters is read with n = mnbt, k = 0 (one full chunk with no
context). No step holds more than mnbt (max_num_batched_tokens) tokens, so a prefill-only interval
whose steps average more holds prompts counted whole at their last chunk (vLLM and engine_sim count a
prompt's tokens, and one iteration, only then): it is priced as the chunks the engine ran, each over
those before it (TimingModel.prefill_time, as WorkerTiming.prefill_s prices a prompt). Priced as one
step, which the profile's tables extrapolate linearly past their last point, prompts of 40-120 k
tokens fitted k_p 1.5 against a right profile. Steps averaging more tokens than one counts (a prompt
at max_model_len, LONGEST_CONTEXT when the worker says none, and a budget of whole prompts beside
it) cannot be true, and their stretch is dropped, counted, as for any figures that cannot be: priced,
one report's +10^10 tokens held the event loop for seconds, in 10^6 chunks.

C is per sequence because a decode step reads each running sequence's whole KV, a prefix shared
with other sequences included (vLLM's paged attention does; engine_sim charges it so). C used to
be kv_used_blocks * block_size / running, which counts a shared prefix once: on requests sharing
a 4 k-token system prompt, decode workers fitted k_d of 1.3-2.0 against their own, right profile,
and slo_aware's room rule, reading that, held back requests that would have met their TPOT
(docs/benchmarks.md, "Self-calibration"). A reading with decode_context 0 while the engine decodes (a
shim from before the field, or requests that bypass the shim) falls back to that estimate; a worker that
has never sent one is logged once at WARNING after NO_CONTEXT_WARN_AFTER such readings.

Windows, not single intervals, because vLLM counts a prompt's tokens when its first token comes
out (and only steps with outputs), not while its chunks run: the tokens of a long prompt land in a
later interval than most of its compute. A window sums the intervals of one busy stretch (`running`
> 0 at either end) until the engine goes idle, or until it holds WINDOW_S of busy time and some
counted work and no request is still prefilling (more running than decoding, less those that
finished; MAX_WINDOW_S at most),
and is one observation: over a window that starts and ends idle every token is
counted inside it, and a long one splits few prompts at its edges. The interval in which the
engine started (or went idle) counts half its length, the expected busy part, unless reports went
missing around it (a gap over MAX_GAP_PERIODS report periods, or times the median spacing of the
worker's recent busy readings, running at both ends: a loaded /metrics is the slow one): then the
stretch is dropped, counted (`dropped`), and said once at WARNING when DROPPED_WARN_AFTER were and
none was fitted. An interval busy at both ends is dropped too when it is over MAX_BUSY_GAP_PERIODS
times that (once CADENCE_KNOWN busy spacings are seen): reports lost for tens of seconds, or a step
of the shim host's wall clock, would read as busy time an engine may have spent mostly idle. A
worker registered again under another profile starts a fresh fit: its factors were against the old
profile's shape. A report made before the last one read and come late (reordered across a
quarantine's subscription switch, or again) is ignored: stamped no later in the same KV epoch, with
fewer iterations, or with as many and an earlier engine reading while the engine is busy (a long
prefill counts no step until its last chunk; read, such a report ran the clock back and dropped the
window). A step back of the shim host's clock while a busy engine counts no step looks the same: it
is read at the report that counts one (or is stamped past the last), a clock fault when the step is
past the time to it, busy time short by the step when not, as a step within any interval is (`_late`).
Idle at both, such a report is read as a new baseline: a step back then costs nothing, but a late
report puts the baseline back by the time between the two readings, and when the engine
starts in the next interval, that interval can pass MAX_GAP_PERIODS: it is dropped as readings gone
missing around a start (counted), and the stretch's window opens at the reading after it.

Each window is weighed by how far its y can be from k_d x_d + k_p x_p: one reading's resolution
(READ_ERROR_S) and each proxy's own error, DECODE_PROXY_ERROR of x_d and PREFILL_PROXY_ERROR of
x_p. The decode proxy prices each step as the engine does, within a few percent; the prefill proxy
prices the worker's average prompt where the attention term is quadratic in a prompt's length, so
on prompts of 1 k to 100 k tokens a window's x_p is off by half or double, the more so the more
prefill it holds. Weighed evenly, least squares let those windows trade the factors: decode workers
serving the shipped trace fitted k_d of 0.2-0.8 and k_p of 1.4-2.5 against their own, right
profile, so the room rule read their decode steps as up to five times faster than they ran. Weighed
so, k_d comes from the windows whose decode the proxy prices well and k_p from the spread of the
prefill-heavy ones. The cost is a prefill worker's: its many short windows now count, and y reads
each a first chunk short (`running` shows a prompt only once that chunk's step has ended), so its
k_p fits some 13% low on the trace (docs/benchmarks.md, "Self-calibration").

Prefill in intervals before the worker had counted any prompt is priced when its window closes,
at the average prompt counted by then, and weighed as a guess (LATE_PRICE_ERROR): vLLM counts a
prompt's computed tokens when the request finishes, so a decode worker's first window holds prompts
none of which is counted yet. Priced as the default prompt (n = mnbt, k = 0) instead, on windows
as collinear as a decode worker's (a steady tenth of prefill each), that one guess kept k_p 1.4%
off for good in tests/router/test_calibration.py. A worker that has counted none by then is priced
on the default, as one that exports no prompt counters always is.

The fit starts from the prior (k_d, k_p) = (`prior_scale`, `prior_scale`), a pseudo-observation of
each factor alone with weight `prior_weight` (in the weighed units: a pure decode window adds up to
1 / DECODE_PROXY_ERROR^2 = 400, a pure prefill one 1 / PREFILL_PROXY_ERROR^2 = 4, so one window
outweighs it), and observations older than `half_life_s` weigh half; factors stay in
[MIN_SCALE, MAX_SCALE] (a fit settled past them, CLAMP_WARN_BUSY_S busy seconds and CLAMP_WARN_FITS
fits in a row, is said once at WARNING). A profile off by a constant factor is corrected exactly;
one of another model or GPU to first order (one factor for prefill, one for decode). `prior_scale`
!= 1 starts the router deliberately wrong (robustness runs). The proxies are first-order, and the
factors absorb what they miss on average (averages of n and k stand for the mix of prompts). Before
the prompt averages were read, x_p priced every chunk without its cached context, and workers
serving the shipped trace's long multi-turn prompts fitted k_p of 1.5-2.2 against their own, right
profile (docs/benchmarks.md, "Self-calibration").

What the shim must report (cumulative since the engine started; vLLM /metrics names):
iterations = vllm:iteration_tokens_total_count, iteration_tokens = its _sum, itl_count =
vllm:inter_token_latency_seconds_count, prefill_requests and prefill_computed_tokens =
vllm:request_prefill_kv_computed_tokens_count and _sum (or request_prefill_time's count),
prefix_hit_tokens = vllm:prefix_cache_hits_total, generation_tokens = vllm:generation_tokens_total,
and engine_ts, when it read them; plus running and
kv_used_blocks, which it reports anyway. An engine that exports none of these (SGLang and
TensorRT-LLM adapters today) reports iterations 0 and is never fitted: the router keeps its prior.
Synchronous; the owner calls `observe` for every load report it accepts.

Each of the three WARNINGs above (no decode_context, stretches dropped, a fit past the bounds) is
said once per worker, and a whole fleet can share its cause (one shim build, one wrong profile): in
a window of 10 s the first eight workers are named, the rest counted in one line (router.fleet_lines).
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from protocol.messages import LoadReport, WorkerInfo
from protocol.timing import DEFAULT_PROFILE, TimingModel
from router.eligibility import few_ids
from router.fleet_lines import FleetLines, FleetLog

__all__ = [
    "DROPPED_WARN_AFTER",
    "FULL_BATCH_TOKENS",
    "LONGEST_CONTEXT",
    "MAX_SCALE",
    "MIN_SCALE",
    "NO_CONTEXT_WARN_AFTER",
    "Calibration",
    "WorkerTiming",
    "timing_of",
    "unusable_profiles",
]

log = logging.getLogger(__name__)
MIN_SCALE = 0.2
MAX_SCALE = 5.0
WINDOW_S = 10.0
MAX_WINDOW_S = 40.0  # a window held open for a prompt in flight closes anyway past this
MAX_GAP_PERIODS = 2.0
# Busy at both ends: a report or two lost in between costs nothing (busy throughout, surely), but
# tens of seconds could be mostly idle, or a step of the shim host's wall clock.
MAX_BUSY_GAP_PERIODS = 4.0
PROMPT_INTERVALS = 40  # intervals with prompts the average prompt is summed over
FULL_BATCH_TOKENS = 8192  # a worker's prefill batch when it registered no max_num_batched_tokens
LONGEST_CONTEXT = 1 << 22  # a worker's max_model_len when it registered none: past what engines serve in practice
NO_CONTEXT_WARN_AFTER = 20  # decoding readings without decode_context, and none ever with, before a warning
DROPPED_WARN_AFTER = 5  # busy stretches dropped, and none ever fitted, before a warning
CLAMP_WARN_FITS = 5  # fits in a row past the bounds before a warning
CLAMP_WARN_BUSY_S = 60.0  # and busy seconds observed
READ_ERROR_S = 0.25  # how far a window's busy time can be off: the engine is read every 0.25 s
DECODE_PROXY_ERROR = 0.05  # x_d's relative error: it prices each step as the engine does
PREFILL_PROXY_ERROR = 0.5  # x_p's: the average prompt stands for prompts of very different lengths
LATE_PRICE_ERROR = 2.0  # and of prefill priced at prompts counted after it ran, not its own
SPACINGS = 9  # busy intervals (running at both ends) whose median spacing is a worker's reading cadence
CADENCE_KNOWN = 3  # busy intervals seen before a gap is judged against their cadence


@dataclass(slots=True)
class _Window:
    """Sums over the busy intervals of one stretch, not yet added to the fit."""

    y: float = 0.0
    x_d: float = 0.0
    x_p: float = 0.0
    # Prefill of intervals before the worker had counted any prompt, priced when the window closes:
    # (prefill tokens, steps, decode batch or 0)
    unpriced: list[tuple[int, int, int]] = field(default_factory=list)


def _weight(x_d: float, x_p: float, late_p: float) -> float:
    """The inverse of a window's expected squared error: the reading's resolution, each proxy's
    error, and that of prefill priced late (`late_p` of x_p)."""
    errors = (READ_ERROR_S, DECODE_PROXY_ERROR * x_d, PREFILL_PROXY_ERROR * (x_p - late_p), LATE_PRICE_ERROR * late_p)
    return 1.0 / sum(e * e for e in errors)


@dataclass(slots=True)
class _Prompts:
    """A worker's recent prompts: how many requests finished (vLLM observes their prefill figures
    then), their computed tokens and their cached ones, summed over its last PROMPT_INTERVALS
    intervals in which any of them moved. Plain sums, not decaying ones: vLLM counts a prompt's
    cache hits when it is scheduled and its computed tokens when it finishes, seconds apart, and a
    decaying sum weighs the two apart (a prompt over 8000 cached tokens read as 6400)."""

    recent: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=PROMPT_INTERVALS))
    n: int = 0
    new: int = 0
    cached: int = 0
    last: tuple[int, int] | None = None  # the last mean, while no prompt finished within the intervals

    def add(self, n: int, new: int, cached: int) -> None:
        if len(self.recent) == PROMPT_INTERVALS:
            n0, new0, cached0 = self.recent[0]
            self.n, self.new, self.cached = self.n - n0, self.new - new0, self.cached - cached0
        self.recent.append((n, new, cached))
        self.n, self.new, self.cached = self.n + n, self.new + new, self.cached + cached
        if self.n > 0 and self.new > 0:
            self.last = max(round(self.new / self.n), 1), round(self.cached / self.n)

    def mean(self) -> tuple[int, int] | None:
        """(new, cached) tokens of the average prompt; None until one has been counted."""
        return self.last


class WorkerTiming(msgspec.Struct, frozen=True):
    """Predicted engine times of one worker: its profile's shape times its fitted factors."""

    shape: TimingModel
    decode_scale: float = 1.0
    prefill_scale: float = 1.0
    kv_bytes_per_token: int | None = None
    chunk_tokens: int = FULL_BATCH_TOKENS  # its max_num_batched_tokens: the chunks it prefills in

    def model(self) -> TimingModel:
        """The whole timing model at this worker's fitted speed (for the ttft_model policy)."""
        if self.decode_scale == 1.0 and self.prefill_scale == 1.0:
            return self.shape
        return self.shape.calibrated(self.decode_scale, self.prefill_scale)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """A prefill of `new_tokens` over `cached_tokens`, alone on the engine, in chunks of
        `chunk_tokens` as its scheduler runs them (TimingModel.prefill_time, what engine_sim charges).
        One step's price for the whole prompt read a 191 k-token prompt as 11 s where its chunks
        take 33 s (the profile's step tables end long before it, and each chunk attends to those
        before it)."""
        return self.prefill_scale * self.shape.prefill_time(new_tokens, cached_tokens, budget=self.chunk_tokens)

    def decode_s(self, batch: int, context_tokens: float) -> float:
        """One decode step of `batch` sequences over `context_tokens` each."""
        return self.decode_scale * self.shape.decode(batch, context_tokens)

    def stall_s(self, new_tokens: int, cached_tokens: int = 0, batch: int = 1) -> float:
        """What prefilling `new_tokens` inside the steps of `batch` running decodes adds to those
        steps, in all: the marginal the engine charges for the chunk (protocol.timing)."""
        return self.prefill_scale * self.shape.marginal(new_tokens, cached_tokens, max(batch, 1))

    def transfer_s(self, tokens: int, gbps: float) -> float:
        """KV of `tokens` over a link of `gbps` GB/s, at the profile's speed as TimingModel.transfer
        (a sim at `--speedup S`, registered `@{S}x`, moves its KV S times as fast)."""
        per_token = self.kv_bytes_per_token or self.shape.profile.kv_bytes_per_token
        return max(tokens, 0) * per_token / (gbps * 1e9) * self.shape.scale

    def queue_s(self, tokens: int) -> float:
        """The prefill of `tokens` queued on the worker: prompts, which do not attend to each
        other, run in full steps of `chunk_tokens` and one of the rest, none over a cached context.
        Priced as one prompt (prefill_s), a queue of ten 4 k-token prompts read as a 40 k-token
        prompt, each chunk attending to all before it."""
        if tokens <= 0:
            return 0.0
        full, rest = divmod(tokens, self.chunk_tokens)
        steps = full * _alone_s(self.shape, self.chunk_tokens) + (_alone_s(self.shape, rest) if rest else 0.0)
        return self.prefill_scale * steps

    def prefill_rate(self, batch: int) -> float | None:
        """Prompt tokens per second at full batches of `batch` tokens."""
        seconds = self.prefill_scale * _alone_s(self.shape, batch)
        return batch / seconds if seconds > 0 else None


@functools.lru_cache(maxsize=1024)
def _alone_s(shape: TimingModel, tokens: int) -> float:
    """`shape.prefill(tokens)`: admission asks it of every candidate on every request, always for
    the same few batch sizes (a TimingModel is immutable, so its identity is the key)."""
    return shape.prefill(tokens)


def timing_of(info: WorkerInfo, fitted: WorkerTiming | None) -> WorkerTiming | None:
    """`fitted` when the router calibrates; else the worker's profile as it stands; None when it
    registered none (or an unknown one)."""
    if fitted is not None:
        return fitted
    if not info.timing_profile:
        return None
    shape = _known_profile(info.timing_profile)
    if shape is None:
        return None
    return WorkerTiming(
        shape, kv_bytes_per_token=info.kv_bytes_per_token, chunk_tokens=info.max_num_batched_tokens or FULL_BATCH_TOKENS
    )


def _readable(
    engine_s: float, wall_s: float, contexts: tuple[float, float], step_tokens: float, info: WorkerInfo
) -> bool:
    """Whether a stretch's figures can be true: finite, the engine's time not twice the wall's
    (a second's leeway: the engine is read every 0.25 s), no mean context past the model's, and
    steps of no more tokens than one counts: a prompt's whole at its last chunk, and whole prompts
    in the rest of the budget (read, a step of 10^10 tokens was priced in 10^6 chunks, seconds)."""
    if not (math.isfinite(engine_s) and all(math.isfinite(c) for c in contexts)):
        return False
    if engine_s > 2 * max(wall_s, 0.0) + 1.0:
        return False
    if step_tokens > (info.max_model_len or LONGEST_CONTEXT) + (info.max_num_batched_tokens or FULL_BATCH_TOKENS):
        return False
    return info.max_model_len is None or max(contexts) <= info.max_model_len


def _late(prev: LoadReport, report: LoadReport) -> bool:
    """Whether `report` was made before `prev`, the last one read, and came late: stamped no later in
    the same session of its shim (a restart is a new KV epoch, though the shim host's clock stepped
    back meanwhile), with fewer iterations (else read as a restarted engine's, dropping the worker's
    windows), or with as many and an earlier engine reading while the engine was busy (else a clock
    fault dropping the open window). A clock step back while the engine counts no step looks the
    same, and is read at the report that counts one (the module docstring)."""
    if report.ts > prev.ts or report.kv_epoch != prev.kv_epoch:
        return False
    if report.iterations < prev.iterations:
        return True
    earlier = (report.engine_ts or report.ts) < (prev.engine_ts or prev.ts)
    return report.iterations == prev.iterations and earlier and (prev.running > 0 or report.running > 0)


def _prefill_work(
    shape: TimingModel, prompt: tuple[int, int] | None, mnbt: int, tokens: int, steps: int, batch: int
) -> float:
    """x_p of `tokens` prefilled over `steps` steps beside `batch` decodes (0: a prefill-only
    engine), the worker's average prompt being `prompt` (new, cached), or one full chunk with no
    context when it has counted none."""
    new, cached = prompt if prompt is not None else (mnbt, 0)
    if not batch:
        chunk = tokens / steps
        if chunk > mnbt:
            # No step holds more than mnbt tokens: prompts counted whole at their last chunk.
            return steps * shape.prefill_time(round(chunk), 0 if prompt is None else cached, budget=mnbt)
        context = 0 if prompt is None else round(cached + max(new - chunk, 0) / 2)
        return steps * shape.prefill(round(chunk), context)
    return tokens * shape.marginal(new, cached, batch) / new


def _known_profile(name: str) -> TimingModel | None:
    """The profile's model; None when this router cannot load it."""
    loaded = _loaded_profile(name)
    return loaded if isinstance(loaded, TimingModel) else None


@functools.cache
def _loaded_profile(name: str) -> TimingModel | str:
    """The profile's model, or why this router cannot load it, said once and remembered: asked per
    candidate and request, a failed load read every table from disk again each time (~200 µs)."""
    try:
        return TimingModel.for_profile(name)
    except ValueError as exc:
        log.warning("a worker registered timing profile %r, which this router cannot use: %s; %s", name, exc, _FIX)
        return str(exc)


_FIX = "give the routers the profile tables the shims have (the same KVSWITCH_PROFILE_DIR)"


def unusable_profiles(infos: Iterable[WorkerInfo]) -> list[str]:
    """One line per timing profile that workers of `infos` registered and this router cannot load,
    naming them and the fix: their timing predictions are then missing, silently but for this."""
    workers: dict[str, list[str]] = {}
    for info in infos:
        if info.timing_profile and _known_profile(info.timing_profile) is None:
            workers.setdefault(info.timing_profile, []).append(info.worker)
    return [
        f"workers {few_ids(sorted(names))} registered timing profile {name!r}, which this router cannot load "
        f"({_loaded_profile(name)}): nothing it decides by predicted time (ttft_model, slo_aware, admission's "
        f"backlog) can read them; {_FIX}"
        for name, names in sorted(workers.items())
    ]


@dataclass(slots=True)
class _Fit:
    """Weighted least squares of y ~ k_d x_d + k_p x_p, each window weighed by the inverse of its
    expected squared error, with a prior and exponential forgetting: the normal equations' sums
    decay by 2^(-dt / half_life)."""

    prior: float
    prior_weight: float
    a11: float = 0.0
    a12: float = 0.0
    a22: float = 0.0
    b1: float = 0.0
    b2: float = 0.0
    updated_at: float | None = None
    busy_s: float = 0.0  # busy seconds observed, undecayed (how warm the fit is)
    decode_scale: float = field(init=False)
    prefill_scale: float = field(init=False)
    estimate: tuple[float, float] = field(init=False)  # (k_d, k_p) before the clamp

    def __post_init__(self) -> None:
        self.decode_scale = self.prefill_scale = self.prior
        self.estimate = (self.prior, self.prior)

    def add(self, at: float, y: float, x_d: float, x_p: float, half_life_s: float, weight: float) -> None:
        if self.updated_at is not None:
            decay = 0.5 ** (max(at - self.updated_at, 0.0) / half_life_s)
            self.a11 *= decay
            self.a12 *= decay
            self.a22 *= decay
            self.b1 *= decay
            self.b2 *= decay
        self.updated_at = at
        self.busy_s += y
        self.a11 += weight * x_d * x_d
        self.a12 += weight * x_d * x_p
        self.a22 += weight * x_p * x_p
        self.b1 += weight * x_d * y
        self.b2 += weight * x_p * y
        # The prior as pseudo-observations of each factor alone.
        w, k0 = self.prior_weight, self.prior
        a11, a22, a12 = self.a11 + w, self.a22 + w, self.a12
        b1, b2 = self.b1 + w * k0, self.b2 + w * k0
        det = a11 * a22 - a12 * a12
        if det <= 0:
            return
        self.estimate = ((b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det)
        self.decode_scale, self.prefill_scale = _clamp(self.estimate[0]), _clamp(self.estimate[1])


def _clamp(k: float) -> float:
    return min(max(k, MIN_SCALE), MAX_SCALE) if math.isfinite(k) else 1.0


class Calibration:
    """Per worker: its last report and its fit. Not thread-safe; one event loop owns it."""

    def __init__(
        self,
        *,
        default_profile: str = DEFAULT_PROFILE,
        prior_scale: float = 1.0,
        prior_weight: float = 0.05,
        half_life_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        fleet_log: FleetLog | None = None,
    ) -> None:
        """`clock` times only the windows of the warnings said per worker (router.fleet_lines): a
        fit reads the reports' own stamps."""
        if not MIN_SCALE <= prior_scale <= MAX_SCALE:
            raise ValueError(f"prior_scale must be in [{MIN_SCALE}, {MAX_SCALE}], got {prior_scale}")
        if prior_weight <= 0 or half_life_s <= 0:
            raise ValueError("prior_weight and half_life_s must be > 0")
        self.default_profile = default_profile
        self.prior_scale = prior_scale
        self.prior_weight = prior_weight
        self.half_life_s = half_life_s
        self._last: dict[str, LoadReport] = {}
        self._windows: dict[str, _Window] = {}
        self._fits: dict[str, _Fit] = {}
        self._prompts: dict[str, _Prompts] = {}
        # decode_context per worker: who has sent one, and how many decoding readings came without
        # (a counting shim sends 0 for a moment when its legs end between two readings)
        self._context_seen: set[str] = set()
        self._no_context: dict[str, int] = {}
        # Seconds between a worker's last busy engine readings (running at both ends): its shim polls
        # /metrics every poll_s plus the time /metrics takes to answer, which can be far longer than
        # its report period.
        self._spacings: dict[str, deque[float]] = {}
        self._dropped: dict[str, int] = {}  # busy stretches that could not be read, per worker
        self._clamp_warned: set[str] = set()
        self._out_fits: dict[str, int] = {}  # fits in a row past the bounds, per worker
        self._profile: dict[str, str | None] = {}  # the profile each worker's fit is against
        # Each said once per worker, and a fleet can share each cause (one old shim build, one wrong
        # profile, one lossy NATS path): the first workers named, the rest counted. Only said lines
        # reach these, never a load report that says nothing.
        self._dropped_lines = FleetLines(
            log,
            logging.WARNING,
            "busy stretches of their engines dropped and none fitted, so their timing stays the prior (one cause "
            "for many workers at once: load reports or readings lost on a path they share, NATS or slow /metrics, "
            "or a step of their hosts' clocks; counted in kvswitch_router_timing_dropped_stretches)",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._clamped_lines = FleetLines(
            log,
            logging.WARNING,
            f"fit outside [{MIN_SCALE:g}, {MAX_SCALE:g}] against their timing profiles, so they are predicted at the "
            "bound, wrongly (one cause for many workers at once: a profile not their model and GPU; give their shims "
            "a --timing-profile of both)",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._no_context_lines = FleetLines(
            log,
            logging.WARNING,
            "decode but their load reports carry no decode_context, so their decode timing is fitted against KV use "
            "and may read slow (one cause for many workers at once: shims of a build that does not count it)",
            clock=clock,
            fleet_log=fleet_log,
        )

    def shape(self, info: WorkerInfo) -> TimingModel | None:
        """The worker's profile, the default one when it registered none; None for a name this
        router does not know (logged once: the policies then say so rather than guess)."""
        return _known_profile(info.timing_profile or self.default_profile)

    def forget(self, worker: str) -> None:
        self._context_seen.discard(worker)
        self._no_context.pop(worker, None)
        self._spacings.pop(worker, None)
        self._dropped.pop(worker, None)
        self._clamp_warned.discard(worker)
        self._out_fits.pop(worker, None)
        self._last.pop(worker, None)
        self._windows.pop(worker, None)
        self._fits.pop(worker, None)
        self._prompts.pop(worker, None)
        self._profile.pop(worker, None)

    def observe(self, info: WorkerInfo | None, report: LoadReport) -> None:
        """A load report of `info`'s worker arrived (None: unknown worker, ignored)."""
        if info is None:
            return
        worker = report.worker
        profile = info.timing_profile or self.default_profile
        if self._profile.setdefault(worker, profile) != profile:
            # Re-registered under another profile (the fix a clamp warning asks for): its factors were
            # fitted against the old profile's shape.
            self.forget(worker)
            self._profile[worker] = profile
        prev = self._last.get(worker)
        if prev is not None and _late(prev, report):
            return
        if prev is None or report.iterations < prev.iterations:  # first report, or the engine restarted
            self._last[worker] = report
            self._windows.pop(worker, None)
            return
        y = (report.engine_ts or report.ts) - (prev.engine_ts or prev.ts)
        if y == 0:
            # A heartbeat repeating the last engine reading. `prev` stays that reading's first report,
            # so the wall time read below is between two readings, not since the last heartbeat.
            return
        self._last[worker] = report
        if report.engine_ts and not prev.engine_ts:
            # The shim's first reading after reports without one (sent before its first poll came
            # back): their report times are no reading to measure against, so this one is the baseline.
            self._windows.pop(worker, None)
            return
        started, running = prev.running > 0, report.running > 0
        contexts = (prev.decode_context, report.decode_context)
        steps = report.iterations - prev.iterations
        step_tokens = (report.iteration_tokens - prev.iteration_tokens) / steps if steps > 0 else 0.0
        if y < 0 or not _readable(y, report.ts - prev.ts, contexts, step_tokens, info):
            # In the fit's sums it would stay for good (an inf or NaN: decay never clears it) or for
            # hours (a finite absurdity). The stretch cannot be read.
            self._drop(
                worker,
                started or running,
                "its readings cannot be true (the engine's clock running back, or ahead of the wall's: check the "
                "shim host's clock; or a decode context past max_model_len, or steps of more tokens than a prompt "
                "at max_model_len and a batch beside it: check the shim's counters)",
            )
            return
        spacings = self._spacings.setdefault(worker, deque(maxlen=SPACINGS))
        cadence = statistics.median(spacings) if spacings else 0.0
        if started and running:  # the cadence of busy readings: a loaded /metrics is the slow one
            known = len(spacings) >= CADENCE_KNOWN
            spacings.append(y)
            if known and y > MAX_BUSY_GAP_PERIODS * max(report.period_s, cadence, 0.05):
                self._drop(
                    worker,
                    True,
                    f"its engine was busy at two readings {y:.2f} s apart, over {MAX_BUSY_GAP_PERIODS:g}x its reading "
                    f"cadence ({cadence:.2f} s) and report period ({report.period_s:g} s), so how long it was busy "
                    "between cannot be told: check that its shim's load reports reach this router (NATS) and that "
                    "the shim host's clock does not step",
                )
                return
        if not started and not running:
            self._windows.pop(worker, None)  # idle throughout (or too short to tell): nothing to read
            return
        if not (started and running) and y > MAX_GAP_PERIODS * max(report.period_s, cadence, 0.05):
            # Started or stopped within a gap far longer than the worker's readings are apart: readings
            # went missing, so how long it was busy cannot be told.
            self._drop(
                worker,
                True,
                f"its engine started or went idle between two readings {y:.2f} s apart, over {MAX_GAP_PERIODS:g}x "
                f"its reading cadence ({cadence:.2f} s) and report period ({report.period_s:g} s): check that its "
                "shim's load polls and reports reach this router (the engine's /metrics latency, NATS)",
            )
            return
        shape = self.shape(info)
        if shape is None:
            return
        window = self._windows.get(worker)
        if window is None or not started:
            window = self._windows[worker] = _Window()
        prompt = self._prompt(worker, prev, report)
        x_d, prefill = self._work(info, shape, prev, report)
        mnbt = info.max_num_batched_tokens or FULL_BATCH_TOKENS
        if prefill is not None and prompt is None:
            window.unpriced.append(prefill)  # priced when the window closes, when its prompts may be counted
        elif prefill is not None:
            window.x_p += _prefill_work(shape, prompt, mnbt, *prefill)
        window.y += y if started and running else y / 2  # started or went idle within: half, expected
        window.x_d += x_d
        worked = window.x_d > 0 or window.x_p > 0 or bool(window.unpriced)  # one that counted nothing holds on
        full = window.y >= MAX_WINDOW_S or (window.y >= WINDOW_S and not self._prefilling(prev, report))
        if not running or (worked and full):
            del self._windows[worker]
            if worked:
                prompt = self._prompts[worker].mean()  # as counted by now
                priced = sum(_prefill_work(shape, prompt, mnbt, *p) for p in window.unpriced)
                late_p = priced if prompt is not None else 0.0  # else the default, as for any worker counting none
                fit = self._fits.get(worker)
                if fit is None:
                    fit = self._fits[worker] = _Fit(self.prior_scale, self.prior_weight)
                x_p = window.x_p + priced
                fit.add(report.ts, window.y, window.x_d, x_p, self.half_life_s, _weight(window.x_d, x_p, late_p))
                self._warn_clamped(info, fit)

    @staticmethod
    def _prefilling(prev: LoadReport, report: LoadReport) -> bool:
        """Whether the engine holds a request still prefilling: more running than the interval
        decoded per step, less the requests that finished in it (they decoded, and have left
        `running`; vLLM counts a request's prefill figures when it finishes, so `prefill_requests`
        moves with them: a shim without prompt counters leaves a finish uncounted, and a prompt
        beside it unseen for that interval). vLLM counts a prompt's tokens at its first token, so a
        window closed meanwhile would hold the prompt's time but not its work (a decode worker's
        80 k-token prompt made two 10 s windows of x_p 0, and the fit read k_d 2.2 and k_p -1.2)."""
        steps = report.iterations - prev.iterations
        decoding = (report.itl_count - prev.itl_count) / steps if steps > 0 else 0.0
        finished = max(report.prefill_requests - prev.prefill_requests, 0)
        return report.running > max(math.ceil(decoding) - finished, 0)

    def _drop(self, worker: str, busy: bool, why: str) -> None:
        """The current busy stretch cannot be read: it is dropped, counted, and said once when a
        worker's stretches keep being dropped and none was ever fitted (its timing stays the prior)."""
        self._windows.pop(worker, None)
        if not busy:
            return
        n = self._dropped[worker] = self._dropped.get(worker, 0) + 1
        if n == DROPPED_WARN_AFTER and worker not in self._fits:
            self._dropped_lines.say(
                worker,
                "worker %s: %d busy stretches of its engine were dropped and none fitted, so its timing stays "
                "the prior (its profile's times x%g); the last was dropped because %s",
                worker, n, self.prior_scale, why,
            )  # fmt: skip

    def _warn_clamped(self, info: WorkerInfo, fit: _Fit) -> None:
        """Said once per worker: a settled fit past the bounds predicts the engine at the bound, wrong.
        Settled: CLAMP_WARN_BUSY_S observed and CLAMP_WARN_FITS fits in a row past them (a fit of one or
        two windows can land anywhere and come back)."""
        named = zip(("k_d", "k_p"), fit.estimate, strict=True)
        out = [f"{name}={k:.3g}" for name, k in named if not MIN_SCALE <= k <= MAX_SCALE]
        worker = info.worker
        runs = self._out_fits[worker] = self._out_fits.get(worker, 0) + 1 if out else 0
        if worker in self._clamp_warned or runs < CLAMP_WARN_FITS or fit.busy_s < CLAMP_WARN_BUSY_S:
            return
        self._clamp_warned.add(worker)
        profile = info.timing_profile or f"{self.default_profile} (the default: it registered none)"
        self._clamped_lines.say(
            worker,
            "worker %s's engine fits %s against timing profile %s, outside [%g, %g], so it is predicted at "
            "the bound, wrongly: its profile may not be its model and GPU (give its shim a --timing-profile "
            "of both), or its decode and prefill work trade off in the fit (docs/benchmarks.md, "
            "Self-calibration)",
            worker, ", ".join(out), profile, MIN_SCALE, MAX_SCALE,
        )  # fmt: skip

    def _prompt(self, worker: str, prev: LoadReport, report: LoadReport) -> tuple[int, int] | None:
        """(new, cached) tokens of the worker's average recent prompt, None while it reports none."""
        prompts = self._prompts.get(worker)
        if prompts is None:
            prompts = self._prompts[worker] = _Prompts()
        n = max(report.prefill_requests - prev.prefill_requests, 0)
        new = max(report.prefill_computed_tokens - prev.prefill_computed_tokens, 0)
        cached = max(report.prefix_hit_tokens - prev.prefix_hit_tokens, 0)
        # vLLM counts a prompt's hits when it is scheduled and its computed tokens when it finishes,
        # often in different intervals: the sums' ratios are right only if each lands where it moved.
        if n or new or cached:
            prompts.add(n, new, cached)
        return prompts.mean()

    def _work(
        self, info: WorkerInfo, shape: TimingModel, prev: LoadReport, report: LoadReport
    ) -> tuple[float, tuple[int, int, int] | None]:
        """The interval's decode work x_d in units of the profile, and its prefill to price
        (`_prefill_work`): (prefill tokens, steps, decode batch or 0), None without any."""
        steps = report.iterations - prev.iterations
        if steps <= 0:
            return 0.0, None
        decode_tokens = max(report.itl_count - prev.itl_count, 0)
        # A step's tokens are what it prefilled and what it generated; under speculative decoding a
        # request generates several per step but counts one ITL. A shim before generation_tokens: ITLs.
        # One outside [0, the step tokens] is no count of this interval (a shim that started sending it).
        generated = report.generation_tokens - prev.generation_tokens
        if not report.generation_tokens or not 0 <= generated <= report.iteration_tokens - prev.iteration_tokens:
            generated = decode_tokens
        prefill_tokens = max(report.iteration_tokens - prev.iteration_tokens - generated, 0)
        if not decode_tokens:
            return 0.0, (prefill_tokens, steps, 0) if prefill_tokens else None
        at = report if report.running > 0 else prev  # went idle: the last busy reading's context
        context_d = at.decode_context
        if context_d:
            self._context_seen.add(info.worker)
        else:
            context_d = at.kv_used_blocks * info.block_size / max(at.running, 1)
            missed = self._no_context[info.worker] = self._no_context.get(info.worker, 0) + 1
            if missed == NO_CONTEXT_WARN_AFTER and info.worker not in self._context_seen:
                self._no_context_lines.say(
                    info.worker,
                    "worker %s decodes but its load reports carry no decode_context (a shim that does not "
                    "count it, or requests that bypass the shim): its decode timing is fitted against KV "
                    "use, which counts a prefix its requests share once, so it may read slow",
                    info.worker,
                )
        batch = max(round(decode_tokens / steps), 1)
        return steps * shape.decode(batch, context_d), (prefill_tokens, steps, batch) if prefill_tokens else None

    def timing(self, info: WorkerInfo) -> WorkerTiming | None:
        """The worker's fitted timing; None when its profile is unknown here."""
        shape = self.shape(info)
        if shape is None:
            return None
        fit = self._fits.get(info.worker)
        k_d = fit.decode_scale if fit is not None else self.prior_scale
        k_p = fit.prefill_scale if fit is not None else self.prior_scale
        return WorkerTiming(shape, k_d, k_p, info.kv_bytes_per_token, info.max_num_batched_tokens or FULL_BATCH_TOKENS)

    def factors(self) -> dict[str, tuple[float, float, float]]:
        """Per worker fitted so far: (decode scale, prefill scale, busy seconds observed)."""
        return {w: (f.decode_scale, f.prefill_scale, f.busy_s) for w, f in self._fits.items()}

    def dropped(self) -> dict[str, int]:
        """Per worker: busy stretches dropped as unreadable (kvswitch_router_timing_dropped_stretches)."""
        return dict(self._dropped)

    def warm_s(self, worker: str) -> float:
        """Busy seconds observed for `worker` so far."""
        fit = self._fits.get(worker)
        return fit.busy_s if fit is not None else 0.0
