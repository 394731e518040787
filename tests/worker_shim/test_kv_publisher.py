"""KvPublisher: a large addition (a whole cache's snapshot at registration) leaves as several
batches that each fit a NATS payload, in order, and a subscriber rebuilds the same set."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.aio.msg import Msg

from protocol import KvEvent, KvEventBatch, Stored, decode_msg, hash_count, subjects, unpack_hashes
from worker_shim.event_log import RING_SIZE
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
