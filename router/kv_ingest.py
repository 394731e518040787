"""The async shell around the BlockIndex: KV event batches from {ns}.kv.* in, index updates out.

Ordering rules, per worker (DESIGN.md: (worker, epoch, seq) orders every event a shim sends):

- The index holds a worker's state as of (epoch, last_seq). A live batch with seq == last_seq + 1
  of that epoch is applied; seq <= last_seq is a duplicate and dropped; seq > last_seq + 1 opens a
  gap: live batches are held back and the missing ones are asked for on {ns}.kvstate.{worker}
  (`KvStateRequest{since_seq=last_seq, epoch}`). Another epoch means the shim restarted its
  numbering: that is repaired with a full dump.
- A reply carries either the missed batches (applied in order) or a full dump: the union of its
  chunks' hashes replaces the worker's entries and (epoch, last_seq) := (chunk.epoch, chunk.seq).
  Held-back batches after last_seq are then applied; if a gap remains, the repair repeats.
- A worker is bootstrapped (a full dump) when the registry adds it; until then, and while it
  repairs, its existing entries keep serving and every other worker routes as usual.
- Batches may race ahead of the etcd watch: a batch of a worker not (yet) added waits up to
  `unknown_ttl_s` for `add_worker`; a worker that never registers (or already left) has them
  dropped and counted. Workers are only ever added by the registry, never by a batch, so a
  worker whose key is gone cannot be resurrected by its last events in flight.
- A kvstate request that gets no answer (the shim is gone or slow) is retried with backoff while
  the worker stays registered.
- Malformed payloads are counted, logged once per worker and dropped; they never reach the index.

One task per repairing worker; the NATS subscription callback never awaits anything but itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import nats.errors
import nats.js.api
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from protocol import subjects
from protocol.errors import ProtocolError
from protocol.messages import KvEventBatch, KvStateChunk, KvStateRequest, decode_msg, encode_msg
from router.block_index import BlockIndex
from router.ingest_stats import IngestStats, SyncState, WorkerSync
from router.lifecycle import PartStatus

__all__ = ["KvIngest"]

log = logging.getLogger(__name__)
_NO_RESPONDERS = "503"  # the status header of the empty reply NATS sends when nobody subscribes


@dataclass(eq=False)
class _Worker:
    name: str
    sync: WorkerSync
    registered_epoch: int
    held: list[KvEventBatch] = field(default_factory=list)  # live batches awaiting a repair, arrival order
    want_dump: bool = True
    repair: asyncio.Task[None] | None = None


class KvIngest:
    """Keeps `index` equal to what every registered worker's shim holds.

    Owns its subscription and repair tasks, not the NATS connection. `stop()` is idempotent.
    """

    def __init__(
        self,
        nc: Client,
        ns: str,
        index: BlockIndex,
        *,
        request_timeout_s: float = 2.0,
        retry_max_s: float = 2.0,
        unknown_ttl_s: float = 5.0,
        held_limit: int = 10_000,
    ) -> None:
        self._nc = nc
        self._ns = subjects.validate_namespace(ns)
        self.index = index
        self.stats = IngestStats()
        self.status = PartStatus.NEW
        self._request_timeout_s = request_timeout_s
        self._retry_max_s = retry_max_s
        self._unknown_ttl_s = unknown_ttl_s
        self._held_limit = held_limit
        self._workers: dict[str, _Worker] = {}
        self._unknown: dict[str, deque[tuple[float, KvEventBatch]]] = {}
        self._malformed_logged: set[str] = set()
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._synced = asyncio.Event()
        self._synced.set()

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.status is not PartStatus.NEW:
            raise RuntimeError(f"KvIngest.start() called while {self.status.value}")
        self._sub = await self._nc.subscribe(subjects.kv_all(self._ns), cb=self._on_msg)
        self.status = PartStatus.RUNNING
        for worker in self._workers.values():
            self._start_repair(worker)

    async def stop(self) -> None:
        if self.status is PartStatus.STOPPED:
            return
        self.status = PartStatus.STOPPED
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):  # the connection may be draining or closed under us
                await sub.unsubscribe()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- the worker set (driven by the registry) -------------------------------------------------

    def add_worker(self, worker: str, epoch: int) -> None:
        """`worker` registered (or its record changed): bootstrap it if new, resync on a new epoch."""
        known = self._workers.get(worker)
        if known is not None:
            if epoch != known.registered_epoch:
                known.registered_epoch = epoch
                if known.sync.epoch != epoch and known.sync.state is SyncState.SYNCED:
                    self.stats.epoch_changes += 1
                    self._open_repair(known, dump=True)
            return
        sync = WorkerSync()
        state = _Worker(name=worker, sync=sync, registered_epoch=epoch)
        self._workers[worker] = state
        self.stats.workers[worker] = sync
        for _, batch in self._unknown.pop(worker, ()):
            state.held.append(batch)
        self.stats.unknown_held -= len(state.held)
        sync.buffered = len(state.held)
        self._synced.clear()
        if self.status is PartStatus.RUNNING:
            self._start_repair(state)

    def remove_worker(self, worker: str) -> None:
        """`worker` left: its entries go at once and its repair, if any, stops."""
        state = self._workers.pop(worker, None)
        self.stats.unknown_held -= len(self._unknown.pop(worker, ()))
        self.stats.workers.pop(worker, None)
        self.index.clear(worker)
        if state is not None and state.repair is not None:
            state.repair.cancel()
        self._refresh_synced()

    @property
    def synced(self) -> bool:
        """Every added worker bootstrapped, with no gap open."""
        return all(w.sync.state is SyncState.SYNCED for w in self._workers.values())

    async def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.synced:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._synced.wait(), left)
            except TimeoutError:
                return False
        return True

    def _refresh_synced(self) -> None:
        if self.synced:
            self._synced.set()
        else:
            self._synced.clear()

    # --- live batches ----------------------------------------------------------------------------

    async def _on_msg(self, msg: Msg) -> None:
        self._on_payload(msg.subject.rpartition(".")[2], msg.data)

    def _on_payload(self, subject_worker: str, data: bytes) -> None:
        """One payload from {ns}.kv.{subject_worker}: decode at the edge, then order and apply."""
        try:
            batch = decode_msg(data, KvEventBatch)
            if batch.worker != subject_worker:
                raise ProtocolError("KvEventBatch", f"names worker {batch.worker!r} on {subject_worker!r}'s subject")
        except ProtocolError as exc:
            self.stats.malformed += 1
            if subject_worker not in self._malformed_logged:
                self._malformed_logged.add(subject_worker)
                log.warning(
                    "dropping malformed KV events from worker %s (logged once per worker): %s", subject_worker, exc
                )
            return
        state = self._workers.get(batch.worker)
        if state is None:
            self._hold_unknown(batch)
            return
        sync = state.sync
        if sync.state is not SyncState.SYNCED:
            self._hold(state, batch)
        elif batch.epoch != sync.epoch:
            self.stats.epoch_changes += 1
            self._hold(state, batch)
            self._open_repair(state, dump=True)
        elif batch.seq <= sync.last_seq:
            self.stats.duplicates += 1
        elif batch.seq > sync.last_seq + 1:
            self.stats.gaps += 1
            self._hold(state, batch)
            self._open_repair(state, dump=False)
        else:
            self._apply(batch, sync)
            self.stats.last_lag_s = max(0.0, time.time() - batch.ts)

    def _apply(self, batch: KvEventBatch, sync: WorkerSync) -> None:
        self.index.apply(batch.worker, batch.events)
        sync.last_seq = batch.seq
        self.stats.batches_applied += 1
        self.stats.events_applied += len(batch.events)

    def _hold(self, state: _Worker, batch: KvEventBatch) -> None:
        if len(state.held) >= self._held_limit:
            # Too far behind to replay: drop what is held and let a full dump catch up instead.
            self.stats.dropped_overflow += len(state.held)
            state.held.clear()
            state.want_dump = True
        state.held.append(batch)
        state.sync.buffered = len(state.held)

    def _hold_unknown(self, batch: KvEventBatch) -> None:
        now = time.monotonic()
        self._expire_unknown(now)
        queue = self._unknown.get(batch.worker)
        if queue is None:
            queue = self._unknown[batch.worker] = deque()
        elif len(queue) >= self._held_limit:
            queue.popleft()
            self.stats.dropped_unknown += 1
            self.stats.unknown_held -= 1
        queue.append((now, batch))
        self.stats.unknown_held += 1

    def _expire_unknown(self, now: float) -> None:
        for worker in [w for w, q in self._unknown.items() if now - q[0][0] > self._unknown_ttl_s]:
            queue = self._unknown[worker]
            while queue and now - queue[0][0] > self._unknown_ttl_s:
                queue.popleft()
                self.stats.dropped_unknown += 1
                self.stats.unknown_held -= 1
            if not queue:
                del self._unknown[worker]

    # --- repair ------------------------------------------------------------------------------------

    def _open_repair(self, state: _Worker, *, dump: bool) -> None:
        state.sync.state = SyncState.REPAIRING
        state.want_dump = state.want_dump or dump
        self._synced.clear()
        if self.status is PartStatus.RUNNING:
            self._start_repair(state)

    def _start_repair(self, state: _Worker) -> None:
        if state.repair is not None and not state.repair.done():
            return
        task = asyncio.create_task(self._repair(state.name, state), name=f"kv-repair-{state.name}")
        state.repair = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _repair(self, worker: str, state: _Worker) -> None:
        delay = 0.05
        while self._workers.get(worker) is state:
            before = (state.sync.epoch, state.sync.last_seq)
            dump = state.want_dump
            request = KvStateRequest(
                since_seq=0 if dump else state.sync.last_seq, epoch=None if dump else state.sync.epoch
            )
            chunks = await self._request_state(worker, request)
            if self._workers.get(worker) is not state:
                return  # removed while we waited
            if chunks is not None:
                self._apply_state(worker, state, chunks)
                if self._drain_held(state):
                    state.sync.state = SyncState.SYNCED
                    state.sync.repairs += 1
                    self._refresh_synced()
                    return
                if (state.sync.epoch, state.sync.last_seq) != before:
                    delay = 0.05
                    continue  # progress: ask again at once for what is still missing
                state.want_dump = True  # the shim's replay did not move us on: take its full state
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._retry_max_s)

    async def _request_state(self, worker: str, request: KvStateRequest) -> list[KvStateChunk] | None:
        """Every chunk of one kvstate reply, or None (counted, logged) if it did not complete."""
        inbox = self._nc.new_inbox()
        chunks: list[KvStateChunk] = []
        sub: Subscription | None = None
        try:
            sub = await self._nc.subscribe(inbox)
            await self._nc.publish(subjects.kvstate(self._ns, worker), encode_msg(request), reply=inbox)
            while True:
                msg = await sub.next_msg(timeout=self._request_timeout_s)
                if not msg.data and msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
                    # The shim registered but has not subscribed yet (it starts up): not a bad reply.
                    self.stats.repair_timeouts += 1
                    log.info("kvstate of worker %s: nobody answers yet; retrying", worker)
                    return None
                chunk = decode_msg(msg.data, KvStateChunk)
                if chunk.chunk != len(chunks) or (chunks and chunk.epoch != chunks[0].epoch):
                    raise ProtocolError("KvStateChunk", f"chunk {chunk.chunk} out of order after {len(chunks)}")
                chunks.append(chunk)
                if chunk.final:
                    return chunks
        except TimeoutError:  # nats.errors.TimeoutError is one
            self.stats.repair_timeouts += 1
            log.info("kvstate of worker %s: no complete answer within %.1fs; retrying", worker, self._request_timeout_s)
        except ProtocolError as exc:
            self.stats.malformed += 1
            log.warning("kvstate of worker %s: bad reply (%s); retrying", worker, exc)
        except nats.errors.Error as exc:  # reconnecting, draining: try again later
            self.stats.repair_timeouts += 1
            log.warning("kvstate of worker %s: NATS error (%s); retrying", worker, exc)
        finally:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        return None

    def _apply_state(self, worker: str, state: _Worker, chunks: list[KvStateChunk]) -> None:
        sync = state.sync
        first = chunks[0]
        if first.dump:
            hashes: set[int] = set()
            for chunk in chunks:
                hashes.update(chunk.hashes)
            self.index.clear(worker)
            self.index.store(worker, hashes)
            sync.epoch, sync.last_seq = first.epoch, first.seq
            state.want_dump = False
            self.stats.repairs_dumps += 1
            return
        self.stats.repairs_batches += 1
        for chunk in chunks:
            for batch in chunk.batches:
                if batch.epoch != sync.epoch or batch.seq != sync.last_seq + 1:
                    continue  # not the next one: _drain_held sees the gap and the repair goes on
                self._apply(batch, sync)

    def _drain_held(self, state: _Worker) -> bool:
        """Apply held-back batches that follow last_seq. True when none is left waiting on a gap."""
        sync = state.sync
        held, state.held = state.held, []
        if held and held[-1].epoch != sync.epoch:
            # The latest batch is of another epoch than the state we hold: the shim restarted its
            # numbering meanwhile. Keep that epoch's batches and take a fresh dump.
            state.held = [b for b in held if b.epoch == held[-1].epoch]
            self.stats.dropped_stale += len(held) - len(state.held)
            sync.buffered = len(state.held)
            state.want_dump = True
            return False
        current = sorted((b for b in held if b.epoch == sync.epoch), key=lambda b: b.seq)
        self.stats.dropped_stale += len(held) - len(current)
        for i, batch in enumerate(current):
            if batch.seq <= sync.last_seq:
                self.stats.duplicates += 1
            elif batch.seq == sync.last_seq + 1:
                self._apply(batch, sync)
            else:
                state.held = current[i:]
                sync.buffered = len(state.held)
                return False
        sync.buffered = 0
        return True
