"""GapRepair waits as long as a correct shim needs for a large dump's first chunk, never asks
again for a replay that timed out, and its ERROR says what it saw. Shims played by the test over a
real nats-server."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from protocol import pack_batch, pack_chunk, subjects
from protocol.messages import KvEventBatch, KvStateChunk, KvStateRequest, LoadReport, Stored, decode_msg, encode_msg
from router.block_index import BlockIndex
from router.gap_repair import FailureKind, FetchFailure, GapRepair
from router.kv_ingest import MIN_ENTRY_LIMIT, KvIngest
from router.metrics import RouterMetrics, StateFigures
from runtime.nats_flush import flush
from tests.router.polling import until


class _Target:
    """The least a RepairTarget is, for calling `fetch` alone."""

    def needs_repair(self, worker: str) -> bool:
        return False

    def repair_request(self, worker: str) -> KvStateRequest:
        return KvStateRequest()

    def __init__(self, *, limit: int = MIN_ENTRY_LIMIT, holds: int = MIN_ENTRY_LIMIT) -> None:
        self.limit, self.holds = limit, holds

    def reply_limit(self, worker: str) -> int:
        return self.limit

    def reply_size(self, worker: str) -> int:
        return self.holds

    def repair_reply(self, worker: str, chunks: list[KvStateChunk]) -> None:
        pass

    def repair_failed(self, worker: str, failure: FetchFailure) -> None:
        pass


class ReplayLostShim:
    """Answers dumps, never a replay (as if each replay were lost on the way, e.g. over max_payload)."""

    def __init__(self, nc: Client, ns: str, worker: str) -> None:
        self.nc, self.ns, self.worker = nc, ns, worker
        self.epoch = random.getrandbits(63)
        self.seq = 0
        self.held: list[int] = []
        self.requests: list[KvStateRequest] = []

    async def start(self) -> None:
        await self.nc.subscribe(subjects.kvstate(self.ns, self.worker), cb=self._on_state)
        await flush(self.nc)

    async def publish(self, h: int, *, drop: bool = False) -> None:
        self.seq += 1
        self.held.append(h)
        batch = KvEventBatch(worker=self.worker, epoch=self.epoch, seq=self.seq, ts=0.0, events=[Stored(hashes=[h])])
        if not drop:
            await self.nc.publish(subjects.kv(self.ns, self.worker), encode_msg(pack_batch(batch)))

    async def _on_state(self, msg: Msg) -> None:
        req = decode_msg(msg.data, KvStateRequest)
        self.requests.append(req)
        if req.epoch is None:
            chunk = KvStateChunk(worker=self.worker, epoch=self.epoch, seq=self.seq, dump=True, hashes=self.held)
            await self.nc.publish(msg.reply, encode_msg(pack_chunk(chunk)))


@pytest.fixture
async def ingest(nc: Client, ns: str) -> AsyncIterator[KvIngest]:
    ing = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, min_entry_limit=1000)
    await ing.start()
    yield ing
    await ing.stop()


async def test_a_dump_whose_first_chunk_takes_seconds_is_waited_for(nc: Client, ns: str) -> None:
    # A shim copies and orders millions of blocks before its first chunk, or answers another
    # router's dump first: 3 s for a worker that says it holds 4 M blocks is honest.
    async def slow(msg: Msg) -> None:
        await asyncio.sleep(3.0)
        chunk = KvStateChunk(worker="w", epoch=5, seq=9, dump=True, hashes=[1, 2])
        await nc.publish(msg.reply, encode_msg(pack_chunk(chunk)))

    await nc.subscribe(subjects.kvstate(ns, "w"), cb=slow)
    await flush(nc)
    chunks = await GapRepair(nc, ns, _Target()).fetch("w", KvStateRequest())
    assert [(c.seq, c.hashes) for c in chunks] == [(9, b"\x01" + bytes(7) + b"\x02" + bytes(7))]


async def test_a_hung_shim_holding_few_blocks_times_out_soon_whatever_its_limit(nc: Client, ns: str) -> None:
    """Before: the first chunk's wait grew with the index limit (64 M blocks: 6.4 s more here), so a
    hung shim held a repair slot that long and then read as `malformed` ('no final chunk')."""

    async def hung(msg: Msg) -> None:
        pass

    await nc.subscribe(subjects.kvstate(ns, "w"), cb=hung)
    await flush(nc)
    repair = GapRepair(nc, ns, _Target(limit=1 << 26, holds=16_384), request_timeout_s=0.2, fetch_timeout_s=1.0)
    with pytest.raises(FetchFailure) as err:
        await repair.fetch("w", KvStateRequest())
    assert err.value.kind is FailureKind.TIMED_OUT, err.value


async def test_a_workers_first_dump_before_any_load_report_gets_its_index_bounds_wait(ingest: KvIngest) -> None:
    """Before: a worker added with no report yet counted as holding 0 blocks, so a router starting
    beside a 4 M-block worker gave its first dump the plain 2 s (6 routers at once: 41 timeouts)."""
    ingest.add_worker("a1", 1)
    assert ingest.reply_size("a1") == ingest.reply_limit("a1") > 500
    ingest.check_digest(LoadReport(worker="a1", ts=1e9, kv_blocks=500))
    assert ingest.reply_size("a1") == 500


async def test_a_replay_that_timed_out_is_not_asked_for_again(ingest: KvIngest, nc: Client, ns: str) -> None:
    shim = ReplayLostShim(nc, ns, "a1")
    await shim.start()
    ingest.add_worker("a1", shim.epoch)
    assert await ingest.wait_synced(5.0)
    await shim.publish(1)
    await shim.publish(2, drop=True)
    await shim.publish(3)  # a gap: the router asks for seq 2 on, which never comes
    await until(lambda: len(shim.requests) >= 3, timeout=5.0, what="a second repair request")
    assert await ingest.wait_synced(5.0)
    assert ingest.index.dump() == {"a1": [1, 2, 3]}
    assert [r.epoch for r in shim.requests[:3]] == [None, shim.epoch, None]  # the dump, the replay, a dump


async def test_the_error_says_what_was_seen(
    ingest: KvIngest, nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def silent(msg: Msg) -> None:  # takes the request, answers nothing
        pass

    await nc.subscribe(subjects.kvstate(ns, "a1"), cb=silent)
    await flush(nc)
    caplog.set_level(logging.INFO, logger="router.gap_repair")
    ingest.add_worker("a1", 1)
    await until(lambda: ingest.repairs.failures("a1") >= 3, timeout=5.0, what="three failures")
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "last: no reply within 0.2s" in error and "until a request on" in error
    assert "gets a complete answer" in error and "until its shim answers" not in error


async def test_failed_repairs_are_counted_by_kind_and_only_timeouts_as_timeouts(
    ingest: KvIngest, nc: Client, ns: str
) -> None:
    """Before: every failure that was not a malformed reply counted in kvswitch_router_kv_repair_timeouts
    (this router's own byte limit, NATS errors and no responders too), pointing an operator alerting
    on timeouts at the shims and NATS when the cause was this router's replies budget."""

    async def silent(msg: Msg) -> None:  # takes the request, answers nothing: a timeout
        pass

    async def garbage(msg: Msg) -> None:
        await nc.publish(msg.reply, b"\x01not msgpack of a chunk")

    await nc.subscribe(subjects.kvstate(ns, "hung"), cb=silent)
    await nc.subscribe(subjects.kvstate(ns, "junk"), cb=garbage)
    await flush(nc)
    for worker in ("hung", "junk", "gone"):  # "gone": nobody subscribes, no responders
        ingest.add_worker(worker, 1)
    await until(lambda: all(ingest.repairs.failures(w) >= 2 for w in ("hung", "junk", "gone")), timeout=10.0)
    await ingest.stop()  # the counts stand still from here
    # What a fetch alone cannot be made to meet here: this router's byte limit, its NATS connection.
    for kind in (FailureKind.BYTE_LIMIT, FailureKind.NATS_ERROR, FailureKind.NATS_ERROR):
        ingest.repair_failed("gone", FetchFailure("made here", kind=kind))
    failures = ingest.stats.repair_failures
    assert failures[FailureKind.TIMED_OUT] >= 2 and failures[FailureKind.MALFORMED] >= 2
    assert failures[FailureKind.NO_RESPONDERS] >= 2
    assert (failures[FailureKind.BYTE_LIMIT], failures[FailureKind.NATS_ERROR]) == (1, 2)
    assert ingest.stats.repair_timeouts == failures[FailureKind.TIMED_OUT]

    text = RouterMetrics(lambda: StateFigures(ingest=ingest.stats)).render().decode()
    samples = {
        (s.name, tuple(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for kind in FailureKind:
        assert samples["kvswitch_router_kv_repair_failures_total", (("kind", kind.label),)] == failures[kind]
    assert samples["kvswitch_router_kv_repair_timeouts_total", ()] == failures[FailureKind.TIMED_OUT]
