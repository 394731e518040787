"""Sequence numbers, the ring buffer of published batches, and `{ns}.kvstate` replies.

One `EventLog` per (worker, epoch): `seal()` stamps the next seq (1, 2, ...) on a batch, folds it
into `digest` (so the digest is always as of `seq`) and keeps it, its hashes packed (the wire form,
protocol.packed), in a ring of at most `ring_size` batches and `ring_bytes` bytes (by `batch_bytes`),
the oldest leaving first. The bytes bound is what holds a shim's memory: by count alone, 4,096
batches of a 100k-token prompt's 6,250 hashes held 1.4 GB as lists of ints (audit of 2026-12-07).
`reply()` answers a KvStateRequest: the missed batches when the request names this epoch and the
ring still holds everything after `since_seq` (each of them fitting a chunk), else a full dump of
the canonical set as of the last sealed seq, parent-first.
Every chunk fits the connection's `max_payload` in encoded bytes: sized by upper bounds of what
msgpack spends (`event_bytes`, `batch_bytes`), never by a count of hashes.
`reply()` is synchronous in what it takes: the caller seals pending events and calls it without
awaiting in between, so a reply and its seq always agree. It takes the missed batches, or the dump's
copy of the set, at once, and builds the chunks as they are drawn, so a large dump can be sent in
pieces while the loop runs.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from protocol import Cleared, KvEvent, KvEventBatch, KvStateChunk, KvStateRequest, hash_count, pack_events
from worker_shim.kv_digest import KvDigest

__all__ = ["MIN_PAYLOAD", "NATS_PAYLOAD", "RING_BYTES", "RING_SIZE", "EventLog", "batch_bytes", "event_bytes"]

RING_SIZE = 4096
RING_BYTES = 64 << 20
"""The most bytes (batch_bytes) of batches a ring keeps, as the shim's other replay buffer does
(request_service's RECENT_BYTES): ~420 batches of 20k hashes (8.4 M blocks; kv_publisher's
MAX_HASHES), ~1,300 stores of a 100k-token prompt (6,250 blocks), all 4,096 batches of a few blocks.
A router further behind gets a dump instead, of the worker's cache alone: smaller than such a replay
(8 B a block either way) for any cache under 8.4 M blocks."""
# What msgpack (protocol.encode_msg) spends at most beside the variable parts, every field present:
# a KvStateChunk ~105 B and a KvEventBatch ~76 B besides their worker's name, a Stored ~53 B besides
# its medium's name (Removed and Cleared less); and 8 B a hash, packed (protocol.pack_chunk).
_CHUNK_BYTES = 128
_BATCH_BYTES = 96
_EVENT_BYTES = 64
_HASH_BYTES = 8
MIN_PAYLOAD = 4096
"""The least NATS max_payload a shim runs with: a kvstate chunk then holds ~480 hashes."""
NATS_PAYLOAD = 1 << 20  # nats-server's default max_payload


def event_bytes(ev: KvEvent) -> int:
    """At most what `ev` takes in an encoded batch, its hashes packed."""
    if isinstance(ev, Cleared):
        return _EVENT_BYTES
    medium = len(ev.medium.encode()) if ev.medium else 0
    return _EVENT_BYTES + medium + _HASH_BYTES * hash_count(ev.hashes)


def batch_bytes(worker: str, events: Iterable[KvEvent] = ()) -> int:
    """At most what a KvEventBatch of `worker` holding `events` takes encoded."""
    return _BATCH_BYTES + len(worker.encode()) + sum(event_bytes(ev) for ev in events)


class EventLog:
    def __init__(self, worker: str, epoch: int, ring_size: int = RING_SIZE, ring_bytes: int = RING_BYTES) -> None:
        self.worker = worker
        self.epoch = epoch
        self.seq = 0
        self.digest = KvDigest()
        self.held_bytes = 0
        """The batch_bytes of the batches in the ring: at most `ring_bytes`."""
        self._ring: deque[KvEventBatch] = deque()
        self._sizes: deque[int] = deque()  # batch_bytes of each batch in the ring
        self._max_batches = ring_size
        self._max_bytes = ring_bytes
        self._chunk_bytes = _CHUNK_BYTES + len(worker.encode())

    def batch_room(self, max_payload: int) -> int:
        """The most bytes a batch may take: it then fits a payload alone, and in a replay chunk, and
        the ring keeps it. By max_payload alone, a batch over ring_bytes (a payload raised past
        64 MiB, an 8.4 M-block Removed) evicted itself at seal and went unsent (review of 6edd5fc)."""
        return min(max_payload, self._max_bytes) - self._chunk_bytes

    def seal(self, events: list[KvEvent], ts: float | None = None, size: int | None = None) -> KvEventBatch:
        """The batch of `events`, its hashes packed. `size`: batch_bytes of the events, when the caller has it.
        Lists of hashes are read (by the digest) before they are packed: never unpacked here.
        Raises ValueError for a batch over ring_bytes: it would evict itself (batch_room bounds it)."""
        size = batch_bytes(self.worker, events) if size is None else size
        if size > self._max_bytes:
            raise ValueError(f"a batch of {size} B exceeds the ring's {self._max_bytes} B (split it: batch_room)")
        self.seq += 1
        self.digest.apply(events)
        batch = KvEventBatch(
            worker=self.worker,
            epoch=self.epoch,
            seq=self.seq,
            ts=time.time() if ts is None else ts,
            events=pack_events(events),
        )
        ring, sizes = self._ring, self._sizes
        ring.append(batch)
        sizes.append(size)
        self.held_bytes += size
        while ring and (len(ring) > self._max_batches or self.held_bytes > self._max_bytes):
            ring.popleft()
            self.held_bytes -= sizes.popleft()
        return batch

    @property
    def first_seq(self) -> int:
        """The seq of the oldest batch the ring holds (seq + 1 when it holds none)."""
        return self._ring[0].seq if self._ring else self.seq + 1

    def since(self, since_seq: int) -> list[KvEventBatch] | None:
        """Batches with seq > since_seq, or None when the ring no longer reaches back that far."""
        if since_seq >= self.seq:
            return []
        first = self.first_seq
        if first > since_seq + 1:
            return None
        return list(self._ring)[since_seq + 1 - first :]

    def reply(
        self, req: KvStateRequest, dump: Callable[[], Iterable[int]], max_payload: int = NATS_PAYLOAD
    ) -> Iterator[KvStateChunk]:
        """The chunks answering `req`, each at most `max_payload` bytes encoded (the connection's).
        `dump()` gives the canonical set parent-first (called only if needed, at once: it must take
        the set as it is now); the chunks are built as they are drawn. A missed batch too large for
        a chunk (the payload limit shrank since it was sealed) is answered with a dump."""
        room = max_payload - self._chunk_bytes  # a chunk's: the ring bounds what it holds already
        missed = self.since(req.since_seq) if req.epoch == self.epoch and req.since_seq >= 0 else None
        if missed is not None:
            sizes = list(self._sizes)[len(self._sizes) - len(missed) :]
            if all(size <= room for size in sizes):
                return self._batch_chunks(missed, sizes, self.seq, room)
        per_chunk = max(1, (max_payload - self._chunk_bytes) // _HASH_BYTES)
        return self._dump_chunks(iter(dump()), self.seq, per_chunk)

    def _batch_chunks(
        self, batches: list[KvEventBatch], sizes: list[int], seq: int, room: int
    ) -> Iterator[KvStateChunk]:
        index = 0
        cur: list[KvEventBatch] = []
        taken = 0
        for b, size in zip(batches, sizes, strict=True):
            if cur and taken + size > room:
                yield self._chunk(index, seq, batches=cur, final=False)
                index, cur, taken = index + 1, [], 0
            cur.append(b)
            taken += size
        yield self._chunk(index, seq, batches=cur, final=True)

    def _dump_chunks(self, hashes: Iterator[int], seq: int, per_chunk: int) -> Iterator[KvStateChunk]:
        index = 0
        cur = list(itertools.islice(hashes, per_chunk))
        for first in hashes:  # more follow: `cur` is not the final chunk
            yield self._chunk(index, seq, dump=True, hashes=cur, final=False)
            index += 1
            cur = [first, *itertools.islice(hashes, per_chunk - 1)]
        yield self._chunk(index, seq, dump=True, hashes=cur, final=True)

    def _chunk(
        self,
        index: int,
        seq: int,
        *,
        batches: list[KvEventBatch] | None = None,
        dump: bool = False,
        hashes: list[int] | None = None,
        final: bool,
    ) -> KvStateChunk:
        return KvStateChunk(
            worker=self.worker,
            epoch=self.epoch,
            seq=seq,
            batches=batches or [],
            dump=dump,
            hashes=hashes or [],
            chunk=index,
            final=final,
        )
