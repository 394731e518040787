"""LoadReports: liveness at the configured period, and a KV digest exactly as of the seq it names."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
import pytest

import runtime
from engine_sim.server import SimServer
from kvswitch.servers import NatsServer
from protocol import Cleared, KvEventBatch, LoadReport, decode_msg, subjects
from protocol.config import MIN_LOAD_PERIOD_S
from router.sender_budget import SenderBudget
from runtime import Throttle
from runtime.nats_flush import flush
from tests.lost_cancellation import ends_within, never_answers
from tests.relay import Relay
from tests.worker_shim.cluster import complete, connect, shared_prefix_prompts, shim_for, sim_config, wait_for
from tests.worker_shim.test_kv_digest import replayed, xor_of
from worker_shim import ShimConfig
from worker_shim.adapters.base import EngineError, EngineLoad
from worker_shim.adapters.sglang import load_from_metrics as sglang_load
from worker_shim.adapters.trtllm import load_from_stats as trtllm_load
from worker_shim.adapters.vllm import load_from_metrics
from worker_shim.load_reporter import EPISODE_SAID_S, LoadReporter


def test_the_default_period_is_half_a_second() -> None:
    assert ShimConfig(model="m", kv_events="tcp://*:1").load_period_s == 0.5


@pytest.mark.timing
async def test_an_idle_worker_reports_at_least_every_period(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url, load_period_s=0.2) as shim:
        await shim.registered.wait()
        assert shim.worker_id is not None
        nc = await connect(nats_url)
        arrivals: list[tuple[float, LoadReport]] = []

        async def on(msg: Any) -> None:
            arrivals.append((time.monotonic(), decode_msg(msg.data, LoadReport)))

        await nc.subscribe(subjects.load(ns, shim.worker_id), cb=on)
        await asyncio.sleep(1.5)
        await nc.close()
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(arrivals)]
        assert len(arrivals) >= 6 and max(gaps) <= 0.2 + 0.12, [round(g, 3) for g in gaps]
        assert {r.period_s for _, r in arrivals} == {0.2}
        assert all(r.events_ok for _, r in arrivals)


async def test_every_reports_digest_equals_the_batches_up_to_its_seq(ns: str, nats_url: str, etcd_url: str) -> None:
    nc = await connect(nats_url)
    batches: list[KvEventBatch] = []
    reports: list[LoadReport] = []

    async def on_kv(msg: Any) -> None:
        batches.append(decode_msg(msg.data, KvEventBatch))

    async def on_load(msg: Any) -> None:
        reports.append(decode_msg(msg.data, LoadReport))

    # Subscribed before the shim registers, so the first batch (Cleared + snapshot) is seen too.
    await nc.subscribe(subjects.kv_all(ns), cb=on_kv)
    await nc.subscribe(subjects.load_all(ns), cb=on_load)
    try:
        async with (
            SimServer(sim_config(num_gpu_blocks=96)) as sim,
            shim_for(sim, ns, nats_url, etcd_url, load_period_s=0.1) as shim,
        ):
            await shim.registered.wait()
            prompts = shared_prefix_prompts(60, seed=11)
            for i, p in enumerate(prompts):
                if i == 30:
                    async with aiohttp.ClientSession() as s, s.post(sim.url + "/reset_prefix_cache") as r:
                        assert r.status == 200
                await complete(sim.url, p)
                await asyncio.sleep(0.02)  # spread over many report periods
            assert shim.publisher is not None
            last = shim.publisher.log
            await wait_for(lambda: bool(batches) and batches[-1].seq == last.seq, what="every batch received")
            await wait_for(
                lambda: any(r.kv_seq == last.seq for r in reports[-3:]), what="a report as of the last batch"
            )
            assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
            assert {b.epoch for b in batches} == {shim.epoch}
            assert sum(isinstance(e, Cleared) for b in batches for e in b.events) >= 2, "no reset was exercised"
            checked: set[int] = set()
            for rep in reports:
                if rep.kv_epoch == 0:
                    continue
                assert rep.kv_epoch == shim.epoch
                held = replayed(batches[: rep.kv_seq])
                assert (rep.kv_blocks, rep.kv_xor) == (len(held), xor_of(held)), f"report as of seq {rep.kv_seq}"
                checked.add(rep.kv_seq)
            assert len(checked) >= 10, f"only seqs {sorted(checked)} were checked"
            final = next(r for r in reversed(reports) if r.kv_seq == last.seq)
            assert final.kv_blocks == len(shim.canonical_hashes())
            assert final.kv_xor == xor_of(shim.canonical_hashes())
    finally:
        await nc.close()


async def test_reports_carry_the_engines_timing_counters_and_when_they_were_read(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url, load_period_s=0.2) as shim:
        await shim.registered.wait()
        assert shim.worker_id is not None
        nc = await connect(nats_url)
        reports: list[LoadReport] = []

        async def on(msg: Any) -> None:
            reports.append(decode_msg(msg.data, LoadReport))

        await nc.subscribe(subjects.load(ns, shim.worker_id), cb=on)
        stats = sim.engine.stats
        # The engine's counters hold the shim's endpoint probe too (one step: 17 prompt tokens and
        # one output token), so the legs' figures are read from its report on.
        await wait_for(lambda: shim.probe.confirmed == 1)
        await wait_for(lambda: bool(reports) and reports[-1].iterations == stats.iteration_tokens.count == 1)
        base = reports[-1]
        await complete(sim.url, list(range(100, 164)), max_tokens=5)
        await wait_for(lambda: bool(reports) and reports[-1].iterations == stats.iteration_tokens.count)
        first = reports[-1]
        await complete(sim.url, list(range(100, 164)), max_tokens=5)  # the same prompt: its blocks are cached
        await wait_for(lambda: reports[-1].prefill_requests == 3)
        await nc.close()
    assert (base.iterations, base.iteration_tokens, base.prefill_requests, base.prefix_hit_tokens) == (1, 17 + 1, 1, 0)
    assert (first.iterations - 1, first.iteration_tokens - 18) == (5, 64 + 5)
    assert (first.itl_count, first.prefill_requests - 1, first.prefill_computed_tokens - 17) == (4, 1, 64)
    assert first.generation_tokens - 1 == 5  # engine_sim's vllm:generation_tokens_total
    assert first.itl_seconds > 0 and first.prefill_seconds > 0 and first.prefix_hit_tokens == 0
    assert reports[-1].prefix_hit_tokens == stats.prefix_cache_hits == 48  # all but the last block
    assert all(0 < r.engine_ts <= r.ts for r in reports)


class _Metrics:
    """The load side of an engine adapter: vLLM's own parse of whatever /metrics text is set."""

    def __init__(self) -> None:
        self.text = ""

    async def load(self) -> EngineLoad:
        return load_from_metrics(self.text)


_GOOD = 'vllm:num_requests_running{engine="0"} 3\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        # Before 2026-12-07: int(nan) in the parse, an ERROR with a traceback naming no series.
        ('vllm:num_requests_running{engine="0"} NaN\n', "vllm:num_requests_running is nan, not a count"),
        ('vllm:num_requests_running{engine="0"} 3\nvllm:kv_cache_usage_perc{engine="0"} NaN\n', "kv_usage = nan"),
        ('vllm:num_requests_running{engine="0"} +Inf\n', "vllm:num_requests_running is inf, not a count"),
        # Before 2026-12-07: read as 2, with no word.
        ('vllm:num_requests_running{engine="0"} 2.7\n', "vllm:num_requests_running is 2.7, not a count"),
        # Before 2026-12-07: an OverflowError encoding the report ended the session, in a loop.
        ('vllm:num_requests_running{engine="0"} 1e30\n', "running = 1000000000000000019884624838656, not a count"),
        ('vllm:num_requests_running{engine="0"} -3\n', "running = -3, not a count"),  # before: sent as is
        # Before 2026-12-07: summed, 3 + 3 running went out as 6.
        ('vllm:num_requests_running{engine="0"} 3\n' * 2, 'vllm:num_requests_running{engine="0"} twice'),
        ('vllm:num_requests_running{engine="0"} 3\nvllm:kv_cache_usage_perc{engine="0"} 1.5\n', "kv_usage = 1.5"),
        (
            'vllm:num_requests_running{engine="0"} 3\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'
            'vllm:cache_config_info{engine="0",num_gpu_blocks="99999999999999999999"} 1\n',
            "kv_total_blocks = 99999999999999999999",
        ),
        ('vllm:num_requests_running{engine="0"} 3\nvllm:iteration_tokens_total_count{engine="0"} 1e20\n', "iterations"),
        ('vllm:num_requests_running{engine="0"} 3\nvllm:nixl_num_failed_transfers_total{engine="0"} 1e30\n', "failed"),
    ],
    ids=[
        "nan-count",
        "nan-usage",
        "inf-count",
        "fractional-count",
        "huge-count",
        "negative-count",
        "repeated-series",
        "usage-over-1",
        "huge-blocks",
        "huge-counter",
        "huge-failed-transfers",
    ],
)
async def test_a_reading_the_shim_cannot_use_marks_the_worker_unhealthy_and_the_reports_go_on(
    nats_url: str, ns: str, bad: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await connect(nats_url)
    reports: list[LoadReport] = []

    async def on(msg: Any) -> None:
        reports.append(decode_msg(msg.data, LoadReport))

    await nc.subscribe(subjects.load(ns, "w1"), cb=on)
    await flush(nc)
    engine = _Metrics()
    engine.text = _GOOD
    reporter = LoadReporter(nc, ns, "w1", engine, lambda: 0, 100, period_s=0.05, poll_s=0.02)  # type: ignore[arg-type]
    reporter.start()
    try:
        await wait_for(lambda: any(r.running == 3 and r.healthy for r in reports), what="a healthy report")
        engine.text = bad
        await wait_for(lambda: not reports[-1].healthy, what="an unhealthy report")
        seen = len(reports)
        await wait_for(lambda: len(reports) >= seen + 3, what="reports after the bad reading")
        assert all(not r.healthy and r.kv_used_blocks == 25 for r in reports[seen:])  # the last good numbers
        engine.text = _GOOD
        await wait_for(lambda: reports[-1].healthy, what="healthy again")
    finally:
        await reporter.stop()  # no exception of a task escapes it
        await nc.close()
    complaints = [r for r in caplog.records if r.name == "worker_shim.load_reporter" and r.levelno >= logging.WARNING]
    assert len(complaints) == 1 and said in complaints[0].getMessage(), [r.getMessage() for r in complaints]
    assert complaints[0].levelno == logging.WARNING and complaints[0].exc_info is None  # the engine's, no traceback


class _Reading:
    """An adapter whose load is one fixed reading."""

    def __init__(self, reading: EngineLoad) -> None:
        self.reading = reading

    async def load(self) -> EngineLoad:
        return self.reading


@pytest.mark.parametrize(
    ("reading", "said"),
    [
        (sglang_load("sglang:num_running_reqs 1e30\nsglang:num_queue_reqs 0\n", 100), "running = "),
        (sglang_load("sglang:num_running_reqs 1\nsglang:num_queue_reqs -2\n", 100), "waiting = -2"),
        (sglang_load("sglang:num_running_reqs 1\nsglang:token_usage 7\n", 100), "kv_usage = 7.0"),
        (trtllm_load([{"numActiveRequests": 10**30, "kvCacheStats": {}}], EngineLoad()), "running = "),
        (trtllm_load([{"kvCacheStats": {"maxNumBlocks": 10, "usedNumBlocks": 30}}], EngineLoad()), "kv_usage = 3.0"),
        (trtllm_load([{"kvCacheStats": {"maxNumBlocks": 10.5, "usedNumBlocks": 1}}], EngineLoad()), "kv_total_blocks"),
    ],
    ids=["sglang-huge", "sglang-negative", "sglang-usage", "trtllm-huge", "trtllm-usage", "trtllm-float-blocks"],
)
async def test_every_engines_absurd_reading_marks_the_worker_unhealthy(
    reading: EngineLoad, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang's and TensorRT-LLM's readings pass the same check as vLLM's, in the reporter."""
    nc = _CountingNats()
    reporter = LoadReporter(nc, "t", "w1", _Reading(reading), lambda: 0, 100, period_s=0.05, poll_s=0.02)  # type: ignore[arg-type]
    reporter.start()
    try:
        await wait_for(lambda: len(nc.sent) >= 3, what="reports")
        assert not reporter.healthy and said in reporter.error, reporter.error
        assert all(not t.done() for t in reporter.tasks)
    finally:
        await reporter.stop()
    complaints = [r for r in caplog.records if r.name == "worker_shim.load_reporter" and r.levelno >= logging.WARNING]
    assert len(complaints) == 1 and complaints[0].levelno == logging.WARNING


async def test_a_report_that_cannot_be_encoded_is_counted_said_once_and_the_session_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The backstop behind the reading's check: a number no check refused (here the shim's own
    queued tokens) made encode_msg raise OverflowError in the report task, which crashed it and
    ended the session, twice a second. Now that report is not sent, counted, the first said at
    ERROR, and the reports go on once the number is one msgpack takes."""
    nc = _CountingNats()
    queued = [0]
    unencodable: list[int] = []
    crashes: list[int] = []
    reporter = LoadReporter(
        nc,  # type: ignore[arg-type]
        "t",
        "w1",
        _Steady(),  # type: ignore[arg-type]
        lambda: queued[0],
        100,
        period_s=0.05,
        poll_s=0.02,
        on_unencodable=lambda: unencodable.append(1),
        on_crash=lambda: crashes.append(1),
    )
    reporter.start()
    try:
        await wait_for(lambda: len(nc.sent) >= 2, what="reports")
        queued[0] = 10**30
        await wait_for(lambda: len(unencodable) >= 5, what="unencodable reports")
        sent = len(nc.sent)
        await asyncio.sleep(0.2)
        assert len(nc.sent) == sent  # none of them went out
        queued[0] = 7
        await wait_for(lambda: len(nc.sent) >= sent + 2, what="reports again")
        assert all(not t.done() for t in reporter.tasks) and crashes == []
    finally:
        await reporter.stop()
    errors = [r for r in caplog.records if r.name == "worker_shim.load_reporter" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "OverflowError" in errors[0].getMessage(), [r.getMessage() for r in errors]


async def _quiet(_exc: Exception) -> None:
    pass  # nats-py says each failed reconnect during the outage


@pytest.fixture
async def gate(own_nats: NatsServer) -> AsyncIterator[Relay]:
    g = Relay(own_nats.port)
    await g.start()
    yield g
    await g.close()


async def test_no_report_goes_out_stale_after_a_nats_outage(own_nats: NatsServer, gate: Relay, ns: str) -> None:
    """NATS restarted after 1 s down; a router back before the shim. The reports made meanwhile
    waited in nats-py's reconnect buffer and reached it on the shim's reconnect, stamped up to the
    outage's length ago: three in a row read as the worker's clock behind (a false "keep hosts on
    NTP" WARNING for every worker, its deadlines moved by the outage, outage audit). A report is
    state the next supersedes: none is queued while NATS is down."""
    options: dict[str, Any] = {"reconnect_time_wait": 0.05, "max_reconnect_attempts": -1, "error_cb": _quiet}
    shim_nc = await nats.connect(f"nats://127.0.0.1:{gate.port}", **options)
    router_nc = await nats.connect(own_nats.url, **options)
    got: list[tuple[float, LoadReport]] = []

    async def on(msg: Any) -> None:
        got.append((time.time(), decode_msg(msg.data, LoadReport)))

    await router_nc.subscribe(subjects.load(ns, "w1"), cb=on)
    await flush(router_nc)
    engine = _Metrics()
    engine.text = _GOOD
    reporter = LoadReporter(shim_nc, ns, "w1", engine, lambda: 0, 100, period_s=0.05, poll_s=0.02)  # type: ignore[arg-type]
    reporter.start()
    try:
        await wait_for(lambda: len(got) >= 3, what="reports before the outage")
        gate.accepting = False
        own_nats.kill()
        await wait_for(lambda: not shim_nc.is_connected, what="the shim to see NATS gone")
        down_at = time.time()
        await asyncio.sleep(1.0)  # 20 report periods
        own_nats.launch()
        await asyncio.to_thread(own_nats.wait_healthy)
        await wait_for(lambda: router_nc.is_connected, what="the router back on NATS")
        await flush(router_nc)  # its subscription is on the server again
        up_at = time.time()
        gate.accepting = True  # the shim comes back after it
        await wait_for(lambda: any(r.ts > up_at for _, r in got), timeout=5, what="a report after the outage")
        first = next(received for received, r in got if r.ts > up_at)
        assert first - up_at < 1.0  # the first after it is not held back
    finally:
        await reporter.stop()
        with contextlib.suppress(Exception):
            await shim_nc.close()
        with contextlib.suppress(Exception):
            await router_nc.close()
    stale = [round(received - r.ts, 2) for received, r in got if down_at < r.ts < up_at]
    assert stale == [], f"reports made during the outage reached the router, this many seconds old: {stale}"


class _CountingNats:
    """The publishing side of a NATS client: when each report went out."""

    is_connected = True

    def __init__(self) -> None:
        self.sent: list[float] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(time.monotonic())


class _Steady:
    async def load(self) -> EngineLoad:
        return EngineLoad(running=1)


class _DownNats:
    """A NATS client whose connection is down until the test says: how often the reporter asked."""

    def __init__(self) -> None:
        self.up = False
        self.asked = 0
        self.sent: list[bytes] = []

    @property
    def is_connected(self) -> bool:
        self.asked += 1
        return self.up

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(payload)


class _Polled:
    """A steady engine that counts its polls."""

    def __init__(self) -> None:
        self.polls = 0

    async def load(self) -> EngineLoad:
        self.polls += 1
        return EngineLoad(running=1)


async def test_a_nats_outage_is_waited_out_a_poll_at_a_time_and_the_first_report_after_goes_at_once() -> None:
    """Until 2026-12-08 the publish loop, once a period had passed in an outage, looked again at once
    without a wait, for the whole outage (151,440 looks in 2 s, a core at 100%, load audit): now it
    looks once per poll or period, and a report goes at the first poll once NATS is back."""
    nc, engine = _DownNats(), _Polled()
    reporter = LoadReporter(nc, "t", "w1", engine, lambda: 0, 100, period_s=0.1, poll_s=0.05)  # type: ignore[arg-type]
    reporter.start()
    try:
        await asyncio.sleep(0.5)
        # A look per poll (each pokes the loop) and at most one heartbeat between two polls.
        assert nc.asked <= 2 * engine.polls + 2, (nc.asked, engine.polls)
        assert engine.polls >= 2 and nc.sent == []
        nc.up = True
        await wait_for(lambda: bool(nc.sent), timeout=1.0, what="a report once NATS is back")
    finally:
        await reporter.stop()


async def test_a_bug_in_the_shims_reading_hook_is_said_once_as_the_shims_and_the_engine_stays_healthy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Until 2026-12-08 the hook ran inside the poll's try: its exception read as the engine's (an
    unhealthy worker, `internal` counted, "a reading the shim cannot use") and the hook was called
    again with None for a reading that was good."""
    nc, engine = _DownNats(), _Polled()
    nc.up = True
    handed: list[EngineLoad | None] = []
    polls_failed: Counter[str] = Counter()

    def on_reading(_asked: float, _done: float, load: EngineLoad | None) -> None:
        handed.append(load)
        if load is not None:
            raise KeyError("the shim's own bug")

    reporter = LoadReporter(
        nc,  # type: ignore[arg-type]
        "t",
        "w1",
        engine,  # type: ignore[arg-type]
        lambda: 0,
        100,
        period_s=0.05,
        poll_s=0.01,
        on_reading=on_reading,
        polls_failed=polls_failed,
    )
    reporter.start()
    try:
        await wait_for(lambda: engine.polls >= 5 and len(nc.sent) >= 3, what="polls and reports")
    finally:
        await reporter.stop()
    assert reporter.healthy and reporter.error == "" and polls_failed == Counter()
    assert handed and all(load is not None and load.running == 1 for load in handed)  # once a poll, never None
    assert all(decode_msg(p, LoadReport).healthy for p in nc.sent)
    said = [r for r in caplog.records if r.name == "worker_shim.load_reporter" and r.levelno >= logging.WARNING]
    assert len(said) == 1 and said[0].levelno == logging.ERROR, [r.getMessage() for r in said]
    assert "on_reading hook" in said[0].getMessage() and said[0].exc_info is not None


async def test_a_shim_at_its_shortest_period_poked_on_every_change_stays_within_a_routers_budget() -> None:
    """Routers take a sender's reports past router.sender_budget's rate for a flood (quarantined, read
    silent): a shim at the shortest --load-period-s it takes, every report a change and poked
    without pause, sends at most 1 / MIN_LOAD_PERIOD_S a second, and a router admits every one."""
    nc = _CountingNats()
    tokens = itertools.count()
    reporter = LoadReporter(nc, "t", "w1", _Steady(), lambda: next(tokens), 100, period_s=MIN_LOAD_PERIOD_S)  # type: ignore[arg-type]
    reporter.start()
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            reporter.poke()
            await asyncio.sleep(0.001)
    finally:
        await reporter.stop()
    sent = [t for t in nc.sent if t < end]
    assert len(sent) >= 20  # it did report on changes
    assert len(sent) <= 2.0 / MIN_LOAD_PERIOD_S + 1, len(sent)
    budget = SenderBudget()
    assert all(budget.admit("w1", t) for t in sent) and budget.over == 0


class _Flapping:
    """An engine whose /metrics alternates a good answer and one the shim cannot read, poll by
    poll (the audit's bad_engine_proxy.py `flap`); `failed` counts the bad ones."""

    def __init__(self) -> None:
        self.polls = 0
        self.failed = 0

    async def load(self) -> EngineLoad:
        self.polls += 1
        if self.polls % 2:
            return EngineLoad(running=1)
        self.failed += 1
        raise EngineError(502, "engine_protocol", "/metrics has no load series")


async def test_a_flapping_metrics_is_counted_by_kind_and_said_once_a_minute_with_how_many_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A WARNING per flip before (38 in 20 s), and the failed polls counted nowhere: each is now
    counted by kind, an episode's WARNING said at most once a minute with how many were held back
    meanwhile, and a said episode's end said at INFO."""
    engine = _Flapping()
    polls_failed: Counter[str] = Counter()
    reporter = LoadReporter(
        _CountingNats(),  # type: ignore[arg-type]
        "t",
        "w1",
        engine,  # type: ignore[arg-type]
        lambda: 0,
        100,
        period_s=0.05,
        poll_s=0.005,
        polls_failed=polls_failed,
    )
    now = [0.0]
    reporter._episodes = Throttle(EPISODE_SAID_S, clock=lambda: now[0])  # a minute passes when the test says
    with caplog.at_level(logging.INFO, logger="worker_shim.load_reporter"):
        reporter.start()
        try:
            await wait_for(lambda: engine.failed >= 20, what="twenty flips")
            held = engine.failed - 1  # each failed poll starts an episode; the first was said
            now[0] += EPISODE_SAID_S
            await wait_for(lambda: engine.failed >= held + 4, what="flips a minute on")
        finally:
            await reporter.stop()
    assert polls_failed == {"engine_protocol": engine.failed}
    said = [r for r in caplog.records if r.name == "worker_shim.load_reporter"]
    warnings = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
    first = "load poll failed: engine_protocol (502): /metrics has no load series"
    assert warnings == [first, f"{first} ({held} more episodes of it since the one said 60s ago)"], warnings
    recovered = [r.getMessage() for r in said if r.levelno == logging.INFO]
    assert len(recovered) == 2 and all(m.startswith("load polls work again after ") for m in recovered), recovered


@pytest.mark.parametrize(("running", "waiting", "legs", "published"), [(0, 0, 3, 3), (0, 1, 3, 2), (5, 0, 3, 5)])
async def test_a_stale_reading_publishes_no_fewer_requests_than_the_shims_legs_in_flight(
    running: int, waiting: int, legs: int, published: int
) -> None:
    """A stale reading (the engine's last figures, repeated: TensorRT-LLM's [] from a buffered
    /metrics while a burst runs) is no failure, but its idle figures are not the engine's now: its
    running requests are floored at the shim's legs in flight less those it reports waiting, and
    `engine_ts` stays at the last fresh reading's. Until 2026-12-07 routers read the busy worker as
    idle. A fresh reading goes out as the engine gave it."""
    adapter = _Reading(EngineLoad(running=running, waiting=waiting))
    reporter = LoadReporter(_CountingNats(), "t", "w1", adapter, lambda: 0, 100, legs_in_flight=lambda: legs,  # type: ignore[arg-type]
                            period_s=0.05, poll_s=0.02)  # fmt: skip
    reporter.start()
    try:
        await wait_for(lambda: reporter.report().engine_ts > 0, what="a fresh reading")
        fresh = reporter.report()
        assert (fresh.running, fresh.waiting) == (running, waiting)
        adapter.reading = EngineLoad(running=running, waiting=waiting, stale=True)
        await wait_for(lambda: reporter.report().running == published, what="the floor")
        stale = reporter.report()
        assert (stale.waiting, stale.engine_ts, reporter.healthy) == (waiting, fresh.engine_ts, True)
    finally:
        await reporter.stop()


class _LosesOneCancel:
    """A NATS client and an engine whose calls never answer, each swallowing its first cancellation."""

    is_connected = True

    def __init__(self) -> None:
        self.lost: list[str] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        await never_answers(self.lost, "publish")

    async def load(self) -> EngineLoad:
        await never_answers(self.lost, "load")
        return EngineLoad()


async def test_a_stop_ends_loops_that_lost_their_cancellations(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop that cancels its loops once and waits waited for good on one whose cancellation was
    lost below it. Each is now cancelled again until it ends, and named."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.2)  # 10 s in service
    both = _LosesOneCancel()
    reporter = LoadReporter(both, "t", "w1", both, lambda: 0, 100, period_s=0.05, poll_s=0.02)  # type: ignore[arg-type]
    reporter.start()
    await asyncio.sleep(0.1)  # each loop in its call
    with caplog.at_level(logging.WARNING, logger="runtime"):
        assert await ends_within(reporter.stop(), 5), "stop() still waits on its loops"
    assert sorted(both.lost) == ["load", "publish"]
    said = sorted(r.getMessage().split(" ran on")[0] for r in caplog.records if r.name == "runtime")
    assert said == ["task load-poll-w1", "task load-w1"], said
