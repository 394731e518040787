"""KvPublisher: a large addition (a whole cache's snapshot at registration) leaves as several
batches that each fit a NATS payload, in order, and a subscriber rebuilds the same set."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.aio.msg import Msg

from protocol import (
    Cleared,
    KvEvent,
    KvEventBatch,
    Removed,
    Stored,
    decode_msg,
    encode_msg,
    hash_count,
    subjects,
    unpack_hashes,
)
from protocol.kv_budget import KV_PACE_BATCH_BURST, KV_PACE_BATCHES_PER_S, KV_PACE_MIB_BURST, KV_PACE_MIB_PER_S
from router.sender_budget import KvBudget
from worker_shim.event_log import RING_BYTES, RING_SIZE, EventLog
from worker_shim.kv_pace import KvPace
from worker_shim.kv_publisher import MAX_EVENTS, MAX_HASHES, KvPublisher
from worker_shim.normaliser import Normaliser


async def test_a_snapshot_larger_than_a_payload_is_split_into_batches_that_fit(nats_url: str, ns: str) -> None:
    nc = await nats.connect(nats_url)
    got: list[KvEventBatch] = []
    sizes: list[int] = []
    all_in = asyncio.Event()

    async def on(msg: Msg) -> None:
        sizes.append(len(msg.data))
        got.append(decode_msg(msg.data, KvEventBatch))
        if sum(len(b.events) for b in got) >= 40_000:
            all_in.set()

    await nc.subscribe(subjects.kv(ns, "w1"), cb=on)
    pub = KvPublisher(nc, ns, "w1", 7, Normaliser(16))
    pub.start()
    try:
        snapshot: list[KvEvent] = [Stored(hashes=[h], parent=h - 1 if h else None) for h in range(40_000)]
        pub.add(snapshot)  # 40,000 events: one batch of them would be ~1.3 MB, over NATS's 1 MB
        await asyncio.wait_for(all_in.wait(), 10)
    finally:
        await pub.stop()
        await nc.close()
    assert len(got) > 1 and pub.counters.send_failures == 0
    assert [b.seq for b in got] == list(range(1, len(got) + 1))
    stored = [[e for e in b.events if isinstance(e, Stored)] for b in got]
    assert all(len(b.events) == len(s) <= MAX_EVENTS for b, s in zip(got, stored, strict=True))
    assert all(isinstance(e.hashes, bytes) for s in stored for e in s)  # packed on the wire
    assert all(sum(hash_count(e.hashes) for e in s) <= MAX_HASHES for s in stored)
    assert max(sizes) < nc.max_payload
    assert [h for s in stored for e in s for h in unpack_hashes(e.hashes)] == list(range(40_000))


async def test_batches_nats_refuses_are_counted_and_logged_once_per_outage(
    nats_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    # a WARNING per batch flooded the log (142 lines in 4 s from one shim) while NATS was away
    nc = await nats.connect(nats_url)
    pub = KvPublisher(nc, ns, "w1", 7, Normaliser(16))
    await nc.close()  # every publish now raises, as with the reconnect buffer full
    with caplog.at_level(logging.INFO, logger="worker_shim.kv_publisher"):
        for h in range(5):
            pub.add([Stored(hashes=[h], parent=None)])
            pub.seal()
            await pub._send_outbox()
        assert pub.counters.send_failures == 5
        assert len([r for r in caplog.records if "publishing KV batch" in r.getMessage()]) == 1
        pub.nc = back = await nats.connect(nats_url)
        try:
            pub.add([Stored(hashes=[9], parent=None)])
            pub.seal()
            await pub._send_outbox()
        finally:
            await back.close()
    messages = [r.getMessage() for r in caplog.records]
    assert pub.counters.batches == 1 and "NATS takes KV batches again from 6 (unsent from 1)" in messages


async def test_batches_waiting_for_a_stalled_nats_are_bounded_counted_and_said_once(
    nats_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """While NATS takes nothing (a stalled server: nats-py blocks the publish that would overfill its
    buffer, here the publisher's task never runs), the engine's events go on: sealed batches waited
    without a bound or a word (8.5 GB in 90 s). Past the ring, the oldest are dropped as failed, and
    subscribers repair by the seq gap as for any batch NATS refused."""
    nc = await nats.connect(nats_url)
    try:
        pub = KvPublisher(nc, ns, "w1", 7, Normaliser(16))
        with caplog.at_level(logging.WARNING, logger="worker_shim.kv_publisher"):
            for h in range(RING_SIZE + 500):
                pub.add([Stored(hashes=[h], parent=None)])
                pub.seal()
        assert len(pub._outbox) == RING_SIZE and pub.counters.send_failures == 500
        assert [b.seq for b, _ in pub._outbox][:1] == [501]  # the newest kept, in order
        warned = [r for r in caplog.records if "subscribers will repair" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]
    finally:
        await nc.close()


async def test_batches_waiting_for_a_stalled_nats_are_bounded_by_the_ring_bytes(nats_url: str, ns: str) -> None:
    """Audit of 2026-12-07: long prompts' batches (MAX_HASHES each) waiting for a stalled NATS were
    bounded by RING_SIZE alone (4,096 of ~160 kB); past what the ring holds (RING_BYTES) the oldest
    are dropped as failed, as past RING_SIZE."""
    nc = await nats.connect(nats_url)
    try:
        pub = KvPublisher(nc, ns, "w1", 7, Normaliser(16))
        hashes = list(range(2**64 - MAX_HASHES, 2**64))  # 8 B each, packed or not
        n = RING_BYTES // (8 * MAX_HASHES) + 50
        for _ in range(n):
            pub.add([Stored(hashes=hashes, parent=None)])
        waiting = [b for b, _ in pub._outbox]
        assert sum(len(encode_msg(b)) for b in waiting) <= RING_BYTES
        assert waiting[0].seq == pub.log.first_seq and waiting[-1].seq == n
        assert pub.counters.send_failures == n - len(waiting) > 0
    finally:
        await nc.close()


class BigPayloadNats:
    """A connection to a server whose max_payload is raised past the ring's bytes (nats-server accepts
    96 MiB, the ring holds RING_BYTES, 64 MiB), at a scale a test affords: 4 MiB over a 1 MiB ring."""

    max_payload = 4 << 20

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(payload)


async def test_an_event_larger_than_the_ring_bytes_is_split_so_the_ring_keeps_its_last_piece() -> None:
    """Review of 6edd5fc: a batch was bounded by max_payload alone, so an event over the ring's bytes
    (a whole cache's Removed of > 8.4 M blocks with max_payload raised past 64 MiB) was sealed whole,
    evicted itself from the ring at once (which then held nothing to replay) and was dropped from
    the outbox, never tried. Now a batch fits the ring too: the event is split, the ring keeps the
    last piece, which is sent. The pieces before it still leave the ring, and the outbox, in the
    same add() (counted as failed): what waits to be sent is what the ring holds."""
    nc = BigPayloadNats()
    pub = KvPublisher(nc, "ns", "w1", 7, Normaliser(16), pace=KvPace(1e12, 1e12, 1e15, 1e15))  # type: ignore[arg-type]
    ring_bytes = 1 << 20
    pub.log = EventLog("w1", 7, ring_bytes=ring_bytes)
    hashes = list(range(1, 200_001))  # 1.6 MB packed: over the ring, under max_payload
    pub.add([Removed(hashes=hashes)])
    pub.seal()
    last = pub.log.seq
    assert last > 1 and pub.log.first_seq <= last
    (held,) = pub.log.since(last - 1) or []
    await pub._send_outbox()
    got = [decode_msg(d, KvEventBatch) for d in nc.sent]
    assert got and got[-1].seq == last and got[-1] == held
    assert max(len(d) for d in nc.sent) <= ring_bytes
    sent = [h for b in got for e in b.events if isinstance(e, Removed) for h in unpack_hashes(e.hashes)]
    assert sent == hashes[len(hashes) - len(sent) :]
    assert pub.counters.send_failures == last - len(got) and pub.digest().seq == last


class PaceClock:
    """A clock of its own for KvPace: a sleep moves it on (and lets the loop run once), so a test
    of the pace reads no wall clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        await asyncio.sleep(0)


class TimedNats:
    """A shim connection that keeps each payload with the (PaceClock) time it was published."""

    max_payload = 1 << 20

    def __init__(self, clock: PaceClock) -> None:
        self.clock = clock
        self.sent: list[tuple[float, int]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append((self.clock.now, len(payload)))


def _most_in_a_window(sent: list[tuple[float, int]], seconds: float, weight: int | None) -> float:
    """The most bytes (or, with `weight`, messages of that weight) published within `seconds` of a
    publish, over every publish."""
    most = 0.0
    for i, (start, _) in enumerate(sent):
        within = [size if weight is None else weight for t, size in sent[i:] if t - start <= seconds]
        most = max(most, sum(within))
    return most


async def test_a_snapshot_past_a_router_s_burst_goes_out_at_the_pace_its_default_budget_holds() -> None:
    """Review of 2026-12-07: a registration's snapshot, sealed at once, went out back-to-back, and a
    warm worker's (4.44 MiB, past the router's default 4 MiB burst) was quarantined as a flood. Sent
    at the pace (protocol.kv_budget: 2 MiB up front, then 2 MiB a second): never more than that in
    any window, a router's default budget admits every batch at the time it is sent, and the
    publisher's loop runs while batches wait."""
    clock = PaceClock()
    nc = TimedNats(clock)
    pub = KvPublisher(nc, "ns", "w1", 7, Normaliser(16), pace=KvPace(clock=clock, sleep=clock.sleep))  # type: ignore[arg-type]
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_work())
    pub.add([Stored(hashes=list(range(i * 1000 + 1, i * 1000 + 1001)), parent=None) for i in range(1200)])
    pub.seal()
    await pub._send_outbox()  # as its task does (a stop() would drop what the pace holds)
    other.cancel()
    total = sum(size for _, size in nc.sent)
    assert total > 9 << 20 and pub.counters.batches == len(nc.sent) and pub.counters.send_failures == 0
    mib = 1 << 20
    for seconds in (0.0, 0.5, 1.0, 3.0):
        assert _most_in_a_window(nc.sent, seconds, None) <= (KV_PACE_MIB_BURST + KV_PACE_MIB_PER_S * seconds) * mib
    # as long as the pace needs (the bytes past the burst at its rate), no longer
    assert clock.now == pytest.approx((total - KV_PACE_MIB_BURST * mib) / (KV_PACE_MIB_PER_S * mib), rel=0.05)
    assert ticks >= clock.sleeps > 0  # the loop ran at each wait
    budget = KvBudget().budget()  # a router's default, on the same clock, with no record of the worker
    assert all(budget.admit("w1", t, size) for t, size in nc.sent) and budget.over == 0


async def test_many_small_batches_go_out_at_half_a_router_s_default_batch_rate() -> None:
    """The batch count is paced too: a ring of 3,000 batches held through a NATS stall goes out at
    KV_PACE_BATCHES_PER_S after a burst of KV_PACE_BATCH_BURST, not at once."""
    clock = PaceClock()
    nc = TimedNats(clock)
    pub = KvPublisher(nc, "ns", "w1", 7, Normaliser(16), pace=KvPace(clock=clock, sleep=clock.sleep))  # type: ignore[arg-type]
    for h in range(3000):
        pub.add([Stored(hashes=[h + 1], parent=None)])
        pub.seal()
    await pub._send_outbox()
    assert len(nc.sent) == 3000
    for seconds in (0.0, 1.0, 2.0):
        assert _most_in_a_window(nc.sent, seconds, 1) <= KV_PACE_BATCH_BURST + KV_PACE_BATCHES_PER_S * seconds
    assert clock.now == pytest.approx((3000 - KV_PACE_BATCH_BURST) / KV_PACE_BATCHES_PER_S, rel=0.01)


class HeldPace:
    """A clock for KvPace that stands still, and a sleep that never ends: past the pace's burst,
    every batch waits until the publisher stops."""

    def __init__(self) -> None:
        self.holding = asyncio.Event()

    def __call__(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        self.holding.set()
        await asyncio.Event().wait()


@pytest.mark.parametrize("cleared", [True, False])
async def test_a_stop_while_the_pace_holds_a_snapshot_drops_it_and_sends_only_the_epoch_s_cleared(
    caplog: pytest.LogCaptureFixture, cleared: bool
) -> None:
    """Final review of 2026-12-07: a stop right after a registration (the shim's end of its epoch,
    `Cleared` last; or a lease lost under --worker-name, no Cleared) waited out the pace of the
    snapshot: 5 s, then the task was cancelled and the closing Cleared never went. Now what the pace
    holds is dropped, counted and said once, and the Cleared alone goes, unpaced."""
    held = HeldPace()
    nc = TimedNats(PaceClock())
    pub = KvPublisher(nc, "ns", "w1", 7, Normaliser(16), pace=KvPace(clock=held, sleep=held.sleep))  # type: ignore[arg-type]
    pub.start()
    await asyncio.sleep(0)
    pub.add([Stored(hashes=list(range(i * 1000 + 1, i * 1000 + 1001)), parent=None) for i in range(600)])
    await held.holding.wait()  # the burst sent, the rest held
    if cleared:
        pub.add([Cleared()])
    with caplog.at_level(logging.WARNING, logger="worker_shim.kv_publisher"):
        await pub.stop()
    sealed = pub.log.seq
    sent = len(nc.sent)
    assert pub.counters.batches == sent and pub.counters.send_failures == sealed - sent > 0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"stopping with {sealed - sent} batches the pace held" in said[0], said
    if cleared:
        assert pub.digest().seq == sealed and pub.digest().blocks == 0  # the Cleared, sent last
    else:
        assert pub.digest().seq < sealed
