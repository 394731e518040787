"""The ZMQ side of KV events, as vLLM's ZmqEventPublisher behaves (frames: protocol/vllm_events.py).

- PUB socket: each batch is one multipart message; seq starts at 0 per engine start and grows by
  one per batch. The socket binds or connects by vLLM's rule (`publisher_binds`). Messages sent
  before a subscriber connects are lost (ZMQ PUB semantics), which is what replay is for.
- ROUTER replay socket (always bound): answers a replay request with every buffered batch from
  its start seq on (payload bytes identical to the live ones), then the end marker. A request
  of another frame count is ignored, as vLLM ignores it; a seq frame of any length is read
  big-endian, as vLLM reads it.
- `drop_event_fraction` (a fault knob) skips the PUB send of that fraction of batches, evenly
  spaced (F = 0.01: every 100th batch) so tests that need drops always get them; the dropped
  batches still take a seq and stay in the replay buffer, like batches lost on the network.

`NullEventPublisher` accepts and discards, for engines with events off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Protocol

import zmq
import zmq.asyncio

from engine_sim.config import KVEventsConfig
from protocol.errors import ProtocolError
from protocol.vllm_events import (
    REPLAY_END,
    KVEvent,
    decode_replay_request,
    encode_batch,
    encode_seq,
    replay_reply,
)
from runtime import background, cancel_and_wait

__all__ = ["EventPublisher", "NullEventPublisher", "ZmqEventPublisher"]

log = logging.getLogger("engine_sim.events")


def _subscriber_address(last_endpoint: str) -> str:
    """What a subscriber on this machine connects to for a socket bound at `last_endpoint`."""
    return last_endpoint.replace("0.0.0.0", "127.0.0.1").replace("[::]", "127.0.0.1")


class EventPublisher(Protocol):
    seq: int
    drop_fraction: float

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def publish(self, events: list[KVEvent]) -> None: ...

    @property
    def endpoint(self) -> str | None: ...

    @property
    def replay_endpoint(self) -> str | None: ...


class NullEventPublisher:
    def __init__(self) -> None:
        self.seq = 0
        self.drop_fraction = 0.0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def publish(self, events: list[KVEvent]) -> None:
        self.seq += 1

    @property
    def endpoint(self) -> str | None:
        return None

    @property
    def replay_endpoint(self) -> str | None:
        return None


class ZmqEventPublisher:
    """Owns its PUB and ROUTER sockets and the replay task; `stop()` closes all of them."""

    def __init__(
        self,
        config: KVEventsConfig,
        *,
        form: str = "map",
        data_parallel_rank: int = 0,
        drop_fraction: float = 0.0,
        binds: bool,
    ) -> None:
        """`binds`: whether the PUB binds, vLLM's rule on the endpoint as first given (a restart
        rebinds the port a wildcard chose, which the endpoint it names no longer says)."""
        self.config = config
        self.binds = binds
        self.form = form
        self.data_parallel_rank = data_parallel_rank
        self.drop_fraction = drop_fraction
        self.seq = 0
        self.sent = 0
        self.dropped = 0
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, config.buffer_steps))
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._endpoint: str | None = None
        self._replay_endpoint: str | None = None
        self._drop_credit = 0.0  # accumulates drop_fraction per batch; a whole unit drops one

    @property
    def endpoint(self) -> str | None:
        """Where a subscriber goes: connect here if the PUB bound, bind here if it connected."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    async def start(self) -> None:
        actx = zmq.asyncio.Context.instance()
        # PUB sends never block (ZMQ drops at the high-water mark), so a plain socket on the same
        # context serves it from the step loop without a future per send.
        pub: zmq.Socket[bytes] = zmq.Context.shadow(actx.underlying).socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        ep = self.config.endpoint
        if self.binds:
            await _bind_retrying(pub, ep)
            self._endpoint = _subscriber_address(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        else:
            pub.connect(ep)
            self._endpoint = ep
        self._pub = pub
        if self.config.replay_endpoint:
            router = actx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            await _bind_retrying(router, self.config.replay_endpoint)
            self._replay_endpoint = _subscriber_address(router.getsockopt_string(zmq.LAST_ENDPOINT))
            self._router = router
            self._replay_task = background(
                self._serve_replay(router), "kv-replay", "the engine answers no replay request until it restarts"
            )

    async def stop(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            await cancel_and_wait(task)  # a crash was said when it happened
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    def publish(self, events: list[KVEvent]) -> None:
        seq = self.seq
        self.seq += 1
        payload = encode_batch(time.time(), events, form=self.form, data_parallel_rank=self.data_parallel_rank)
        self._buffer.append((seq, payload))
        if self._pub is None:
            return
        if self.drop_fraction:
            self._drop_credit += self.drop_fraction
            if self._drop_credit >= 1.0:
                self._drop_credit -= 1.0
                self.dropped += 1
                return
        try:
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            identity, *request = await router.recv_multipart()
            try:
                start_seq = decode_replay_request(request)
            except ProtocolError as exc:
                log.debug("ignoring replay request: %s", exc)
                continue
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart([identity, *replay_reply(self._topic, seq, payload)])
            await router.send_multipart([identity, *REPLAY_END])


async def _bind_retrying(sock: zmq.Socket[bytes] | zmq.asyncio.Socket, endpoint: str) -> None:
    """Bind, retrying briefly: after a restart the port a closed socket held frees asynchronously."""
    for attempt in range(40):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt == 39:
                raise
            await asyncio.sleep(0.05)
