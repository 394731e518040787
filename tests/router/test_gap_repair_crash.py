"""A repair loop that crashes (a bug, not a failed kvstate request) is said loudly, counted, and
started again after a backoff: before 2026-12-06 it was one ERROR without its traceback, said again on
every restart of the loop and counted nowhere; then (review of 2026-12-06) nothing restarted it, and
a worker one crash left repairing stayed out of routing until it registered anew (router.gap_repair's
module docstring). Real nats-server (the ingest's connection; the fetch itself is stubbed)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from protocol.messages import KvStateChunk, KvStateRequest
from router.block_index import BlockIndex
from router.gap_repair import CRASH_JITTER, FailureKind, FetchFailure, GapRepair
from router.ingest_stats import SyncState
from router.kv_ingest import KvIngest
from router.metrics import RouterMetrics, StateFigures
from tests.router.polling import until


def _retried_in(said: str) -> float:
    return float(said.partition("retried in ")[2].partition("s,")[0])


class _CrashingTarget:
    """A target whose every repair round crashes (a bug in repair_request) while `healthy` is False;
    `failed` has the kind of each failure it was told of."""

    def __init__(self) -> None:
        self.healthy = False
        self.failed: list[FailureKind] = []

    def needs_repair(self, worker: str) -> bool:
        return not self.healthy

    def repair_request(self, worker: str) -> KvStateRequest:
        raise RuntimeError("injected: a bug in repair_request")

    def reply_limit(self, worker: str) -> int:
        return 1000

    def reply_size(self, worker: str) -> int:
        return 0

    def repair_reply(self, worker: str, chunks: list[KvStateChunk]) -> None:
        raise AssertionError("never reached")

    def repair_failed(self, worker: str, failure: FetchFailure) -> None:
        self.failed.append(failure.kind)


async def test_a_crashed_repair_is_an_error_with_its_traceback_counted_and_said_once_a_while(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def fetch(self: GapRepair, worker: str, request: KvStateRequest) -> list[KvStateChunk]:
        return [KvStateChunk(worker=worker, epoch=1, seq=0, chunk=0, dump=True, final=True)]

    def repair_reply(self: KvIngest, worker: str, chunks: list[KvStateChunk]) -> None:
        raise KeyError("injected: a bug deep in repair_reply")

    monkeypatch.setattr(GapRepair, "fetch", fetch)
    monkeypatch.setattr(KvIngest, "repair_reply", repair_reply)
    ingest = KvIngest(nc, ns, BlockIndex(), min_entry_limit=1000)
    await ingest.start()
    try:
        with caplog.at_level(logging.INFO, logger="router.gap_repair"):
            ingest.add_worker("w1", epoch=1)  # bootstraps: its repair loop starts and crashes
            crashes = ingest.stats.repair_failures
            # nothing but the repair's own backoff starts it again (0.05 s, then 0.1 s at the defaults)
            await until(lambda: crashes[FailureKind.CRASHED] >= 3, what="the crash counted, retried, again")
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]  # once a while per worker, not per crash
        said = errors[0].getMessage()
        assert "w1" in said and "crashed" in said and "out of routing" in said, said
        assert 0.05 <= _retried_in(said) <= 0.05 * (1 + CRASH_JITTER), said
        assert errors[0].exc_info is not None and isinstance(errors[0].exc_info[1], KeyError)
        assert ingest.stats.workers["w1"].state is not SyncState.SYNCED and not ingest.synced  # out of routing

        text = RouterMetrics(lambda: StateFigures(ingest=ingest.stats)).render().decode()
        samples = {
            (s.name, tuple(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert (
            samples["kvswitch_router_kv_repair_failures_total", (("kind", "crashed"),)] == crashes[FailureKind.CRASHED]
        )
    finally:
        await ingest.stop()


async def test_a_repair_crashing_again_after_the_interval_says_how_often_it_did(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]

    class _CrashOnce(_CrashingTarget):  # each crash leaves the worker repaired: no retry, the test starts each
        def repair_failed(self, worker: str, failure: FetchFailure) -> None:
            super().repair_failed(worker, failure)
            self.healthy = True

    target = _CrashOnce()
    repair = GapRepair(None, "ns", target, error_every_s=30.0, clock=lambda: now[0])  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="router.gap_repair"):
        for t in (0.0, 1.0, 2.0, 31.0):
            now[0] = t
            target.healthy = False
            repair.ensure("w1")
            await asyncio.sleep(0.01)
        await repair.stop()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 2, said
    assert "again, 3 times in 31s" in said[1], said
    assert target.failed == [FailureKind.CRASHED] * 4


async def test_a_worker_one_crash_left_repairing_is_repaired_again_and_routed(
    nc: Client, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once not synced, nothing else starts its repair: its batches are held, its digests ignored,
    a re-put of its record (same epoch) changes nothing. It was out of routing until it registered
    anew or this router restarted (review of 2026-12-06)."""
    fetches = [0]

    async def fetch(self: GapRepair, worker: str, request: KvStateRequest) -> list[KvStateChunk]:
        fetches[0] += 1
        return [KvStateChunk(worker=worker, epoch=1, seq=0, chunk=0, dump=True, final=True)]

    real = KvIngest.repair_reply
    crashed = [False]

    def repair_reply(self: KvIngest, worker: str, chunks: list[KvStateChunk]) -> None:
        if not crashed[0]:
            crashed[0] = True
            raise KeyError("injected: a one-off bug (a race)")
        real(self, worker, chunks)

    monkeypatch.setattr(GapRepair, "fetch", fetch)
    monkeypatch.setattr(KvIngest, "repair_reply", repair_reply)
    ingest = KvIngest(nc, ns, BlockIndex(), min_entry_limit=1000)
    await ingest.start()
    try:
        ingest.add_worker("w1", epoch=1)
        await until(lambda: ingest.synced, what="the worker synced after its one crash")
        assert ingest.stats.workers["w1"].state is SyncState.SYNCED
        assert ingest.stats.repair_failures[FailureKind.CRASHED] == 1 and fetches[0] == 2
    finally:
        await ingest.stop()


async def test_a_repair_that_crashes_every_time_backs_off_to_its_own_cap(caplog: pytest.LogCaptureFixture) -> None:
    """For a bug that crashes every round, one kvstate request (a full dump: a crash asks for one) per
    crash_retry_max_s, each wait up to CRASH_JITTER longer at random, not one per retry_max_s; the wait
    starts over once a loop of the worker ends without crashing, and stop() leaves no retry."""
    target = _CrashingTarget()
    repair = GapRepair(
        None,  # type: ignore[arg-type]
        "ns",
        target,
        retry_min_s=0.01,
        retry_max_s=0.01,  # failed requests' cap: not a crash's
        crash_retry_max_s=0.04,
        error_every_s=0.0,
    )

    def waits() -> list[float]:
        return [_retried_in(r.getMessage()) for r in caplog.records]

    with caplog.at_level(logging.ERROR, logger="router.gap_repair"):
        repair.ensure("w1")
        await until(lambda: len(waits()) >= 5, what="five crashes, each retried")
        for wait, base in zip(waits()[:5], [0.01, 0.02, 0.04, 0.04, 0.04], strict=True):
            assert base <= wait <= base * (1 + CRASH_JITTER), waits()
        target.healthy = True  # the waiting loop wakes (within 0.048 s) and ends without crashing
        await asyncio.sleep(0.1)
        target.healthy = False
        before = len(waits())
        repair.ensure("w1")
        await until(lambda: len(waits()) > before, what="a crash after a loop that did not")
        assert waits()[before] <= 0.01 * (1 + CRASH_JITTER), waits()  # the wait started over
        await repair.stop()
        stopped = len(waits())
        await asyncio.sleep(0.1)
    assert len(waits()) == stopped, waits()  # no retry outlives stop()


async def test_a_gap_during_the_crash_wait_does_not_cut_it_short(caplog: pytest.LogCaptureFixture) -> None:
    """The ingest asks for a repair on every gap it sees; until 2026-12-06 such an ensure() during a
    crash's wait started the loop at once, bypassing the backoff that keeps a crashing bug from asking
    the worker for a full dump on every gap."""
    target = _CrashingTarget()
    repair = GapRepair(None, "ns", target, retry_min_s=60.0, error_every_s=0.0)  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="router.gap_repair"):
        repair.ensure("w1")
        await until(lambda: len(target.failed) == 1, what="the first crash")
        for _ in range(5):  # gaps seen while its successor waits 60 s
            repair.ensure("w1")
            await asyncio.sleep(0.01)
        await repair.stop()
    assert target.failed == [FailureKind.CRASHED], target.failed
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]


async def test_crash_retries_reach_30_s_with_jitter_at_the_defaults(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the defaults a repair crashing every round was retried every 2 s (retry_max_s) with a full
    dump each time: R routers asked each worker it hit for R/2 full dumps a second (review of
    2026-12-06). The first 13 waits pass at once here (asyncio.sleep stubbed), each recorded: the loop
    waits what its ERROR line says; the 14th lasts until stop()."""
    real_sleep = asyncio.sleep
    slept: list[float] = []

    async def no_wait(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0 if len(slept) < 14 else 3600)

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    repair = GapRepair(None, "ns", _CrashingTarget(), error_every_s=0.0)  # type: ignore[arg-type]

    def waits() -> list[float]:
        return [_retried_in(r.getMessage()) for r in caplog.records]

    with caplog.at_level(logging.ERROR, logger="router.gap_repair"):
        repair.ensure("w1")
        async with asyncio.timeout(20):
            while len(slept) < 14:  # 50 ms doubling: 30 s from the 11th crash on
                await real_sleep(0.001)
        await repair.stop()
    assert [float(f"{s:.3g}") for s in slept] == waits(), (slept, waits())
    assert len(waits()) == 14, waits()
    capped = waits()[10:]
    assert all(30.0 <= wait <= 30.0 * (1 + CRASH_JITTER) for wait in capped), waits()
    assert len(set(capped)) > 1, capped  # jittered: routers that crash alike do not ask in step
    assert "doubling to 30s" in caplog.records[-1].getMessage()
