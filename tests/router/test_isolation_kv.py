"""One worker's KV traffic cannot reach another worker's entries or grow a replica without bound.

Against a real nats-server, with tests.router.test_kv_ingest's FakeShim playing the shims (and
misbehaving where a test says so): a kvstate reply naming another worker's batches, a reply that
never ends, held batches of a worker that never answers, entries past a worker's KV capacity, and
a reply that claimed a seq its shim never reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import pack_hashes
from protocol.messages import (
    MAX_KV_TOTAL_BLOCKS,
    Cleared,
    KvEventBatch,
    KvStateChunk,
    KvStateRequest,
    LoadReport,
    Removed,
    Stored,
    decode_msg,
    encode_msg,
)
from router.block_index import BlockIndex
from router.gap_repair import FailureKind, FetchFailure, GapRepair
from router.kv_ingest import CLOCK_ALLOWANCE_S, MAX_CLAIMED_ENTRIES, KvIngest
from router.sender_budget import SenderBudget
from runtime.nats_flush import flush
from tests.router.polling import until
from tests.router.test_kv_ingest import Clock, FakeShim, digest, synced_with

EPOCH = 7


@pytest.fixture
async def ingest(nc: Client, ns: str) -> AsyncIterator[KvIngest]:
    ing = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2)
    await ing.start()
    yield ing
    await ing.stop()


@pytest.fixture
async def shim(nc: Client, ns: str) -> FakeShim:
    s = FakeShim(nc, ns, "a1")
    await s.start()
    return s


class ForgingShim(FakeShim):
    """Answers its next batch request with a batch that names `victim` (its own name on the chunk)."""

    def __init__(self, nc: Client, ns: str, worker: str, victim: str) -> None:
        super().__init__(nc, ns, worker)
        self.victim = victim
        self.forge = True

    async def _on_state(self, msg: Msg) -> None:
        req = decode_msg(msg.data, KvStateRequest)
        if not (self.forge and req.epoch == self.epoch):
            await super()._on_state(msg)
            return
        self.forge = False
        self.requests.append(req)
        seq = req.since_seq + 1
        forged = KvEventBatch(
            worker=self.victim, epoch=self.epoch, seq=seq, ts=0.0, events=[Cleared(), Stored(hashes=[11, 22, 33])]
        )
        chunk = KvStateChunk(worker=self.worker, epoch=self.epoch, seq=seq, batches=[forged])
        await self.nc.publish(msg.reply, encode_msg(chunk))


async def test_a_kvstate_reply_carrying_another_workers_batch_is_refused(nc: Client, ns: str, ingest: KvIngest) -> None:
    victim = FakeShim(nc, ns, "b2")
    forger = ForgingShim(nc, ns, "a1", victim="b2")
    for s in (victim, forger):
        await s.start()
        await synced_with(ingest, s)
    await victim.publish(Stored(hashes=[1, 2]))
    await forger.publish(Stored(hashes=[5]))
    await forger.publish(Stored(hashes=[6], parent=5), drop=True)
    await forger.publish(Stored(hashes=[7], parent=6))  # a gap: a1 is asked for the batch after seq 1
    await until(lambda: not forger.forge and ingest.synced, what="a1 repaired")
    assert ingest.index.dump() == {"a1": [5, 6, 7], "b2": [1, 2]}  # b2's entries untouched
    assert ingest.stats.malformed == 1
    assert forger.requests[-2:] == [KvStateRequest(since_seq=1, epoch=forger.epoch), KvStateRequest(since_seq=0)]
    assert ingest.sync_state("b2") is None


async def test_a_repair_reply_applies_its_batches_to_the_worker_asked_only(nc: Client, ns: str) -> None:
    ingest = KvIngest(nc, ns, BlockIndex())  # not started: the test plays the repair loop
    for worker, hashes in (("a1", []), ("b2", [1, 2])):
        ingest.add_worker(worker, EPOCH)
        ingest.repair_reply(worker, [KvStateChunk(worker=worker, epoch=EPOCH, seq=0, dump=True, hashes=hashes)])
    batch = KvEventBatch(worker="b2", epoch=EPOCH, seq=1, ts=0.0, events=[Cleared(), Stored(hashes=[9])])
    ingest.repair_reply("a1", [KvStateChunk(worker="a1", epoch=EPOCH, seq=1, batches=[batch])])
    assert ingest.index.dump() == {"a1": [9], "b2": [1, 2]}


class EndlessShim(FakeShim):
    """Answers dump requests with chunks that never end while `endless`, every `every_s`."""

    def __init__(self, nc: Client, ns: str, worker: str, hashes: bytes, every_s: float) -> None:
        super().__init__(nc, ns, worker)
        self.chunk_hashes, self.every_s = hashes, every_s
        self.endless = True
        self.sent = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _on_state(self, msg: Msg) -> None:
        if not self.endless:
            await super()._on_state(msg)
            return
        self.requests.append(decode_msg(msg.data, KvStateRequest))
        task = asyncio.create_task(self._flood(msg.reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flood(self, reply: str) -> None:
        i = 0
        while self.endless:
            chunk = KvStateChunk(
                worker=self.worker, epoch=self.epoch, seq=0, dump=True, hashes=self.chunk_hashes, chunk=i, final=False
            )
            await self.nc.publish(reply, encode_msg(chunk))
            self.sent += 1
            i += 1
            await asyncio.sleep(self.every_s)


async def test_a_kvstate_reply_that_never_ends_fails_at_its_deadline(nc: Client, ns: str) -> None:
    shim = EndlessShim(nc, ns, "a1", hashes=b"", every_s=0.05)  # each chunk well within the 0.2 s timeout
    await shim.start()
    await shim.publish(Stored(hashes=[1, 2]), drop=True)
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, fetch_timeout_s=1.0, retry_max_s=0.2)
    await ingest.start()
    try:
        ingest.add_worker("a1", shim.epoch)
        await until(lambda: ingest.stats.malformed >= 1, timeout=5.0, what="the endless reply refused")
        assert not ingest.synced
        shim.endless = False
        assert await ingest.wait_synced(10.0)
        assert ingest.index.dump() == {"a1": [1, 2]}
    finally:
        shim.endless = False
        await ingest.stop()


async def test_a_dump_of_more_blocks_than_any_worker_holds_is_refused(
    nc: Client, ns: str, ingest: KvIngest, caplog: pytest.LogCaptureFixture
) -> None:
    # No capacity known: the ceiling is 4 M blocks, 35 chunks of 120 k (under NATS's 1 MB payload).
    shim = EndlessShim(nc, ns, "a1", hashes=os.urandom(8 * 120_000), every_s=0.005)
    await shim.start()
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    try:
        ingest.add_worker("a1", shim.epoch)
        await until(lambda: ingest.stats.malformed >= 1 or shim.sent > 80, what="the oversized dump refused")
        assert ingest.stats.malformed >= 1, f"{shim.sent} chunks taken"
        warnings = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert len(warnings) == 1 and "the dump holds more blocks than the worker can hold" in warnings[0]
        shim.endless = False
        assert await ingest.wait_synced(10.0)
        assert ingest.index.dump() == {}
    finally:
        shim.endless = False


async def test_held_batches_are_bounded_in_bytes_and_a_dump_catches_up(nc: Client, ns: str, shim: FakeShim) -> None:
    # Batches of 110,000 hashes (a shim seals at most 20,000), 40 MB at once: past a sender's byte
    # budget (router.sender_budget), which this test is not about
    ingest = KvIngest(nc, ns, BlockIndex(), budget=SenderBudget(1000.0, 5000.0), request_timeout_s=0.2, retry_max_s=0.2)
    await ingest.start()
    try:
        shim.answering = False  # a worker that never answers kvstate: everything it sends is held
        ingest.add_worker(shim.worker, shim.epoch)
        payload = [int.from_bytes(os.urandom(8), "little") for _ in range(110_000)]  # ~880 kB packed
        for i in range(46):  # ~40 MB, past the 32 MiB a worker may have held; the last removes the rest
            await shim.publish(Removed(hashes=payload) if i % 2 else Stored(hashes=payload))
            await flush(shim.nc)
        await shim.publish(Stored(hashes=[1]))
        await until(lambda: ingest.stats.dropped_overflow > 0, what="held batches dropped")
        assert ingest.stats.workers["a1"].buffered < 40
        shim.answering = True
        assert await ingest.wait_synced(10.0)
        assert ingest.index.dump() == shim.expected() == {"a1": [1]}
    finally:
        await ingest.stop()


async def test_held_batches_of_all_workers_share_one_byte_budget(nc: Client, ns: str) -> None:
    ingest = KvIngest(nc, ns, BlockIndex(), held_total_bytes_limit=1 << 20)
    await ingest.start()
    try:
        ghost = FakeShim(nc, ns, "ghost")  # never registers: its batches wait for add_worker
        for _ in range(3):
            await ghost.publish(Stored(hashes=pack_hashes(range(50_000))))  # 400 kB each
        await until(lambda: ingest.stats.unknown_held + ingest.stats.dropped_unknown == 3)
        assert ingest.stats.dropped_unknown == 1
    finally:
        await ingest.stop()


@pytest.fixture
async def small_ingest(nc: Client, ns: str) -> AsyncIterator[KvIngest]:
    """An ingest whose entry floor is 4,096 (4 M by default), so a test can pass it."""
    ing = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, min_entry_limit=4096)
    await ing.start()
    yield ing
    await ing.stop()


async def test_an_offloading_worker_may_hold_more_than_its_gpu_blocks(ingest: KvIngest, shim: FakeShim) -> None:
    # A KV connector's CPU tier holds blocks that kv_total_blocks (the GPU's) does not count: below
    # the 4 M floor, such a worker is honest and stays routable.
    await synced_with(ingest, shim)
    ingest.check_digest(LoadReport(worker="a1", ts=0.0, kv_total_blocks=100))
    await shim.publish(Stored(hashes=list(range(10, 10 + 5000))))
    await until(lambda: ingest.stats.batches_applied >= 1)
    assert ingest.index.digest("a1")[0] == 5000 and ingest.stats.malformed == 0
    assert ingest.sync_state("a1") is None


async def test_a_worker_past_its_kv_capacity_is_cleared_and_resynced(
    small_ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    ingest = small_ingest
    await synced_with(ingest, shim)
    # The capacity as its load reports say (the registry's record says it too, through add_worker).
    ingest.check_digest(LoadReport(worker="a1", ts=0.0, kv_total_blocks=100))
    await shim.publish(Stored(hashes=[1, 2]))
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    await shim.publish(Stored(hashes=list(range(10, 10 + 4096))))  # more than 8 x 100 and the 4,096 floor
    await until(lambda: ingest.stats.malformed >= 1, what="the worker refused")
    assert ingest.index.digest("a1") == (0, 0)  # cleared; its dump (4,098 blocks) is refused as well
    assert "more than its KV capacity allows (4096; kv_total_blocks 100)" in caplog.text
    await shim.publish(Removed(hashes=list(range(10, 10 + 4096))))  # back within its capacity
    await until(lambda: ingest.synced and ingest.index.dump() == shim.expected(), what="resynced")
    assert ingest.index.dump() == {"a1": [1, 2]}


async def test_the_capacity_named_at_registration_bounds_the_entries(small_ingest: KvIngest, shim: FakeShim) -> None:
    ingest = small_ingest
    ingest.add_worker(shim.worker, shim.epoch, kv_total_blocks=1000)
    assert await ingest.wait_synced(10.0)
    await shim.publish(Stored(hashes=list(range(8000))))  # 8 x 1,000: still within
    await until(lambda: ingest.stats.batches_applied == 1)
    assert ingest.index.digest("a1")[0] == 8000 and ingest.stats.malformed == 0
    await shim.publish(Stored(hashes=[9000]))
    await until(lambda: ingest.stats.malformed == 1, what="the worker refused")
    assert ingest.sync_state("a1") is not None


async def test_reports_made_before_a_dump_by_a_shim_whose_clock_runs_ahead_take_no_dump(
    nc: Client, ns: str, shim: FakeShim
) -> None:
    # The dump's time is the router's: a shim 3 s ahead stamped its late reports, made before the
    # dump, after it, and each such dump reset the time to the router's again (a loop of dumps).
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=1.0)
    await ingest.start()
    try:
        for h in (1, 2, 3, 4, 5):
            await shim.publish(Stored(hashes=[h]), drop=True)  # seq 1..5, lost: the dump brings them
        await synced_with(ingest, shim)
        now = time.time()
        for i, made_before in enumerate((2.5, 2.0, 1.5, 1.0, 0.5)):  # seq 1..5's reports, drained late
            n, x = digest([1, 2, 3, 4, 5][: i + 1])
            ts = now - made_before + 3.0  # the shim's clock runs 3 s ahead
            ingest.check_digest(LoadReport(worker="a1", ts=ts, kv_epoch=shim.epoch, kv_seq=i, kv_blocks=n, kv_xor=x))
        await asyncio.sleep(0.3)
        assert ingest.stats.digest_mismatches == 0 and ingest.synced
    finally:
        await ingest.stop()


async def test_an_index_ahead_of_its_shim_for_longer_than_the_grace_takes_a_dump(
    nc: Client, ns: str, shim: FakeShim
) -> None:
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=1.0)
    await ingest.start()
    try:
        shim.held = dict.fromkeys([1, 2, 3])
        shim.seq = 10**12  # its first dump claims a seq it never sent
        await synced_with(ingest, shim)
        shim.seq = 0
        shim.held.clear()
        for h in (100, 101, 102):
            await shim.publish(Stored(hashes=[h]))
        await until(lambda: ingest.stats.duplicates == 3)  # every real batch reads as a duplicate
        # The shim's clock, later than the dump's reply by more than a clock may run ahead.
        t0 = time.time() + CLOCK_ALLOWANCE_S

        def report(at: float) -> LoadReport:
            n, x = digest(shim.expected().get("a1", []))
            return LoadReport(worker="a1", ts=t0 + at, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=n, kv_xor=x)

        ingest.check_digest(report(0.0))
        ingest.check_digest(report(0.5))
        assert ingest.synced  # made after the seq was claimed and below it, but not for the grace yet
        ingest.check_digest(report(1.0))
        await until(lambda: ingest.stats.digest_mismatches == 1 and ingest.synced, what="resynced")
        assert ingest.index.dump() == shim.expected() == {"a1": [100, 101, 102]}
        assert ingest.stats.workers["a1"].last_seq == 3

        # Reports that lag the index but keep reaching what it held are no contradiction.
        asked = len(shim.requests)
        lagging = report(2.0)  # seq 3
        await shim.publish(Stored(hashes=[103]))
        await until(lambda: ingest.stats.workers["a1"].last_seq == 4)
        ingest.check_digest(lagging)
        caught_up = report(3.5)  # seq 4
        await shim.publish(Stored(hashes=[104]))
        await until(lambda: ingest.stats.workers["a1"].last_seq == 5)
        ingest.check_digest(caught_up)
        ingest.check_digest(report(4.0))
        assert ingest.synced and ingest.stats.digest_mismatches == 1 and len(shim.requests) == asked
    finally:
        await ingest.stop()


# --- a worker's own word on its capacity, the operator's floor, late reports, stale unknown batches ---


def test_a_worker_cannot_lift_its_index_bound_past_the_ceiling(nc: Client, ns: str) -> None:
    # kv_total_blocks 2**60 would have made its bound 2**63 entries, and its kvstate reply's byte
    # budget 32 x that: no bound at all. A record or report past 2**31 is dropped before it comes
    # here (tests.router.test_isolation_peers); this holds even for one that gets through.
    ingest = KvIngest(nc, ns, BlockIndex())
    ingest.add_worker("a1", EPOCH, kv_total_blocks=2**60)
    assert ingest.reply_limit("a1") == MAX_CLAIMED_ENTRIES == 1 << 26
    ingest.add_worker("b2", EPOCH)
    ingest.check_digest(LoadReport(worker="b2", ts=0.0, kv_total_blocks=MAX_KV_TOTAL_BLOCKS))
    assert ingest.reply_limit("b2") == 1 << 26
    ingest.check_digest(LoadReport(worker="b2", ts=0.0, kv_total_blocks=1 << 20))  # an honest capacity
    assert ingest.reply_limit("b2") == 8 << 20
    above = KvIngest(nc, ns, BlockIndex(), min_entry_limit=1 << 27)  # the operator's floor goes past it
    above.add_worker("a1", EPOCH, kv_total_blocks=2**60)
    assert above.reply_limit("a1") == 1 << 27


class StampingShim(FakeShim):
    """Stamps each batch with the time it is sent, as the real shim does (worker_shim.event_log)."""

    def _wire(self, msg: KvEventBatch) -> KvEventBatch:
        return super()._wire(msgspec.structs.replace(msg, ts=time.time()))


async def test_refusing_a_worker_past_its_bound_names_the_setting_that_lifts_it(
    nc: Client, ns: str, small_ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    await synced_with(small_ingest, shim)
    await shim.publish(Stored(hashes=list(range(5000))))  # past the 4,096 floor: cleared
    big = FakeShim(nc, ns, "b2", dump_chunk=1000)  # past it from the start: its first dump is refused
    big.held = dict.fromkeys(range(5000))
    await big.start()
    small_ingest.add_worker(big.worker, big.epoch)
    await until(lambda: small_ingest.stats.malformed >= 2, what="both refused")
    said = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(said) == 2 and all("raise the router's --index-limit-per-worker" in m for m in said), said
    assert any("the dump holds more blocks than the worker can hold" in m for m in said)
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, min_entry_limit=8192)
    await ingest.start()  # an operator who knows these workers' tiers lifts the floor: both route
    try:
        for s in (shim, big):
            ingest.add_worker(s.worker, s.epoch)
        assert await ingest.wait_synced(10.0)
        assert ingest.index.dump() == {**shim.expected(), **big.expected()} and ingest.stats.malformed == 0
    finally:
        await ingest.stop()


def _report_now(shim: FakeShim) -> LoadReport:
    n, x = digest(shim.expected().get(shim.worker, []))
    return LoadReport(worker=shim.worker, ts=time.time(), kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=n, kv_xor=x)


async def test_reports_that_arrive_late_behind_the_batches_take_no_dump(nc: Client, ns: str) -> None:
    # An overloaded router drains its load-report queue behind its KV queue: each report it reads
    # is below the index's seq, for seconds. The shim made it before it sent that seq (its ts says
    # so): no contradiction, no full dump (there was one a second per worker, more load on a
    # router already behind).
    shim = StampingShim(nc, ns, "a1")
    await shim.start()
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=1.0, clock=clock)
    await ingest.start()
    try:
        await synced_with(ingest, shim)
        made: list[LoadReport] = []
        for h in range(6):
            made.append(_report_now(shim))
            await shim.publish(Stored(hashes=[h]))
        await until(lambda: ingest.stats.workers["a1"].last_seq == 6)
        asked = len(shim.requests)
        for i, late in enumerate(made):  # 2.5 s behind on this router's clock, seqs 0 to 5 of 6
            clock.now = 0.5 * i
            ingest.check_digest(late)
        ingest.check_digest(_report_now(shim))  # the first one made after the batches: it agrees
        await asyncio.sleep(0.3)  # a dump, had one been asked, would be under way
        assert ingest.synced and ingest.stats.digest_mismatches == 0 and len(shim.requests) == asked
        assert ingest.index.dump() == shim.expected()
    finally:
        await ingest.stop()


async def test_stale_batches_of_unknown_workers_never_keep_the_budget_from_a_repair(nc: Client, ns: str) -> None:
    # They expired only when another unknown worker's batch came; until then they held the shared
    # budget, and a registered worker under repair had its held batches dropped.
    clock = Clock()
    ingest = KvIngest(
        nc, ns, BlockIndex(), request_timeout_s=0.2, held_total_bytes_limit=1 << 20, unknown_ttl_s=5.0, clock=clock
    )
    await ingest.start()
    try:
        ghost = FakeShim(nc, ns, "ghost")  # never registers
        for _ in range(2):
            await ghost.publish(Stored(hashes=pack_hashes(range(50_000))))  # 400 kB each
        await until(lambda: ingest.stats.unknown_held == 2)
        shim = FakeShim(nc, ns, "a1", dump_chunk=100_000)
        shim.answering = False  # bootstrapping: what it sends is held
        await shim.start()
        ingest.add_worker(shim.worker, shim.epoch)
        clock.now = 6.0  # past the ghost's TTL, and no other unknown batch comes
        await shim.publish(Stored(hashes=pack_hashes(range(100, 50_100))))  # fits once the ghost's go
        await until(lambda: ingest.stats.workers["a1"].buffered + ingest.stats.dropped_overflow > 0)
        assert ingest.stats.dropped_overflow == 0 and ingest.stats.workers["a1"].buffered == 1
        assert (ingest.stats.unknown_held, ingest.stats.dropped_unknown) == (0, 2)
        shim.answering = True
        assert await ingest.wait_synced(10.0)
        assert ingest.index.dump() == shim.expected()
    finally:
        await ingest.stop()


class _Limits:
    """A RepairTarget's reply limit, for GapRepair.fetch alone."""

    def reply_limit(self, worker: str) -> int:
        return 1 << 22

    def reply_size(self, worker: str) -> int:
        return 0


async def test_the_replies_in_flight_share_one_byte_budget(nc: Client, ns: str) -> None:
    # Each reply was bounded alone: 32 replies in flight of 2 GiB each could hold 64 GiB.
    shims = [EndlessShim(nc, ns, w, hashes=os.urandom(8 * 16_384), every_s=0.01) for w in ("a1", "a2")]
    for s in shims:
        await s.start()
    repair = GapRepair(nc, ns, _Limits(), request_timeout_s=0.5, fetch_timeout_s=5.0, replies_bytes_limit=1 << 20)  # type: ignore[arg-type]
    first = asyncio.create_task(repair.fetch("a1", KvStateRequest()))
    try:
        await until(lambda: repair.reply_bytes > 1 << 20, what="the first reply past the shared budget")
        with pytest.raises(FetchFailure, match="the replies in flight hold") as err:
            await repair.fetch("a2", KvStateRequest())
        assert err.value.kind is FailureKind.BYTE_LIMIT  # no fault of a2's: it is asked again later
        assert not first.done(), "the first reply goes on to its own bound"
    finally:
        for s in shims:
            s.endless = False
        with contextlib.suppress(FetchFailure):
            await first
    assert repair.reply_bytes == 0
