"""Publishes canonical KV events on `{ns}.kv.{worker}` and answers `{ns}.kvstate.{worker}`.

Coalescing: events wait at most `COALESCE_S` (5 ms) or until `MAX_EVENTS` (256) events,
`MAX_HASHES` hashes or the bytes of a NATS payload are pending, then become one KvEventBatch with
the next seq. Batches leave in seq order from one task, their hashes packed (protocol.packed).
Sizes are in encoded bytes, from the connection's `max_payload` (worker_shim.event_log): a batch
fits a payload alone and in a replay chunk; an event too large for one is split.
A kvstate request first seals what is pending, then takes its reply (the missed batches, or a copy
of the normaliser's set) without awaiting, so a dump is exactly the state as of its seq; the
chunks are then built and sent one by one, the loop running between them (a dump of millions of
blocks takes about a second to order). A reply NATS refuses as over its payload limit (the server
changed under the connection) is answered with a dump instead when nothing of it went out yet.

Pace: batches go at most as fast as worker_shim.kv_pace allows (half a router's default KV budget,
protocol.kv_budget), so a registration's snapshot of a warm cache, sealed at once, goes out over
seconds (~5.5 s for 13 MiB) and never reads as a flood; the loop runs while a batch waits. Live
events wait behind it (the outbox is in seq order). stop() drops what the pace holds, but for the
epoch's closing Cleared.

Outbox: batches sealed but not yet handed to NATS wait in seq order, those the EventLog's ring still
holds (at most RING_SIZE batches and RING_BYTES bytes: a kvstate request can fetch no older batch
anyway), so it costs no memory beyond the ring's. While NATS takes nothing (a stalled server: nats-py
blocks each publish once its buffer is full, and notices the stall only minutes later), the oldest
are dropped as sent and failed, counted in send_failures and said once per outage: subscribers see
the seq gap and repair. Before 2026-12-06 the outbox grew without a bound or a word (8.5 GB in 90 s
of a stalled server under a heavy event rate). Sealed batches hold their hashes packed: they are
encoded as they are.

Digest: each batch carries, from its seal, the KvDigest as of its seq; once the batch has been
handed to NATS, `digest()` returns that one. NATS keeps one connection's messages in order, so a
LoadReport carrying it reaches a router after the batch it names.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError

from protocol import (
    Cleared,
    ConfigError,
    KvEvent,
    KvEventBatch,
    KvStateRequest,
    ProtocolError,
    Removed,
    Stored,
    decode_msg,
    encode_msg,
    hash_count,
    pack_chunk,
    subjects,
    unpack_hashes,
)
from runtime import background, cancel_and_wait
from worker_shim.event_log import MIN_PAYLOAD, EventLog, batch_bytes, event_bytes
from worker_shim.kv_pace import KvPace
from worker_shim.normaliser import Normaliser

__all__ = ["COALESCE_S", "MAX_EVENTS", "KvDigestAt", "KvPublisher", "PublisherCounters", "check_payload"]

log = logging.getLogger(__name__)
COALESCE_S = 0.005
MAX_EVENTS = 256
MAX_HASHES = 20_000


def check_payload(max_payload: int, servers: list[str]) -> None:
    """ConfigError unless the NATS server's max_payload leaves room for useful kvstate chunks."""
    if max_payload < MIN_PAYLOAD:
        raise ConfigError(
            "nats_servers",
            servers,
            f"the server's max_payload is {max_payload} bytes, under the {MIN_PAYLOAD} a shim needs for its "
            "KV state replies: raise max_payload in the nats-server configuration",
        )


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
    kvstate_failures: int = 0  # replies NATS refused (counted once each, not as batches or dumps)
    # Requests dropped unanswered, by kind (the metric's `reply`): `malformed` (no KvStateRequest),
    # `no_reply` (no reply subject to answer on); each kind logged once.
    malformed: Counter[str] = field(default_factory=Counter)


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
        on_crash: Callable[[], None] = lambda: None,
        pace: KvPace | None = None,
    ) -> None:
        self.nc = nc
        self.pace = pace or KvPace()
        self.on_crash = on_crash  # its task crashed (said at ERROR): the shim counts it
        self.subject = subjects.kv(ns, worker)
        self.log = EventLog(worker, epoch)
        self.normaliser = normaliser
        self.counters = counters or PublisherCounters()
        self._published = KvDigestAt(epoch, 0, 0, 0)
        self._failing_since: int | None = None  # the first batch NATS refused, while it refuses them
        self._pending: list[KvEvent] = []
        self._pending_hashes = 0
        self._empty_batch = batch_bytes(worker)
        self._pending_bytes = self._empty_batch
        self._outbox: deque[tuple[KvEventBatch, KvDigestAt]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = asyncio.Event()  # set by stop(): a batch the pace holds is not waited for

    def start(self) -> None:
        if self._task is None:
            self._task = background(
                self._run(),
                f"kv-publisher-{self.log.worker}",
                f"no KV event of worker id {self.log.worker} is published: the shim ends the session if it is "
                "the current id (a new one registers); an old id in its re-registration grace serves on without "
                "its KV stream until the grace ends",
                self.on_crash,
            )

    @property
    def task(self) -> asyncio.Task[None] | None:
        """Its loop, from start() until stop() (which alone ends it): the shim ends the session should
        it end before (runtime.ended), as its KV stream is frozen otherwise."""
        return self._task

    async def stop(self, timeout: float = 5.0) -> None:
        """Seal and send what is pending, then stop; safe to call twice.

        What the pace holds back is dropped instead (counted as send failures, said in one WARNING),
        but for the final batch when it ends with `Cleared` (the shim's end of its epoch), sent
        unpaced: a stop right after a registration's snapshot waited out its pace (5 s, then
        cancelled before the Cleared went: final review of 2026-12-07). The epoch ends, so what was
        dropped is moot: its routers drop the worker, or start again from the next epoch's Cleared.

        The task is asked to finish rather than cancelled: a publish cancelled mid-flush can leave
        nats-py waiting on a flush that never comes. Cancel only if it does not finish in time.
        """
        task, self._task = self._task, None
        if task is None:
            return
        self.seal()
        self._closing = True
        self._closed.set()
        self._wake.set()
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            log.warning("KV publisher did not drain within %.0fs: %d batches unsent", timeout, len(self._outbox))
            await cancel_and_wait(task)

    def add(self, events: list[KvEvent]) -> None:
        """Queue events; a batch is sealed before it would pass MAX_EVENTS, MAX_HASHES or the bytes
        a batch may take (EventLog.batch_room), so a large addition (a whole cache's snapshot at
        registration) becomes several batches that each fit a NATS payload; an event larger than a
        batch may take is split."""
        if not events:
            return
        room = self.log.batch_room(self.nc.max_payload)
        for event in events:
            size = event_bytes(event)
            for ev in (event,) if self._empty_batch + size <= room else self._split(event, room):
                if ev is not event:
                    size = event_bytes(ev)
                n = hash_count(ev.hashes) if isinstance(ev, Stored | Removed) else 1
                pending = self._pending
                if pending and (
                    len(pending) >= MAX_EVENTS
                    or self._pending_hashes + n > MAX_HASHES
                    or self._pending_bytes + size > room
                ):
                    self.seal()
                self._pending.append(ev)
                self._pending_hashes += n
                self._pending_bytes += size
        if len(self._pending) >= MAX_EVENTS or self._pending_hashes >= MAX_HASHES:
            self.seal()
        self._wake.set()

    def _split(self, ev: KvEvent, room: int) -> list[KvEvent]:
        """`ev` as events of as many hashes as a batch of one may take (one at least); a Stored
        piece's parent is the last hash of the piece before."""
        if not isinstance(ev, Stored | Removed):
            return [ev]
        hashes = unpack_hashes(ev.hashes)
        framing = event_bytes(ev) - 8 * len(hashes)
        per = max(1, (room - self._empty_batch - framing) // 8)
        pieces = [hashes[i : i + per] for i in range(0, len(hashes), per)]
        if isinstance(ev, Removed):
            return [msgspec.structs.replace(ev, hashes=p) for p in pieces]
        parents = [ev.parent] + [p[-1] for p in pieces[:-1]]
        return [msgspec.structs.replace(ev, hashes=p, parent=q) for p, q in zip(pieces, parents, strict=True)]

    def digest(self) -> KvDigestAt:
        """The digest as of the last batch handed to NATS."""
        return self._published

    def seal(self) -> None:
        if self._pending:
            log_ = self.log
            batch = log_.seal(self._pending, size=self._pending_bytes)
            outbox = self._outbox
            outbox.append((batch, KvDigestAt(log_.epoch, batch.seq, log_.digest.blocks, log_.digest.xor)))
            while outbox and outbox[0][0].seq < log_.first_seq:
                dropped, _ = outbox.popleft()
                self._failed(dropped.seq, "NATS takes nothing, or batches come faster than their pace: the oldest "
                             "unsent batch was dropped")  # fmt: skip
            self._pending = []
            self._pending_hashes = 0
            self._pending_bytes = self._empty_batch

    def _failed(self, seq: int, why: str) -> None:
        self.counters.send_failures += 1
        if self._failing_since is None:  # once per outage, as response chunks: a line per batch flooded
            self._failing_since = seq
            log.warning(
                "publishing KV batch %d failed (%s); subscribers will repair. Batches go unsent until "
                "NATS takes them again (kvswitch_shim_kv_publish_failures_total)",
                seq,
                why,
            )

    async def _send_outbox(self) -> None:
        while self._outbox:
            batch, digest = self._outbox.popleft()
            data = encode_msg(batch)
            if not await self.pace.wait(len(data), self._closed):
                self._outbox.appendleft((batch, digest))
                await self._send_closing()
                return
            await self._publish(batch, digest, data)

    async def _send_closing(self) -> None:
        """stop() came while the pace held the outbox: drop it, but for a final batch ending with
        Cleared, sent unpaced."""
        final = self._outbox.pop() if isinstance(self._outbox[-1][0].events[-1], Cleared) else None
        dropped = len(self._outbox)
        if dropped:
            self.counters.send_failures += dropped
            log.warning(
                "KV publisher of worker %s stopping with %d batches the pace held (seq %d to %d): dropped "
                "(kvswitch_shim_kv_publish_failures_total); %s",
                self.log.worker,
                dropped,
                self._outbox[0][0].seq,
                self._outbox[-1][0].seq,
                "its epoch's Cleared sent" if final is not None else "its epoch ends without a Cleared",
            )
            self._outbox.clear()
        if final is not None:
            batch, digest = final
            await self._publish(batch, digest, encode_msg(batch))

    async def _publish(self, batch: KvEventBatch, digest: KvDigestAt, data: bytes) -> None:
        try:
            await self.nc.publish(self.subject, data)
            self.counters.batches += 1
        except NatsError as exc:
            # The batch stays in the ring: subscribers see the seq gap (or the digest) and repair.
            self._failed(batch.seq, str(exc))
        else:
            if self._failing_since is not None:
                log.info("NATS takes KV batches again from %d (unsent from %d)", batch.seq, self._failing_since)
                self._failing_since = None
        self._published = digest

    async def _run(self) -> None:
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            if self._pending and not self._outbox and not self._closing:
                await asyncio.sleep(COALESCE_S)
            self.seal()
            await self._send_outbox()

    def _malformed(self, kind: str, what: str) -> None:
        self.counters.malformed[kind] += 1
        if self.counters.malformed[kind] == 1:  # anyone who may publish there can send any number
            log.warning('%s (logged once; counted in kvswitch_shim_kvstate_requests_total{reply="%s"})', what, kind)

    async def on_kvstate(self, msg: Msg) -> None:
        if not msg.reply:
            self._malformed("no_reply", f"kvstate request on {msg.subject} without a reply subject: dropped")
            return
        try:
            req = decode_msg(msg.data, KvStateRequest)
        except ProtocolError as exc:
            self._malformed("malformed", f"ignoring malformed kvstate request: {exc}")
            return
        for request in (req, KvStateRequest()):  # the second, a dump: NATS refused the first whole
            self.seal()
            sent, dump = 0, False
            try:
                for chunk in self.log.reply(request, self.normaliser.dump_lazily, self.nc.max_payload):
                    await self.nc.publish(msg.reply, encode_msg(pack_chunk(chunk)))
                    sent, dump = sent + 1, chunk.dump
                    await asyncio.sleep(0)  # building the next chunk of a dump takes a while: let the loop run
            except NatsError as exc:
                self.counters.kvstate_failures += 1
                again = isinstance(exc, MaxPayloadError) and not sent and request is req
                log.warning(
                    "answering a kvstate request failed after %d chunks (%s); %s",
                    sent,
                    exc,
                    "answering with a full dump" if again else "the router will ask again",
                )
                if again:
                    continue
                return
            if dump:
                self.counters.kvstate_dumps += 1
            else:
                self.counters.kvstate_batches += 1
            return
