"""KV batches and kvstate replies fit the server's max_payload in encoded bytes, whatever the
events' framing (single-block stores with a parent and a medium, what decode traffic makes), and a
server whose max_payload is too small for them is refused at shim start. Real nats-servers: the
session's (1 MiB) and ones of their own with a smaller max_payload."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import (
    ConfigError,
    KvEvent,
    KvEventBatch,
    KvStateChunk,
    KvStateRequest,
    Stored,
    decode_msg,
    encode_msg,
    subjects,
    unpack_hashes,
)
from protocol.config import EtcdSettings, NatsSettings
from tests.small_nats import SmallNats
from worker_shim import ShimConfig, WorkerShim
from worker_shim.engine_events import EngineStored
from worker_shim.kv_publisher import KvPublisher
from worker_shim.normaliser import Normaliser

EPOCH = 7
SMALL = 64 << 10


@pytest.fixture(scope="module")
def small_url() -> Iterator[str]:
    with SmallNats(SMALL) as server:
        yield server.url


@pytest.fixture
async def small_nc(small_url: str) -> AsyncIterator[Client]:
    nc = await nats.connect(small_url)
    assert nc.max_payload == SMALL
    yield nc
    await nc.close()


async def ask(nc: Client, ns: str, req: KvStateRequest, timeout: float = 10.0) -> list[tuple[int, KvStateChunk]]:
    """Every chunk of the reply to `req`, with its size on the wire."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subjects.kvstate(ns, "w1"), encode_msg(req), reply=inbox)
        out: list[tuple[int, KvStateChunk]] = []
        while not out or not out[-1][1].final:
            msg = await sub.next_msg(timeout=timeout)
            out.append((len(msg.data), decode_msg(msg.data, KvStateChunk)))
        return out
    finally:
        await sub.unsubscribe()


def chains(norm: Normaliser, blocks: int, length: int, rng: random.Random) -> list[KvEvent]:
    """Engine chains of `length` blocks (1 token a block) folded into `norm`; its events."""
    events: list[KvEvent] = []
    for start in range(0, blocks, length):
        n = min(length, blocks - start)
        hashes = [rng.getrandbits(63) for _ in range(n)]
        tokens = [rng.randrange(1 << 20) for _ in range(n)]
        events += norm.apply([EngineStored(hashes=hashes, parent=None, token_ids=tokens, block_size=1)])
    return events


def parent_first(hashes: list[int], parents: dict[int, int | None]) -> bool:
    at = {h: i for i, h in enumerate(hashes)}
    return all(p is None or p not in at or at[p] < i for i, h in enumerate(hashes) for p in [parents.get(h)])


async def test_a_replay_of_many_single_block_stores_fits_the_payload(nats_url: str, ns: str) -> None:
    # What decode traffic makes: one block stored a request a step, with its parent and a medium.
    # Each live batch fits; the replay re-aggregates them and must be cut by bytes, not by hashes.
    nc = await nats.connect(nats_url)
    rng = random.Random(1)
    pub = KvPublisher(nc, ns, "w1", EPOCH, Normaliser(16))
    await nc.subscribe(subjects.kvstate(ns, "w1"), cb=pub.on_kvstate)
    try:
        for _ in range(120):
            pub.add(
                [Stored(hashes=[rng.getrandbits(64)], parent=rng.getrandbits(64), medium="CPU") for _ in range(256)]
            )
        chunks = await ask(nc, ns, KvStateRequest(since_seq=0, epoch=EPOCH))
    finally:
        await nc.close()
    assert len(chunks) > 1 and not any(c.dump for _, c in chunks)
    assert max(size for size, _ in chunks) <= nc.max_payload
    assert [b.seq for _, c in chunks for b in c.batches] == list(range(1, 121))
    assert pub.counters.kvstate_batches == 1 and pub.counters.kvstate_failures == 0


async def test_live_batches_and_a_dump_fit_a_small_max_payload(small_nc: Client, ns: str) -> None:
    rng = random.Random(2)
    norm = Normaliser(1)
    pub = KvPublisher(small_nc, ns, "w1", EPOCH, norm)
    live: list[tuple[int, KvEventBatch]] = []
    got_all = asyncio.Event()

    async def on_batch(msg: Msg) -> None:
        live.append((len(msg.data), decode_msg(msg.data, KvEventBatch)))
        if live[-1][1].seq == pub.log.seq:
            got_all.set()

    await small_nc.subscribe(subjects.kv(ns, "w1"), cb=on_batch)
    await small_nc.subscribe(subjects.kvstate(ns, "w1"), cb=pub.on_kvstate)
    pub.start()
    try:
        pub.add(chains(norm, 16_384, 64, rng))  # 64 blocks an event: 256 of them are ~140 kB
        pub.add(chains(norm, 20_000, 20_000, rng))  # one event of 160 kB: split
        pub.seal()
        await asyncio.wait_for(got_all.wait(), 10)
        chunks = await ask(small_nc, ns, KvStateRequest())
    finally:
        await pub.stop()
    assert pub.counters.send_failures == 0
    assert max(size for size, _ in live) <= SMALL and [b.seq for _, b in live] == list(range(1, pub.log.seq + 1))
    held: set[int] = set()
    parents: dict[int, int | None] = {}
    for _, batch in live:
        for ev in batch.events:
            assert isinstance(ev, Stored)
            hashes = unpack_hashes(ev.hashes)
            assert ev.parent is None or ev.parent in held  # a split event's pieces chain on
            parents.update(zip(hashes, [ev.parent, *hashes[:-1]], strict=True))
            held.update(hashes)
    assert held == norm.canonical_hashes()
    dump = [h for _, c in chunks for h in unpack_hashes(c.hashes)]
    assert all(c.dump for _, c in chunks) and len(chunks) > 2 and max(size for size, _ in chunks) <= SMALL
    assert len(dump) == len(held) and set(dump) == held and parent_first(dump, parents)
    assert pub.counters.kvstate_dumps == 1


async def test_a_replay_sealed_under_a_larger_payload_is_answered_with_a_dump(
    nats_url: str, small_nc: Client, ns: str
) -> None:
    # The batches were sealed on a 1 MiB server; the shim now talks to one of 64 KiB (a reconnect
    # to another server): they cannot be replayed, so the reply is a dump that fits.
    big_nc = await nats.connect(nats_url)
    rng = random.Random(3)
    norm = Normaliser(1)
    pub = KvPublisher(big_nc, ns, "w1", EPOCH, norm)
    pub.add(chains(norm, 40_000, 1_000, rng))
    pub.seal()
    await big_nc.close()
    pub.nc = small_nc
    await small_nc.subscribe(subjects.kvstate(ns, "w1"), cb=pub.on_kvstate)
    chunks = await ask(small_nc, ns, KvStateRequest(since_seq=0, epoch=EPOCH))
    assert all(c.dump and c.seq == pub.log.seq for _, c in chunks) and max(size for size, _ in chunks) <= SMALL
    assert {h for _, c in chunks for h in unpack_hashes(c.hashes)} == norm.canonical_hashes()
    assert pub.counters.kvstate_dumps == 1 and pub.counters.kvstate_batches == 0


@pytest.mark.timing  # its bound is wall time: run serially, off a loaded box (make test does)
async def test_a_dump_of_millions_of_blocks_leaves_the_loop_free(nats_url: str, ns: str) -> None:
    # Ordering 2 M blocks parent-first takes the shim about half a second: never in one go (a chunk's
    # share is ~30 ms).
    nc = await nats.connect(nats_url)
    norm = Normaliser(1)
    n = 1 << 21
    parents: dict[int, int | None] = {h: (h - 1 if h % 64 else None) for h in range(1, n + 1)}
    norm._canon = dict.fromkeys(parents, 1)  # a worker's set as the normaliser holds it, without hashing 2 M blocks
    norm._canon_parent = parents
    pub = KvPublisher(nc, ns, "w1", EPOCH, norm)
    await nc.subscribe(subjects.kvstate(ns, "w1"), cb=pub.on_kvstate)
    stalls: list[float] = []

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            stalls.append(loop.time() - t)

    tick = asyncio.create_task(ticker())
    try:
        chunks = await ask(nc, ns, KvStateRequest(), timeout=30.0)
    finally:
        tick.cancel()
        await nc.close()
    dump = [h for _, c in chunks for h in unpack_hashes(c.hashes)]
    assert len(dump) == n and set(dump) == set(parents) and parent_first(dump, parents)
    assert max(stalls) < 0.2, f"the loop stalled {max(stalls):.2f}s"  # ~0.07 s here; 0.4-0.7 s in one go


async def test_a_server_max_payload_too_small_is_refused_at_start(ns: str, etcd_url: str) -> None:
    with SmallNats(2048) as server:
        cfg = ShimConfig(model="m", namespace=ns)
        shim = WorkerShim(cfg, NatsSettings(servers=[server.url]), EtcdSettings(endpoints=[etcd_url]))
        with pytest.raises(ConfigError) as err:
            await shim.start()
        await shim.stop()
    assert "max_payload is 2048 bytes" in str(err.value) and "nats-server configuration" in str(err.value)
