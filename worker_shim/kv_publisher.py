"""Publishes canonical KV events on `{ns}.kv.{worker}` and answers `{ns}.kvstate.{worker}`.

Coalescing: events wait at most `COALESCE_S` (5 ms) or until `MAX_EVENTS` (256) events or
`MAX_HASHES` hashes are pending, then become one KvEventBatch with the next seq. Batches leave in
seq order from one task, their hashes packed (protocol.packed). A kvstate request first seals what
is pending, then builds its reply from the ring or the normaliser's dump without awaiting, so the
dump is exactly the state as of its seq.

Digest: each batch carries, from its seal, the KvDigest as of its seq; once the batch has been
handed to NATS, `digest()` returns that one. NATS keeps one connection's messages in order, so a
LoadReport carrying it reaches a router after the batch it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass

from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from protocol import (
    KvEvent,
    KvEventBatch,
    KvStateRequest,
    ProtocolError,
    Removed,
    Stored,
    decode_msg,
    encode_msg,
    pack_batch,
    pack_chunk,
    subjects,
)
from runtime import background
from worker_shim.event_log import EventLog
from worker_shim.normaliser import Normaliser

__all__ = ["COALESCE_S", "MAX_EVENTS", "KvDigestAt", "KvPublisher", "PublisherCounters"]

log = logging.getLogger(__name__)
COALESCE_S = 0.005
MAX_EVENTS = 256
MAX_HASHES = 20_000


@dataclass(slots=True, frozen=True)
class KvDigestAt:
    """The digest of (epoch, seq): `blocks` distinct hashes held, XOR `xor` (LoadReport's kv_* fields)."""

    epoch: int
    seq: int
    blocks: int
    xor: int


@dataclass(slots=True)
class PublisherCounters:
    """Counts over every KvPublisher of a shim (one per registration), for /metrics."""

    batches: int = 0
    send_failures: int = 0
    kvstate_batches: int = 0
    kvstate_dumps: int = 0
    malformed_requests: int = 0


class KvPublisher:
    """Owns the EventLog of one (worker, epoch). `add()` is synchronous; `start()`/`stop()` own the task."""

    def __init__(
        self,
        nc: Nats,
        ns: str,
        worker: str,
        epoch: int,
        normaliser: Normaliser,
        counters: PublisherCounters | None = None,
    ) -> None:
        self.nc = nc
        self.subject = subjects.kv(ns, worker)
        self.log = EventLog(worker, epoch)
        self.normaliser = normaliser
        self.counters = counters or PublisherCounters()
        self._published = KvDigestAt(epoch, 0, 0, 0)
        self._pending: list[KvEvent] = []
        self._pending_hashes = 0
        self._outbox: deque[tuple[KvEventBatch, KvDigestAt]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        if self._task is None:
            self._task = background(
                self._run(),
                f"kv-publisher-{self.log.worker}",
                "no KV event is published until the shim's next session (an engine restart or a new lease)",
            )

    async def stop(self, timeout: float = 5.0) -> None:
        """Seal and send what is pending, then stop; safe to call twice.

        The task is asked to finish rather than cancelled: a publish cancelled mid-flush can leave
        nats-py waiting on a flush that never comes. Cancel only if it does not finish in time.
        """
        task, self._task = self._task, None
        if task is None:
            return
        self.seal()
        self._closing = True
        self._wake.set()
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            log.warning("KV publisher did not drain within %.0fs: %d batches unsent", timeout, len(self._outbox))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def add(self, events: list[KvEvent]) -> None:
        """Queue events; a batch is sealed before it would pass MAX_EVENTS or MAX_HASHES, so a large
        addition (a whole cache's snapshot at registration) becomes several batches that each fit a
        NATS payload."""
        if not events:
            return
        pending = self._pending
        for ev in events:
            n = len(ev.hashes) if isinstance(ev, Stored | Removed) else 1
            if pending and (len(pending) >= MAX_EVENTS or self._pending_hashes + n > MAX_HASHES):
                self.seal()
                pending = self._pending
            pending.append(ev)
            self._pending_hashes += n
        if len(pending) >= MAX_EVENTS or self._pending_hashes >= MAX_HASHES:
            self.seal()
        self._wake.set()

    def digest(self) -> KvDigestAt:
        """The digest as of the last batch handed to NATS."""
        return self._published

    def seal(self) -> None:
        if self._pending:
            log_ = self.log
            batch = log_.seal(self._pending)
            self._outbox.append((batch, KvDigestAt(log_.epoch, batch.seq, log_.digest.blocks, log_.digest.xor)))
            self._pending = []
            self._pending_hashes = 0

    async def _send_outbox(self) -> None:
        while self._outbox:
            batch, digest = self._outbox.popleft()
            try:
                await self.nc.publish(self.subject, encode_msg(pack_batch(batch)))
                self.counters.batches += 1
            except NatsError as exc:
                # The batch stays in the ring: subscribers see the seq gap (or the digest) and repair.
                self.counters.send_failures += 1
                log.warning("publishing KV batch %d failed (%s); subscribers will repair", batch.seq, exc)
            self._published = digest

    async def _run(self) -> None:
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            if self._pending and not self._outbox and not self._closing:
                await asyncio.sleep(COALESCE_S)
            self.seal()
            await self._send_outbox()

    async def on_kvstate(self, msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            req = decode_msg(msg.data, KvStateRequest)
        except ProtocolError as exc:
            self.counters.malformed_requests += 1
            log.warning("ignoring malformed kvstate request: %s", exc)
            return
        self.seal()
        chunks = self.log.reply(req, self.normaliser.dump)
        if chunks[0].dump:
            self.counters.kvstate_dumps += 1
        else:
            self.counters.kvstate_batches += 1
        for chunk in chunks:
            await self.nc.publish(msg.reply, encode_msg(pack_chunk(chunk)))
