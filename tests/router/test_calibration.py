"""router.calibration: the fit recovers a synthetic engine's known speed from its reports' counters,
from any starting profile, follows a change, and ignores what cannot be read as busy time."""

from __future__ import annotations

import itertools
import math
import random

import msgspec
import pytest

from protocol import LoadReport, WorkerInfo
from protocol.timing import DEFAULT_PROFILE, TimingModel, speed_profile
from router.calibration import (
    DROPPED_WARN_AFTER,
    LONGEST_CONTEXT,
    MAX_SCALE,
    MAX_WINDOW_S,
    MIN_SCALE,
    NO_CONTEXT_WARN_AFTER,
    WINDOW_S,
    Calibration,
    WorkerTiming,
    _Fit,
    _weight,
    timing_of,
)

BLOCK = 16
MNBT = 8192
SHAPE = TimingModel.for_profile(DEFAULT_PROFILE)


def _info(name: str = "w", profile: str | None = DEFAULT_PROFILE) -> WorkerInfo:
    return WorkerInfo(
        worker=name, model="m", role="decode", engine="vllm", block_size=BLOCK, max_num_batched_tokens=MNBT,
        timing_profile=profile,
    )  # fmt: skip


def _fitted(cal: Calibration, info: WorkerInfo) -> WorkerTiming:
    t = cal.timing(info)
    assert t is not None
    return t


class SyntheticEngine:
    """An engine whose step takes k_d * decode_s(B, C) + k_p * (prefill part) exactly, reporting
    the cumulative counters a shim forwards."""

    def __init__(self, k_d: float, k_p: float, seed: int = 0) -> None:
        self.k_d, self.k_p = k_d, k_p
        self.rng = random.Random(seed)
        self.ts = 0.0
        self.iterations = self.iteration_tokens = self.itl_count = 0

    def interval(self, *, running: int, context: int, prefill_tokens: int, steps: int = 40) -> LoadReport:
        """`steps` steps of `running` decodes at `context` tokens, with `prefill_tokens` of chunks."""
        if running:
            busy = self.k_d * steps * SHAPE.decode(running, context)
            busy += self.k_p * prefill_tokens * SHAPE.marginal(MNBT, 0, running) / MNBT
        else:
            busy = self.k_p * steps * SHAPE.prefill(round(prefill_tokens / steps))
        self.ts += busy
        self.iterations += steps
        self.iteration_tokens += running * steps + prefill_tokens
        self.itl_count += running * steps
        return self.report(running=max(running, 1), context=context)

    def idle(self, seconds: float) -> LoadReport:
        self.ts += seconds
        return self.report(running=0, context=0)

    def report(self, *, running: int, context: int) -> LoadReport:
        return LoadReport(
            worker="w",
            ts=self.ts,
            running=running,
            kv_used_blocks=running * context // BLOCK,
            iterations=self.iterations,
            iteration_tokens=self.iteration_tokens,
            itl_count=self.itl_count,
        )


def _feed(cal: Calibration, engine: SyntheticEngine, intervals: int, info: WorkerInfo | None = None) -> None:
    info = info or _info()
    cal.observe(info, engine.report(running=1, context=4096))
    for _ in range(intervals):
        running = engine.rng.randrange(1, 64)
        prefill = engine.rng.choice([0, 0, 4096, 16384, 40000])
        context = engine.rng.randrange(512, 16384)
        cal.observe(info, engine.interval(running=running, context=context, prefill_tokens=prefill))


@pytest.mark.parametrize(("k_d", "k_p"), [(1.0, 1.0), (1.3, 0.8), (0.6, 2.0)])
def test_the_fit_recovers_a_known_engine_speed(k_d: float, k_p: float) -> None:
    cal = Calibration()
    _feed(cal, SyntheticEngine(k_d, k_p), 200)
    t = _fitted(cal, _info())
    assert t.decode_scale == pytest.approx(k_d, rel=0.02)
    assert t.prefill_scale == pytest.approx(k_p, rel=0.02)


def test_a_profile_25_percent_slow_is_corrected() -> None:
    cal = Calibration(prior_scale=1.25)
    assert _fitted(cal, _info()).prefill_s(8192) == pytest.approx(1.25 * SHAPE.prefill(8192))
    _feed(cal, SyntheticEngine(1.0, 1.0), 200)
    assert _fitted(cal, _info()).prefill_s(8192) == pytest.approx(SHAPE.prefill(8192), rel=0.02)


def test_a_worker_without_a_profile_is_calibrated_against_the_default_shape() -> None:
    cal = Calibration()
    info = _info(profile=None)
    assert timing_of(info, None) is None  # nothing to predict with until the router calibrates
    _feed(cal, SyntheticEngine(1.6, 0.7), 200, info)
    t = _fitted(cal, info)
    assert (t.decode_scale, t.prefill_scale) == pytest.approx((1.6, 0.7), rel=0.02)
    assert cal.warm_s("w") > 0


def test_a_prefill_only_engine_fits_its_prefill_and_keeps_the_prior_decode() -> None:
    cal = Calibration()
    engine = SyntheticEngine(1.0, 1.5)
    cal.observe(_info(), engine.report(running=1, context=0))
    for _ in range(100):
        cal.observe(_info(), engine.interval(running=0, context=0, prefill_tokens=engine.rng.randrange(8192, 80000)))
    t = _fitted(cal, _info())
    assert t.prefill_scale == pytest.approx(1.5, rel=0.02) and t.decode_scale == 1.0


def test_the_fit_follows_an_engine_that_slows_down() -> None:
    cal = Calibration(half_life_s=30.0)
    engine = SyntheticEngine(1.0, 1.0)
    _feed(cal, engine, 200)
    engine.k_d = engine.k_p = 2.0
    _feed(cal, engine, 400)
    t = _fitted(cal, _info())
    assert (t.decode_scale, t.prefill_scale) == pytest.approx((2.0, 2.0), rel=0.05)


def test_a_long_gap_busy_at_both_ends_is_dropped_not_read_as_busy() -> None:
    # Reports lost for 30 s (a NATS reconnect) or the shim host's clock stepping: the engine was busy
    # at both readings, mostly idle between. Read whole, it put k_d at 1.36 for minutes.
    for lost in ("reports", "clock step"):
        cal = Calibration()
        engine = SyntheticEngine(1.0, 1.0)
        _feed(cal, engine, 200)
        before = _fitted(cal, _info()).decode_scale
        if lost == "reports":
            engine.ts += 26.0  # idle, unseen: the router got no report of it
            report = engine.interval(running=8, context=4096, prefill_tokens=0)
        else:
            report = engine.interval(running=8, context=4096, prefill_tokens=0)
            report = msgspec.structs.replace(report, ts=report.ts + 30.0)
            engine.ts += 30.0
        cal.observe(_info(), report)
        _feed(cal, engine, 20)
        assert _fitted(cal, _info()).decode_scale == pytest.approx(before, rel=0.01), lost
        assert cal.dropped() == {"w": 1}, lost


def test_a_worker_registered_again_under_another_profile_starts_a_fresh_fit() -> None:
    # The fix a clamp warning asks for: factors fitted against the old profile's shape must not
    # carry over to the new one (the registry re-adds a changed record without removing it first).
    cal = Calibration()
    wrong, right = _info(profile="h200:qwen2.5-32b"), _info()
    _feed(cal, SyntheticEngine(1.0, 1.0), 200, wrong)
    assert _fitted(cal, wrong).decode_scale < 0.7
    cal.observe(right, SyntheticEngine(1.0, 1.0).report(running=1, context=4096))
    t = _fitted(cal, right)
    assert (t.decode_scale, t.prefill_scale) == (1.0, 1.0) and cal.warm_s("w") == 0.0


def test_idle_intervals_and_restarts_teach_nothing() -> None:
    cal = Calibration()
    engine = SyntheticEngine(1.0, 1.0)
    info = _info()
    cal.observe(info, engine.report(running=1, context=4096))
    cal.observe(info, engine.idle(30.0))  # 30 s with nothing running: not busy time
    cal.observe(info, engine.interval(running=8, context=4096, prefill_tokens=0))  # starts from an idle report
    assert cal.warm_s("w") == 0.0
    # A restarted engine's counters start over, read later (at the same instant a report repeats the
    # last reading and is skipped before the restart check, which the test then did not reach).
    engine.iterations = engine.iteration_tokens = engine.itl_count = 0
    engine.ts += 2.0
    cal.observe(info, engine.report(running=4, context=4096))
    assert cal.warm_s("w") == 0.0 and _fitted(cal, info).decode_scale == 1.0
    # The restarted engine's report is a baseline: its 2 s of restart are no busy time of the next window.
    while cal.warm_s("w") == 0.0:
        cal.observe(info, engine.interval(running=8, context=4096, prefill_tokens=0))
    assert _fitted(cal, info).decode_scale == pytest.approx(1.0, rel=1e-6)


def test_an_older_report_come_late_is_no_engine_restart() -> None:
    """Load reports come reordered across a quarantine's subscription switch (each subscription has
    its own queue in nats-py), or twice: an older one has fewer iterations than the last, as a
    restarted engine's has, but was made before it. Taken for a restart, it dropped the worker's
    fitting windows and measured the next from itself (review of 2026-12-07)."""
    info = _info()
    plain, reordered = Calibration(), Calibration()
    engine = SyntheticEngine(1.3, 1.0)
    reports = [engine.report(running=1, context=4096)]
    plain.observe(info, reports[0])
    while plain.warm_s("w") == 0.0:
        reports.append(engine.interval(running=8, context=4096, prefill_tokens=0))
        plain.observe(info, reports[-1])
    reordered.observe(info, reports[0])
    for before, report in itertools.pairwise(reports):
        reordered.observe(info, report)
        reordered.observe(info, before)  # the one before it, again, late
    assert reordered.warm_s("w") == plain.warm_s("w") > 0.0
    assert _fitted(reordered, info).decode_scale == _fitted(plain, info).decode_scale != 1.0


def _long_prefill(tokens: int, k_p: float, period: float = 0.5) -> list[LoadReport]:
    """A prefill engine's reports through one prompt of `tokens`, from idle to idle: it counts no
    step until the prompt's last chunk, so every report but the last has the same iterations."""
    busy = k_p * SHAPE.prefill_time(tokens, 0, budget=MNBT)
    reports, t = [LoadReport(worker="w", ts=0.0, running=0, period_s=period)], 0.0
    while t < busy:
        t = min(t + period, busy)
        done = int(t >= busy)
        reports.append(LoadReport(worker="w", ts=t, running=1 - done, period_s=period, iterations=done,
                                  iteration_tokens=done * (tokens + 1)))  # fmt: skip
    return reports


def test_an_older_report_come_late_during_a_long_prefill_is_ignored() -> None:
    """While a prompt prefills no step is counted, so a report come late has as many iterations as
    the last: read as an interval it ran the clock back, and the open window, the prompt's busy
    seconds, was dropped as a clock fault ('check the shim host's clock'; 2026-12 audit)."""
    info = _info()
    plain, reordered = Calibration(), Calibration()
    reports = _long_prefill(100_000, 1.3)
    for r in reports:
        plain.observe(info, r)
    reordered.observe(info, reports[0])
    for before, report in itertools.pairwise(reports):
        reordered.observe(info, report)
        reordered.observe(info, before)  # the one before it, again, late
    assert plain.warm_s("w") > 10.0 and plain.dropped() == {}
    assert reordered.dropped() == {}
    assert reordered.warm_s("w") == plain.warm_s("w")
    assert _fitted(reordered, info).prefill_scale == _fitted(plain, info).prefill_scale != 1.0


def test_a_clock_step_back_during_a_long_prefill_is_still_a_clock_fault() -> None:
    """The cost of ignoring those: a step back of the shim host's clock while the prompt prefills
    looks the same, and is read at the report that counts the prompt, as the fault it is when the
    step is past the time to it; reports after it are read from it. (Before, the reports after the
    step were read from it: a window of the prompt's tail time holding all its work, k_p read low.)"""
    info, cal = _info(), Calibration()
    reports = _long_prefill(100_000, 1.0)
    step = 20.0
    for i, r in enumerate(reports):
        cal.observe(info, msgspec.structs.replace(r, ts=r.ts - step) if i >= 5 else r)
    assert cal.dropped() == {"w": 1} and cal.warm_s("w") == 0.0
    t = reports[-1].ts - step
    for r in _long_prefill(100_000, 1.0):
        cal.observe(info, msgspec.structs.replace(r, ts=t + 1.0 + r.ts, iterations=r.iterations + 1,
                                                  iteration_tokens=r.iteration_tokens + 100_001))  # fmt: skip
    assert cal.dropped() == {"w": 1} and cal.warm_s("w") > 9.0  # the second prompt, 10.2 s, fitted


def test_a_restart_while_the_shim_hosts_clock_stepped_back_is_a_restart() -> None:
    """Fewer iterations and an older stamp, but a new KV epoch (the shim's new session with the
    restarted engine): a restart, not a late report (review of ba7d33d)."""
    info = _info()
    cal = Calibration()
    engine = SyntheticEngine(1.3, 1.0)
    cal.observe(info, engine.report(running=1, context=4096))
    for _ in range(5):
        last = engine.interval(running=8, context=4096, prefill_tokens=0)
        cal.observe(info, last)
    restarted = msgspec.structs.replace(last, ts=last.ts - 2.0, iterations=0, kv_epoch=last.kv_epoch + 1)
    cal.observe(info, restarted)
    assert cal._last["w"] is restarted


@pytest.mark.parametrize(
    ("name", "value"),
    [("decode_context", math.inf), ("decode_context", math.nan), ("engine_ts", math.inf), ("engine_ts", math.nan),
     ("ts", math.inf), ("ts", math.nan), ("engine_ts", 1e12), ("decode_context", 1e12)],
)  # fmt: skip
def test_one_report_not_finite_leaves_the_fit_to_the_honest_ones(name: str, value: float) -> None:
    """Before, its inf or NaN entered the fit's sums, which decay never clears: the worker read as
    its raw profile (factors 1.0) for as long as it stayed registered. A finite absurdity (an engine
    clock in ms, a context past the model's) pinned the fit at its bounds for 1-2 hours."""
    cal = Calibration()
    info = msgspec.structs.replace(_info(), max_model_len=131072)
    engine = SyntheticEngine(2.5, 0.6)
    cal.observe(info, engine.report(running=1, context=4096))
    for i in range(200):
        running = engine.rng.randrange(1, 64)
        prefill = engine.rng.choice([0, 0, 4096, 16384, 40000])
        r = engine.interval(running=running, context=engine.rng.randrange(512, 16384), prefill_tokens=prefill)
        cal.observe(info, msgspec.structs.replace(r, **{name: value}) if i == 3 else r)
    t = _fitted(cal, info)
    assert (t.decode_scale, t.prefill_scale) == pytest.approx((2.5, 0.6), rel=0.02)


def test_unknown_workers_are_ignored_and_bad_priors_refused() -> None:
    cal = Calibration()
    cal.observe(None, LoadReport(worker="x", ts=1.0))
    assert cal.warm_s("x") == 0.0
    with pytest.raises(ValueError, match="prior_scale"):
        Calibration(prior_scale=10.0)


def test_worker_timing_scales_the_shape() -> None:
    t = WorkerTiming(SHAPE, decode_scale=2.0, prefill_scale=0.5, kv_bytes_per_token=1000)
    assert t.decode_s(8, 4096) == pytest.approx(2.0 * SHAPE.decode(8, 4096))
    assert t.prefill_s(4096, 1024) == pytest.approx(0.5 * SHAPE.prefill(4096, 1024))
    assert t.stall_s(2048, 0, 4) == pytest.approx(0.5 * SHAPE.marginal(2048, 0, 4))
    assert t.transfer_s(1000, 1.0) == pytest.approx(1e-3)  # the worker's own bytes per token
    assert t.prefill_rate(MNBT) == pytest.approx(MNBT / (0.5 * SHAPE.prefill(MNBT)))


def test_a_long_prompt_is_priced_in_the_chunks_its_engine_prefills_it_in() -> None:
    """As engine_sim charges it (protocol.timing.prefill_time: one step per chunk of the worker's
    max_num_batched_tokens, each over those before it): one step's price for the whole prompt read
    a 191 k-token prompt as 11 s where its chunks take 33 s, and slo_aware sent such prompts to a
    prefill worker whose leg then ran past prefill_timeout_s."""
    info = msgspec.structs.replace(_info(), max_num_batched_tokens=4096)
    for timing in (timing_of(info, None), Calibration().timing(info)):
        assert timing is not None and timing.chunk_tokens == 4096
        want = SHAPE.prefill_time(191_386, 1000, budget=4096)
        assert timing.prefill_s(191_386, 1000) == pytest.approx(want)
        assert want > 2.5 * SHAPE.prefill(191_386, 1000)
        assert timing.prefill_s(3000, 1000) == pytest.approx(SHAPE.prefill(3000, 1000))  # one chunk: one step


def test_a_profile_unknown_here_gets_no_timing_rather_than_a_guess() -> None:
    cal = Calibration()
    info = _info(profile="h200:no-such-model")
    engine = SyntheticEngine(1.0, 1.0)
    _feed(cal, engine, 20, info=info)
    assert cal.timing(info) is None and cal.warm_s("w") == 0.0


def test_busy_time_is_measured_between_the_engine_readings_not_the_reports() -> None:
    # A heartbeat repeats the last reading: the report's ts moves on, the engine's figures do not.
    cal = Calibration()
    info = _info()
    engine = SyntheticEngine(1.5, 1.0)
    first = engine.interval(running=8, context=4096, prefill_tokens=0)
    cal.observe(info, msgspec.structs.replace(first, engine_ts=first.ts, ts=first.ts + 0.2))
    for _ in range(30):
        r = engine.interval(running=8, context=4096, prefill_tokens=0)
        cal.observe(info, msgspec.structs.replace(r, engine_ts=r.ts, ts=r.ts + 0.2))
        cal.observe(info, msgspec.structs.replace(r, engine_ts=r.ts, ts=r.ts + 0.45))  # the heartbeat
    assert _fitted(cal, info).decode_scale == pytest.approx(1.5, rel=0.02)


def test_the_calibrated_model_scales_decode_and_prefill_work_apart() -> None:
    t = WorkerTiming(SHAPE, decode_scale=2.0, prefill_scale=0.5)
    m = t.model()
    assert m.decode(8, 4096) == pytest.approx(2.0 * SHAPE.decode(8, 4096))
    assert m.prefill(4096) == pytest.approx(0.5 * SHAPE.prefill(4096))
    assert m.step(8, 4096, [(1024, 0)]) == pytest.approx(2.0 * SHAPE.decode(8, 4096) + 0.5 * SHAPE.marginal(1024, 0, 8))
    assert m.transfer(1000, 50.0) == SHAPE.transfer(1000, 50.0)  # the link's speed, not the engine's
    assert WorkerTiming(SHAPE).model() is SHAPE


def test_prompts_counted_when_their_first_token_comes_out_are_fitted_without_bias() -> None:
    # vLLM counts a prompt's tokens (and a step) only when the step produces output, so a long
    # prompt that starts on an idle engine is counted in a later report than most of its compute.
    # A prefill engine of known speed serving one prompt at a time, idle between them, reporting
    # every 0.5 s as a shim does: the fit must not read the early intervals as idle busy time.
    k_p, period = 1.4, 0.5
    cal = Calibration()
    info = _info()
    rng = random.Random(3)
    t, iterations, tokens = 0.0, 0, 0
    events: list[tuple[float, int, int]] = []  # (time, running after, tokens counted then)
    for _ in range(120):
        t += rng.uniform(0.1, 3.0)  # idle gap
        prompt = rng.randrange(4096, 40000)
        busy = k_p * SHAPE.prefill(prompt)
        events.append((t, 1, 0))
        t += busy
        events.append((t, 0, prompt))
    reports, e = [], 0
    clock = 0.0
    running = 0
    while e < len(events):
        clock += period
        while e < len(events) and events[e][0] <= clock:
            _, running, counted = events[e]
            if counted:
                iterations += 1
                tokens += counted + 1  # the prompt and its first token
            e += 1
        reports.append(LoadReport(worker="w", ts=clock, running=running, period_s=period,
                                  iterations=iterations, iteration_tokens=tokens))  # fmt: skip
    for r in reports:
        cal.observe(info, r)
    assert _fitted(cal, info).prefill_scale == pytest.approx(k_p, rel=0.1)


class CachedContextEngine(SyntheticEngine):
    """Prompts with cached context: each interval prefills `prompts` prompts of `new` tokens over
    `cached` cached ones beside `running` decodes, at k_p times what the profile's marginal charges
    for each, and reports the prompt counters vLLM exports (computed tokens, cache hits)."""

    def __init__(self, k_d: float, k_p: float, seed: int = 0) -> None:
        super().__init__(k_d, k_p, seed)
        self.prompts = self.computed = self.hits = 0

    def prompt_interval(self, *, running: int, context: int, prompts: int, new: int, cached: int) -> LoadReport:
        steps = 40
        self.ts += self.k_d * steps * SHAPE.decode(running, context)
        self.ts += self.k_p * prompts * SHAPE.marginal(new, cached, running)
        self.iterations += steps
        self.iteration_tokens += running * steps + prompts * new
        self.itl_count += running * steps
        self.prompts += prompts
        self.computed += prompts * new
        self.hits += prompts * cached
        return self.report(running=running, context=context)

    def report(self, *, running: int, context: int) -> LoadReport:
        r = super().report(running=running, context=context)
        return msgspec.structs.replace(
            r, prefill_requests=self.prompts, prefill_computed_tokens=self.computed, prefix_hit_tokens=self.hits
        )


def _feed_cached(cal: Calibration, engine: CachedContextEngine, counters: bool) -> None:
    info = _info()
    cal.observe(info, engine.report(running=1, context=4096))
    for _ in range(200):
        r = engine.prompt_interval(
            running=engine.rng.randrange(1, 48),
            context=engine.rng.randrange(4096, 32768),
            prompts=engine.rng.randrange(1, 4),
            new=engine.rng.randrange(256, 2048),
            cached=engine.rng.randrange(8192, 32768),
        )
        if not counters:  # what a shim forwarding no prompt counters would report
            r = msgspec.structs.replace(r, prefill_requests=0, prefill_computed_tokens=0, prefix_hit_tokens=0)
        cal.observe(info, r)


def test_prefill_over_cached_context_is_fitted_at_its_own_speed() -> None:
    # Short new parts over long cached prefixes (the shipped trace's multi-turn prompts) cost more
    # per token than a context-free chunk: read without the cached context, a right profile looked
    # 1.5-2.2x slow. With the prompt counters the fit finds the engine's own speed.
    cal = Calibration()
    _feed_cached(cal, CachedContextEngine(1.0, 1.2), counters=True)
    t = _fitted(cal, _info())
    assert t.prefill_scale == pytest.approx(1.2, rel=0.1)
    assert t.decode_scale == pytest.approx(1.0, rel=0.05)
    blind = Calibration()
    _feed_cached(blind, CachedContextEngine(1.0, 1.2), counters=False)
    assert _fitted(blind, _info()).prefill_scale > 1.2 * 1.25  # the bias the counters remove


def test_prefill_before_any_prompt_was_counted_is_priced_at_the_prompts_counted_by_the_windows_close() -> None:
    # vLLM counts a prompt's computed tokens when the request finishes, so a decode worker's first
    # interval would price its prefill as the default prompt (a full batch, nothing cached) where its
    # prompts are short over long cached prefixes. Its windows are nearly collinear (prefill a steady
    # tenth of each), so that one guess kept k_p 1.4% off here.
    cal, info = Calibration(), _info()
    engine = CachedContextEngine(1.0, 1.0, seed=2)
    cal.observe(info, engine.report(running=1, context=4096))
    for _ in range(120):
        r = engine.prompt_interval(
            running=engine.rng.randrange(24, 40),
            context=engine.rng.randrange(6000, 10000),
            prompts=1,
            new=512,
            cached=8192,
        )
        if engine.ts < 6.0:  # the first prompts are counted later, when they finish
            r = msgspec.structs.replace(r, prefill_requests=0, prefill_computed_tokens=0, prefix_hit_tokens=0)
        cal.observe(info, r)
    t = _fitted(cal, info)
    assert (t.decode_scale, t.prefill_scale) == pytest.approx((1.0, 1.0), rel=0.005)


@pytest.mark.parametrize(("decodes", "draining"), [(4, False), (16, True)])
def test_a_window_holds_open_while_a_long_prompt_prefills_beside_decodes(decodes: int, draining: bool) -> None:
    # vLLM counts a prompt's tokens at its first token. A decode worker prefilling an 80 k-token
    # prompt beside decodes for longer than a window: closed meanwhile, a window held the prompt's
    # time with none of its work, and the fit read it as slow decoding (k_d 2.2, k_p -1.2 on the
    # trace's decode workers under `ttft_model`). Draining: a decode finishes in every interval; it
    # decoded there and has left `running`, so it must not hide the prompt still in flight (before,
    # the window closed at 10 s with x_p 0 and the fit read k_d 2.6, k_p 0.2).
    cal, info = Calibration(), _info()
    engine = CachedContextEngine(1.0, 1.0, seed=4)
    cal.observe(info, engine.report(running=1, context=4096))
    new, chunk = 80_000, MNBT - decodes
    for _ in range(12):
        running, done = decodes, 0
        while done < new:  # the prompt's chunks: decodes count, the prompt does not yet
            n = min(chunk, new - done)
            left = running - 1 if draining and running > 2 else running  # one finishes halfway through
            engine.ts += (
                20 * SHAPE.decode(running, 8192) + 20 * SHAPE.decode(left, 8192) + SHAPE.marginal(n, done, left)
            )
            engine.iterations += 40
            engine.iteration_tokens += 20 * (running + left)
            engine.itl_count += 20 * (running + left)
            if left < running:  # vLLM counts the finished request's prefill figures now: an earlier long prompt
                engine.prompts += 1
                engine.computed += new
            done, running = done + n, left
            cal.observe(info, engine.report(running=running + 1, context=8192))
        engine.prompts += 1  # its first token: vLLM counts it all now
        engine.computed += new
        engine.iteration_tokens += new
        for _ in range(10):  # then decoding alone for a while
            cal.observe(info, engine.prompt_interval(running=decodes, context=8192, prompts=0, new=1, cached=0))
    t = _fitted(cal, info)
    assert (t.decode_scale, t.prefill_scale) == pytest.approx((1.0, 1.0), rel=0.1)


def test_a_prompt_longer_than_any_window_is_fitted_whole() -> None:
    # One prompt keeps a prefill engine busy for minutes and is counted only at its first token: the
    # window that holds its time must still be open then (closed at MAX_WINDOW_S with nothing
    # counted, its time would be lost and the prompt read five times faster than it ran). The engine
    # prefills it in chunks of MNBT, as engine_sim does (this test charged it as one step once).
    cal, info = Calibration(), _info()
    tokens, k_p = 400_000, 3.0  # an engine three times slower than its profile
    busy = k_p * SHAPE.prefill_time(tokens, 0, budget=MNBT)
    assert busy > 1.5 * MAX_WINDOW_S
    t, period, counted = 0.0, 0.5, 0
    cal.observe(info, LoadReport(worker="w", ts=t, running=0, period_s=period))
    for _ in range(3):
        end = t + busy
        while t < end:
            t = min(t + period, end)
            if t == end:
                counted += 1
            cal.observe(info, LoadReport(worker="w", ts=t, running=0 if t == end else 1, period_s=period,
                                         iterations=counted, iteration_tokens=counted * (tokens + 1)))  # fmt: skip
        t += 5.0
        cal.observe(info, LoadReport(worker="w", ts=t, running=0, period_s=period, iterations=counted,
                                     iteration_tokens=counted * (tokens + 1)))  # fmt: skip
    assert _fitted(cal, info).prefill_scale == pytest.approx(k_p, rel=0.1)


@pytest.mark.parametrize(("lo", "hi"), [(40_000, 120_000), (120_000, 192_000)])
def test_prompts_longer_than_a_step_on_a_prefill_engine_are_priced_in_their_chunks(lo: int, hi: int) -> None:
    """A prefill engine at 1.4 times its profile serving one prompt at a time, each prefilled in
    chunks of MNBT tokens, each over those before it (engine_sim's TimingModel.prefill_time), and
    counted, one step, at its last. Priced as one step of the whole prompt, 40-120 k-token prompts
    fitted k_p 1.5 for 1.0 (the shipped trace's prompts reach 191 k tokens; 2026-12 audit)."""
    k_p, period = 1.4, 0.5
    cal, info = Calibration(), _info()
    rng = random.Random(3)
    t, iterations, tokens = 0.0, 0, 0
    events: list[tuple[float, int, int]] = []  # (time, running after, tokens counted then)
    for _ in range(60):
        t += rng.uniform(0.1, 3.0)
        prompt = rng.randrange(lo, hi)
        events.append((t, 1, 0))
        t += k_p * SHAPE.prefill_time(prompt, 0, budget=MNBT)
        events.append((t, 0, prompt))
    clock, running, e = 0.0, 0, 0
    while e < len(events):
        clock += period
        while e < len(events) and events[e][0] <= clock:
            _, running, counted = events[e]
            if counted:
                iterations += 1
                tokens += counted + 1  # the prompt and its first token
            e += 1
        cal.observe(info, LoadReport(worker="w", ts=clock, running=running, period_s=period,
                                     iterations=iterations, iteration_tokens=tokens))  # fmt: skip
    assert cal.dropped() == {}
    assert _fitted(cal, info).prefill_scale == pytest.approx(k_p, rel=0.1)


@pytest.mark.parametrize(("max_model_len", "limit"), [(131072, 131072 + MNBT), (None, LONGEST_CONTEXT + MNBT)])
def test_steps_of_more_tokens_than_a_prompt_can_hold_are_unreadable(max_model_len: int | None, limit: int) -> None:
    """A report's step that counts more tokens than a prompt at max_model_len and a budget beside it
    cannot be true: before, a prefill-only interval with iteration_tokens +10^10 was priced in 10^6
    chunks of MNBT tokens, holding the event loop for seconds (review of 6188f59). Now it drops its
    stretch, counted, as any figures that cannot be true; one step at the limit is read."""
    info = msgspec.structs.replace(_info(), max_model_len=max_model_len)
    for tokens, dropped in ((limit, {}), (limit + 1, {"w": 1}), (10**10, {"w": 1})):
        cal = Calibration()
        cal.observe(info, LoadReport(worker="w", ts=100.0, running=1, period_s=0.5))
        cal.observe(info, LoadReport(worker="w", ts=100.5, running=1, period_s=0.5, iterations=1,
                                     iteration_tokens=tokens, prefill_requests=1))  # fmt: skip
        assert cal.dropped() == dropped, tokens


class SharedPrefixEngine(SyntheticEngine):
    """Every running sequence shares one `shared`-token prefix, held once in the KV cache."""

    def __init__(self, shared: int, *, with_context: bool) -> None:
        super().__init__(1.0, 1.0)
        self.shared, self.with_context = shared, with_context

    def report(self, *, running: int, context: int) -> LoadReport:
        r = super().report(running=running, context=context)
        used = (self.shared + running * max(context - self.shared, 0)) // BLOCK
        return msgspec.structs.replace(
            r, kv_used_blocks=used, decode_context=float(context) if self.with_context else 0.0
        )


@pytest.mark.parametrize("with_context", [True, False])
def test_a_shared_prefix_is_priced_per_sequence_when_the_shim_reports_decode_context(with_context: bool) -> None:
    # A decode step reads each sequence's whole KV; the cache holds a shared prefix once. The
    # shim's decode_context gives the per-sequence length; without it, KV use over running
    # under-counts the context and a right profile fits slow.
    cal = Calibration()
    engine = SharedPrefixEngine(shared=4096, with_context=with_context)
    info = _info()
    cal.observe(info, engine.report(running=1, context=4608))
    for _ in range(200):
        running = engine.rng.randrange(8, 64)
        context = engine.rng.randrange(4608, 8192)
        cal.observe(info, engine.interval(running=running, context=context, prefill_tokens=0))
    k_d = _fitted(cal, info).decode_scale
    if with_context:
        assert k_d == pytest.approx(1.0, rel=0.02)
    else:
        assert k_d > 1.15  # the bias decode_context removes (decode workers fitted 1.3-2.0)


def test_a_worker_that_never_sends_decode_context_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    info = _info()
    old_shim = SharedPrefixEngine(shared=4096, with_context=False)
    cal = Calibration()
    cal.observe(info, old_shim.report(running=1, context=4608))
    for _ in range(NO_CONTEXT_WARN_AFTER * 2):
        cal.observe(info, old_shim.interval(running=16, context=6000, prefill_tokens=0))
    warned = [r for r in caplog.records if "no decode_context" in r.getMessage()]
    assert len(warned) == 1 and "worker w" in warned[0].getMessage()
    # A counting shim's momentary zeros (its legs ended between two readings) are not a fault.
    caplog.clear()
    counting = SharedPrefixEngine(shared=4096, with_context=True)
    cal = Calibration()
    cal.observe(info, counting.report(running=1, context=4608))
    for i in range(NO_CONTEXT_WARN_AFTER * 2):
        counting.with_context = i % 2 == 0
        cal.observe(info, counting.interval(running=16, context=6000, prefill_tokens=0))
    assert not [r for r in caplog.records if "no decode_context" in r.getMessage()]


def test_a_profile_this_router_cannot_load_is_not_read_again_for_every_request(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """timing_of runs per candidate and request: a profile that failed to load read every table
    from disk again each time, ~200 µs a call, and without calibration said nothing (reviews of
    the table checks)."""
    import protocol.timing

    reads = 0
    read = protocol.timing._read

    def counting(path: object) -> object:
        nonlocal reads
        reads += 1
        return read(path)  # type: ignore[arg-type]

    monkeypatch.setattr(protocol.timing, "_read", counting)
    info = _info(profile="h200:no-such-model-for-this-test")
    assert timing_of(info, None) is None
    first = reads
    assert first > 0
    for _ in range(5):
        assert timing_of(info, None) is None
    assert reads == first
    said = [r.getMessage() for r in caplog.records if "h200:no-such-model-for-this-test" in r.getMessage()]
    assert len(said) == 1 and "cannot use" in said[0], said
    assert timing_of(_info(), None) is not None  # a known one still loads


def _polled(
    k_d: float, *, latency: float, bursty: bool, seconds: float, seed: int = 0, idle_latency: float | None = None
) -> list[LoadReport]:
    """What a shim sends for an engine decoding 16 sequences at k_d times its profile (busy 4-6 s,
    then idle 2-4 s, in turn, when `bursty`) if /metrics takes `latency` s to answer (`idle_latency`
    when the engine idles as it is asked): a reading every 0.25 s poll plus that (stamped halfway),
    its first report when it is in, then heartbeats repeating it every 0.5 s period until the next."""
    rng = random.Random(seed)
    step, period = k_d * SHAPE.decode(16, 4096), 0.5
    bursts, t = [], 0.0  # (start, end) of each busy stretch
    while t < seconds:
        length = rng.uniform(4.0, 6.0) if bursty else seconds
        bursts.append((t, t + length))
        t += length + rng.uniform(2.0, 4.0)
    reports, asked = [], 0.0
    while asked < seconds:
        busy = any(start <= asked < end for start, end in bursts)
        lat = latency if busy or idle_latency is None else idle_latency
        at, done = asked + lat / 2, asked + lat
        steps = int(sum(max(min(at, end) - start, 0.0) for start, end in bursts) / step)
        running = 16 if any(start <= at < end for start, end in bursts) else 0
        reading = LoadReport(
            worker="w", ts=done, engine_ts=at, running=running, period_s=period,
            kv_used_blocks=running * 4096 // BLOCK, decode_context=4096.0 if running else 0.0,
            iterations=steps, iteration_tokens=16 * steps, itl_count=16 * steps,
        )  # fmt: skip
        asked = done + 0.25
        beats = [done + period * i for i in range(math.ceil((asked + lat - done) / period))]
        reports += [msgspec.structs.replace(reading, ts=ts) for ts in beats]
    return reports


@pytest.mark.parametrize(
    ("latency", "bursty", "idle_latency"),
    [(0.05, True, None), (0.9, True, None), (1.5, True, None), (2.5, False, None)],
)
def test_a_slow_metrics_endpoint_is_still_fitted(latency: float, bursty: bool, idle_latency: float | None) -> None:
    """The 2026-12-05 calibration audit: with readings over 0.75 s apart on bursty load (2 s on
    steady load), every busy stretch was dropped and the worker kept its prior, silently. A start
    or stop was judged against the report period, not how far apart the readings are, and a
    heartbeat's report time stood for the reading's."""
    cal = Calibration()
    for r in _polled(2.0, latency=latency, bursty=bursty, seconds=300.0, idle_latency=idle_latency):
        cal.observe(_info(), r)
    assert cal.warm_s("w") > 20.0
    assert _fitted(cal, _info()).decode_scale == pytest.approx(2.0, rel=0.05)
    assert cal.dropped() == {}


def test_a_metrics_endpoint_slow_only_while_busy_drops_no_stretch() -> None:
    """/metrics 1.5 s while the engine is busy, 0.05 s while it idles (an API server slow when
    loaded): the cadence is the busy readings' (the review of the fix above: the idle readings set
    it, and about half the stretches were dropped). Each start and stop then falls in a 1.5 s
    interval counted at half its length, so the factor is read within 15%, not 5%."""
    cal = Calibration()
    for r in _polled(2.0, latency=1.5, bursty=True, seconds=300.0, idle_latency=0.05):
        cal.observe(_info(), r)
    assert cal.dropped() == {}
    assert cal.warm_s("w") > 100.0
    assert _fitted(cal, _info()).decode_scale == pytest.approx(2.0, rel=0.15)


def test_busy_stretches_dropped_are_counted_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Readings every 0.25 s, but the reports of the first 1.5 s after each stop lost: no stretch
    can be read, and the operator is told why, once."""
    cal, stopped = Calibration(), None
    for r in _polled(2.0, latency=0.0, bursty=True, seconds=80.0):
        if r.running:
            stopped = None
        else:
            stopped = r.engine_ts if stopped is None else stopped
            if r.engine_ts < stopped + 1.5:
                continue  # lost
        cal.observe(_info(), r)
    assert cal.warm_s("w") == 0.0 and cal.dropped()["w"] >= DROPPED_WARN_AFTER
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "worker w" in said[0] and "dropped" in said[0] and "/metrics latency" in said[0]
    cal.forget("w")
    assert cal.dropped() == {}


@pytest.mark.parametrize("accepted", [1, 2, 3])
def test_speculative_decoding_tokens_are_not_read_as_prefill(accepted: int) -> None:
    """A decode-only engine at its profile's speed whose steps generate `accepted` tokens per
    request (speculative decoding): vLLM counts them all in iteration_tokens and one ITL per step.
    Read as prefill, the surplus fitted k_p 0.2 at 3 tokens a step (2026-12-05 audit)."""
    rng = random.Random(0)
    cal, info = Calibration(), _info()
    ts, it, tokens, itl = 0.0, 0, 0, 0

    def report(running: int, context: int) -> LoadReport:
        return LoadReport(worker="w", ts=ts, running=running, kv_used_blocks=running * context // BLOCK,
                          iterations=it, iteration_tokens=tokens, itl_count=itl, generation_tokens=tokens,
                          decode_context=float(context))  # fmt: skip

    cal.observe(info, report(8, 4000))
    for _ in range(400):
        b, context, steps = rng.randrange(4, 64), rng.randrange(1000, 16000), 40
        ts += steps * SHAPE.decode(b, context)
        it, itl, tokens = it + steps, itl + b * steps, tokens + accepted * b * steps
        cal.observe(info, report(b, context))
    t = _fitted(cal, info)
    assert t.prefill_scale == pytest.approx(1.0, rel=0.05) and t.decode_scale == pytest.approx(1.0, rel=0.05)


def test_an_engine_past_the_bounds_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    cal = Calibration()
    _feed(cal, SyntheticEngine(8.0, 8.0), 300, _info(profile=None))
    said = [r.getMessage() for r in caplog.records if "outside" in r.getMessage()]
    assert len(said) == 1, said
    assert "worker w" in said[0] and "k_d=" in said[0] and DEFAULT_PROFILE in said[0] and "--timing-profile" in said[0]
    assert _fitted(cal, _info(profile=None)).decode_scale == 5.0
    caplog.clear()
    _feed(Calibration(), SyntheticEngine(0.6, 2.0), 300)  # within the bounds: nothing to say
    assert not [r for r in caplog.records if "outside" in r.getMessage()]


def test_a_sim_at_a_speedup_registered_at_it_fits_its_profile_and_says_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`kvswitch up --speedup 10` registers each shim's profile at 10x (`@10x`): against the plain
    profile its sims fitted k_d = 0.1, past the bound, and every healthy run said so at WARNING."""
    fast = speed_profile(DEFAULT_PROFILE, 10.0)
    cal = Calibration()
    assert _fitted(cal, _info(profile=fast)).prefill_s(8192) == pytest.approx(SHAPE.prefill(8192) / 10)
    assert _fitted(cal, _info(profile=fast)).transfer_s(1000, 25.0) == pytest.approx(SHAPE.transfer(1000, 25.0) / 10)
    _feed(cal, SyntheticEngine(0.1, 0.1), 3000, _info(profile=fast))
    t = _fitted(cal, _info(profile=fast))
    assert t.decode_scale == pytest.approx(1.0, rel=0.02) and t.prefill_scale == pytest.approx(1.0, rel=0.02)
    assert t.decode_s(16, 4096) == pytest.approx(SHAPE.decode(16, 4096) / 10, rel=0.02)
    assert cal.warm_s("w") > 60  # past CLAMP_WARN_BUSY_S: a fit out of bounds would have been said
    assert not [r for r in caplog.records if "outside" in r.getMessage()]
    _feed(Calibration(), SyntheticEngine(0.1, 0.1), 3000)  # the plain profile: the audit's line
    assert [r for r in caplog.records if "outside" in r.getMessage() and "k_d=" in r.getMessage()]


@pytest.mark.parametrize("at_finish", [False, True])
def test_the_average_prompt_keeps_its_cached_context_whenever_its_tokens_are_counted(at_finish: bool) -> None:
    """vLLM 0.32 counts a prompt's computed tokens when the request finishes and its cache hits
    when it is scheduled, seconds apart: hits were added only in intervals where a prompt was
    counted, and the average prompt read as (500 new, 0 cached) (2026-12-05 audit)."""
    new, cached, duration = 500, 8000, 4.6  # a prompt every 2 s, finishing 4.6 s after it is scheduled
    cal, info, it = Calibration(), _info(), 0
    for k in range(1, 400):
        t = k * 0.3
        scheduled = sum(1 for j in range(200) if 2 * j < t)
        counted = sum(1 for j in range(200) if 2 * j + (duration if at_finish else 0.05) < t)
        it += 20
        cal.observe(info, LoadReport(
            worker="w", ts=t, engine_ts=t, running=3, iterations=it, iteration_tokens=3 * it, itl_count=3 * it,
            decode_context=8800.0, prefill_requests=counted, prefill_computed_tokens=new * counted,
            prefix_hit_tokens=cached * scheduled,
        ))  # fmt: skip
    mean = cal._prompts["w"].mean()
    assert mean is not None
    assert mean == pytest.approx((new, cached), rel=0.05)


def test_a_fit_past_the_bounds_for_a_window_or_two_is_not_said(caplog: pytest.LogCaptureFixture) -> None:
    """A fit of one or two windows can land anywhere and come back: only a settled one is said
    (review of the warning: make demo's virtual engines, at their own profile, warned 11 times)."""
    cal, info = Calibration(), _info()
    fit = cal._fits["w"] = _Fit(1.0, cal.prior_weight)
    # two windows that disagree, then the truth (1, 1) from windows of mixed work
    windows = [(6.0, 3.0, 3.0), (8.0, 4.0, 1.0)] + [(6.0, 5.0, 1.0), (6.0, 1.0, 5.0)] * 20
    for i, (y, x_d, x_p) in enumerate(windows):
        fit.add(float(i), y, x_d, x_p, cal.half_life_s, _weight(x_d, x_p, 0.0))
        cal._warn_clamped(info, fit)
        if i == 1:  # out, for a moment, with more than a window's busy time seen
            assert not MIN_SCALE <= fit.estimate[1] <= MAX_SCALE and fit.busy_s >= WINDOW_S, fit.estimate
    assert fit.decode_scale == pytest.approx(1.0, rel=0.05)
    assert not [r for r in caplog.records if "outside" in r.getMessage()]


def test_a_shim_that_starts_sending_generation_tokens_mid_run_does_not_zero_prefill() -> None:
    """A replaced shim (the router kept the worker) sends generation_tokens where the one before
    sent 0: that interval's difference is the engine's whole count, more than the step tokens."""
    cal, info = Calibration(), _info()
    shape = cal.shape(info)
    assert shape is not None
    prev = LoadReport(worker="w", ts=0.0, running=4, iterations=100, iteration_tokens=5_000, itl_count=400)
    counted = LoadReport(worker="w", ts=1.0, running=4, iterations=110, iteration_tokens=6_000, itl_count=440)
    switched = msgspec.structs.replace(counted, generation_tokens=900_000)
    assert cal._work(info, shape, prev, switched) == cal._work(info, shape, prev, counted)
    prefill = cal._work(info, shape, prev, counted)[1]
    assert prefill is not None and prefill[0] == 6_000 - 5_000 - 40  # the step tokens less the 40 decoded


def test_heartbeats_before_the_first_reading_drop_nothing() -> None:
    """A shim sends reports before its first /metrics reading comes back (no engine_ts); the first
    reading, stamped when the engine was asked, reads as a clock running back against them."""
    cal, info = Calibration(), _info()
    for ts in (0.0, 0.5, 1.0):
        cal.observe(info, LoadReport(worker="w", ts=ts, running=8, iterations=0))
    cal.observe(info, LoadReport(worker="w", ts=1.2, engine_ts=0.4, running=8, iterations=40, iteration_tokens=320,
                                 itl_count=320, decode_context=2000.0))  # fmt: skip
    assert cal.dropped() == {}
