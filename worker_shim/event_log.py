"""Sequence numbers, the ring buffer of published batches, and `{ns}.kvstate` replies.

One `EventLog` per (worker, epoch): `seal()` stamps the next seq (1, 2, ...) on a batch, keeps it
in a ring of `ring_size` batches and folds it into `digest` (so the digest is always as of `seq`).
`reply()` answers a KvStateRequest: the missed batches when the request names this epoch and the
ring still holds everything after `since_seq`, else a full dump of the canonical set as of the
last sealed seq, parent-first, in chunks that fit a NATS payload.
Synchronous: the caller seals pending events and builds the reply without awaiting in between, so a
dump and its seq always agree.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from protocol import KvEvent, KvEventBatch, KvStateChunk, KvStateRequest, Removed, Stored
from worker_shim.kv_digest import KvDigest

__all__ = ["DUMP_CHUNK_HASHES", "RING_SIZE", "EventLog"]

RING_SIZE = 4096
DUMP_CHUNK_HASHES = 20_000  # 20k msgpack uint64s ~ 180 kB, well under NATS's 1 MB default payload
_REPLY_CHUNK_HASHES = 20_000


def _weight(batch: KvEventBatch) -> int:
    return 1 + sum(len(e.hashes) if isinstance(e, Stored | Removed) else 1 for e in batch.events)


class EventLog:
    def __init__(self, worker: str, epoch: int, ring_size: int = RING_SIZE) -> None:
        self.worker = worker
        self.epoch = epoch
        self.seq = 0
        self.digest = KvDigest()
        self._ring: deque[KvEventBatch] = deque(maxlen=ring_size)

    def seal(self, events: list[KvEvent], ts: float | None = None) -> KvEventBatch:
        self.seq += 1
        batch = KvEventBatch(
            worker=self.worker, epoch=self.epoch, seq=self.seq, ts=time.time() if ts is None else ts, events=events
        )
        self._ring.append(batch)
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

    def reply(self, req: KvStateRequest, dump: Callable[[], Sequence[int]]) -> list[KvStateChunk]:
        """The chunks answering `req`; `dump()` gives the canonical set parent-first (called only if needed)."""
        missed = self.since(req.since_seq) if req.epoch == self.epoch and req.since_seq >= 0 else None
        if missed is not None:
            return self._batch_chunks(missed)
        return self._dump_chunks(dump())

    def _batch_chunks(self, batches: list[KvEventBatch]) -> list[KvStateChunk]:
        chunks: list[KvStateChunk] = []
        cur: list[KvEventBatch] = []
        weight = 0
        for b in batches:
            w = _weight(b)
            if cur and weight + w > _REPLY_CHUNK_HASHES:
                chunks.append(self._chunk(len(chunks), batches=cur, final=False))
                cur, weight = [], 0
            cur.append(b)
            weight += w
        chunks.append(self._chunk(len(chunks), batches=cur, final=True))
        return chunks

    def _dump_chunks(self, hashes: Sequence[int]) -> list[KvStateChunk]:
        n = max(1, -(-len(hashes) // DUMP_CHUNK_HASHES))
        return [
            self._chunk(
                i,
                dump=True,
                hashes=list(hashes[i * DUMP_CHUNK_HASHES : (i + 1) * DUMP_CHUNK_HASHES]),
                final=i == n - 1,
            )
            for i in range(n)
        ]

    def _chunk(
        self,
        index: int,
        *,
        batches: list[KvEventBatch] | None = None,
        dump: bool = False,
        hashes: list[int] | None = None,
        final: bool,
    ) -> KvStateChunk:
        return KvStateChunk(
            worker=self.worker,
            epoch=self.epoch,
            seq=self.seq,
            batches=batches or [],
            dump=dump,
            hashes=hashes or [],
            chunk=index,
            final=final,
        )
