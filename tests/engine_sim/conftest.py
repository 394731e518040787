"""Builders for engine_sim tests: sims on free ports, ZMQ subscribers, replay requests.

The vLLM captures are loaded by tests/protocol/vllm_captures.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from engine_sim import KVEventsConfig, SimConfig, SimServer


def sim_config(**changes: Any) -> SimConfig:
    """Small and fast by default: 100x speed, a small pool, events on free ports, topic as captured."""
    base = SimConfig(speedup=100.0, num_gpu_blocks=256, kv_events=KVEventsConfig.ephemeral("kv-events"))
    return base.replace(**changes) if changes else base


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with SimServer(sim_config()) as server:
        yield server


class Subscriber:
    """A SUB socket collecting raw multipart messages; `wait_for(n)` awaits n of them."""

    def __init__(self, endpoint: str, *, bind: bool = False, monitor: bool = False) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Attach the monitor before connecting, or the handshake event can be missed.
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) if monitor else None
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)
        self.messages: list[list[bytes]] = []

    async def wait_for(self, n: int, timeout: float = 5.0) -> list[list[bytes]]:
        async def fill() -> None:
            while len(self.messages) < n:
                self.messages.append(await self.sock.recv_multipart())

        await asyncio.wait_for(fill(), timeout)
        return self.messages[:n]

    async def drain(self, quiet: float = 0.2) -> list[list[bytes]]:
        """Everything that arrives until `quiet` seconds pass without a message."""
        while True:
            try:
                self.messages.append(await asyncio.wait_for(self.sock.recv_multipart(), quiet))
            except TimeoutError:
                return self.messages

    def close(self) -> None:
        self.sock.close(linger=0)


async def connected_subscriber(sim: SimServer) -> Subscriber:
    """A subscriber that provably receives: ZMQ drops what a PUB sends before the SUB joins, so
    wait until the sim's PUB has a peer (a dummy send would change seq; poll the monitor instead)."""
    assert sim.events_endpoint is not None
    sub = Subscriber(sim.events_endpoint, monitor=True)
    assert sub.monitor is not None
    try:
        await asyncio.wait_for(sub.monitor.recv_multipart(), 5)
    finally:
        sub.sock.disable_monitor()
        sub.monitor.close(linger=0)
    # The handshake is done on our side; give the PUB's subscription processing one beat.
    await asyncio.sleep(0.05)
    return sub


async def replay(endpoint: str, start_seq: int | bytes, timeout: float = 5.0) -> list[list[bytes]]:
    """DEALER request `["", start_seq]` (bytes: the seq frame as given); every reply up to and
    including the end marker."""
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        # Raw frames, not protocol's helpers: these tests check the sim's bytes independently.
        seq = start_seq if isinstance(start_seq, bytes) else start_seq.to_bytes(8, "big")
        await dealer.send_multipart([b"", seq])
        out: list[list[bytes]] = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), timeout)
            out.append(frames)
            if frames[2] == b"\xff" * 8:
                return out
    finally:
        dealer.close(linger=0)


def decode_payload(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload)


def events_of(messages: list[list[bytes]]) -> list[dict[str, Any]]:
    return [e for m in messages for e in decode_payload(m[2])[1]]
