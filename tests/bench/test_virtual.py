"""The virtual clock: deterministic, conserving, free of wall time, and exact against the timing
model on cases small enough to compute by hand."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import itertools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType, MethodType, ModuleType

import msgspec
import pytest

from bench.calibration_check import Fits
from bench.compare import CONFIGURATIONS, CompareSpec, run_compare
from bench.trace import TokenSynth, load_trace, shipped_trace
from bench.virtual.clock import VirtualClock
from bench.virtual.delays import Delays
from bench.virtual.engine import VirtualEngine
from bench.virtual.fleet import FleetSpec, VirtualFleet, settings_from_args
from bench.workloads import WorkItem, from_trace, multi_turn
from engine_sim.request import SimRequest
from engine_sim.scheduler import Scheduler, StepOutput
from protocol import LoadReport
from protocol.timing import TimingModel

PROFILE = "h200:llama-3.1-8b"


def _items(n: int = 60) -> list[WorkItem]:
    return from_trace(load_trace(shipped_trace(), start_s=960, limit=n), scale_tokens=0.25)


def _fleet(*args: str, **spec: object) -> VirtualFleet:
    fields: dict[str, object] = {
        "prefill": 1,
        "decode": 2,
        "routers": 2,
        "settings": settings_from_args(args),
        "max_model_len": 65536,
    }
    fields.update(spec)
    return VirtualFleet(FleetSpec(**fields))  # type: ignore[arg-type]


CONDITIONAL = ("--conditional-disagg", "--conditional-disagg-policy", "ttft_model")


def test_two_identical_runs_give_identical_json() -> None:
    spec = CompareSpec(
        items=_items(),
        configurations=[CONFIGURATIONS["kv"], CONFIGURATIONS["ttft_model"]],
        prefill=1,
        decode=2,
        routers=2,
        runs=1,
        rates=[1.5],
        progress=False,
        clock="virtual",
    )
    first = msgspec.json.encode(run_compare(spec))
    assert first == msgspec.json.encode(run_compare(spec))
    assert b'"clock":"virtual"' in first


def test_every_request_ends_once_with_its_output_length_and_frees_everything() -> None:
    items = _items()
    fleet = _fleet(*CONDITIONAL)
    run = fleet.run(items, TokenSynth(0), rate=2.0)
    assert [r.index for r in run.requests] == list(range(len(items)))
    assert all(r.status == 200 for r in run.requests)
    assert [r.output_tokens for r in run.requests] == [item.output_len for item in items]
    assert {r.prefill for r in run.requests} == {"bypass", "remote"}  # both paths were taken
    for router in fleet.routers:
        assert router.planner.ledger.live == 0 and not router.waiters
        assert all(router.view.bookings(w) == 0 for w in fleet.engines)
    for engine in fleet.engines.values():
        assert not engine.scheduler.requests and not engine.scheduler.running
        assert not engine.scheduler.pins and engine.failed_pulls == 0  # every prefilled KV was pulled
        assert engine.scheduler.pool.num_used == 0
    assert sum(e.transfers for e in fleet.engines.values()) == sum(r.prefill == "remote" for r in run.requests)


# Wall-clock reads as a profiler sees them: a clock captured as a default argument (`clock=
# time.monotonic`) is the same builtin, so it is caught where a monkeypatched module attribute is not.
_WALL = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}


def _wall_reads(run: Callable[[], object]) -> list[str]:
    reads: list[str] = []

    def hook(frame: FrameType, event: str, arg: object) -> None:
        # Not a log record's stamp, nor a library's own bookkeeping (hypothesis times every GC from
        # gc.callbacks once an earlier test used it): neither decides anything in a run.
        caller = frame.f_code.co_filename
        if event == "c_call" and caller != logging.__file__ and "site-packages" not in caller:
            owner, name = getattr(arg, "__self__", None), getattr(arg, "__name__", "")
            dated = isinstance(owner, type) and issubclass(owner, datetime.date)
            if (owner is time and name in _WALL) or (dated and name in ("now", "utcnow", "today")):
                reads.append(name)
        elif event == "call" and frame.f_code is asyncio.BaseEventLoop.time.__code__:
            reads.append("loop.time")

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return reads


def test_the_wall_clock_probe_sees_a_clock_captured_as_a_default_argument() -> None:
    def stamp(clock: Callable[[], float] = time.monotonic) -> float:
        return clock()

    assert _wall_reads(stamp) == ["monotonic"]
    assert _wall_reads(datetime.datetime.now) == ["now"]


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_a_run_reads_no_wall_clock(name: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every configuration, under load enough for admission 429s and remote-prefill timeouts, with
    DEBUG logging on (the policy's timing there read perf_counter; the suite's order decided whether
    an earlier test had left DEBUG on)."""
    caplog.set_level(logging.DEBUG, logger="router")
    config = CONFIGURATIONS[name]
    agg = config.fleet == "agg"
    stress = ("--slo-ttft-s", "0.3", "--prefill-timeout-s", "0.05")
    fleet = _fleet(*config.router_args, *stress, prefill=0 if agg else 1, decode=0 if agg else 1, agg=2 if agg else 0)
    # building may (engine_sim stamps its stats); running may not
    reads = _wall_reads(lambda: fleet.run(_items(20), TokenSynth(0), rate=3.0))
    assert reads == [], f"{name} read the wall clock: {sorted(set(reads))}"


def test_no_wall_clock_is_reachable_from_a_fleet() -> None:
    """A clock kept for later (e.g. a default argument stored on an object) is read on paths a run
    may not reach, such as the shims' Normaliser on LoRA adapter drops: none may be there."""
    fleet = _fleet(*CONDITIONAL)
    clocks = {getattr(time, n) for n in _WALL}
    seen: set[int] = set()
    todo: list[tuple[str, object]] = [("fleet", fleet)]
    found = []
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (int, float, str, bytes, type, ModuleType)) or obj is None:
            continue
        seen.add(id(obj))
        if any(obj is c for c in clocks):
            found.append(path)
            continue
        if isinstance(obj, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            todo += [(f"{path}[]", v) for v in obj]
        elif isinstance(obj, MethodType):
            todo.append((path, obj.__self__))
        else:
            fields = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                fields.update({n: getattr(obj, n) for n in getattr(cls, "__slots__", ()) if hasattr(obj, n)})
            todo += [(f"{path}.{k}", v) for k, v in fields.items()]
    assert found == []


def _one_request(prompt: int, output: int) -> list[WorkItem]:
    return [WorkItem(0.0, ((7, prompt),), output, "one")]


def test_one_request_costs_exactly_the_modelled_steps_and_hops() -> None:
    delays = Delays(kv_event_s=0.004, load_report_s=0.001, sync_s=0.003, leg_s=0.002, token_s=0.003, client_s=0.001)
    fleet = _fleet("--disagg", "never", prefill=0, decode=0, agg=1, routers=1, delays=delays)
    run = fleet.run(_one_request(1000, 4), TokenSynth(0))
    (r,) = run.results()
    t = TimingModel.for_profile(PROFILE)
    prefill = t.step(0, 0, [(1000, 0)])
    decodes = [t.step(1, ctx, []) for ctx in (1001, 1002, 1003)]
    assert r.ttft_s == pytest.approx(delays.client_s + delays.leg_s + prefill + delays.token_s + delays.client_s)
    assert r.itl_s == pytest.approx(decodes)  # 5.2 ms steps: beyond the shim's 5 ms coalescing
    assert r.ttft_s is not None and r.e2e_s == pytest.approx(r.ttft_s + sum(decodes))


def test_remote_prefill_pays_the_transfer_of_the_uncached_prompt() -> None:
    delays = Delays(kv_event_s=0.0, load_report_s=0.0, sync_s=0.0, leg_s=0.002, token_s=0.003, client_s=0.0)
    fleet = _fleet("--disagg", "always", prefill=1, decode=1, routers=1, delays=delays)
    run = fleet.run(_one_request(1000, 2), TokenSynth(0))
    (r,) = run.results()
    t = TimingModel.for_profile(PROFILE)
    prefill = t.step(0, 0, [(1000, 0)])
    # The decode engine takes no local hit and pulls the whole prompt's KV, then computes the last
    # prompt token in a step of its own (the scheduler counts it as a decode) to sample the first.
    transfer = t.transfer(1000, 50.0)
    last_token = t.step(1, 1000, [])
    hop = delays.leg_s + delays.token_s
    assert r.prefill == "remote"
    assert r.ttft_s == pytest.approx(hop + prefill + hop + transfer + last_token)


def test_a_slow_prefill_falls_back_to_a_local_prefill() -> None:
    fleet = _fleet("--disagg", "always", "--prefill-timeout-s", "0.05", prefill=1, decode=1, routers=1)
    run = fleet.run(_one_request(8000, 2), TokenSynth(0))
    (r,) = run.results()
    assert r.ok and r.prefill == "bypass" and r.outcome == "fallback_prefill_failed"
    assert run.fallbacks == 1
    prefill_engine = fleet.engines["prefill-0"].scheduler
    assert not prefill_engine.requests and not prefill_engine.pins  # the prefill leg was cancelled


def _prefill_then_queued_decode(lease: float) -> tuple[VirtualClock, VirtualEngine, VirtualEngine, list[str]]:
    """A prefill engine and a decode engine (max_num_seqs=1) busy with a 2,000-token request (about
    10 s) from time 0; a request prefilled at time 0 then waits on the decode engine behind it.
    The list gets the decode request's id once it is submitted."""
    clock = VirtualClock()
    engines: dict[str, VirtualEngine] = {}
    for name, seqs in (("p", 256), ("d", 1)):
        sched = Scheduler(num_gpu_blocks=2048, max_num_seqs=seqs, engine_id=name, kv_connector=True,
                          recompute_kv_load_failures=True, timing=TimingModel.for_profile(PROFILE))  # fmt: skip
        engines[name] = VirtualEngine(clock, sched, peers=engines, kv_lease_duration=lease)
    p, d = engines["p"], engines["d"]
    submitted: list[str] = []

    def prefilled(out: StepOutput, at: float) -> None:
        if out.kv_transfer_params is not None:
            d.submit(SimRequest("decode", list(range(400)), max_tokens=2, remote_prefill=out.kv_transfer_params),
                     lambda out, at: None)  # fmt: skip
            submitted.append("decode")

    d.submit(SimRequest("busy", list(range(5000, 5016)), max_tokens=2000), lambda out, at: None)
    p.submit(SimRequest("prefill", list(range(400)), max_tokens=1, remote_decode=True), prefilled)
    return clock, p, d, submitted


def test_a_decode_request_aborted_before_its_pull_frees_the_prefill_pin_at_once() -> None:
    """As the live sims do (vLLM 0.32's NixlConnector): no stranded KV until the lease runs out."""
    clock, p, d, submitted = _prefill_then_queued_decode(lease=30.0)
    seen: list[list[str]] = []

    def abort() -> None:
        seen.append(list(p.scheduler.pins))
        d.abort(submitted[0])
        seen.append(list(p.scheduler.pins))

    clock.at(2.0, abort)
    clock.run()
    assert seen == [["prefill"], []]
    assert d.transfers == 0 and not p.scheduler.pins and p.scheduler.pool.num_used == 0


def test_a_decode_engine_holding_the_request_renews_the_lease_and_an_unheld_lease_runs_out() -> None:
    lease = 2.0
    clock, p, d, _ = _prefill_then_queued_decode(lease)
    pinned: list[bool] = []

    def unheld(out: StepOutput, at: float) -> None:  # prefilled KV no decode engine ever asks for
        for t in (at + lease - 0.01, at + lease + 0.01):
            clock.at(t, lambda: pinned.append("orphan" in p.scheduler.pins))

    p.submit(SimRequest("orphan", list(range(9000, 9400)), max_tokens=1, remote_decode=True), unheld)
    clock.run()
    assert d.transfers == 1 and d.failed_pulls == 0  # pulled some 10 s (5 leases) after the prefill
    assert d.scheduler.stats.external_kv_tokens == 400
    assert pinned == [True, False]  # pinned until a lease after its prefill, then freed
    assert not p.scheduler.pins and p.scheduler.pool.num_used == 0


def test_heartbeats_follow_vllms_floored_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 heartbeats every `kv_lease_duration // 6`: every 1 s on a 10 s lease."""
    clock, p, d, _ = _prefill_then_queued_decode(lease=10.0)
    beats: list[float] = []
    renew = p.renew_pins

    def beat(request_ids: list[str]) -> None:
        beats.append(clock.now)
        renew(request_ids)

    monkeypatch.setattr(p, "renew_pins", beat)
    clock.run()
    assert len(beats) > 2 and {round(b - a, 9) for a, b in itertools.pairwise(beats)} == {1.0}
    assert d.transfers == 1 and d.failed_pulls == 0


def test_on_a_1s_lease_heartbeats_extend_nothing_as_in_vllm() -> None:
    """vLLM 0.32 extends a lease by `kv_lease_duration * 2 // 3`, 0 on a 1 s lease: the KV goes a
    second after the prefill while the decode engine still holds the request, and its pull fails."""
    clock, _, d, _ = _prefill_then_queued_decode(lease=1.0)
    clock.run()
    assert d.transfers == 1 and d.failed_pulls == 1
    assert d.scheduler.stats.external_kv_tokens == 0  # prefilled locally instead (recompute)


def test_replicas_see_each_others_bookings_after_the_sync_delay() -> None:
    delays = Delays(sync_s=0.5, client_s=0.0, leg_s=0.0, token_s=0.0, kv_event_s=0.0, load_report_s=10.0)
    fleet = _fleet("--disagg", "never", prefill=0, decode=0, agg=2, routers=2, delays=delays)
    r0, r1 = fleet.routers
    seen: list[tuple[float, int]] = []

    def probe(at: float, check: Callable[[], int]) -> None:
        fleet.clock.at(at, lambda: seen.append((at, check())))

    load = lambda: sum(r1.view.load(w).active_blocks for w in fleet.engines)  # noqa: E731
    probe(0.01, load)
    probe(0.6, load)
    fleet.run(_one_request(4000, 400), TokenSynth(0))  # request 0 goes to replica 0
    assert seen[0] == (0.01, 0)
    assert seen[1][1] == 4000 // 16  # replica 0's booking, seen by replica 1 after 0.5 s
    assert r0.planner.ledger.live == 0


def test_a_remote_request_waiting_on_its_decode_engine_stays_booked_there() -> None:
    """As router.dispatch: the end of the prefill leg ends the prefill worker's part of the booking
    only; the decode worker's blocks count on every replica until its own first token, here ~10 s
    later, behind a long request on an engine that runs one at a time (bookings audit, D1)."""
    fleet = _fleet("--disagg", "always", prefill=1, decode=1, routers=2, max_num_seqs=1)
    items = [WorkItem(0.0, ((7, 64),), 2000, "long"), WorkItem(0.5, ((8, 1600),), 2, "waits")]
    seen: list[tuple[int, int, int]] = []  # (engine's waiting, view's active_blocks, report's kv_used)

    def probe() -> None:
        waiting = len(fleet.engines["decode-0"].scheduler.waiting)
        for router in fleet.routers:
            load = router.view.load("decode-0")
            seen.append((waiting, load.active_blocks, load.kv_used_blocks))

    fleet.clock.at(2.0, probe)  # its prefill leg ended long since, and the decode engine has reported
    run = fleet.run(items, TokenSynth(0))
    assert all(r.ok for r in run.results())
    assert len(seen) == 2 and all(w == 1 and active - reported >= 1600 // 16 for w, active, reported in seen), seen


def test_a_prompt_over_the_context_limit_is_refused_with_400() -> None:
    fleet = _fleet("--disagg", "always", prefill=1, decode=1, routers=1, max_model_len=4096)
    run = fleet.run([*_one_request(5000, 2), WorkItem(0.1, ((8, 100),), 3, "short")], TokenSynth(0))
    long, short = run.results()
    assert long.status == 400 and not long.ok and "maximum context length is 4096" in (long.error or "")
    assert short.ok and short.output_tokens == 3
    assert fleet.routers[0].planner.ledger.live == 0


def test_decode_workers_serving_a_shared_prefix_fit_their_own_profile() -> None:
    # Every prompt starts with one 4 k-token system prompt, held once in each engine's cache but
    # read by every sequence's decode step: calibration must price the steps per sequence (the
    # shims' decode_context), or the right profile fits slow (2.1-2.3 here before).
    items = multi_turn(
        sessions=100, turns=2, system_len=4096, user_len=256, answer_len=512, session_rate=10, turn_gap_s=2, seed=0
    )
    fleet = _fleet("--disagg", "always", prefill=1, decode=2, routers=1, max_model_len=32768)
    fleet.run(items, TokenSynth(0))
    calibration = fleet.routers[0].planner.calibration
    assert calibration is not None
    fitted = {w: k_d for w, (k_d, _, _) in calibration.factors().items() if w.startswith("decode")}
    assert fitted and all(k == pytest.approx(1.0, abs=0.03) for k in fitted.values()), fitted


def test_decode_workers_serving_the_trace_fit_their_own_decode_speed() -> None:
    # The trace's prompts run from 1 k to 100 k tokens, so the calibration's prefill proxy (the
    # average prompt) errs by half or double in a window. Weighed evenly, those windows traded the
    # factors: here the decode workers' fits were 7% off in k_d (RMS of log k), and up to 5x on the
    # whole trace.
    items = from_trace(load_trace(shipped_trace(), start_s=0, limit=400))
    settings = settings_from_args(CONFIGURATIONS["slo_aware"].router_args)
    fleet = _fleet(prefill=1, decode=4, routers=1, settings=settings, max_model_len=131072, profile=PROFILE)
    calibration = fleet.routers[0].planner.calibration
    assert calibration is not None
    fits = Fits(lambda: fleet.clock.now)
    fits.watch(calibration)
    fleet.run(items, TokenSynth(0))
    k_d, _, n = fits.rms_log("decode")
    assert n > 40 and k_d < 0.05, (k_d, n)


def test_the_shims_credit_checks_find_the_engines_reusing_what_they_promised() -> None:
    """worker_shim.credit_check in each virtual shim, every window judged: engine_sim reuses what
    the shim's index promised at dispatch, less only what it evicted before scheduling."""
    fleet = _fleet("--routing", "kv", "--disagg", "never", prefill=0, decode=0, agg=2, routers=1)
    for shim in fleet.shims.values():
        shim.credit.min_legs = shim.credit.min_tokens = 1
    fleet.run(_items(120), TokenSynth(0), rate=1.0)
    checks = [shim.credit for shim in fleet.shims.values()]
    assert sum(c.windows for c in checks) >= 10
    assert sum(c.predicted_total for c in checks) > 0
    assert all(c.short_windows == 0 and c.reused_total >= c.predicted_total for c in checks)


def test_a_prefill_leg_that_times_out_leaves_its_worker_out_as_the_live_router_does() -> None:
    """router.dispatch reports each prefill leg to eligibility: one that times out leaves the worker
    out for PREFILL_COOLDOWN_S. The virtual dispatch did not, and sent every later request into the
    same timeout and fallback."""
    fleet = _fleet("--disagg", "always", "--prefill-timeout-s", "0.05", prefill=1, decode=1, routers=1)
    items = [WorkItem(2.0 * i, ((7 + i, 8000),), 2, f"r{i}") for i in range(3)]
    run = fleet.run(items, TokenSynth(0))
    outcomes = [r.outcome for r in sorted(run.results(), key=lambda r: r.tag)]
    assert outcomes[0] == "fallback_prefill_failed" and run.fallbacks == 1
    assert outcomes[1:] == ["bypass_transfer_failing"] * 2


def test_an_empty_step_publishes_the_engines_figures_as_the_runner_does() -> None:
    """A request waiting on its KV pull makes a step with nothing to compute; engine_sim.runner
    publishes its scheduler stats then too, so /metrics (and the shim's reports) count it."""
    clock = VirtualClock()
    engines: dict[str, VirtualEngine] = {}
    for name in ("p", "d"):
        sched = Scheduler(num_gpu_blocks=2048, engine_id=name, kv_connector=True,
                          recompute_kv_load_failures=True, timing=TimingModel.for_profile(PROFILE))  # fmt: skip
        engines[name] = VirtualEngine(clock, sched, peers=engines)
    p, d = engines["p"], engines["d"]
    seen: list[tuple[int, int, int, int]] = []

    def look() -> None:
        published, sched = d.scheduler.stats.published, d.scheduler
        seen.append((published.running, published.waiting, len(sched.running), len(sched.waiting)))

    def prefilled(out: StepOutput, at: float) -> None:
        if out.kv_transfer_params is not None:
            d.submit(SimRequest("decode", list(range(20_000)), max_tokens=2, remote_prefill=out.kv_transfer_params),
                     lambda out, at: None)  # fmt: skip
            clock.after(1e-6, look)  # the pull of 20 k tokens' KV takes ~50 ms

    p.submit(SimRequest("prefill", list(range(20_000)), max_tokens=1, remote_decode=True), prefilled)
    clock.run()
    (figures,) = seen
    assert figures[:2] == figures[2:] and sum(figures[2:]) == 1


def test_workers_register_their_max_model_len_as_live_shims_do() -> None:
    """A live shim registers its engine's (/v1/models); slo_aware counts each request's length
    within it. Unregistered, every prompt past 32 k read as 32 k and the virtual slo_aware priced
    decode steps at contexts far shorter than the live one would."""
    fleet = _fleet(max_model_len=200_000)
    assert {shim.info.max_model_len for shim in fleet.shims.values()} == {200_000}


def test_a_max_model_len_no_engine_holds_is_refused_as_vllm_refuses_to_start() -> None:
    """Review of 2026-12-06: a fleet built with engines whose KV cache cannot hold one request of
    max_model_len tokens let such a request wait for its blocks for ever, and the clock ran on
    (`bench replay --clock virtual --profile h200:qwen2.5-32b --scale-tokens 8`: killed at 60 s).
    The longest length accepted is the one check_max_model_len's message offers (it said one block
    more, a length it then refused)."""
    from bench.virtual.fleet import check_max_model_len

    qwen = "h200:qwen2.5-32b"
    with pytest.raises(ValueError, match=r"at most \d+") as refused:
        check_max_model_len(10**6, qwen)
    most = int(refused.value.args[0].split("at most ")[1].split()[0])
    check_max_model_len(most, qwen)
    _fleet(profile=qwen, max_model_len=most)
    with pytest.raises(ValueError, match=f"estimated maximum model length is {most}"):
        _fleet(profile=qwen, max_model_len=most + 1)
    with pytest.raises(ValueError, match="larger than the available KV cache"):
        _fleet(num_gpu_blocks=2048, max_model_len=32768)  # 2047 blocks for requests, 2048 needed


def _run_slow(ticking: bool, rate: float, *configuration: str) -> tuple[bytes, int]:
    """8 requests at `rate` times their arrival rate (at 1e-3, about half an hour of idle virtual time)."""
    fleet = _fleet(*configuration, routers=1)
    if ticking:  # the shims' loops tick through every quiet stretch, as before the skip
        for shim in fleet.shims.values():
            shim.quiet_until = lambda: None
    run = fleet.run(_items(8), TokenSynth(0), rate=rate)
    return msgspec.json.encode(run.results()), run.events


@pytest.mark.parametrize("configuration", [("--disagg", "never"), ("--disagg", "always")])
def test_quiet_stretches_cost_no_ticks_and_change_no_result(configuration: tuple[str, ...]) -> None:
    """The shims' polls and heartbeats ticked through every idle virtual second: 5 requests at 1e-6
    times the trace's rate took 79 s of wall time, and 1e-9 never ended. Now a quiet stretch costs a
    few events whatever its length, and the results are the ticking run's."""
    skipped, events = _run_slow(False, 1e-3, *configuration)
    ticked, ticked_events = _run_slow(True, 1e-3, *configuration)
    assert skipped == ticked
    assert events * 10 < ticked_events
    _, slower = _run_slow(False, 1e-6, *configuration)  # a thousand times the idle time
    assert slower < events * 1.1


def test_a_waiters_429_names_its_wait_as_configured() -> None:
    """Half a 0.05 s TTFT SLO read `no worker had room within 0.0s` (rendered to one decimal)."""
    fleet = _fleet("--disagg", "never", "--slo-ttft-s", "0.05", routers=1, prefill=0, decode=0, agg=1)
    errors = {r.error for r in fleet.run(_items(30), TokenSynth(0), rate=20).results() if not r.ok}
    assert "no worker had room within 0.025s" in errors


def _bursts(gaps: Sequence[float], per: int) -> list[WorkItem]:
    """`per` requests of the trace after each of `gaps` quiet seconds."""
    items = _items(len(gaps) * per)
    out: list[WorkItem] = []
    t = 0.0
    for n, gap in enumerate(gaps):
        burst = items[n * per : (n + 1) * per]
        t += gap
        out += [dataclasses.replace(item, arrival_s=t + (item.arrival_s - burst[0].arrival_s)) for item in burst]
        t = out[-1].arrival_s
    return out


def _run_gaps(items: list[WorkItem], configuration: str, seed: int, ticking: bool) -> tuple[bytes, set[object]]:
    """The results, and every report the routers got: when, which router, the report's bytes."""
    fleet = _fleet(*CONFIGURATIONS[configuration].router_args, seed=seed)
    got: set[object] = set()

    def recording(name: str, take: Callable[[LoadReport], None]) -> Callable[[LoadReport], None]:
        def on_load(report: LoadReport) -> None:
            got.add((fleet.clock.now, name, msgspec.json.encode(report)))
            take(report)

        return on_load

    for router in fleet.routers:
        router.on_load = recording(router.name, router.on_load)  # type: ignore[method-assign,assignment]
    if ticking:
        for shim in fleet.shims.values():
            shim.quiet_until = lambda: None
    run = fleet.run(items, TokenSynth(0), rate=1.0)
    return msgspec.json.encode(run.results()), got


@pytest.mark.parametrize("configuration", ["slo_aware", "ttft_model"])
def test_every_report_after_a_quiet_stretch_is_one_ticking_through_sends(configuration: str) -> None:
    """After a quiet stretch each loop resumed on its own, `due + n * period`: a poll coming back
    before the heartbeat resumed poked against the last report's time from before the skip, so a
    heartbeat went out at once and its phase moved; and the resumed times differed from ticking's
    sums in their last bits. The routers held other reports, and calibrating policies (2 routers,
    30-100 s gaps, seed 4) routed 6 of 60 requests otherwise. Now both loops resume at ticking's
    very floats, the poll first, so every report a router gets is one ticking through delivers at
    that moment, byte for byte, and the results are byte-identical."""
    items = _bursts((46.5, 37.2, 57.7, 40.8), per=6)
    for seed in range(4):
        skipped, reports = _run_gaps(items, configuration, seed, ticking=False)
        ticked, ticked_reports = _run_gaps(items, configuration, seed, ticking=True)
        assert skipped == ticked
        assert reports <= ticked_reports
        assert len(reports) * 3 < len(ticked_reports)  # the quiet stretches were skipped
