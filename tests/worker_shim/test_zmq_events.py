"""The ZMQ transport against a stand-in engine that sends the captured vLLM 0.32 frames verbatim.

The stand-in's PUB sends the capture's messages with a hole in the middle; its ROUTER answers the
shim's replay request for seq 8 with the capture's own replay reply frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvswitch.servers import free_port
from protocol.vllm_events import END_SEQ, BlockStored, decode_pub_frames, encode_batch
from tests.protocol.vllm_captures import expected_set, pub_frames, replay_frames
from tests.worker_shim.cluster import collector, wait_for
from worker_shim import EngineBatch, EngineStored, Normaliser
from worker_shim.adapters import zmq_events
from worker_shim.adapters.zmq_events import QUIET_PROBE_S, SETTLE_S, ZmqEventSource, resolve_endpoint
from worker_shim.engine_events import EngineRestarted, EventSink
from worker_shim.event_health import EventProblem


class StandIn:
    """Engine side: PUB (binding or connecting, as vLLM decides) and a ROUTER for replay."""

    def __init__(self, capture: str, pub_binds: bool) -> None:
        self.ctx = zmq.asyncio.Context()
        self.capture = capture
        self.frames = pub_frames(capture)
        self.sent: list[list[bytes]] = []
        self.replay_requests: list[int] = []
        self.pub = self.ctx.socket(zmq.PUB)
        port = free_port()
        self.shim_endpoint = f"tcp://*:{port}" if pub_binds else f"tcp://127.0.0.1:{port}"
        if pub_binds:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://*:{rport}"
        self.pub_binds = pub_binds
        self.port = port

    def connect_pub(self) -> None:
        if not self.pub_binds:
            self.pub.connect(f"tcp://127.0.0.1:{self.port}")

    async def serve_replay(self) -> None:
        while True:
            ident, _, seq_frame = await self.router.recv_multipart()
            start = int.from_bytes(seq_frame, "big")
            self.replay_requests.append(start)
            if start == 8:
                for r in replay_frames(self.capture, "8"):  # the captured reply, byte for byte
                    await self.router.send_multipart([ident, *r])
                continue
            for f in self.sent:
                if decode_pub_frames(f)[1] >= start:
                    await self.router.send_multipart([ident, b"", *f])
            await self.router.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture(params=[True, False], ids=["engine-binds", "engine-connects"])
async def stand_in(request: pytest.FixtureRequest) -> AsyncIterator[StandIn]:
    s = StandIn("bs32", pub_binds=request.param)
    yield s
    s.close()


@contextlib.asynccontextmanager
async def running(stand_in: StandIn, sink: EventSink) -> AsyncIterator[ZmqEventSource]:
    """A source running against the stand-in, its PUB connected, what it delivers given to `sink`;
    stopped on exit."""
    source = ZmqEventSource("vllm", stand_in.shim_endpoint, "auto", "kv-events", stand_in.replay_endpoint, "127.0.0.1")
    assert source.bind is (not stand_in.pub_binds)
    replay = asyncio.create_task(stand_in.serve_replay())
    live = asyncio.Event()
    run = asyncio.create_task(source.run(sink, live))
    try:
        await asyncio.wait_for(live.wait(), 5)
        stand_in.connect_pub()
        await wait_for(lambda: source._connections >= 1, 5, "SUB connected")
        yield source
    finally:
        run.cancel()
        replay.cancel()
        for t in (run, replay):
            with contextlib.suppress(asyncio.CancelledError):
                await t


def folded(norm: Normaliser) -> EventSink:
    """A sink folding what the source delivers into `norm`."""

    async def sink(batch: EngineBatch) -> None:
        if batch.reset:
            norm.reset(exact=batch.complete)
        norm.apply(batch.events)

    return sink


@contextlib.asynccontextmanager
async def connected(stand_in: StandIn) -> AsyncIterator[tuple[ZmqEventSource, Normaliser]]:
    """`running`, what the source delivers folded into a Normaliser."""
    norm = Normaliser(32)
    async with running(stand_in, folded(norm)) as source:
        yield source, norm


async def test_captured_stream_with_a_hole_is_filled_by_the_captured_replay(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)  # the gap is the live stream's to find here
    monkeypatch.setattr(zmq_events, "QUIET_PROBE_S", 60.0)
    async with connected(stand_in) as (source, norm):
        await asyncio.sleep(0.2)  # ZMQ subscriptions propagate after the connection event
        live = 0
        for i, f in enumerate(stand_in.frames):
            stand_in.sent.append(f)
            if not 8 <= i < 12:  # the hole: seq 8..11 never arrive live
                await stand_in.pub.send_multipart(f)
                live += 1
        await wait_for(lambda: source._last == len(stand_in.frames) - 1, 5, "every seq delivered")
        assert stand_in.replay_requests == [0, 8]
        assert source.stats.gaps == 1 and source.stats.replay_failures == 0
        # The replay of the gap seq 12 revealed delivers through the last seq, so _last gets there
        # before the live frames after 12 are read (a loaded box reads them later still).
        await wait_for(lambda: source.stats.messages == live, 5, "every live frame read")
        # Live seq 13.. came after the replay had delivered them; 12 revealed the gap.
        assert source.stats.duplicates == len(stand_in.frames) - 13
        assert norm.canonical_hashes() == expected_set(stand_in.frames, 32)


async def test_batches_the_pub_dropped_before_the_subscription_arrived_are_fetched_once_settled(
    stand_in: StandIn,
) -> None:
    """ZMQ's slow joiner: right after a (re)connection the PUB drops batches until the SUB's
    subscription reaches it. When the engine then goes quiet no later seq reveals the gap, so the
    source asks the replay socket SETTLE_S after the connection."""
    async with connected(stand_in) as (source, norm):
        published = stand_in.frames[:4]
        stand_in.sent.extend(published)  # published while the subscription was on its way: dropped
        await wait_for(lambda: source._last == 3, SETTLE_S + 3, "the dropped batches fetched")
        assert stand_in.replay_requests == [0, 0], "the start's replay, then the settled connection's"
        assert norm.canonical_hashes() == expected_set(published, 32)


class BufferedEngine(StandIn):
    """A stand-in publishing a chain of blocks of its own, one per batch, whose replay buffer holds
    only the last `buffer` batches (vLLM: deque(maxlen=buffer_steps)), and whose PUB's link can drop
    while the engine goes on or restarts."""

    RELINK_TYPE = zmq.PUB  # the socket type of the PUB `link` opens

    def __init__(self, pub_binds: bool) -> None:
        super().__init__("bs32", pub_binds)
        self.buffer: int | None = None  # None: every batch of the run
        self.run = 0

    async def serve_replay(self) -> None:
        while True:
            ident, _, seq_frame = await self.router.recv_multipart()
            start = int.from_bytes(seq_frame, "big")
            self.replay_requests.append(start)
            for f in self.sent[-self.buffer :] if self.buffer else self.sent:
                if decode_pub_frames(f)[1] >= start:
                    await self.router.send_multipart([ident, b"", *f])
            await self.router.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    async def store(self, n: int, *, live: bool = True) -> None:
        """`n` more blocks extending the run's chain; `live=False`: buffered, never sent live."""
        for _ in range(n):
            seq = len(self.sent)
            h = (self.run << 32) + seq + 1  # another run stores other blocks
            stored = BlockStored(
                block_hashes=[h], parent_block_hash=h - 1 if seq else None, token_ids=[h % 4096] * 32, block_size=32
            )
            frames = [b"kv-events", seq.to_bytes(8, "big"), encode_batch(time.time(), [stored])]
            self.sent.append(frames)
            if live:
                await self.pub.send_multipart(frames)

    def restart(self) -> None:
        self.run, self.sent, self.buffer = self.run + 1, [], None

    def drop_link(self) -> None:
        self.pub.close(linger=0)

    async def link(self) -> None:
        self.pub = self.ctx.socket(self.RELINK_TYPE)
        if not self.pub_binds:
            self.connect_pub()
            return
        deadline = time.monotonic() + 5
        while True:
            try:  # the closed socket frees its port in ZMQ's I/O thread, a moment later
                self.pub.bind(f"tcp://127.0.0.1:{self.port}")
                return
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)


@pytest.fixture(params=[True, False], ids=["engine-binds", "engine-connects"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[BufferedEngine]:
    e = BufferedEngine(pub_binds=request.param)
    yield e
    e.close()


async def test_a_reconnect_to_the_same_engine_run_keeps_the_index_though_its_buffer_wrapped(
    engine: BufferedEngine,
) -> None:
    """Audit: every reconnection rebuilt from a replay from 0. A long-lived engine's buffer no longer
    starts at 0, so the rebuild reset to a partial state, the replayed blocks' parents were just
    forgotten (dropped), and so was every later block extending a cached prefix until the engine
    restarted. The replay holds seq `last` with the payload received live: the run goes on."""
    await engine.store(20, live=False)  # before the shim: its start's replay delivers them
    async with connected(engine) as (source, norm):
        assert (source._last, len(norm), norm.exact) == (19, 20, True)
        engine.buffer = 4  # wrapped: seq 16..19 only
        engine.drop_link()  # a network blip; the engine runs on
        await engine.link()
        await wait_for(lambda: source.stats.reconnects == 1, 5, "the SUB reconnected")
        await engine.store(1)  # seq 20, extending the chain (fetched by the settle probe if dropped)
        await wait_for(lambda: source._last == 20, SETTLE_S + 3, "seq 20 delivered")
        assert (len(norm), norm.exact, norm.stats.unknown_parent) == (21, True, 0)
        assert (source.stats.gaps, source.stats.replay_failures) == (0, 0)


@pytest.mark.parametrize("sends", [b"", b"GET /health HTTP/1.1\r\n\r\n"], ids=["connect-close", "http-probe"])
async def test_a_tcp_connection_that_never_speaks_zmtp_is_no_engine_reconnecting(sends: bytes) -> None:
    """A port check (a tcpSocket liveness probe, nc -z, a scan) on the SUB the shim binds: until
    2026-12-07 the accepted TCP socket counted as the engine reconnecting, so every check ended the
    session without --kv-replay (a new worker id every 2 s), asked a replay with it, voided the
    no_stored judgements pending and cleared a real no_stored. Only a ZMTP handshake makes a peer."""
    engine = BufferedEngine(pub_binds=False)  # the engine's PUB connects: the shim binds
    await engine.store(3, live=False)
    norm = Normaliser(32)
    source = ZmqEventSource("vllm", engine.shim_endpoint, "auto", "kv-events", engine.replay_endpoint, "127.0.0.1")
    source.health.problem(EventProblem.NO_STORED, "a real no_stored")
    source.health.expect_stored(1 << 60, "req-1", 1)  # a judgement pending
    replay = asyncio.create_task(engine.serve_replay())
    live = asyncio.Event()
    run = asyncio.create_task(source.run(folded(norm), live))
    try:
        await asyncio.wait_for(live.wait(), 5)
        engine.connect_pub()
        await wait_for(lambda: source._connections == 1, 5, "the engine connected")
        source.health.problem(EventProblem.NO_STORED, "a real no_stored, again")  # the engine's connection cleared it
        source.health.expect_stored(1 << 60, "req-2", 1)
        await asyncio.sleep(SETTLE_S + 0.3)  # past the engine connection's settle probe
        replays = len(engine.replay_requests)
        for _ in range(3):
            stray = await asyncio.open_connection("127.0.0.1", engine.port)
            stray[1].write(sends)
            await stray[1].drain()
            stray[1].close()
            await asyncio.sleep(0.3)
        await asyncio.sleep(0.5)
        assert not run.done(), "the run goes on"
        assert (source._connections, source._peers, source.stats.reconnects, source.stats.restarts) == (1, 1, 0, 0)
        assert len(engine.replay_requests) == replays, "no replay asked for"
        assert EventProblem.NO_STORED in source.health.problems, "a real no_stored stays"
        assert source.health._timers, "the judgement pending stands"
        assert source._alone_since is None, "the engine is still the socket's peer"
        await engine.store(1)  # the engine's link still delivers
        await wait_for(lambda: source._last == 3, 5, "seq 3 delivered live")
    finally:
        for task in (run, replay):
            task.cancel()
        await asyncio.gather(run, replay, return_exceptions=True)
        source.health.close()
        engine.close()


@pytest.mark.parametrize(
    ("batches", "buffer", "held"),
    [(5, None, "no batch"), (25, None, "another batch"), (30, 4, "no batch")],
    ids=["seq-went-back", "new-run-past-last", "new-run-past-last-buffer-wrapped"],
)
async def test_a_reconnect_to_a_restarted_engine_ends_the_run_before_delivering_the_new_one(
    engine: BufferedEngine, batches: int, buffer: int | None, held: str
) -> None:
    """A restart while the link was down: the replay lacks seq `last`, or holds another run's
    batch there (its payload differs, if only by its timestamp). Until 2026-12-07 the shim rebuilt
    from the new run's replay and its session went on with the old run's limits (a restarted engine
    may have another block size, KV capacity or context length): now the run ends with
    EngineRestarted, nothing of the new run delivered, and the shim starts a new session."""
    await engine.store(20, live=False)
    norm = Normaliser(32)
    source = ZmqEventSource("vllm", engine.shim_endpoint, "auto", "kv-events", engine.replay_endpoint, "127.0.0.1")
    replay = asyncio.create_task(engine.serve_replay())
    live = asyncio.Event()
    run = asyncio.create_task(source.run(folded(norm), live))
    try:
        await asyncio.wait_for(live.wait(), 5)
        engine.connect_pub()
        await wait_for(lambda: source._connections >= 1, 5, "SUB connected")
        assert (source._last, len(norm)) == (19, 20)
        engine.drop_link()
        engine.restart()
        await engine.store(batches, live=False)  # published while the link was down
        engine.buffer = buffer
        await engine.link()
        with pytest.raises(EngineRestarted, match=f"its replay holds {held} at seq 19"):
            await asyncio.wait_for(run, 5)
        assert (source.stats.reconnects, source.stats.restarts) == (1, 1)
        assert (len(norm), norm.exact, source._last) == (20, True, 19), "nothing of the new run delivered"
    finally:
        for task in (run, replay):
            task.cancel()
        await asyncio.gather(run, replay, return_exceptions=True)


async def test_a_reconnect_with_a_rebuild_pending_is_still_judged(engine: BufferedEngine) -> None:
    """Until 2026-12-07 a reconnection with a rebuild pending (an unknown parent, say) was not
    judged: the rebuild replayed a restarted engine's new run from 0 into the old run's session."""
    await engine.store(20, live=False)
    source = ZmqEventSource("vllm", engine.shim_endpoint, "auto", "kv-events", engine.replay_endpoint, "127.0.0.1")
    source._ctx = zmq.asyncio.Context()  # as run() sets it: the replay's DEALER is made in it
    source._last, source._last_digest = 19, zmq_events._digest(engine.sent[19][2])
    replay = asyncio.create_task(engine.serve_replay())
    try:
        engine.restart()
        await engine.store(25, live=False)
        source.request_rebuild()
        with pytest.raises(EngineRestarted, match="another batch at seq 19"):
            await source._on_reconnect(collector([]))
    finally:
        replay.cancel()
        await asyncio.gather(replay, return_exceptions=True)
        source._ctx.term()


@pytest.mark.parametrize("changed", [None, "its limits went from A to B"], ids=["same-limits", "other-limits"])
async def test_a_reconnect_before_any_batch_with_replay_reads_the_engine_limits_again(
    engine: BufferedEngine, changed: str | None
) -> None:
    """An SGLang engine idle since the shim started (no endpoint probe publishes for it), replay on:
    until 2026-12-07 its link's first drop ended the session, nothing delivered to prove the run goes
    on. The shim holds nothing of it; the engine's limits, read again, decide."""
    asked: list[str] = []

    async def engine_changed() -> str | None:
        asked.append("limits")
        return changed

    source = ZmqEventSource(
        "sglang",
        engine.shim_endpoint,
        "auto",
        "kv-events",
        engine.replay_endpoint,
        "127.0.0.1",
        engine_changed=engine_changed,
    )
    norm = Normaliser(32)
    replay = asyncio.create_task(engine.serve_replay())
    live = asyncio.Event()
    run = asyncio.create_task(source.run(folded(norm), live))
    try:
        await asyncio.wait_for(live.wait(), 5)
        engine.connect_pub()
        await wait_for(lambda: source._connections == 1, 5, "the engine connected")
        await asyncio.sleep(SETTLE_S + 0.3)
        assert source._last == -1 and asked == []
        engine.drop_link()
        await engine.link()
        if changed is not None:
            with pytest.raises(EngineRestarted, match="before any batch of the engine's run was delivered, and its"):
                await asyncio.wait_for(run, 5)
            assert (source.stats.reconnects, source.stats.restarts, asked) == (1, 1, ["limits"])
            return
        await wait_for(lambda: source.stats.reconnects == 1, 5, "the SUB reconnected")
        await engine.store(2)  # seq 0, 1 (fetched by the settle probe if the PUB dropped them)
        await wait_for(lambda: source._last == 1, SETTLE_S + 3, "seq 0..1 delivered")
        assert (len(norm), norm.exact, source.stats.restarts, asked) == (2, True, 0, ["limits"])
    finally:
        for task in (run, replay):
            task.cancel()
        await asyncio.gather(run, replay, return_exceptions=True)


async def test_a_reconnect_with_nothing_to_prove_the_run_goes_on_ends_it() -> None:
    """No batch delivered yet, or no replay socket to ask: the run cannot be shown to go on."""
    source = ZmqEventSource("vllm", "tcp://*:5557", "auto", "kv-events", None, "127.0.0.1")
    with pytest.raises(EngineRestarted, match="before any batch of the engine's run was delivered"):
        await source._on_reconnect(collector([]))
    got: list[EngineBatch] = []
    await _send(source, got, b"kv-events", 0, _payload(_stored(-1, [1, 2, 3, 4])))
    with pytest.raises(EngineRestarted, match=r"the shim has no replay socket \(--kv-replay\)"):
        await source._on_reconnect(collector(got))
    assert source.stats.restarts == 2 and len(got) == 1


async def test_the_last_batch_before_a_quiet_spell_lost_on_the_way_is_fetched(
    engine: BufferedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost batch shows as a gap when the next one comes; the last before the engine went quiet
    had none after it, and its blocks stayed out of the index until the engine stored again (the
    chaos bench's event_loss_10pct: one block short on every router)."""
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)
    await engine.store(2, live=False)  # seq 0..1: the start's replay delivers them
    async with connected(engine) as (source, norm):
        await asyncio.sleep(0.2)  # ZMQ subscriptions propagate after the connection event
        await engine.store(3)  # seq 2..4 live
        await engine.store(1, live=False)  # seq 5, lost on the way; then quiet
        await wait_for(lambda: source._last == 5, QUIET_PROBE_S + 3, "the quiet probe fetched seq 5")
        assert engine.replay_requests == [0, 5]
        assert (len(norm), norm.exact, source.stats.gaps) == (6, True, 0)
        await asyncio.sleep(QUIET_PROBE_S + 0.5)
        assert engine.replay_requests == [0, 5], "one probe per quiet spell"


async def test_a_probe_whose_replay_starts_past_the_next_seq_counts_the_gap_and_resets(
    engine: BufferedEngine,
) -> None:
    """Audit: the probe delivered every replayed seq above the last one, even when the buffer had
    wrapped past the next: the batches between (BlockRemoved among them, maybe) were skipped with no
    gap counted and no reset, the state still called complete."""
    await engine.store(3, live=False)  # seq 0..2: the start's replay delivers them
    async with connected(engine) as (source, norm):
        await engine.store(9, live=False)  # seq 3..11, dropped before the subscription arrived
        engine.buffer = 2  # and the buffer wrapped: seq 10..11 only
        await wait_for(lambda: source._last == 11, SETTLE_S + 3, "the settle probe delivered seq 10..11")
        assert engine.replay_requests == [0, 3]
        assert (source.stats.gaps, source.stats.replay_failures) == (1, 1)
        assert not norm.exact


async def test_a_gap_replay_that_times_out_counts_one_replay_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit: `_replay` counted the timeout and `_fill_gap` counted it again."""
    monkeypatch.setattr(zmq_events, "REPLAY_TIMEOUT_S", 0.2)
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)  # the engine's replay socket, which never answers
    port = router.bind_to_random_port("tcp://127.0.0.1")
    source = ZmqEventSource("vllm", "tcp://*:5557", "auto", "kv-events", f"tcp://127.0.0.1:{port}", "127.0.0.1")
    source._ctx = ctx  # as run() sets it: the replay's DEALER is made in it
    got: list[EngineBatch] = []
    try:
        for seq in (0, 3):  # seq 1..2 missing
            stored = BlockStored(block_hashes=[seq + 1], parent_block_hash=None, token_ids=[seq] * 4, block_size=4)
            await _send(source, got, b"kv-events", seq, encode_batch(1.0, [stored]))
    finally:
        router.close(linger=0)
        source._ctx = None
        ctx.term()
    assert (source.stats.gaps, source.stats.replays, source.stats.replay_failures) == (1, 1, 1)
    assert [(b.reset, b.complete) for b in got if b.reset] == [(True, False)]


@pytest.mark.parametrize(
    ("endpoint", "mode", "expected"),
    [
        ("tcp://*:5557", "auto", ("tcp://10.0.0.5:5557", False)),
        ("tcp://127.0.0.1:5557", "auto", ("tcp://127.0.0.1:5557", True)),
        ("tcp://0.0.0.0:5557", "auto", ("tcp://0.0.0.0:5557", True)),  # vLLM 0.32's PUB connects to it
        ("ipc:///tmp/kv", "auto", ("ipc:///tmp/kv", False)),
        ("tcp://127.0.0.1:5557", "connect", ("tcp://127.0.0.1:5557", False)),
        ("tcp://*:5557", "bind", ("tcp://*:5557", True)),
    ],
)
def test_bind_or_connect_follows_vllms_rule_backwards(endpoint: str, mode: str, expected: tuple[str, bool]) -> None:
    assert resolve_endpoint(endpoint, mode, "10.0.0.5", "vllm") == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://0.0.0.0:5557", ("tcp://10.0.0.5:5557", False)),
        ("tcp://*:5557", ("tcp://10.0.0.5:5557", False)),
        ("tcp://127.0.0.1:5557", ("tcp://127.0.0.1:5557", True)),
    ],
)
def test_sglangs_pub_binds_0_0_0_0_so_the_shim_connects_to_the_engine_host(
    endpoint: str, expected: tuple[str, bool]
) -> None:
    """SGLang's ZmqEventPublisher binds `*`, `::` and `0.0.0.0` endpoints: a shim that bound
    tcp://0.0.0.0 too met no engine, and the KV events never came."""
    assert resolve_endpoint(endpoint, "auto", "10.0.0.5", "sglang") == expected
    source = ZmqEventSource("sglang", endpoint, "auto", "kv", "tcp://0.0.0.0:5558", "10.0.0.5")
    assert (source.address, source.bind) == expected
    # Both engines' replay ROUTER binds: a bind-all address is reached at the engine host.
    assert source.replay_address == "tcp://10.0.0.5:5558"
    assert ZmqEventSource("vllm", endpoint, "auto", "kv", "tcp://0.0.0.0:5558", "10.0.0.5").replay_address == (
        "tcp://10.0.0.5:5558"
    )


# --- SGLang's live topics with a snapshot_endpoint, and malformed events, on the message path ---------

EPOCH, BARRIER = b"\x00sgl-kv-epoch=", b"\x00sgl-kv-snapshot="


def _payload(*events: object) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def _stored_hashes(batches: list[EngineBatch]) -> list[list[int]]:
    return [list(e.hashes) for b in batches for e in b.events if isinstance(e, EngineStored)]


def _stored(hash_: int, tokens: list[int], parent: int | None = None) -> list[object]:
    return ["BlockStored", [hash_], parent, tokens, 4, None, "GPU"]


async def _send(source: ZmqEventSource, sink: list[EngineBatch], topic: bytes, seq: int, payload: bytes) -> None:
    await source._on_message([topic, seq.to_bytes(8, "big"), payload], collector(sink))


async def test_sglangs_epoch_topics_are_the_shims_topic_and_its_barriers_hold_no_events() -> None:
    """With a snapshot_endpoint, SGLang publishes under topic + \\x00sgl-kv-epoch=<epoch>, and a
    snapshot barrier (no events) adds \\x00sgl-kv-snapshot=<id>: the exact topic check counted every
    such message as another topic, and the shim indexed nothing."""
    source = ZmqEventSource("sglang", "tcp://*:5557", "auto", "kv", None, "127.0.0.1")
    got: list[EngineBatch] = []
    await _send(source, got, b"kv" + EPOCH + b"3f2a", 0, _payload(_stored(-1, [1, 2, 3, 4])))
    await _send(source, got, b"kv" + EPOCH + b"3f2a" + BARRIER + b"b1", 1, _payload())
    await _send(source, got, b"kv" + EPOCH + b"3f2a", 2, _payload(_stored(-2, [5, 6, 7, 8], -1)))
    await _send(source, got, b"kvx" + EPOCH + b"3f2a", 3, _payload(_stored(-3, [9, 9, 9, 9])))
    assert _stored_hashes(got) == [[-1], [-2]]
    s = source.stats
    assert (s.barriers, s.other_topic, s.gaps, s.restarts, source._last) == (1, 1, 0, 0, 2)


@pytest.mark.parametrize("seq", [0, 3], ids=["from-0", "looks-like-the-next"])
async def test_another_sglang_epoch_is_a_restarted_publisher(seq: int) -> None:
    """A new epoch is a new publisher run: its seq may even look like the next one (the shim missed
    the new run's start), yet what the shim holds is void. The run ends (EngineRestarted) before
    any of the new run is delivered: the shim starts a new session (until 2026-12-07 it reset and
    went on under the old run's limits)."""
    source = ZmqEventSource("sglang", "tcp://*:5557", "auto", "kv", None, "127.0.0.1")
    got: list[EngineBatch] = []
    for i in range(3):
        await _send(source, got, b"kv" + EPOCH + b"run-1", i, _payload(_stored(-10 - i, [i] * 4)))
    with pytest.raises(EngineRestarted, match="publisher's epoch went from run-1 to run-2"):
        await _send(source, got, b"kv" + EPOCH + b"run-2", seq, _payload(_stored(-20, [7] * 4)))
    assert source.stats.restarts == 1
    assert len(got) == 3 and not any(b.reset for b in got)


class _QueuedSub:
    """What `_queued` reads of the SUB socket: the messages it holds, then zmq.Again."""

    def __init__(self, held: list[list[bytes]]) -> None:
        self.held = held

    async def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[bytes]:
        if not self.held:
            raise zmq.Again
        return self.held.pop(0)


async def test_sglangs_first_rebuild_delivers_what_came_live_under_its_epoch_as_live() -> None:
    """The start's rebuild runs before any live message gave the shim the publisher's epoch: the
    live messages queued meanwhile (their topics carrying it) were taken for another run's, so
    the replay delivered them as replayed (review of 2026-12-07)."""
    source = ZmqEventSource("sglang", "tcp://*:5557", "auto", "kv", None, "127.0.0.1")
    payloads = [_payload(_stored(-1, [1] * 4)), _payload(_stored(-2, [2] * 4, -1)), _payload(_stored(-3, [3] * 4, -2))]
    topic = b"kv" + EPOCH + b"3f2a"
    source._sub = _QueuedSub([[topic, (2).to_bytes(8, "big"), payloads[2]]])  # type: ignore[assignment]
    got: list[EngineBatch] = []
    await source._deliver_rebuild(list(enumerate(payloads)), collector(got))
    assert [b.live for b in got if b.events] == [False, False, True], got
    assert (source._epoch, source.stats.duplicates, source.stats.restarts) == (b"3f2a", 1, 0)


async def test_a_live_seq_that_goes_back_is_a_restarted_engine() -> None:
    source = ZmqEventSource("vllm", "tcp://*:5557", "auto", "kv-events", None, "127.0.0.1")
    got: list[EngineBatch] = []
    for i in range(3):
        await _send(source, got, b"kv-events", i, _payload(_stored(-10 - i, [i] * 4)))
    with pytest.raises(EngineRestarted, match="seq went back from 2 to 0"):
        await _send(source, got, b"kv-events", 0, _payload(_stored(-20, [7] * 4)))
    assert source.stats.restarts == 1 and len(got) == 3


async def test_a_seq_back_into_a_replay_long_past_is_a_restarted_engine_not_a_duplicate() -> None:
    """The window in which a seq at or below the last is a replayed batch's live copy lasts until a
    live batch past the replay: it never closed, so a restarted engine's seq 2 after the start's
    rebuild of 0..4 and live batches up to 999 was dropped as a duplicate (module read of
    2026-12-07), where the restart check is the fallback to the monitor's reconnection."""
    source = ZmqEventSource("vllm", "tcp://*:5557", "auto", "kv-events", None, "127.0.0.1")
    source._sub = _QueuedSub([])  # type: ignore[assignment]
    got: list[EngineBatch] = []
    rebuild = [(i, _payload(_stored(-1 - i, [i] * 4, -i if i else None))) for i in range(5)]
    await source._deliver_rebuild(rebuild, collector(got))
    await _send(source, got, b"kv-events", 4, rebuild[4][1])  # a live copy of the replay's: a duplicate
    for i in range(5, 9):
        await _send(source, got, b"kv-events", i, _payload(_stored(-1 - i, [i] * 4, -i)))
    with pytest.raises(EngineRestarted, match="seq went back from 8 to 2"):
        await _send(source, got, b"kv-events", 2, _payload(_stored(-20, [7] * 4)))
    assert (source.stats.duplicates, source.stats.restarts) == (1, 1)


async def test_one_malformed_event_is_dropped_alone_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A malformed event is counted, logged once and dropped (docs/worker_shim.md): its batch's
    other events (vLLM 0.32 maps here) were dropped with it."""
    source = ZmqEventSource("vllm", "tcp://*:5557", "auto", "kv-events", None, "127.0.0.1")
    good = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1] * 4}
    bad = {"type": "BlockRemoved", "block_hashes": ["x"]}
    got: list[EngineBatch] = []
    with caplog.at_level(logging.WARNING):
        for seq in range(2):
            batch = _payload({**good, "block_size": 4}, bad, {"type": "AllBlocksCleared"})
            await _send(source, got, b"kv-events", seq, batch)
    assert [len(b.events) for b in got] == [2, 2]
    assert source.stats.malformed == 2
    assert len([r for r in caplog.records if "neither an integer nor bytes" in r.getMessage()]) == 1
    # once per kind, not per value: each new bad hash was a new line, kept for good in the "once" set
    with caplog.at_level(logging.WARNING):
        for seq in range(2, 40):
            batch = _payload({"type": "BlockRemoved", "block_hashes": [f"h{seq}"]})
            await _send(source, got, b"kv-events", seq, batch)
    assert source.stats.malformed == 40
    assert len([r for r in caplog.records if "neither an integer nor bytes" in r.getMessage()]) == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_batch_nested_too_deeply_is_counted_malformed_and_the_stream_goes_on(engine: str) -> None:
    """Audit 2026-12-04: its RecursionError escaped the decoder and ended the event stream, and the
    shim re-registered under a new worker id (routers dropped its index entries and bookings)."""
    source = ZmqEventSource(engine, "tcp://*:5557", "auto", "kv", None, "127.0.0.1")
    got: list[EngineBatch] = []
    await _send(source, got, b"kv", 0, b"\x93\xcb" + b"\0" * 8 + b"\x91" * 3001 + b"\x01\x00")
    await _send(source, got, b"kv", 1, _payload(_stored(-1, [1, 2, 3, 4])))
    assert source.stats.malformed == 1 and source.stats.gaps == 0
    assert _stored_hashes(got) == [[-1]]


@pytest.mark.parametrize("how", ["rebuild", "gap"])
async def test_a_replay_of_many_batches_gives_the_loop_turns_while_it_is_received_and_delivered(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A rebuild fetches and delivers the engine's whole buffer (vLLM keeps 10,000 batches), a gap
    what the live socket lost (a stalled shim's high-water mark): awaiting a reply the socket holds
    already, and the synchronous sink, never yield, so every leg's chunks and heartbeats waited for
    all of it (236 ms for 5,000 batches; the gap's delivery was left so by the first fix, review of
    2026-12-06)."""
    monkeypatch.setattr(zmq_events, "SLICE_S", 0.0, raising=False)  # a turn after every batch: counted, not timed
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    batches = [
        [
            b"kv-events",
            seq.to_bytes(8, "big"),
            encode_batch(
                time.time(),
                [BlockStored(block_hashes=[seq + 1], parent_block_hash=seq or None, token_ids=[1] * 16, block_size=16)],
            ),
        ]
        for seq in range(202)
    ]
    # rebuild: the first replay holds 200 batches; gap: it holds seq 0, the live socket then brings
    # seq 201, and the gap's replay holds 1..200
    first = batches[:200] if how == "rebuild" else batches[:1]

    async def serve() -> None:
        while True:
            ident, _, start_frame = await router.recv_multipart()
            start = int.from_bytes(start_frame, "big")
            for frames in first if start == 0 else batches[start:201]:  # queued at once: all waiting
                router.send_multipart([ident, b"", *frames])
            await router.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    turns = 0
    seen: list[int] = []  # the turns other tasks had had when each replayed batch was delivered

    async def other_task() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    async def sink(batch: EngineBatch) -> None:
        if batch.events:
            seen.append(turns)

    source = ZmqEventSource("vllm", f"tcp://*:{port}", "auto", "kv-events", f"tcp://*:{replay_port}", "127.0.0.1")
    tasks = [asyncio.create_task(t) for t in (serve(), other_task(), source.run(sink, asyncio.Event()))]
    try:
        if how == "gap":
            await wait_for(lambda: len(seen) == 1, timeout=10)

            async def publish_until_seen() -> None:  # the SUB's subscription reaches the PUB late
                while len(seen) < 2:
                    await pub.send_multipart(batches[201])
                    await asyncio.sleep(0.05)

            tasks.append(asyncio.create_task(publish_until_seen()))
        await wait_for(lambda: len(seen) >= 200, timeout=10)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()
    replayed = seen[:200] if how == "rebuild" else seen[1:201]
    assert replayed[-1] - replayed[0] >= len(replayed) - 1  # another task ran between each two batches


class PublishesWhileReplayIsAsked(BufferedEngine):
    """An engine that publishes a batch while the shim's probe waits for its replay: vLLM's
    publisher thread sends a batch on the PUB, then buffers it, and answers a replay request only
    between batches, so the probe's replay holds a batch the live socket has already delivered."""

    def __init__(self, pub_binds: bool) -> None:
        super().__init__(pub_binds)
        self.publish_on_probe = False

    async def serve_replay(self) -> None:
        while True:
            ident, _, seq_frame = await self.router.recv_multipart()
            start = int.from_bytes(seq_frame, "big")
            self.replay_requests.append(start)
            if self.publish_on_probe and self._publishes_at(start):
                self.publish_on_probe = False
                await self._before_live_store()
                await self.store(1)  # live, before the replay answer
                await asyncio.sleep(0.2)  # ... on the shim's side well before it
            for f in self.sent:
                if decode_pub_frames(f)[1] >= start:
                    await self.router.send_multipart([ident, b"", *f])
            await self.router.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    def _publishes_at(self, start: int) -> bool:
        """Whether a replay from `start` is the one asked while a batch goes out: a probe's or a
        gap's (the start's replay, from 0, is long done)."""
        return start > 0

    async def _before_live_store(self) -> None:
        """Nothing here: the batch goes out as soon as the replay is asked for."""


@pytest.mark.parametrize("pub_binds", [True, False], ids=["engine-binds", "engine-connects"])
async def test_a_batch_the_live_socket_delivered_while_a_probe_waited_is_live_not_missed(
    pub_binds: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Against real vLLM 0.32 (make test-vllm, 2026-12-06), a batch sent as a quiet probe asked for
    the replay came in the replay and was delivered as replayed (live false), its live copy then
    dropped as a duplicate, with a WARNING that the live socket never delivered it: about one batch
    a second per shim (a replayed batch proves nothing of the live stream: event_health). A batch
    the live socket holds is live."""
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)
    batches: list[EngineBatch] = []
    with contextlib.closing(PublishesWhileReplayIsAsked(pub_binds)) as engine:
        async with running(engine, collector(batches)) as source:
            await asyncio.sleep(0.2)  # ZMQ subscriptions propagate after the connection event
            engine.publish_on_probe = True
            with caplog.at_level(logging.WARNING, logger=zmq_events.__name__):
                await engine.store(1)  # seq 0 live; the quiet probe follows a second later, and seq 1 with it
                await wait_for(lambda: source._last == 1, QUIET_PROBE_S + 3, "seq 1 delivered")
                await asyncio.sleep(0.3)
            assert engine.replay_requests == [0, 1]
            stored = [b for b in batches if b.events]
            assert [b.live for b in stored] == [True, True], "seq 1 came on the live socket"
            assert not [r for r in caplog.records if "never delivered" in r.getMessage()]
            assert source.stats.gaps == 0


@pytest.mark.parametrize("pub_binds", [True, False], ids=["engine-binds", "engine-connects"])
async def test_after_a_gap_the_batches_that_came_live_are_live_and_only_the_missing_ones_replayed(
    pub_binds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gap's replay runs to the newest seq, so it holds the batch that revealed the gap and those
    the live socket queued while the replay was asked for. Until 2026-12-07 `_fill_gap` delivered all
    of them as replayed (their live copies dropped as duplicates): the shim's live-batch count
    (kvswitch_shim_kv_batches_received_total{live="true"}) fell short after every gap, by the gap's
    revealing batch and all that came live meanwhile."""
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)  # the gap is the live stream's to find here
    monkeypatch.setattr(zmq_events, "QUIET_PROBE_S", 60.0)
    batches: list[EngineBatch] = []
    with contextlib.closing(PublishesWhileReplayIsAsked(pub_binds)) as engine:
        await engine.store(2, live=False)  # seq 0..1: the start's replay delivers them
        async with running(engine, collector(batches)) as source:
            await asyncio.sleep(0.2)  # ZMQ subscriptions propagate after the connection event
            engine.publish_on_probe = True  # seq 5 goes out live while the gap's replay is asked for
            await engine.store(1)  # seq 2 live
            await engine.store(1, live=False)  # seq 3 lost on the way
            await engine.store(1)  # seq 4 live: reveals the gap
            await wait_for(lambda: source.stats.messages == 3, 5, "seq 2, 4 and 5 read live (5 a duplicate)")
            assert engine.replay_requests == [0, 3]
            stored = [b.live for b in batches if b.events]
            assert stored == [False, False, True, False, True, True], "only seq 0, 1 (start) and 3 (the gap) replayed"
            assert (source.stats.gaps, source.stats.duplicates, source.stats.replay_failures) == (1, 1, 0)


class PublishesWhileRebuildReplayIsAsked(PublishesWhileReplayIsAsked):
    """Publishes a batch while the shim's rebuild replay, from 0, is asked for."""

    def _publishes_at(self, start: int) -> bool:
        return start == 0


@pytest.mark.parametrize("pub_binds", [True, False], ids=["engine-binds", "engine-connects"])
async def test_after_a_rebuild_the_batches_that_came_live_meanwhile_are_live(
    pub_binds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuild's replay from 0 runs to the newest seq, so it holds what the live socket queued
    while it was asked for. Until 2026-12-07 `_deliver_rebuild` delivered all of it as replayed (the
    live copies dropped as duplicates), as _fill_gap and _on_reconnect did before that day's fixes:
    the shim's live-batch count (kvswitch_shim_kv_batches_received_total{live="true"}) fell short
    after every rebuild, by all that came live meanwhile."""
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)  # the rebuild's replay is the only one asked after the start's
    monkeypatch.setattr(zmq_events, "QUIET_PROBE_S", 60.0)
    batches: list[EngineBatch] = []
    with contextlib.closing(PublishesWhileRebuildReplayIsAsked(pub_binds)) as engine:
        await engine.store(2, live=False)  # seq 0..1: the start's replay delivers them
        async with running(engine, collector(batches)) as source:
            await asyncio.sleep(0.2)  # ZMQ subscriptions propagate after the connection event
            await engine.store(1)  # seq 2 live
            await wait_for(lambda: source._last == 2, 5, "seq 2 delivered")
            engine.publish_on_probe = True  # seq 3 goes out live while the rebuild's replay is asked for
            source.request_rebuild()
            await wait_for(lambda: source.stats.messages == 2, 5, "seq 2 and 3 read live (3 a duplicate)")
            assert engine.replay_requests == [0, 0]
            stored = [b.live for b in batches if b.events]
            # the start's 0, 1; seq 2 live; the rebuild's 0, 1, 2 again (replayed) and 3 (came live)
            assert stored == [False, False, True, False, False, False, True], stored
            assert [b.reset for b in batches].count(True) == 2
            assert (source.stats.gaps, source.stats.duplicates, source.stats.replay_failures) == (0, 1, 0)


class PublishesWhileReconnectReplayIsAsked(PublishesWhileReplayIsAsked):
    """Publishes a batch on the new link while the shim's reconnection replay is asked for, once the
    link's subscription has come (its PUB an XPUB, which reads it): ZMQ's PUB drops what it sends
    before (the slow joiner), so the live socket surely holds the batch by the replay's answer."""

    RELINK_TYPE = zmq.XPUB

    async def _before_live_store(self) -> None:
        assert await asyncio.wait_for(self.pub.recv(), 5) == b"\x01kv-events", "the new link's subscription"


@pytest.mark.parametrize("pub_binds", [True, False], ids=["engine-binds", "engine-connects"])
async def test_after_a_reconnect_to_the_same_run_the_batches_the_new_link_brought_are_live(
    pub_binds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reconnection's replay from the last seq runs to the newest seq, so it holds what the new
    link's live socket queued while it was asked for. Until 2026-12-07 `_on_reconnect` delivered all
    of it as replayed (the live copies dropped as duplicates) when the engine's run went on, so the
    shim's live-batch count (kvswitch_shim_kv_batches_received_total{live="true"}) fell short after
    every reconnection, by all that came live meanwhile."""
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)  # the reconnection's replay is the only one
    monkeypatch.setattr(zmq_events, "QUIET_PROBE_S", 60.0)
    batches: list[EngineBatch] = []
    with contextlib.closing(PublishesWhileReconnectReplayIsAsked(pub_binds)) as engine:
        await engine.store(2, live=False)  # seq 0..1: the start's replay delivers them
        async with running(engine, collector(batches)) as source:
            engine.drop_link()  # a network blip; the engine runs on
            await engine.store(1, live=False)  # seq 2 sent while the link was down
            engine.publish_on_probe = True  # seq 3 goes out on the new link while the replay is asked for
            await engine.link()
            await wait_for(lambda: source.stats.messages == 1, 5, "seq 3 read live (a duplicate)")
            assert (source.stats.reconnects, engine.replay_requests) == (1, [0, 1])
            stored = [b.live for b in batches if b.events]
            assert stored == [False, False, False, True], "only seq 0, 1 (start) and 2 (link down) replayed"
            assert [b.reset for b in batches] == [True, False, False, False, False], "the run went on"
            assert (source.stats.gaps, source.stats.duplicates, source.stats.replay_failures) == (0, 1, 0)
