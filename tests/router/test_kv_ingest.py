"""KvIngest against a small shim played by the test over a real nats-server.

FakeShim publishes KvEventBatches on {ns}.kv.{worker} and answers {ns}.kvstate.{worker} the way the
real shim does: the missed batches when its ring still has them all and the epoch matches, else a
full dump in chunks; hashes packed as the real shim sends them, or as lists (`packed=False`, what
shims sent before protocol.packed).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import pack_batch, pack_chunk, pack_hashes, subjects
from protocol.messages import (
    Cleared,
    KvEvent,
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
from router.ingest_stats import SyncState
from router.kv_ingest import ENDED_MAX, ENDED_S, KvIngest
from router.lifecycle import PartStatus
from router.pending_prefixes import PendingPrefixes
from router.sender_budget import SenderBudget
from runtime.nats_flush import flush
from tests.router.polling import until
from worker_shim import EngineRemoved, EngineStored, Normaliser
from worker_shim.event_log import RING_SIZE, EventLog
from worker_shim.kv_pace import KvPace
from worker_shim.kv_publisher import MAX_HASHES, KvPublisher


class FakeShim:
    def __init__(
        self, nc: Client, ns: str, worker: str, *, ring: int = 64, dump_chunk: int = 3, packed: bool = True
    ) -> None:
        self.nc, self.ns, self.worker, self.packed = nc, ns, worker, packed
        self.epoch = random.getrandbits(63)
        self.seq = 0
        self.ring: deque[KvEventBatch] = deque(maxlen=ring)
        self.held: dict[int, None] = {}  # insertion-ordered: parent-first, like the real shim's dump
        self.dump_chunk = dump_chunk
        self.requests: list[KvStateRequest] = []
        self.answering = True
        self.garbage = 0  # answer this many requests with bytes that are no KvStateChunk
        self.bad_dumps = 0  # answer this many dump requests with packed hashes of a bad length
        self.short_replays = 0  # answer this many replays with their first batch only, at the shim's own seq

    async def start(self) -> None:
        await self.nc.subscribe(subjects.kvstate(self.ns, self.worker), cb=self._on_state)
        await flush(self.nc)

    async def publish(self, *events: KvEvent, drop: bool = False) -> KvEventBatch:
        """Make the next batch; `drop` loses it on the way (it stays in the ring)."""
        self.seq += 1
        for ev in events:
            match ev:
                case Stored(hashes=hs):
                    self.held.update(dict.fromkeys(hs))
                case Removed(hashes=hs):
                    for h in hs:
                        self.held.pop(h, None)
                case Cleared():
                    self.held.clear()
        batch = KvEventBatch(worker=self.worker, epoch=self.epoch, seq=self.seq, ts=0.0, events=list(events))
        self.ring.append(batch)
        if not drop:
            await self.nc.publish(subjects.kv(self.ns, self.worker), encode_msg(self._wire(batch)))
        return batch

    def _wire(self, msg: KvEventBatch) -> KvEventBatch:
        return pack_batch(msg) if self.packed else msg

    async def _reply(self, msg: Msg, chunk: KvStateChunk) -> None:
        await self.nc.publish(msg.reply, encode_msg(pack_chunk(chunk) if self.packed else chunk))

    def restart(self) -> None:
        """A new epoch: numbering starts again and the engine holds nothing."""
        self.epoch = random.getrandbits(63)
        self.seq = 0
        self.ring.clear()
        self.held.clear()

    def expected(self) -> dict[str, list[int]]:
        return {self.worker: sorted(self.held)} if self.held else {}

    async def _on_state(self, msg: Msg) -> None:
        req = decode_msg(msg.data, KvStateRequest)
        self.requests.append(req)
        if not self.answering:
            return
        if self.garbage:
            self.garbage -= 1
            await self.nc.publish(msg.reply, b"\x01not msgpack of a chunk")
            return
        missed = [b for b in self.ring if b.seq > req.since_seq]
        covered = req.since_seq == self.seq or (bool(missed) and missed[0].seq == req.since_seq + 1)
        if req.epoch == self.epoch and covered:
            if self.short_replays and missed:
                self.short_replays -= 1
                missed = missed[:1]
            for i in range(0, max(len(missed), 1), 2):  # two batches per chunk
                last = i + 2 >= len(missed)
                chunk = KvStateChunk(
                    worker=self.worker,
                    epoch=self.epoch,
                    seq=self.seq,
                    batches=missed[i : i + 2],
                    chunk=i // 2,
                    final=last,
                )
                await self._reply(msg, chunk)
            return
        if self.bad_dumps:
            self.bad_dumps -= 1
            bad = KvStateChunk(worker=self.worker, epoch=self.epoch, seq=self.seq, dump=True, hashes=b"\x01" * 7)
            await self.nc.publish(msg.reply, encode_msg(bad))
            return
        hashes = list(self.held)
        parts = [hashes[i : i + self.dump_chunk] for i in range(0, len(hashes), self.dump_chunk)] or [[]]
        for i, part in enumerate(parts):
            chunk = KvStateChunk(
                worker=self.worker,
                epoch=self.epoch,
                seq=self.seq,
                dump=True,
                hashes=part,
                chunk=i,
                final=i == len(parts) - 1,
            )
            await self._reply(msg, chunk)


@pytest.fixture
async def shim(nc: Client, ns: str) -> FakeShim:
    s = FakeShim(nc, ns, "a1")
    await s.start()
    return s


@pytest.fixture
async def ingest(nc: Client, ns: str) -> AsyncIterator[KvIngest]:
    ing = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2)
    await ing.start()
    yield ing
    await ing.stop()


async def synced_with(ingest: KvIngest, shim: FakeShim) -> None:
    ingest.add_worker(shim.worker, shim.epoch)
    assert await ingest.wait_synced(10.0)


async def test_batches_in_order_are_applied(ingest: KvIngest, shim: FakeShim) -> None:
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1, 2, 3]))
    await shim.publish(Stored(hashes=[4], parent=3), Removed(hashes=[1]))
    await until(lambda: ingest.stats.batches_applied == 2)
    assert ingest.index.dump() == shim.expected() == {"a1": [2, 3, 4]}
    assert ingest.stats.events_applied == 3
    assert ingest.stats.workers["a1"].last_seq == 2
    assert ingest.stats.gaps == ingest.stats.duplicates == 0


async def test_shims_sending_hash_lists_are_still_understood(nc: Client, ns: str, ingest: KvIngest) -> None:
    old = FakeShim(nc, ns, "o1", packed=False)
    await old.start()
    await old.publish(Stored(hashes=[1, 2, 3]))
    await synced_with(ingest, old)  # a dump of lists
    await old.publish(Stored(hashes=[4], parent=3), Removed(hashes=[1]))
    await until(lambda: ingest.stats.batches_applied == 1)
    assert ingest.index.dump() == old.expected() == {"o1": [2, 3, 4]}
    assert ingest.stats.malformed == 0


async def test_a_batch_with_bad_hashes_is_counted_and_its_seq_taken(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    await synced_with(ingest, shim)
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    await shim.publish(Stored(hashes=[1]))
    for bad in (b"\x02" * 9, [-1]):  # not whole u64s; out of range (msgpack carries negative ints)
        shim.seq += 1
        batch = KvEventBatch(
            worker="a1",
            epoch=shim.epoch,
            seq=shim.seq,
            ts=0.0,
            events=[Stored(hashes=pack_hashes([7])), Stored(hashes=bad)],
        )
        await nc.publish(subjects.kv(ns, "a1"), encode_msg(batch))
    await shim.publish(Stored(hashes=[9]))
    await until(lambda: ingest.stats.batches_applied == 4)
    assert ingest.stats.malformed == 2
    assert ingest.stats.gaps == 0 and ingest.synced
    assert ingest.index.dump() == {"a1": [1, 7, 9]}  # what came before the bad event is in
    assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1


async def test_a_batch_with_a_bad_hash_ends_its_workers_pending_entries(nc: Client, ns: str, shim: FakeShim) -> None:
    # Its events before the bad one are applied, the rest not; none confirmed the pending entries,
    # so one for a block it evicted credited the worker until its TTL (a dump leaves them alone).
    pending = PendingPrefixes(30.0, lambda: 0.0)

    def on_events(worker: str, events: list[KvEvent]) -> None:  # as the router's service wires them
        for ev in events:
            if isinstance(ev, Stored | Removed):
                pending.confirm(worker, ev.hashes)
            elif isinstance(ev, Cleared):
                pending.forget_worker(worker)

    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, on_events=on_events)
    await ingest.start()
    try:
        await shim.publish(Stored(hashes=[1, 2]))
        await synced_with(ingest, shim)
        pending.add("a1", [1, 2, 3])  # a request routed there: its third block is on its way
        shim.seq += 1
        events: list[KvEvent] = [Stored(hashes=[3], parent=2), Removed(hashes=[2]), Stored(hashes=b"\x02" * 9)]
        batch = KvEventBatch(worker="a1", epoch=shim.epoch, seq=shim.seq, ts=0.0, events=events)
        await nc.publish(subjects.kv(ns, "a1"), encode_msg(batch))
        await until(lambda: ingest.stats.malformed == 1)
        assert ingest.index.dump() == {"a1": [1, 3]}
        assert not pending.holds("a1", 2)  # evicted
        assert pending.match([1, 2, 3], ingest.index.find_matches([1, 2, 3])) == {}
    finally:
        await ingest.stop()


async def test_a_dump_with_bad_hashes_is_a_failed_repair_and_retried(ingest: KvIngest, shim: FakeShim) -> None:
    await shim.publish(Stored(hashes=[1, 2]))
    shim.bad_dumps = 1
    await synced_with(ingest, shim)
    assert ingest.stats.malformed == 1
    assert ingest.index.dump() == shim.expected() == {"a1": [1, 2]}


async def test_duplicate_batch_is_dropped(nc: Client, ns: str, ingest: KvIngest, shim: FakeShim) -> None:
    await synced_with(ingest, shim)
    first = await shim.publish(Stored(hashes=[1, 2]))
    latest = await shim.publish(Removed(hashes=[2]))
    await nc.publish(subjects.kv(ns, "a1"), encode_msg(first))  # seq < last_seq
    await nc.publish(subjects.kv(ns, "a1"), encode_msg(latest))  # seq == last_seq
    await until(lambda: ingest.stats.duplicates == 2)
    assert ingest.index.dump() == {"a1": [1]}
    assert ingest.stats.batches_applied == 2


async def test_gap_is_repaired_with_the_missed_batches(ingest: KvIngest, shim: FakeShim) -> None:
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1]))
    await shim.publish(Stored(hashes=[2], parent=1), drop=True)
    await shim.publish(Stored(hashes=[3], parent=2), drop=True)
    await shim.publish(Removed(hashes=[1]))
    await until(lambda: ingest.stats.gaps == 1 and ingest.synced)
    assert ingest.index.dump() == shim.expected() == {"a1": [2, 3]}
    assert shim.requests[-1] == KvStateRequest(since_seq=1, epoch=shim.epoch)
    assert ingest.stats.repairs_batches == 1
    assert ingest.stats.repairs_dumps == 1  # the bootstrap only
    assert ingest.stats.workers["a1"].last_seq == 4


async def test_gap_older_than_the_ring_is_repaired_with_a_dump(nc: Client, ns: str, ingest: KvIngest) -> None:
    shim = FakeShim(nc, ns, "b2", ring=2)
    await shim.start()
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[10, 11]))
    for h in range(12, 20):
        await shim.publish(Stored(hashes=[h], parent=h - 1), Removed(hashes=[h - 2]), drop=True)
    await shim.publish(Stored(hashes=[20], parent=19))
    await until(lambda: ingest.stats.gaps == 1 and ingest.synced)
    assert ingest.index.dump() == shim.expected() == {"b2": [18, 19, 20]}
    assert ingest.stats.repairs_dumps == 2  # bootstrap, then the repair
    assert ingest.stats.workers["b2"].last_seq == shim.seq


async def test_epoch_change_resyncs_from_a_dump(ingest: KvIngest, shim: FakeShim) -> None:
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1, 2, 3]))
    await until(lambda: ingest.stats.batches_applied == 1)
    shim.restart()
    await shim.publish(Stored(hashes=[7, 8]))
    await until(lambda: ingest.stats.epoch_changes == 1 and ingest.synced)
    assert ingest.index.dump() == shim.expected() == {"a1": [7, 8]}
    assert ingest.stats.workers["a1"].epoch == shim.epoch
    await shim.publish(Stored(hashes=[9], parent=8))
    await until(lambda: ingest.stats.workers["a1"].last_seq == 2)
    assert ingest.index.dump() == {"a1": [7, 8, 9]}


async def test_cleared_drops_every_entry_of_the_worker(ingest: KvIngest, shim: FakeShim, nc: Client, ns: str) -> None:
    other = FakeShim(nc, ns, "c3")
    await other.start()
    await synced_with(ingest, shim)
    await synced_with(ingest, other)
    await shim.publish(Stored(hashes=[1, 2, 3]))
    await other.publish(Stored(hashes=[1, 2]))
    await shim.publish(Cleared())
    await until(lambda: ingest.stats.batches_applied == 3)
    assert ingest.index.dump() == {"c3": [1, 2]}
    assert ingest.index.find_matches([1, 2, 3]) == {"c3": 2}


async def test_malformed_payloads_are_counted_logged_once_and_dropped(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    await synced_with(ingest, shim)
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    await nc.publish(subjects.kv(ns, "a1"), b"\xc1 not msgpack")
    await nc.publish(subjects.kv(ns, "a1"), encode_msg(Stored(hashes=[1])))  # not a batch
    wrong = KvEventBatch(worker="zz", epoch=shim.epoch, seq=1, ts=0.0, events=[Stored(hashes=[5])])
    await nc.publish(subjects.kv(ns, "a1"), encode_msg(wrong))  # names another worker
    await shim.publish(Stored(hashes=[1]))
    await until(lambda: ingest.stats.batches_applied == 1)
    assert ingest.stats.malformed == 3
    assert ingest.index.dump() == {"a1": [1]}
    warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1
    assert "a1" in warnings[0].getMessage()


async def test_a_batch_of_a_newer_schema_version_is_counted_malformed_not_applied(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    # A shim of a future, incompatible schema (v 2): its events may mean something else, so they
    # must not reach the index; the operator is told which process to upgrade.
    await synced_with(ingest, shim)
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    newer = KvEventBatch(worker="a1", epoch=shim.epoch, seq=shim.seq + 1, ts=0.0, events=[Stored(hashes=[5])], v=2)
    await nc.publish(subjects.kv(ns, "a1"), encode_msg(newer))
    await until(lambda: ingest.stats.malformed == 1, what="the v 2 batch counted malformed")
    await shim.publish(Stored(hashes=[1]))  # the same seq at this schema: taken
    await until(lambda: ingest.stats.batches_applied == 1)
    assert ingest.index.dump() == {"a1": [1]} and ingest.stats.malformed == 1
    (line,) = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert "a1" in line and "newer schema version (2)" in line and "upgrade this process" in line


async def test_a_newer_schema_after_garbage_from_the_same_worker_is_still_said(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """Its own slot: the line telling to upgrade was swallowed by an earlier one of garbage
    (logonce audit of 2026-12-07, finding 6)."""
    await synced_with(ingest, shim)
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    await nc.publish(subjects.kv(ns, "a1"), b"\xc1 not msgpack")
    newer = KvEventBatch(worker="a1", epoch=shim.epoch, seq=shim.seq + 1, ts=0.0, events=[], v=2)
    for _ in range(2):
        await nc.publish(subjects.kv(ns, "a1"), encode_msg(newer))
    await until(lambda: ingest.stats.malformed == 3)
    lines = _malformed_lines(caplog)
    assert len(lines) == 2 and "newer schema version (2)" in lines[1] and "upgrade this process" in lines[1]


async def _newer_batch(nc: Client, ns: str, shim: FakeShim, *events: dict[str, object]) -> None:
    """The shim's next batch as a newer shim sends it: `events` as maps, of types this router may not know."""
    shim.seq += 1
    batch = {"v": 1, "worker": shim.worker, "epoch": shim.epoch, "seq": shim.seq, "ts": 0.0, "events": list(events)}
    await nc.publish(subjects.kv(ns, shim.worker), msgspec.msgpack.encode(batch))


async def test_events_of_a_type_a_newer_shim_adds_are_skipped_and_the_rest_of_their_batch_applied(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """logonce audit of 2026-12-07, finding 6: one event {"type": "moved"} made its whole batch
    malformed, the good events lost with it; a newer shim's every batch was lost so."""
    await synced_with(ingest, shim)
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    await _newer_batch(nc, ns, shim, {"type": "stored", "hashes": [1]}, {"type": "moved", "hashes": [1], "to": "cpu"})
    await _newer_batch(nc, ns, shim, {"type": "moved", "hashes": [1]}, {"type": "stored", "hashes": [2], "parent": 1})
    await _newer_batch(
        nc, ns, shim, {"type": "stored_v2", "hashes": [3], "parent": 2}
    )  # it stores: the index misses it
    shim.held.update(dict.fromkeys([1, 2, 3]))
    await shim.publish(Stored(hashes=[4], parent=3))
    await until(lambda: ingest.stats.batches_applied == 4)
    assert ingest.stats.malformed == 0 and ingest.stats.gaps == 0 and ingest.synced
    assert ingest.stats.events_unknown == {"moved": 2, "stored_v2": 1}
    assert ingest.index.dump() == {"a1": [1, 2, 4]}
    (line,) = [r.getMessage() for r in caplog.records]  # once per worker
    assert line.startswith("worker a1 sends KV events of type 'moved', which this router does not know")
    assert "newer kvswitch" in line and "kvswitch_router_kv_events_unknown_total" in line
    # what a skipped event changed, the next load report's digest check repairs
    n, x = digest(shim.expected()["a1"])
    ingest.check_digest(LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=n, kv_xor=x))
    await until(lambda: ingest.stats.digest_mismatches == 1 and ingest.synced)
    assert ingest.index.dump() == shim.expected() == {"a1": [1, 2, 3, 4]}


async def test_malformed_batches_from_senders_with_no_record_name_each_sender(
    nc: Client, ns: str, ingest: KvIngest, caplog: pytest.LogCaptureFixture
) -> None:
    """logonce audit of 2026-12-07, finding 8: every sender with no record shared one entry, never
    removed: garbage on kv.aaaa0001, kv.aaaa0002 and kv.aaaa0003 named aaaa0001 alone."""
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    senders = ("aaaa0001", "aaaa0002", "aaaa0003")
    for _ in range(3):
        for sender in senders:
            await nc.publish(subjects.kv(ns, sender), b"\xc1\xc1garbage")
    await until(lambda: ingest.stats.malformed == 9)
    lines = _malformed_lines(caplog)
    assert [line.split(" (")[0] for line in lines] == [f"dropping malformed KV events from worker {s}" for s in senders]


async def test_events_of_unknown_types_count_as_their_batch_is_applied_never_for_a_sender_with_no_record(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review of e1d08bd, finding 1: events of an unknown type were counted and said as they were
    decoded, before the sender's record was looked up: any publisher on {ns}.kv.<name> took the 8
    label values of kvswitch_router_kv_events_unknown_total for good (a real newer shim's type then
    counted as "other") and a WARNING that its shim runs a newer kvswitch; a batch dropped later (a
    duplicate, a stranger's expired) was counted too."""
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    ing = KvIngest(nc, ns, BlockIndex())  # not started: its batches and its one repair are handed to it here

    def batch(worker: str, seq: int, *kinds: str) -> bytes:
        events = [{"type": "stored", "hashes": [seq]}, *({"type": kind} for kind in kinds)]
        return msgspec.msgpack.encode({"worker": worker, "epoch": 7, "seq": seq, "ts": 0.0, "events": events})

    for s in range(4):  # senders with no record, two made-up types each
        ing._on_payload(f"zz{s}", batch(f"zz{s}", 1, f"junk-{s}-0", f"junk-{s}-1"))
    ing._on_payload("a1", batch("a1", 1, "moved"))  # ahead of its record: held
    assert ing.stats.unknown_held == 5 and ing.stats.events_unknown == {} and not caplog.records
    ing.add_worker("a1", 7)
    ing._on_payload("a1", batch("a1", 2, "moved", "moved"))  # bootstrapping: held
    assert ing.stats.events_unknown == {}
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=1, dump=True, hashes=[1])])
    # seq 1 the dump covers (a duplicate, dropped), seq 2 applied
    assert (ing.stats.duplicates, ing.stats.batches_applied) == (1, 1) and ing.stats.events_unknown == {"moved": 2}
    ing._on_payload("a1", batch("a1", 2, "moved"))  # a duplicate again
    ing._on_payload("a1", batch("a1", 3, "pinned"))
    assert ing.stats.batches_applied == 2 and ing.stats.events_unknown == {"moved": 2, "pinned": 1}
    assert ing.index.dump() == {"a1": [1, 2, 3]}
    ing._expire_unknown(ing._clock() + 3600.0)  # the strangers' batches dropped unapplied
    assert ing.stats.dropped_unknown == 4 and ing.stats.events_unknown == {"moved": 2, "pinned": 1}
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("worker a1 sends KV events of type 'moved', which this router does not know")


async def test_late_replica_bootstraps_to_an_identical_index(nc: Client, ns: str, ingest: KvIngest) -> None:
    shims = [FakeShim(nc, ns, name, dump_chunk=2) for name in ("d1", "d2", "d3")]
    for s in shims:
        await s.start()
        await synced_with(ingest, s)
    rnd = random.Random(7)
    for step in range(60):
        s = shims[step % 3]
        if rnd.random() < 0.25 and s.held:
            await s.publish(Removed(hashes=rnd.sample(list(s.held), 1)))
        else:
            await s.publish(Stored(hashes=[rnd.randrange(1000) for _ in range(3)]))
    await until(lambda: ingest.stats.batches_applied == 60)
    late = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2)
    await late.start()
    try:
        for s in shims:
            late.add_worker(s.worker, s.epoch)
        assert not late.synced
        assert await late.wait_synced(10.0)
        expected = {w: hs for s in shims for w, hs in s.expected().items()}
        assert late.index.dump() == ingest.index.dump() == expected
        await shims[0].publish(Stored(hashes=[5000]))
        await until(lambda: late.stats.batches_applied == 1 and ingest.stats.batches_applied == 61)
        assert late.index.dump() == ingest.index.dump()
    finally:
        await late.stop()


async def test_unanswered_kvstate_is_retried_until_the_shim_answers(ingest: KvIngest, shim: FakeShim) -> None:
    shim.answering = False
    await shim.publish(Stored(hashes=[1, 2]), drop=True)
    ingest.add_worker(shim.worker, shim.epoch)
    await until(lambda: len(shim.requests) >= 2)
    assert not ingest.synced
    assert ingest.stats.workers["a1"].state is SyncState.BOOTSTRAPPING
    assert ingest.stats.repair_timeouts >= 1
    shim.answering = True
    assert await ingest.wait_synced(10.0)
    assert ingest.index.dump() == {"a1": [1, 2]}


async def test_batches_racing_ahead_of_registration_are_kept(ingest: KvIngest, shim: FakeShim) -> None:
    shim.answering = False  # so the bootstrap cannot cover for the early batches by itself
    await shim.publish(Stored(hashes=[1]))
    await shim.publish(Stored(hashes=[2], parent=1))
    await until(lambda: ingest.stats.unknown_held == 2)
    assert ingest.stats.workers == {}
    assert ingest.index.dump() == {}
    ingest.add_worker(shim.worker, shim.epoch)
    assert ingest.stats.workers["a1"].buffered == 2
    assert ingest.stats.unknown_held == 0
    shim.answering = True
    assert await ingest.wait_synced(10.0)
    assert ingest.index.dump() == {"a1": [1, 2]}


async def test_batches_of_a_worker_that_never_registers_expire(nc: Client, ns: str) -> None:
    ingest = KvIngest(nc, ns, BlockIndex(), unknown_ttl_s=0.0)
    await ingest.start()
    try:
        ghost = FakeShim(nc, ns, "ghost")
        await ghost.publish(Stored(hashes=[1]))
        await ghost.publish(Stored(hashes=[2]))
        await until(lambda: ingest.stats.dropped_unknown == 1)
        assert ingest.stats.unknown_held == 1
        assert ingest.index.dump() == {}
        assert ingest.synced
    finally:
        await ingest.stop()


async def test_removed_worker_loses_its_entries_and_late_batches_do_not_revive_it(
    ingest: KvIngest, shim: FakeShim
) -> None:
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1, 2]))
    await until(lambda: ingest.stats.batches_applied == 1)
    ingest.remove_worker("a1")
    assert ingest.index.dump() == {}
    assert ingest.synced
    await shim.publish(Stored(hashes=[3]))
    await until(lambda: ingest.stats.unknown_held == 1)
    assert ingest.index.dump() == {}
    assert "a1" not in ingest.stats.workers


async def _left_with_its_last_batch_held(ingest: KvIngest, shim: FakeShim) -> None:
    """`shim`'s worker synced, then gone as a stopping shim leaves: its key's delete comes first
    (the lease revoked), its epoch's last Cleared after it, held for a worker with no record."""
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1, 2]))
    await until(lambda: ingest.stats.batches_applied == 1)
    ingest.remove_worker(shim.worker)
    await shim.publish(Cleared())
    await until(lambda: ingest.stats.unknown_held == 1, what="the last Cleared held")


async def test_an_earlier_sessions_batch_held_before_the_name_registers_again_is_dropped_quietly(
    ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """A shim under a fixed --worker-name restarting: the old session's last batch went to the new
    registration's bootstrap, which dropped it as forged with an ERROR (every pod restart, in the
    engine-fault audit of 2026-12-07)."""
    caplog.set_level(logging.DEBUG, logger="router.kv_ingest")
    await _left_with_its_last_batch_held(ingest, shim)
    old = shim.epoch
    shim.restart()
    await shim.publish(Cleared(), Stored(hashes=[5]))  # the new session's first batch, ahead of its key
    await until(lambda: ingest.stats.unknown_held == 2)
    ingest.add_worker(shim.worker, shim.epoch)
    assert ingest.stats.dropped_stale_session == 1
    assert ingest.stats.workers["a1"].buffered == 1  # the new session's own batch is kept
    assert ingest.stats.unknown_held == 0
    assert await ingest.wait_synced(10.0)
    assert ingest.stats.dropped_impossible == 0
    assert ingest.index.dump() == shim.expected() == {"a1": [5]}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    (line,) = [r for r in caplog.records if "of another session" in r.getMessage()]
    assert line.levelno == logging.DEBUG and f"epoch {old:x} seq 2" in line.getMessage()


async def test_an_earlier_sessions_batch_past_the_ttl_when_the_name_registers_again_expires_first(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Expiry ran only when another unknown batch came: one 9-20 s old still went to the new
    registration, and was dropped as forged."""
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, unknown_ttl_s=5.0, clock=clock)
    await ingest.start()
    try:
        shim = FakeShim(nc, ns, "a1")
        await shim.start()
        await _left_with_its_last_batch_held(ingest, shim)
        clock.now = 9.0
        shim.restart()
        with caplog.at_level(logging.WARNING, logger="router.kv_ingest"):
            await synced_with(ingest, shim)
        assert (ingest.stats.dropped_unknown, ingest.stats.unknown_held) == (1, 0)  # an unregistered worker's
        assert (ingest.stats.dropped_stale_session, ingest.stats.dropped_impossible) == (0, 0)
        assert caplog.records == []
    finally:
        await ingest.stop()


async def _forge_held(nc: Client, ns: str, ingest: KvIngest, epoch: int) -> None:
    """A batch `a1`'s shim never sent, of `epoch`, held for a worker with no record."""
    held = ingest.stats.unknown_held
    forged = KvEventBatch(worker="a1", epoch=epoch, seq=1, ts=0.0, events=[Cleared(), Stored(hashes=[66])])
    await nc.publish(subjects.kv(ns, "a1"), encode_msg(forged))
    await until(lambda: ingest.stats.unknown_held == held + 1, what="the forged batch held")


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_forged_batch_held_before_a_name_never_seen_registers_is_an_error(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """The review of bc70a4c: every batch of another epoch held before its worker registered was
    dropped as an earlier session's, at DEBUG, a forged one too. A name that never left while this
    router heard the fleet had no earlier session it could have missed."""
    ingest.fleet_listed()
    await _forge_held(nc, ns, ingest, shim.epoch ^ 1)
    with caplog.at_level(logging.ERROR, logger="router.kv_ingest"):
        await synced_with(ingest, shim)
        await until(lambda: ingest.stats.dropped_impossible == 1)
    assert ingest.stats.dropped_stale_session == 0
    (line,) = _errors(caplog)
    assert "a1" in line and "never sent" in line
    assert ingest.index.dump() == shim.expected() == {}


async def test_a_forged_batch_held_as_a_name_returns_of_an_epoch_it_never_had_is_an_error(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the epochs the name had as it left are an earlier session's; the router remembers them."""
    await _left_with_its_last_batch_held(ingest, shim)
    old = shim.epoch
    shim.restart()
    await _forge_held(nc, ns, ingest, old ^ shim.epoch ^ 1)
    with caplog.at_level(logging.ERROR, logger="router.kv_ingest"):
        await synced_with(ingest, shim)
        await until(lambda: ingest.stats.dropped_impossible == 1)
    assert ingest.stats.dropped_stale_session == 1  # the old session's last Cleared, quietly
    (line,) = _errors(caplog)
    assert "a1" in line and "never sent" in line


async def test_a_batch_held_before_the_router_heard_the_fleet_is_dropped_quietly(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """A router started after the name's earlier session ended knows none of its epochs: a batch of
    another epoch that came before its registry's first listing may be that session's last."""
    await _forge_held(nc, ns, ingest, shim.epoch ^ 1)
    ingest.fleet_listed()
    with caplog.at_level(logging.WARNING, logger="router.kv_ingest"):
        await synced_with(ingest, shim)
    assert (ingest.stats.dropped_stale_session, ingest.stats.dropped_impossible) == (1, 0)
    assert caplog.records == []


async def test_a_names_epochs_are_remembered_for_ended_s(nc: Client, ns: str, caplog: pytest.LogCaptureFixture) -> None:
    """Past ENDED_S a batch of the epoch a name left with is no longer taken for that session's last."""
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, clock=clock)
    await ingest.start()
    try:
        shim = FakeShim(nc, ns, "a1")
        await shim.start()
        ingest.fleet_listed()
        await synced_with(ingest, shim)
        ingest.remove_worker("a1")
        clock.now = ENDED_S - 1
        await _forge_held(nc, ns, ingest, shim.epoch)
        shim.restart()
        await synced_with(ingest, shim)
        assert (ingest.stats.dropped_stale_session, ingest.stats.dropped_impossible) == (1, 0)
        old = shim.epoch
        ingest.remove_worker("a1")
        clock.now += ENDED_S + 1
        await _forge_held(nc, ns, ingest, old)
        shim.restart()
        with caplog.at_level(logging.ERROR, logger="router.kv_ingest"):
            await synced_with(ingest, shim)
            await until(lambda: ingest.stats.dropped_impossible == 1)
        assert ingest.stats.dropped_stale_session == 1
        assert len(_errors(caplog)) == 1
    finally:
        await ingest.stop()


async def test_names_forgotten_past_the_bound_leave_their_last_batches_unjudged(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """The oldest name goes once ENDED_MAX are remembered; its session's last batches may still be
    on their way, so for unknown_ttl_s no held batch of a name with none remembered is judged forged."""
    ingest.fleet_listed()
    await synced_with(ingest, shim)
    ingest.remove_worker("a1")  # the oldest, forgotten below
    for n in range(ENDED_MAX):
        ingest.add_worker(f"w{n}", n)
        ingest.remove_worker(f"w{n}")
    await _forge_held(nc, ns, ingest, shim.epoch)
    shim.restart()
    with caplog.at_level(logging.WARNING, logger="router.kv_ingest"):
        await synced_with(ingest, shim)
    assert (ingest.stats.dropped_stale_session, ingest.stats.dropped_impossible) == (1, 0)
    assert caplog.records == []


async def test_stop_is_idempotent_and_cancels_repairs(nc: Client, ns: str, shim: FakeShim) -> None:
    shim.answering = False
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.1)
    await ingest.start()
    ingest.add_worker("a1", shim.epoch)
    await until(lambda: len(shim.requests) >= 1)
    await ingest.stop()
    await ingest.stop()
    assert ingest.status is PartStatus.STOPPED
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-repair")] == []


async def test_a_forged_far_ahead_seq_costs_one_repair_and_is_dropped(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1, 2]))
    await until(lambda: ingest.stats.batches_applied == 1)
    asked = len(shim.requests)
    forged = KvEventBatch(worker="a1", epoch=shim.epoch, seq=shim.seq + 1000, ts=0.0, events=[Stored(hashes=[999])])
    with caplog.at_level(logging.ERROR, logger="router.kv_ingest"):
        await nc.publish(subjects.kv(ns, "a1"), encode_msg(forged))
        await until(lambda: ingest.stats.dropped_impossible == 1 and ingest.synced)
    assert len(shim.requests) == asked + 1  # one request settled it
    assert "a1" in caplog.text and "never sent" in caplog.text
    await shim.publish(Stored(hashes=[3], parent=2))  # the real next batch is applied as usual
    await until(lambda: ingest.stats.workers["a1"].last_seq == 2)
    assert ingest.index.dump() == shim.expected() == {"a1": [1, 2, 3]}


async def test_a_forged_epoch_is_settled_by_one_dump(nc: Client, ns: str, ingest: KvIngest, shim: FakeShim) -> None:
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1]))
    await until(lambda: ingest.stats.batches_applied == 1)
    forged = KvEventBatch(worker="a1", epoch=shim.epoch ^ 1, seq=1, ts=0.0, events=[Cleared(), Stored(hashes=[66])])
    await nc.publish(subjects.kv(ns, "a1"), encode_msg(forged))
    await until(lambda: ingest.stats.dropped_impossible == 1 and ingest.synced)
    assert shim.requests[-1] == KvStateRequest(since_seq=0, epoch=None)
    assert ingest.index.dump() == shim.expected() == {"a1": [1]}
    assert ingest.stats.workers["a1"].epoch == shim.epoch


async def test_forged_batches_repair_after_repair_are_one_error_until_a_repair_drops_none(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """A flood of forged batches was one ERROR a repair (1,955 lines, 91% of a router's log in the
    isolation audit of 2026-12-07): one line an episode, each batch counted."""
    await synced_with(ingest, shim)

    async def forge(n: int) -> None:
        forged = KvEventBatch(worker="a1", epoch=shim.epoch ^ n, seq=1, ts=0.0, events=[Stored(hashes=[66])])
        await nc.publish(subjects.kv(ns, "a1"), encode_msg(forged))
        await until(lambda: ingest.stats.dropped_impossible == n and ingest.synced, what=f"forged batch {n} dropped")

    def said() -> int:
        return sum("never sent" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.ERROR, logger="router.kv_ingest"):
        for n in range(1, 6):  # five repairs, each dropping one
            await forge(n)
        assert said() == 1
        assert "dropped 1 KV batches" in caplog.text and "logged once until a repair of it drops none" in caplog.text
        await shim.publish(Stored(hashes=[1]), drop=True)  # an honest gap: its repair drops nothing
        await shim.publish(Stored(hashes=[2], parent=1))
        await until(lambda: ingest.stats.workers["a1"].last_seq == shim.seq and ingest.synced)
        await forge(6)  # a new episode: said again
        assert said() == 2
    assert ingest.index.dump() == shim.expected() == {"a1": [1, 2]}


async def test_a_reply_that_does_not_decode_is_followed_by_a_dump_not_the_same_request(
    ingest: KvIngest, shim: FakeShim
) -> None:
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1]))
    await shim.publish(Stored(hashes=[2], parent=1), drop=True)
    shim.garbage = 1
    await shim.publish(Stored(hashes=[3], parent=2))
    await until(lambda: ingest.stats.gaps == 1 and ingest.synced)
    since, dump = shim.requests[-2:]
    assert since == KvStateRequest(since_seq=1, epoch=shim.epoch)  # answered with garbage
    assert dump == KvStateRequest(since_seq=0, epoch=None)
    assert ingest.index.dump() == shim.expected()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def digest(hashes: list[int]) -> tuple[int, int]:
    xor = 0
    for h in hashes:
        xor ^= h
    return len(hashes), xor


async def test_a_lost_last_batch_is_caught_by_the_digest_within_the_grace(nc: Client, ns: str, shim: FakeShim) -> None:
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=1.0, clock=clock)
    await ingest.start()
    try:
        await synced_with(ingest, shim)
        await shim.publish(Stored(hashes=[1]))
        await shim.publish(Stored(hashes=[2], parent=1), drop=True)  # the last batch: no later one reveals the gap
        await until(lambda: ingest.stats.batches_applied == 1)

        def report() -> LoadReport:
            n, x = digest(shim.expected()["a1"])
            return LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=n, kv_xor=x)

        ingest.check_digest(report())
        assert ingest.synced  # one report ahead may just be ahead of its batch
        clock.now = 1.0
        ingest.check_digest(report())
        await until(lambda: ingest.stats.digest_lags == 1 and ingest.synced)
        assert ingest.index.dump() == shim.expected() == {"a1": [1, 2]}
        ingest.check_digest(report())  # now equal: nothing to do
        assert ingest.stats.digest_mismatches == 0 and ingest.synced
    finally:
        await ingest.stop()


async def test_a_replay_short_of_the_shims_own_seq_is_malformed_and_a_dump_follows(
    nc: Client, ns: str, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    # Nothing held (the last batches lost, seen by the digest): the worker was synced, and routable,
    # at the seq the replay stopped at, its later blocks missing until another repair.
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=1.0, clock=clock)
    await ingest.start()
    try:
        await synced_with(ingest, shim)
        caplog.set_level(logging.WARNING, logger="router.kv_ingest")
        await shim.publish(Stored(hashes=[1]))
        await shim.publish(Stored(hashes=[2], parent=1), drop=True)
        await shim.publish(Stored(hashes=[3], parent=2), drop=True)
        await until(lambda: ingest.stats.batches_applied == 1)
        shim.short_replays = 1
        n, x = digest(shim.expected()["a1"])
        report = LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=n, kv_xor=x)
        ingest.check_digest(report)
        clock.now = 1.0
        ingest.check_digest(report)
        await until(lambda: ingest.stats.digest_lags == 1 and ingest.synced)
        assert ingest.index.dump() == shim.expected() == {"a1": [1, 2, 3]}
        assert ingest.stats.workers["a1"].last_seq == shim.seq
        assert shim.requests[-2:] == [KvStateRequest(since_seq=1, epoch=shim.epoch), KvStateRequest()]
        assert ingest.stats.malformed == 1
        assert not _malformed_lines(caplog)  # nothing dropped: the replay's batches are in
        [line] = _short_replay_lines(caplog)
        assert line == (
            "applied worker a1's KV replay, which stops at seq 2, short of its own seq 3; a full dump is next, "
            "the worker out of routing until it is in (logged once per worker)"
        )
    finally:
        await ingest.stop()


async def test_a_short_replay_is_said_of_a_worker_whose_garbled_reply_was_said_before(
    ingest: KvIngest, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    # Both were said once per worker under one kind: the short replay went unsaid.
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1]))
    await shim.publish(Stored(hashes=[2], parent=1), drop=True)
    shim.garbage = 1
    await shim.publish(Stored(hashes=[3], parent=2))
    await until(lambda: ingest.stats.gaps == 1 and ingest.synced)
    assert len(_malformed_lines(caplog)) == 1  # the garbled reply's
    await shim.publish(Stored(hashes=[4], parent=3), drop=True)
    await shim.publish(Stored(hashes=[5], parent=4), drop=True)
    shim.short_replays = 1
    await shim.publish(Stored(hashes=[6], parent=5))
    await until(lambda: ingest.stats.gaps == 2 and ingest.synced)
    assert ingest.stats.malformed == 2
    [line] = [r.getMessage() for r in caplog.records if "short of its own seq" in r.getMessage()]
    assert "worker a1" in line and "stops at seq 4, short of its own seq 6" in line
    assert shim.requests[-2:] == [KvStateRequest(since_seq=3, epoch=shim.epoch), KvStateRequest()]
    assert ingest.index.dump() == shim.expected()


def _batch(seq: int, *hashes: int) -> KvEventBatch:
    return KvEventBatch(worker="a1", epoch=7, seq=seq, ts=0.0, events=[Stored(hashes=list(hashes))])


def _stored(seq: int, *hashes: int) -> bytes:
    return encode_msg(_batch(seq, *hashes))


# 392 bytes held for a batch of one listed hash, 2,752 for one of 60: past the bound alone
_BIG = range(100, 160)


async def test_batches_dropped_past_the_shared_bound_during_a_replay_are_replayed(nc: Client, ns: str) -> None:
    """Audit of mod-ingest: the shared bound dropped the batches held while a replay was asked, and
    the one that came; the reply found nothing held and synced the worker at its own seq, routed on
    an index without them until its next batch showed a gap. They came after the reply's seq: a
    replay from it brings them (the review of fd21416: not a full dump)."""
    ing = KvIngest(nc, ns, BlockIndex(), held_total_bytes_limit=2000)  # not started: its repairs driven here
    ing.add_worker("a1", 7)
    ing.repair_request("a1")
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=0, dump=True, hashes=[])])
    ing._on_payload("a1", _stored(1, 1))
    ing._on_payload("a1", _stored(3, 3))  # seq 2 lost: a replay
    assert ing.repair_request("a1") == KvStateRequest(since_seq=1, epoch=7)
    for seq in (4, 5, 6):  # sent after the shim answered: held until the reply is in
        ing._on_payload("a1", _stored(seq, seq))
    ing._on_payload("a1", _stored(7, *_BIG))  # past the bound: it and the four held dropped
    assert ing.stats.dropped_overflow == 5 and ing.stats.workers["a1"].buffered == 0
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=3, batches=[_batch(2, 2), _batch(3, 3)])])
    assert ing.sync_state("a1") == (
        "repairing",
        "held KV batches up to seq 7 dropped past a bound while it repaired, its reply at seq 3: a replay is next",
    )
    assert ing.repair_request("a1") == KvStateRequest(since_seq=3, epoch=7)
    replay = [_batch(4, 4), _batch(5, 5), _batch(6, 6), _batch(7, *_BIG)]
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=7, batches=replay)])
    assert ing.sync_state("a1") is None
    assert ing.index.dump() == {"a1": sorted([1, 2, 3, 4, 5, 6, *_BIG])} and ing.stats.workers["a1"].last_seq == 7


async def test_batches_dropped_past_the_shared_bound_during_a_dump_are_asked_again(nc: Client, ns: str) -> None:
    # A dump reply reset want_dump: the same hole, from a worker's first dump. The shim's ring no
    # longer reaching back, it answers the replay asked with a dump.
    ing = KvIngest(nc, ns, BlockIndex(), held_total_bytes_limit=2000)
    ing.add_worker("a1", 7)
    assert ing.repair_request("a1") == KvStateRequest()
    ing._on_payload("a1", _stored(1, 1))
    ing._on_payload("a1", _stored(2, *_BIG))  # past the bound: both dropped
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=0, dump=True, hashes=[])])  # answered before
    assert ing.sync_state("a1") is not None and ing.repair_request("a1") == KvStateRequest(since_seq=0, epoch=7)
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=2, dump=True, hashes=[1, *_BIG])])
    assert ing.sync_state("a1") is None and ing.index.dump() == {"a1": [1, *_BIG]}


async def test_a_dump_whose_seq_covers_batches_dropped_under_lasting_pressure_syncs_the_worker(
    nc: Client, ns: str
) -> None:
    """Review of fd21416: another worker's held batches fill the shared bound for good, so each batch
    that comes while a dump is out is dropped. Each dump was taken after that batch and holds it,
    yet every reply asked another full dump: the worker never synced."""
    ing = KvIngest(nc, ns, BlockIndex(), held_total_bytes_limit=3000)
    ing.add_worker("a1", 7)
    ing.add_worker("b1", 7)
    ing.repair_request("b1")  # b1's shim never answers: what it sends stays held
    ing._on_payload(
        "b1", encode_msg(KvEventBatch(worker="b1", epoch=7, seq=1, ts=0.0, events=[Stored(hashes=[*_BIG])]))
    )
    assert ing.repair_request("a1") == KvStateRequest()
    ing._on_payload("a1", _stored(1, 1))  # the others fill the bound: dropped
    ing._on_payload("a1", _stored(2, 2))
    assert ing.stats.dropped_overflow == 2
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=2, dump=True, hashes=[1, 2])])
    assert ing.sync_state("a1") is None and ing.stats.repairs_dumps == 1
    assert ing.index.dump()["a1"] == [1, 2] and ing.stats.workers["a1"].last_seq == 2
    for _ in range(3):  # the pressure lasts: each gap's batch, and each one sent while the dump is out, dropped
        seq = ing.stats.workers["a1"].last_seq
        ing._on_payload("a1", _stored(seq + 2, seq + 2))  # seq + 1 lost
        assert ing.repair_request("a1") == KvStateRequest()
        ing._on_payload("a1", _stored(seq + 3, seq + 3))
        ing.repair_reply(
            "a1", [KvStateChunk(worker="a1", epoch=7, seq=seq + 3, dump=True, hashes=[*range(1, seq + 4)])]
        )
        assert ing.sync_state("a1") is None and ing.index.dump()["a1"] == [*range(1, seq + 4)]
    assert ing.stats.repairs_dumps == 4 and ing.stats.dropped_overflow == 8


async def test_batches_of_another_epoch_dropped_while_a_reply_was_awaited_are_dumped(nc: Client, ns: str) -> None:
    # The shim restarted after its reply: what its new epoch holds, only a dump says.
    ing = KvIngest(nc, ns, BlockIndex(), held_total_bytes_limit=2000)
    ing.add_worker("a1", 7)
    assert ing.repair_request("a1") == KvStateRequest()
    ing._on_payload(
        "a1", encode_msg(KvEventBatch(worker="a1", epoch=8, seq=1, ts=0.0, events=[Stored(hashes=[*_BIG])]))
    )
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=5, dump=True, hashes=[1])])
    assert ing.sync_state("a1") == (
        "bootstrapping",
        "held KV batches of another epoch dropped past a bound while it repaired: a full dump is next",
    )
    assert ing.repair_request("a1") == KvStateRequest()


async def test_a_disagreement_right_after_a_dump_that_waited_on_dropped_batches_backs_off(nc: Client, ns: str) -> None:
    """Review of fd21416: the dump taken for a digest disagreement came before batches dropped past
    the shared bound; its mark was lost with that reply, and a disagreement right after the dump
    that completed it counted as a new one, dumped at once instead of backing off."""
    ing = KvIngest(nc, ns, BlockIndex(), held_total_bytes_limit=2000)
    ing.add_worker("a1", 7)
    ing.repair_request("a1")
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=1, dump=True, hashes=[1])])

    def report(seq: int) -> LoadReport:  # a shim whose digest is not its dump's
        return LoadReport(worker="a1", ts=0.0, kv_epoch=7, kv_seq=seq, kv_blocks=5, kv_xor=12345)

    ing.check_digest(report(1))
    assert ing.stats.digest_mismatches == 1 and ing.repair_request("a1") == KvStateRequest()
    ing._on_payload("a1", _stored(2, *_BIG))  # past the bound while the dump is out: dropped
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=1, dump=True, hashes=[1])])
    assert ing.sync_state("a1") is not None
    ing.repair_request("a1")
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=2, dump=True, hashes=[1, *_BIG])])
    assert ing.sync_state("a1") is None
    ing.check_digest(report(2))
    assert (ing.stats.digest_mismatches, ing.stats.digest_unfixed) == (1, 1) and ing.sync_state("a1") is None


async def test_a_disagreement_right_after_a_dump_completed_by_a_replay_backs_off(nc: Client, ns: str) -> None:
    # The same, the batches dropped replayed: the index is the dump's plus the shim's own batches.
    ing = KvIngest(nc, ns, BlockIndex(), held_total_bytes_limit=2000)
    ing.add_worker("a1", 7)
    ing.repair_request("a1")
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=1, dump=True, hashes=[1])])
    report = LoadReport(worker="a1", ts=0.0, kv_epoch=7, kv_seq=2, kv_blocks=5, kv_xor=12345)
    ing.check_digest(msgspec.structs.replace(report, kv_seq=1))
    ing.repair_request("a1")
    ing._on_payload("a1", _stored(2, *_BIG))
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=1, dump=True, hashes=[1])])
    assert ing.repair_request("a1") == KvStateRequest(since_seq=1, epoch=7)
    ing.repair_reply("a1", [KvStateChunk(worker="a1", epoch=7, seq=2, batches=[_batch(2, *_BIG)])])
    assert ing.sync_state("a1") is None
    ing.check_digest(report)
    assert (ing.stats.digest_mismatches, ing.stats.digest_unfixed) == (1, 1) and ing.sync_state("a1") is None


async def test_an_index_that_trails_every_report_by_a_batch_has_lost_nothing(
    nc: Client, ns: str, shim: FakeShim
) -> None:
    # Load reports and KV batches come on separate connections: each report may name the batch
    # still on its way. The index reaches each watched seq at once, so no grace ever runs out.
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=1.0, clock=clock)
    await ingest.start()
    try:
        await synced_with(ingest, shim)

        def applied(n: int) -> Callable[[], bool]:
            return lambda: ingest.stats.batches_applied == n

        for i in range(1, 8):
            clock.now = 0.3 * i
            ingest.check_digest(LoadReport(worker="a1", ts=clock.now, kv_epoch=shim.epoch, kv_seq=shim.seq + 1))
            await shim.publish(Stored(hashes=[i], parent=i - 1 if i > 1 else None))
            await until(applied(i))
        assert ingest.synced and ingest.stats.digest_lags == 0
        # a batch that never comes is still caught, the grace after the report that first named it
        clock.now = 3.0
        ingest.check_digest(LoadReport(worker="a1", ts=clock.now, kv_epoch=shim.epoch, kv_seq=shim.seq + 1))
        clock.now = 3.9
        ingest.check_digest(LoadReport(worker="a1", ts=clock.now, kv_epoch=shim.epoch, kv_seq=shim.seq + 2))
        assert ingest.synced
        clock.now = 4.0
        ingest.check_digest(LoadReport(worker="a1", ts=clock.now, kv_epoch=shim.epoch, kv_seq=shim.seq + 2))
        await until(lambda: ingest.stats.digest_lags == 1, what="lost once the KV subscriptions caught up")
    finally:
        await ingest.stop()


async def test_a_batch_still_on_its_way_behind_others_past_the_grace_is_late_not_lost(
    nc: Client, ns: str, shim: FakeShim
) -> None:
    """A worker's batches and its load reports come on separate connections. Behind a flood on the
    KV connection, on a loaded machine, an honest worker's batch came 2 s after the report naming it
    (test_e2e_faults' flood test, 2026-12-07): judged lost once the grace ran out, the worker was
    taken out of routing to repair what was on its way. It is lost only if it has not come once the
    KV subscriptions have caught up past the report."""
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=1.0, clock=clock)
    await ingest.start()
    try:
        await synced_with(ingest, shim)
        asked = len(shim.requests)
        other = FakeShim(nc, ns, "b1")  # never registers: a backlog of others' batches ahead of it
        for i in range(100):
            await other.publish(Stored(hashes=pack_hashes(range(i * 1000, (i + 1) * 1000))))
        await shim.publish(Stored(hashes=[1]))  # on its way
        report = LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=1, kv_xor=1)
        ingest.check_digest(report)  # before the batch: the reports' connection is not behind
        clock.now = 1.0
        ingest.check_digest(report)  # past the grace, the batch not here yet
        await until(lambda: ingest.stats.workers["a1"].last_seq == shim.seq, what="the batch applied")
        ingest.check_digest(report)
        assert ingest.stats.digest_lags == 0 and ingest.synced and len(shim.requests) == asked
        assert ingest.index.dump() == shim.expected()
    finally:
        await ingest.stop()


async def test_a_digest_that_disagrees_at_the_same_seq_resyncs_from_a_dump(ingest: KvIngest, shim: FakeShim) -> None:
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1, 2]))
    await until(lambda: ingest.stats.batches_applied == 1)
    ingest.index.remove("a1", [2])  # the index lost something behind the ingest's back
    n, x = digest([1, 2])
    ingest.check_digest(LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=n, kv_xor=x))
    await until(lambda: ingest.stats.digest_mismatches == 1 and ingest.synced)
    assert ingest.index.dump() == {"a1": [1, 2]}
    assert ingest.stats.repairs_dumps == 2


async def test_a_digest_no_dump_can_fix_backs_off_instead_of_dumping_on_every_report(
    nc: Client, ns: str, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a shim whose digest disagrees with its own dump (another build computing it otherwise)
    took a full dump on every load report, with no back-off: 7,878 dumps in 15 s at 300 workers."""
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, clock=clock)
    await ingest.start()
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    try:
        await shim.publish(Stored(hashes=[1, 2]))
        await synced_with(ingest, shim)
        n, x = digest([1, 2])
        skewed = LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=n, kv_xor=x ^ 1)
        for _ in range(20):  # 10 s of reports, one every 0.5 s
            ingest.check_digest(skewed)
            await until(lambda: ingest.synced)
            assert ingest.sync_state("a1") is None  # routable throughout: its index is its shim's dump
            clock.now += 0.5
        dumps = len(shim.requests) - 1  # the bootstrap's aside
        assert dumps == ingest.stats.digest_mismatches == 3  # at 0 s, then after 2 s and 4 s of back-off
        assert ingest.stats.digest_unfixed == 1
        (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert "worker a1" in error and "another kvswitch build" in error
        # three dumps in one episode, one WARNING: it is said once per episode
        assert len([r for r in caplog.records if "disagrees at seq" in r.getMessage()]) == 1
        caplog.set_level(logging.INFO, logger="router.kv_ingest")
        ingest.check_digest(
            LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=n, kv_xor=x)
        )
        assert ingest.stats.digest_unfixed == 0
        again = [r for r in caplog.records if "agrees with the index again" in r.getMessage()]
        assert [r.levelno for r in again] == [logging.INFO]
    finally:
        await ingest.stop()


async def test_repairing_worker_is_reported_with_its_reason_and_others_stay_synced(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim
) -> None:
    other = FakeShim(nc, ns, "b2")
    await other.start()
    await synced_with(ingest, shim)
    await synced_with(ingest, other)
    shim.answering = False
    await shim.publish(Stored(hashes=[1]), drop=True)
    await shim.publish(Stored(hashes=[2], parent=1))
    await until(lambda: ingest.sync_state("a1") is not None)
    state, why = ingest.sync_state("a1")  # type: ignore[misc]
    assert state == "repairing" and "gap: seq 2 after 0" in why
    assert ingest.sync_state("b2") is None
    await until(lambda: "failed kvstate requests" in (ingest.sync_state("a1") or ("", ""))[1], what="failures")
    shim.answering = True
    await until(lambda: ingest.sync_state("a1") is None, what="repaired")


async def _bad_hash(nc: Client, ns: str, shim: FakeShim) -> None:
    shim.seq += 1
    bad = Stored(hashes=b"\x02" * 9)  # not whole u64s
    batch = KvEventBatch(worker=shim.worker, epoch=shim.epoch, seq=shim.seq, ts=0.0, events=[bad])
    await nc.publish(subjects.kv(ns, shim.worker), encode_msg(batch))


def _malformed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "malformed KV events" in r.getMessage()]


def _short_replay_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "KV replay" in r.getMessage()]


async def test_a_worker_back_under_its_name_is_logged_again(
    nc: Client, ns: str, ingest: KvIngest, caplog: pytest.LogCaptureFixture
) -> None:
    # the "logged once" set was never cleared: a StatefulSet pod back as w-0 was never logged again
    shim = FakeShim(nc, ns, "a1")
    await shim.start()
    await synced_with(ingest, shim)
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    await _bad_hash(nc, ns, shim)
    await until(lambda: ingest.stats.malformed == 1)
    ingest.remove_worker("a1")
    shim.answering = False
    again = FakeShim(nc, ns, "a1")
    await again.start()
    await synced_with(ingest, again)
    await _bad_hash(nc, ns, again)
    await until(lambda: ingest.stats.malformed == 2)
    assert len(_malformed_lines(caplog)) == 2


async def test_another_kind_of_fault_from_a_worker_already_logged_is_logged(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    # one bad hash used up the worker's one line: its later refusal past its KV capacity, whose line
    # names the flag to raise, never came
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, min_entry_limit=4096)
    await ingest.start()
    try:
        shim = FakeShim(nc, ns, "a1")
        await shim.start()
        await synced_with(ingest, shim)
        caplog.set_level(logging.WARNING, logger="router.kv_ingest")
        ingest.check_digest(LoadReport(worker="a1", ts=0.0, kv_total_blocks=100))
        await shim.publish(Stored(hashes=[1, 2]))
        await _bad_hash(nc, ns, shim)
        await until(lambda: ingest.stats.malformed == 1)
        await shim.publish(Stored(hashes=list(range(10, 10 + 4096))))  # past its capacity
        await until(lambda: ingest.stats.malformed >= 2, what="the worker refused")
        lines = _malformed_lines(caplog)
        assert len(lines) == 2 and "more than its KV capacity allows" in lines[1]
    finally:
        await ingest.stop()


async def test_a_sender_past_its_budget_is_dropped_quarantined_named_once_and_repaired_alone(
    nc: Client, nats_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's own subject flooded past its budget (isolation audit of 2026-12-07): the rest is
    dropped before decoding, counted for it, named once, its subject unheard for a while; the drop
    is a gap of that worker alone, repaired on the requests connection, and the other is untouched."""
    requests_nc = await nats.connect(nats_url)
    flooded, other = FakeShim(nc, ns, "a1"), FakeShim(nc, ns, "b2")
    for s in (flooded, other):
        await s.start()
    ingest = KvIngest(
        nc,
        ns,
        BlockIndex(),
        requests_nc=requests_nc,
        budget=SenderBudget(10.0, 5.0, bytes_per_s=1e6, bytes_burst=1e6),
        quarantine_s=1.0,
        request_timeout_s=0.2,
        retry_max_s=0.2,
    )
    await ingest.start()
    try:
        await synced_with(ingest, flooded)
        await synced_with(ingest, other)
        asked = requests_nc.stats["out_msgs"]
        with caplog.at_level(logging.WARNING, logger="router.kv_ingest"):
            for _ in range(40):
                await flooded.publish(Stored(hashes=[flooded.seq + 1]))
            await other.publish(Stored(hashes=[7]))
            await until(lambda: ingest.subscriptions.quarantined() != {}, what="the flooded worker quarantined")
            await until(lambda: ingest.synced and ingest.stats.workers["b2"].last_seq == 1, what="b2's batch applied")
        assert list(ingest.subscriptions.quarantined()) == ["a1"]
        dropped = ingest.stats.worker_over_budget["a1"]
        assert dropped >= 1 and "b2" not in ingest.stats.worker_over_budget and ingest.stats.over_budget == dropped
        said = [r.getMessage() for r in caplog.records if "KV batches from worker" in r.getMessage()]
        assert len(said) == 1 and "a1" in said[0] and subjects.kv(ns, "a1") in said[0], said
        assert ingest.stats.workers["b2"].repairs == 1  # its bootstrap alone
        assert requests_nc.stats["out_msgs"] > asked  # a1's repair asked on the requests connection
        assert ingest.index.dump() == flooded.expected() | other.expected()  # a1's repair took what was dropped
        await other.publish(Stored(hashes=[8], parent=7))  # heard while a1 is not
        await until(lambda: ingest.stats.workers["b2"].last_seq == 2, what="b2 heard during the quarantine")
        await until(lambda: ingest.subscriptions.quarantined() == {}, what="the quarantine over")
    finally:
        await ingest.stop()
        await requests_nc.close()


@pytest.mark.parametrize("lost", [False, True])
async def test_a_gap_seen_as_the_subscriptions_switch_waits_for_the_old_subscriptions_queue(
    nc: Client, ns: str, ingest: KvIngest, shim: FakeShim, lost: bool
) -> None:
    """nats-py gives each subscription its own queue and task: as a quarantine begins, {ns}.kv.*'s
    queue may still hold a worker's batch N behind a flood while the worker's own subscription hands
    over N+1 (review of 2026-12-07: an honest worker taken out of routing to repair batches on their
    way). Here the wildcard's queue waits on a stranger's message with N behind it, or N lost: the
    gap is held, the worker routable, until the switch ends; then repaired only if it remains."""
    await synced_with(ingest, shim)
    await shim.publish(Stored(hashes=[1]))
    await until(lambda: ingest.stats.workers["a1"].last_seq == 1, what="batch 1")
    subs = ingest.subscriptions
    gate = asyncio.Event()
    handler = subs._handler

    async def gated(msg: Msg) -> None:
        if msg.subject == subjects.kv(ns, "x"):
            await gate.wait()
        await handler(msg)

    subs._handler = gated
    try:
        await nc.publish(subjects.kv(ns, "x"), b"a stranger's")  # the wildcard's task waits on it
        await shim.publish(Stored(hashes=[2], parent=1), drop=lost)  # N, behind it in that queue
        assert subs.quarantine("x")
        await until(lambda: "a1" in subs._each, what="a1's own subscription")
        await shim.publish(Stored(hashes=[3], parent=2))  # N+1 on a1's own (its SUB went first on nc)
        await until(lambda: ingest.stats.workers["a1"].buffered > 0 or ingest.stats.gaps > 0, what="N+1 handled")
        assert ingest.stats.gaps == 0 and ingest.sync_state("a1") is None  # held, a1 still routable
        assert subs.switching  # the wildcard's queue not through yet
    finally:
        gate.set()
    await until(lambda: not subs.switching and ingest.synced and ingest.stats.workers["a1"].last_seq == 3)
    assert ingest.index.dump() == shim.expected() == {"a1": [1, 2, 3]}
    assert ingest.stats.gaps == int(lost)  # a loss is repaired still
    assert ingest.stats.workers["a1"].repairs == 1 + int(lost)  # its bootstrap, and the loss's repair


class _PaceClock:
    """A clock of its own for a shim's KvPace (and a router's ingest): a sleep moves it on, so a
    paced snapshot takes no wall-clock time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class _ShimNats:
    """A shim's connection that keeps what its KV publisher sends, and hands each payload to
    `deliver` (a router reading it) as it is published."""

    max_payload = 1 << 20

    def __init__(self, deliver: Callable[[bytes], Awaitable[None]] | None = None) -> None:
        self.sent: list[bytes] = []
        self.deliver = deliver

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(payload)
        if self.deliver is not None:
            await self.deliver(payload)


def _warm_cache(blocks: int, seed: int = 3) -> Normaliser:
    """A shim's normaliser holding `blocks` blocks: prompts of 2 to 200 blocks on a few shared
    prefixes, a branching tree as a busy engine's cache is."""
    rng = random.Random(seed)
    size = 4
    n = Normaliser(size)
    trunks = [[rng.randrange(1 << 20) for _ in range(size * rng.randint(1, 40))] for _ in range(20)]
    engine = 1
    while len(n) < blocks:
        toks = rng.choice(trunks) + [rng.randrange(1 << 20) for _ in range(size * rng.randint(1, 160))]
        k = len(toks) // size
        n.apply([EngineStored(hashes=list(range(engine, engine + k)), parent=None, token_ids=toks, block_size=size)])
        engine += k
    return n


async def _registration(
    normaliser: Normaliser,
    worker: str,
    clock: _PaceClock | None = None,
    deliver: Callable[[bytes], Awaitable[None]] | None = None,
) -> list[bytes]:
    """What a shim publishes as it registers (worker_shim.shim's _start_epoch), payload by payload,
    at its pace on `clock` (a clock of its own by default)."""
    shim_nc = _ShimNats(deliver)
    clock = clock or _PaceClock()
    pace = KvPace(clock=clock, sleep=clock.sleep)
    pub = KvPublisher(shim_nc, "ns", worker, 7, normaliser, pace=pace)  # type: ignore[arg-type]
    pub.add([Cleared(), *normaliser.snapshot()])
    pub.seal()
    await pub._send_outbox()  # as its task does (a stop() would drop what the pace holds)
    return shim_nc.sent


def _payload(nc: Client, worker: str, data: bytes) -> Msg:
    return Msg(nc, subject=subjects.kv("ns", worker), data=data)


async def test_an_honest_registration_snapshot_of_a_warm_cache_passes_the_default_budget(nc: Client) -> None:
    """Review of 2026-12-07: a warm cache's snapshot (a Stored per block, ~54 B each) went past the
    default byte burst: 90k blocks lost 47 batches, 100k had the worker quarantined as a flood. Sent
    a Stored per chain (~8 B a block), 150k blocks read back-to-back pass whole, and rebuild the set."""
    normaliser = _warm_cache(150_000)
    sent = await _registration(normaliser, "w1")
    ingest = KvIngest(nc, "ns", BlockIndex())  # the default budget (router.sender_budget.KvBudget)
    ingest.add_worker("w1", 7)
    for data in sent:
        await ingest._on_msg(_payload(nc, "w1", data))
    assert ingest.stats.over_budget == 0 and ingest.subscriptions.quarantined() == {}
    assert ingest.stats.workers["w1"].buffered == len(sent)  # every batch kept for its bootstrap
    index = BlockIndex()
    for data in sent:
        index.apply("w1", decode_msg(data, KvEventBatch).events)
    assert index.worker_hashes("w1") == normaliser.canonical_hashes()


async def test_a_registered_worker_flooding_its_own_subject_gets_only_the_default_burst(nc: Client) -> None:
    """Final review of 2026-12-07: a registered worker had a byte burst of its own, from its capacity
    (42.7 MiB for 100k blocks), and a flood on its subject within it cut the router's whole KV
    connection (5 of 5 runs). A worker of 100k blocks, its record first, flooding 8 MiB back-to-back
    (valid batches of 20,000 packed hashes) is over the default 4 MiB and quarantined."""
    ingest = KvIngest(nc, "ns", BlockIndex(), clock=_PaceClock())  # the default budget; read at one instant
    ingest.add_worker("w1", 7, kv_total_blocks=100_000)
    sent = 0
    for seq in range(1, 60):
        hashes = pack_hashes(range(seq << 20, (seq << 20) + 20_000))
        batch = KvEventBatch(worker="w1", epoch=7, seq=seq, ts=0.0, events=[Stored(hashes=hashes)])
        data = encode_msg(batch)
        sent += len(data)
        await ingest._on_msg(_payload(nc, "w1", data))
    assert sent > 8 << 20
    assert ingest.stats.worker_over_budget["w1"] == 59 - (4 << 20) // len(data)  # past 4 MiB, all dropped
    assert list(ingest.subscriptions.quarantined()) == ["w1"]


def _short_branches(shape: str, blocks: int, seed: int = 1) -> Normaliser:
    """A warm cache of short branches, the costliest to send per block (~31 B, each chain's Stored
    ~46 B of framing over 1 to 3 blocks; review of 2026-12-07): `sysprompt`, many requests on 8
    shared 64-block system prompts, each adding 1 to 3 blocks of its own; `evicted`, prompts of 1
    to 160 blocks on 20 trunks with every third block then evicted (LRU across requests), holes
    cutting chains short."""
    rng = random.Random(seed)
    size = 16
    n = Normaliser(size)
    engine = 1

    def store(tokens: list[int], parent: int | None = None) -> int:
        """The engine's hash of the last block stored."""
        nonlocal engine
        hashes = list(range(engine, engine + len(tokens) // size))
        n.apply([EngineStored(hashes=hashes, parent=parent, token_ids=tokens, block_size=size)])
        engine += len(hashes)
        return engine - 1

    if shape == "sysprompt":
        trunks = [[rng.randrange(1 << 20) for _ in range(size * 64)] for _ in range(8)]
        # each trunk stored once and each branch after it, as an engine with prefix caching sends
        # them: the same canonical tree as each prompt stored whole, in a fraction of the time
        ends = [store(trunk) for trunk in trunks]
        while len(n) < blocks:
            end = rng.choice(ends)
            store([rng.randrange(1 << 20) for _ in range(size * rng.randint(1, 3))], parent=end)
    else:
        trunks = [[rng.randrange(1 << 20) for _ in range(size * rng.randint(1, 40))] for _ in range(20)]
        while len(n) < blocks * 3 // 2:
            store(rng.choice(trunks) + [rng.randrange(1 << 20) for _ in range(size * rng.randint(1, 160))])
        n.apply([EngineRemoved(hashes=list(range(1, engine, 3)))])
    return n


@pytest.mark.parametrize("shape", ["sysprompt", "evicted"])
async def test_a_registration_snapshot_of_short_branches_passes_a_router_that_has_no_record_yet(
    nc: Client, shape: str
) -> None:
    """Review of 2026-12-07: a snapshot of short branches costs ~31 B a block, and the shim publishes
    it before its etcd key, so a router reads it under the default budget: 150k blocks of many
    requests on one system prompt (4.4 MiB) went past the 4 MiB burst and the honest worker was
    quarantined as "something other than its shim". Paced (worker_shim.kv_pace), the same snapshot,
    each batch read as it is sent and the record coming after it, passes whole."""
    normaliser = _short_branches(shape, 150_000)
    assert len(normaliser.canonical_hashes()) >= 150_000
    clock = _PaceClock()
    ingest = KvIngest(nc, "ns", BlockIndex(), clock=clock)  # the default budget, on the shim's clock

    async def read(data: bytes) -> None:
        await ingest._on_msg(_payload(nc, "w1", data))

    sent = await _registration(normaliser, "w1", clock, read)
    ingest.add_worker("w1", 7, kv_total_blocks=150_000)  # its record, after the snapshot
    assert ingest.stats.over_budget == 0 and ingest.subscriptions.quarantined() == {}
    if shape == "sysprompt":
        assert sum(map(len, sent)) > 4 << 20  # past the default burst: back-to-back, it is over
    index = BlockIndex()
    for data in sent:
        index.apply("w1", decode_msg(data, KvEventBatch).events)
    assert index.worker_hashes("w1") == normaliser.canonical_hashes()


class _LossyNats:
    """A shim's connection that loses the KV batches published while `losing`; kvstate replies pass."""

    def __init__(self, nc: Client, kv_subject: str) -> None:
        self.nc, self.kv_subject, self.losing = nc, kv_subject, False
        self.max_payload = nc.max_payload

    async def publish(self, subject: str, payload: bytes) -> None:
        if not (self.losing and subject == self.kv_subject):
            await self.nc.publish(subject, payload)


async def test_a_router_behind_what_the_ring_bytes_hold_is_repaired_with_a_dump(nc: Client, ns: str) -> None:
    """Audit of 2026-12-07: the shim's ring is bounded by bytes as well as by count. A router whose gap
    starts before the oldest batch it holds (evicted by bytes, far under RING_SIZE batches) gets a
    dump, never a replay that starts late and silently loses what was evicted. A real KvPublisher and
    KvIngest over NATS, from the registration's snapshot on."""
    rng = random.Random(5)
    norm = Normaliser(1)

    def prompt(blocks: int) -> list[KvEvent]:
        tokens = [rng.randrange(1 << 20) for _ in range(blocks)]
        hashes = [rng.getrandbits(63) for _ in range(blocks)]
        return norm.apply([EngineStored(hashes=hashes, parent=None, token_ids=tokens, block_size=1)])

    prompt(3_000)
    shim_nc = _LossyNats(nc, subjects.kv(ns, "w1"))
    pub = KvPublisher(shim_nc, ns, "w1", 7, norm)  # type: ignore[arg-type]
    pub.log = EventLog("w1", 7, ring_bytes=1 << 20)  # ~6 batches of MAX_HASHES (RING_BYTES holds ~420)
    await nc.subscribe(subjects.kvstate(ns, "w1"), cb=pub.on_kvstate)
    await flush(nc)
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=1.0, retry_max_s=0.2)
    await ingest.start()
    pub.start()
    try:
        pub.add([Cleared(), *norm.snapshot()])
        ingest.add_worker("w1", 7)
        await until(lambda: ingest.synced and ingest.stats.workers["w1"].last_seq == pub.log.seq)
        seen = pub.log.seq
        shim_nc.losing = True
        for _ in range(10):
            pub.add(prompt(MAX_HASHES))  # a 20k-block prompt, one batch of ~160 kB each
        await until(lambda: not pub._outbox)
        shim_nc.losing = False
        assert seen + 1 < pub.log.first_seq and pub.log.seq - seen < RING_SIZE  # evicted by bytes alone
        pub.add(prompt(1))  # the router sees the gap
        await until(lambda: ingest.stats.gaps == 1 and ingest.synced)
        await until(lambda: ingest.stats.workers["w1"].last_seq == pub.log.seq)
        assert ingest.stats.repairs_dumps == 2 and ingest.stats.repairs_batches == 0  # bootstrap, then the gap
        assert ingest.index.worker_hashes("w1") == norm.canonical_hashes()
        # every batch sent or counted failed (unsent ones the ring no longer held were dropped)
        assert pub.counters.kvstate_dumps == 2 and pub.counters.batches + pub.counters.send_failures == pub.log.seq
    finally:
        await pub.stop()
        await ingest.stop()


async def test_a_batch_lost_under_a_kv_backlog_longer_than_the_barriers_bound_is_judged_lost(
    nc: Client, ns: str, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """A review of 2026-12-07: a barrier past its bound was given up and the next report began one
    from a later snapshot, as far behind; under a steady backlog longer than the bound none ever
    ended and a truly lost batch was never judged lost (10 barriers begun, none ended, in 5 s). A
    late barrier is said and waited to its end."""
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=0.2,
                      barrier_timeout_s=0.3, clock=clock)  # fmt: skip
    await ingest.start()
    assert nc.connected_url is not None
    pub = await nats.connect(nc.connected_url.geturl())
    try:
        await synced_with(ingest, shim)
        subs = ingest.subscriptions
        real = subs._handler

        async def slow(msg: Msg) -> None:
            await asyncio.sleep(0.01)
            await real(msg)

        subs._handler = slow
        other = FakeShim(pub, ns, "b1")
        stop = asyncio.Event()

        async def keep_backlog() -> None:  # a steady ~0.5 s backlog on the KV connection
            while not stop.is_set():
                if subs._all is not None and subs._all.pending_msgs < 40:
                    await other.publish(Stored(hashes=[1]))
                await asyncio.sleep(0.005)

        feeder = asyncio.create_task(keep_backlog())
        try:
            await asyncio.sleep(1.0)
            await shim.publish(Stored(hashes=[7]), drop=True)  # truly lost
            report = LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=1, kv_xor=7)
            with caplog.at_level(logging.WARNING, logger="router.kv_ingest"):
                async with asyncio.timeout(20):
                    t = 0.0
                    while not ingest.stats.digest_lags:  # the backlog goes on all along
                        t += 0.25
                        clock.now = t
                        ingest.check_digest(report)  # a load report every 0.25 s
                        await asyncio.sleep(0.25)
        finally:
            stop.set()
            await feeder
        assert any("more than 0.3s late" in r.getMessage() for r in caplog.records)
    finally:
        await pub.close()
        await ingest.stop()


async def test_late_barriers_in_a_row_are_said_once_and_none_called_in_time(
    nc: Client, ns: str, shim: FakeShim, caplog: pytest.LogCaptureFixture
) -> None:
    """A review of 2026-12-07: a late barrier waited to its end then said "in time again", so
    under a steady backlog each barrier logged a WARNING and a false INFO. Three late barriers in
    a row: one WARNING, no "in time again"."""
    clock = Clock()
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, behind_grace_s=0.2,
                      barrier_timeout_s=0.3, clock=clock)  # fmt: skip
    await ingest.start()
    gate = asyncio.Event()
    try:
        await synced_with(ingest, shim)
        subs = ingest.subscriptions
        real = subs._handler

        async def held(msg: Msg) -> None:
            await gate.wait()
            await real(msg)

        subs._handler = held
        t = 0.0
        with caplog.at_level(logging.INFO, logger="router.kv_ingest"):
            for i in range(3):
                gate.clear()
                await shim.publish(Stored(hashes=[7 + i]))
                report = LoadReport(worker="a1", ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=1, kv_xor=0)
                begun = ingest._barriers_begun
                async with asyncio.timeout(10):
                    while ingest._barriers_begun == begun:
                        t += 0.25
                        clock.now = t
                        ingest.check_digest(report)
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.6)  # each barrier ends 0.6 s in: twice its 0.3 s bound
                gate.set()
                await until(lambda: ingest._barriers_ended == ingest._barriers_begun, 10, "the barrier's end")
        said = [r.getMessage() for r in caplog.records if "late" in r.getMessage() or "in time" in r.getMessage()]
        assert len(said) == 1 and "more than 0.3s late" in said[0], said
    finally:
        gate.set()
        await ingest.stop()
