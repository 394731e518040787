"""A repair loop that crashes (a bug, not a failed kvstate request) is said loudly and counted:
before 2026-12-06 it was one ERROR without its traceback, said again on every restart of the loop
and counted nowhere (router.gap_repair's module docstring). Real nats-server (the ingest's
connection; the fetch itself is stubbed)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from protocol.messages import KvStateChunk, KvStateRequest
from router.block_index import BlockIndex
from router.gap_repair import FailureKind, GapRepair
from router.ingest_stats import SyncState
from router.kv_ingest import KvIngest
from router.metrics import RouterMetrics, StateFigures
from tests.router.polling import until


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
            await until(lambda: crashes[FailureKind.CRASHED] == 1, what="the crash counted")
            for n in (2, 3):  # each later repair of the worker crashes alike (kv_ingest ensures one per gap)
                ingest.repairs.ensure("w1")
                await until(lambda n=n: crashes[FailureKind.CRASHED] == n, what="the crash counted again")  # type: ignore[misc]
            await asyncio.sleep(0)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]  # once a while per worker, not per crash
        said = errors[0].getMessage()
        assert "w1" in said and "crashed" in said and "out of routing" in said, said
        assert errors[0].exc_info is not None and isinstance(errors[0].exc_info[1], KeyError)
        assert ingest.stats.workers["w1"].state is not SyncState.SYNCED and not ingest.synced  # out of routing

        text = RouterMetrics(lambda: StateFigures(ingest=ingest.stats)).render().decode()
        samples = {
            (s.name, tuple(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples["kvswitch_router_kv_repair_failures_total", (("kind", "crashed"),)] == 3
    finally:
        await ingest.stop()


async def test_a_repair_crashing_again_after_the_interval_says_how_often_it_did(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]

    class Target:
        def __init__(self) -> None:
            self.failed: list[FailureKind] = []

        def needs_repair(self, worker: str) -> bool:
            return True

        def repair_request(self, worker: str) -> KvStateRequest:
            raise RuntimeError("injected: a bug in repair_request")

        def reply_limit(self, worker: str) -> int:
            return 1000

        def reply_size(self, worker: str) -> int:
            return 0

        def repair_reply(self, worker: str, chunks: list[KvStateChunk]) -> None:
            raise AssertionError("never reached")

        def repair_failed(self, worker: str, failure: object) -> None:
            self.failed.append(failure.kind)  # type: ignore[attr-defined]

    target = Target()
    repair = GapRepair(None, "ns", target, error_every_s=30.0, clock=lambda: now[0])  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="router.gap_repair"):
        for t in (0.0, 1.0, 2.0, 31.0):
            now[0] = t
            repair.ensure("w1")
            await asyncio.sleep(0.01)
        await repair.stop()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 2, said
    assert "again, 3 times in 31s" in said[1], said
    assert target.failed == [FailureKind.CRASHED] * 4
