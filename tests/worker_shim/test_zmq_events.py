"""The ZMQ transport against a stand-in engine that sends the captured vLLM 0.32 frames verbatim.

The stand-in's PUB sends the capture's messages with a hole in the middle; its ROUTER answers the
shim's replay request for seq 8 with the capture's own replay reply frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from kvswitch.servers import free_port
from protocol.vllm_events import END_SEQ, decode_pub_frames
from tests.protocol.vllm_captures import expected_set, pub_frames, replay_frames
from tests.worker_shim.cluster import wait_for
from worker_shim import EngineBatch, Normaliser
from worker_shim.adapters import zmq_events
from worker_shim.adapters.zmq_events import SETTLE_S, ZmqEventSource, resolve_endpoint


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
async def connected(stand_in: StandIn) -> AsyncIterator[tuple[ZmqEventSource, Normaliser]]:
    """A source running against the stand-in, its PUB connected, what it delivers folded into a
    Normaliser; stopped on exit."""
    source = ZmqEventSource("vllm", stand_in.shim_endpoint, "auto", "kv-events", stand_in.replay_endpoint, "127.0.0.1")
    assert source.bind is (not stand_in.pub_binds)
    norm = Normaliser(32)

    def sink(batch: EngineBatch) -> None:
        if batch.reset:
            norm.reset(exact=batch.complete)
        norm.apply(batch.events)

    replay = asyncio.create_task(stand_in.serve_replay())
    live = asyncio.Event()
    run = asyncio.create_task(source.run(sink, live))
    try:
        await asyncio.wait_for(live.wait(), 5)
        stand_in.connect_pub()
        await wait_for(lambda: source._connections >= 1, 5, "SUB connected")
        yield source, norm
    finally:
        run.cancel()
        replay.cancel()
        for t in (run, replay):
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def test_captured_stream_with_a_hole_is_filled_by_the_captured_replay(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)  # the gap is the live stream's to find here
    async with connected(stand_in) as (source, norm):
        await asyncio.sleep(0.2)  # ZMQ subscriptions propagate after the connection event
        for i, f in enumerate(stand_in.frames):
            stand_in.sent.append(f)
            if not 8 <= i < 12:  # the hole: seq 8..11 never arrive live
                await stand_in.pub.send_multipart(f)
        await wait_for(lambda: source._last == len(stand_in.frames) - 1, 5, "every seq delivered")
        assert stand_in.replay_requests == [0, 8]
        assert source.stats.gaps == 1 and source.stats.replay_failures == 0
        assert source.stats.duplicates >= 1  # live seq 12.. arrived after the replay delivered them
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


@pytest.mark.parametrize(
    ("endpoint", "mode", "expected"),
    [
        ("tcp://*:5557", "auto", ("tcp://10.0.0.5:5557", False)),
        ("tcp://127.0.0.1:5557", "auto", ("tcp://127.0.0.1:5557", True)),
        ("ipc:///tmp/kv", "auto", ("ipc:///tmp/kv", False)),
        ("tcp://127.0.0.1:5557", "connect", ("tcp://127.0.0.1:5557", False)),
        ("tcp://*:5557", "bind", ("tcp://*:5557", True)),
    ],
)
def test_bind_or_connect_follows_vllms_rule_backwards(endpoint: str, mode: str, expected: tuple[str, bool]) -> None:
    assert resolve_endpoint(endpoint, mode, "10.0.0.5") == expected  # type: ignore[arg-type]
