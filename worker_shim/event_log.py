"""Sequence numbers, the ring buffer of published batches, and `{ns}.kvstate` replies.

One `EventLog` per (worker, epoch): `seal()` stamps the next seq (1, 2, ...) on a batch, keeps it
in a ring of `ring_size` batches and folds it into `digest` (so the digest is always as of `seq`).
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

from protocol import Cleared, KvEvent, KvEventBatch, KvStateChunk, KvStateRequest, hash_count
from worker_shim.kv_digest import KvDigest

__all__ = ["MIN_PAYLOAD", "NATS_PAYLOAD", "RING_SIZE", "EventLog", "batch_bytes", "event_bytes"]

RING_SIZE = 4096
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
    def __init__(self, worker: str, epoch: int, ring_size: int = RING_SIZE) -> None:
        self.worker = worker
        self.epoch = epoch
        self.seq = 0
        self.digest = KvDigest()
        self._ring: deque[KvEventBatch] = deque(maxlen=ring_size)
        self._sizes: deque[int] = deque(maxlen=ring_size)  # batch_bytes of each batch in the ring
        self._chunk_bytes = _CHUNK_BYTES + len(worker.encode())

    def batch_room(self, max_payload: int) -> int:
        """The most bytes a batch may take: it then fits a payload alone, and in a replay chunk."""
        return max_payload - self._chunk_bytes

    def seal(self, events: list[KvEvent], ts: float | None = None, size: int | None = None) -> KvEventBatch:
        """`size`: batch_bytes of the events, when the caller has it."""
        self.seq += 1
        batch = KvEventBatch(
            worker=self.worker, epoch=self.epoch, seq=self.seq, ts=time.time() if ts is None else ts, events=events
        )
        self._ring.append(batch)
        self._sizes.append(batch_bytes(self.worker, events) if size is None else size)
        self.digest.apply(events)
        return batch

    def since(self, since_seq: int) -> list[KvEventBatch] | None:
        """Batches with seq > since_seq, or None when the ring no longer reaches back that far."""
        if since_seq >= self.seq:
            return []
        if not self._ring or self._ring[0].seq > since_seq + 1:
            return None
        first = self._ring[0].seq
        return list(self._ring)[since_seq + 1 - first :]

    def reply(
        self, req: KvStateRequest, dump: Callable[[], Iterable[int]], max_payload: int = NATS_PAYLOAD
    ) -> Iterator[KvStateChunk]:
        """The chunks answering `req`, each at most `max_payload` bytes encoded (the connection's).
        `dump()` gives the canonical set parent-first (called only if needed, at once: it must take
        the set as it is now); the chunks are built as they are drawn. A missed batch too large for
        a chunk (the payload limit shrank since it was sealed) is answered with a dump."""
        room = self.batch_room(max_payload)
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
