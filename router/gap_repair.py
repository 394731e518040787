"""Gap repair: asking a worker's shim for its KV state until the index agrees with it again.

The worker is the authority on its own state (DESIGN.md amendments): whatever the router saw (a
gap, an unknown epoch, an impossible seq, a digest that disagrees), one `{ns}.kvstate.{worker}`
request settles it. The reply says where the shim stands, (epoch, seq), and carries either the
missed batches or a full dump; the ingest applies it and drops whatever contradicts it.

One loop per worker that needs repair, owned here:

    while the ingest says the worker needs repair:
        request = ingest.repair_request(worker)      # since_seq, or a full dump
        chunks = fetch(request)                      # every chunk, or None on failure
        ingest.repair_reply(...) or ingest.repair_failed(...)

Waiting: each chunk may take `request_timeout_s` after the one before, and the first one that
again per `BLOCKS_PER_WAIT` (2 M) blocks the worker's shim last said it holds (`reply_size`, its
load reports' `kv_blocks`): 6 s for 4 M blocks at the defaults. A shim copies its set and orders
it as it sends (worker_shim.event_log), and may be answering another router's dump first (about a
second per 4 M blocks). The whole reply may take `fetch_timeout_s` plus that first-chunk
allowance, plus `request_timeout_s` per `BLOCKS_PER_WAIT` dump blocks received. A reply that
never starts is a timeout, whatever the wait.
Failures (no responder yet, timeout, a reply that does not decode, NATS errors, this router's
replies in flight at their byte limit: FailureKind, each counted by the ingest) back off
exponentially from `retry_min_s` to `retry_max_s`. A failed decode asks for a full dump next,
never the same `since_seq` again; so does a timeout (a replay that cannot reach this router, e.g.
over its NATS payload limit, must not be asked for again and again). So does a reply that breaks
the bounds of one worker's answer: a batch naming another worker (it would rewrite that worker's
entries), a dump of more blocks than the worker can hold (`RepairTarget.reply_limit`), more bytes
than such a dump needs, or no final chunk in the whole reply's time (an endless reply, each chunk
within the per-chunk timeout, would hold the repair and grow memory without end). The third
consecutive failure of a worker is logged as an ERROR naming it, and then at most every
`error_every_s` while it keeps failing; success after an ERROR is logged too. Each of these lines
names at most NAMED_AT_MOST workers per window, the rest counted in one summary
(router.fleet_lines), but a worker an ERROR named is named when it succeeds; when more than half
of the workers being repaired fail alike (of one kind: timed out, no responders, a malformed
reply, a NATS error, whatever each one's wait), the summary says the cause is likely shared (NATS
permissions on the kvstate subject, or the shims not answering) rather than any one worker's.
Meanwhile only that worker is out of routing (router.eligibility), never the fleet.

A loop that crashes (a bug: the target's or this module's code raised) is counted as a failure of
kind `crashed` and logged as an ERROR with its traceback, naming the worker and that it stays out of
routing: per worker at most every `error_every_s` (with how many more), and as one of the few workers
a FleetLines names per window. While the worker still needs repair, a new loop starts at once and
waits before its first request, from `retry_min_s` doubling to `crash_retry_max_s` (30 s) with each
crash in a row (reset by a loop that ends without one), each wait up to `CRASH_JITTER` longer at
random. A gap seen meanwhile finds that loop running and does not cut its wait short, which would
bypass the backoff. Nothing else would start it, since a worker that is not synced holds its batches
and has its digests ignored, so a one-off crash would leave it out of routing until it registered
anew. A crash asks for a full dump next (router.kv_ingest), so a bug that crashes every round costs
each worker it hits one full dump per router every 30 s at most; capped at `retry_max_s` (2 s) as
failed requests are, R routers asked each such worker for R/2 full dumps a second, for as long as
the bug lasted (review of 2026-12-06). The jitter spreads routers that crash alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import nats.errors
import nats.js.api
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from protocol import check_hashes, hash_count, subjects
from protocol.errors import ProtocolError
from protocol.messages import KvStateChunk, KvStateRequest, decode_msg, encode_msg
from router.fleet_lines import FleetEpisodes, FleetLines, FleetLog
from runtime import Throttle, cancel_and_wait

__all__ = ["BLOCKS_PER_WAIT", "CRASH_JITTER", "LIMIT_HINT", "FailureKind", "FetchFailure", "GapRepair", "RepairTarget"]

log = logging.getLogger(__name__)
_NO_RESPONDERS = "503"  # the status header of the empty reply NATS sends when nobody subscribes
ERROR_AFTER = 3
# A reply's byte budget: per block of reply_limit (a msgpack u64 takes 9 B, packed 8; replayed
# batches add their events' framing), and at least this much, so a replay of small batches fits.
_REPLY_BYTES_PER_BLOCK = 32
_MIN_REPLY_BYTES = 64 << 20
_REPLIES_BYTES_LIMIT = 1 << 30
# A crashed loop's retry waits up to this fraction longer, at random: routers that one bug hits
# alike would otherwise ask the same workers for their dumps in step.
CRASH_JITTER = 0.2
BLOCKS_PER_WAIT = 1 << 21  # a dump's blocks a shim copies, orders and sends in far less than 2 s
# What an operator does for an honest worker past its bound (router.kv_ingest): said with the refusal.
LIMIT_HINT = (
    "if the worker is honest (a CPU or disk KV tier holds more than its GPU blocks), "
    "raise the router's --index-limit-per-worker"
)


class _OverCapacity(ProtocolError):
    """A dump of more blocks than the worker's index bound: an honest offload tier, most often."""


class FailureKind(enum.StrEnum):
    """What failed in a kvstate request, without what varies by worker (a timeout's wait grows with
    the blocks its shim holds): for judging whether workers fail alike, and for the failures' metric
    (its `kind` label is the member's name, lowercased)."""

    TIMED_OUT = "timed out"  # no reply, or chunks that stopped: the shim, or NATS between
    NO_RESPONDERS = "no responders"  # nobody subscribes to the worker's kvstate subject
    MALFORMED = "malformed reply"  # a reply that does not decode, or breaks one worker's bounds
    NATS_ERROR = "NATS error"  # this router's connection (reconnecting, draining)
    BYTE_LIMIT = "this router's replies in flight at their byte limit"  # this router's own budget
    OVER_CAPACITY = "a dump past the worker's index bound"  # an offload tier past --index-limit-per-worker
    CRASHED = "a crash of this router's repair loop"  # a bug: its ERROR line has the traceback

    @property
    def label(self) -> str:
        return self.name.lower()


class FetchFailure(Exception):
    """A kvstate request that got no complete, valid answer, and what failed (`kind`)."""

    def __init__(self, why: str, *, kind: FailureKind) -> None:
        self.kind = kind
        super().__init__(why)


class RepairTarget(Protocol):
    """What the loop drives (router.kv_ingest.KvIngest)."""

    def needs_repair(self, worker: str) -> bool: ...
    def repair_request(self, worker: str) -> KvStateRequest: ...
    def reply_limit(self, worker: str) -> int: ...  # the most blocks a dump of the worker may carry
    def reply_size(self, worker: str) -> int: ...  # the blocks the worker's shim last said it holds
    def repair_reply(self, worker: str, chunks: list[KvStateChunk]) -> None: ...
    def repair_failed(self, worker: str, failure: FetchFailure) -> None: ...


@dataclass
class _Loop:
    task: asyncio.Task[None]
    failures: int = 0
    last_error_log: float = field(default=-1e18)
    last_failure: str = ""  # of the failures in a row, the last one's why
    last_kind: FailureKind | None = None  # and its FetchFailure.kind


class GapRepair:
    def __init__(
        self,
        nc: Client,
        ns: str,
        target: RepairTarget,
        *,
        request_timeout_s: float = 2.0,
        fetch_timeout_s: float = 30.0,
        retry_min_s: float = 0.05,
        retry_max_s: float = 2.0,
        crash_retry_max_s: float = 30.0,
        error_every_s: float = 30.0,
        max_in_flight: int = 32,
        replies_bytes_limit: int = _REPLIES_BYTES_LIMIT,
        clock: Callable[[], float] = time.monotonic,
        fleet_log: FleetLog | None = None,
    ) -> None:
        self._nc = nc
        self._ns = ns
        self._target = target
        self.request_timeout_s = request_timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.crash_retry_max_s = crash_retry_max_s
        self.error_every_s = error_every_s
        self._clock = clock
        self._loops: dict[str, _Loop] = {}
        # A replica bootstrapping 1,000 workers at once would ask for 1,000 dumps together: NATS
        # then cuts it off as a slow consumer. At most this many replies are in flight.
        self._in_flight = asyncio.Semaphore(max_in_flight)
        # Each reply is bounded on its own (`_ReplyBudget`); together, the replies in flight hold at
        # most `replies_bytes_limit` beside the first one's: max_in_flight replies of the largest
        # budget would otherwise be tens of GiB.
        self.replies_bytes_limit = replies_bytes_limit
        self.reply_bytes = 0  # what the replies in flight hold now
        # A shared cause (every kvstate request unanswered) was one line per worker per failure.
        self._retry_lines = FleetLines(
            log, logging.INFO, self._shared("kvstate requests failed; retrying"), clock=clock, fleet_log=fleet_log
        )
        self._error_lines = FleetLines(
            log,
            logging.ERROR,
            self._shared(
                "KV state cannot be repaired; each stays out of routing until a request on its kvstate "
                "subject gets a complete answer"
            ),
            clock=clock,
            fleet_log=fleet_log,
        )
        self._recovered_lines = FleetLines(
            log,
            logging.WARNING,
            f"KV repair succeeded after {ERROR_AFTER} or more failures",
            clock=clock,
            fleet_log=fleet_log,
        )
        # an ERROR, then the success: a worker named failing is named succeeding (kept while its loop is)
        self._episodes = FleetEpisodes(self._error_lines, self._recovered_lines)
        self._crash_lines = FleetLines(
            log,
            logging.ERROR,
            "their KV repair crashed (a bug in this router: the workers named have its traceback); each stays out "
            "of routing",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._crash_said = Throttle(error_every_s, clock)  # per worker, until it leaves
        # per worker whose loop crashed while it needed repair: the wait after its next crash (until a
        # loop of it ends without crashing, or it leaves); the waiting loop itself is in _loops
        self._crash_waits: dict[str, float] = {}

    def ensure(self, worker: str) -> None:
        """Run the worker's repair loop unless it runs already."""
        loop = self._loops.get(worker)
        if loop is not None and not loop.task.done():
            return
        self._start(worker, 0.0)

    def _start(self, worker: str, first_wait: float) -> None:
        task = asyncio.create_task(self._run(worker, first_wait), name=f"kv-repair-{worker}")
        self._loops[worker] = _Loop(task)
        task.add_done_callback(functools.partial(self._done, worker))

    def cancel(self, worker: str) -> None:
        self._crash_said.forget(worker)
        self._crash_waits.pop(worker, None)
        loop = self._loops.pop(worker, None)
        if loop is not None:
            loop.task.cancel()
            self._episodes.forget(worker)

    def failures(self, worker: str) -> int:
        loop = self._loops.get(worker)
        return loop.failures if loop is not None else 0

    def last_failure(self, worker: str) -> FailureKind | None:
        """How `worker`'s last kvstate request failed, while its requests fail in a row; else None."""
        loop = self._loops.get(worker)
        return loop.last_kind if loop is not None and loop.failures else None

    async def stop(self) -> None:
        for worker in self._loops:
            self._episodes.forget(worker)
        loops, self._loops = list(self._loops.values()), {}
        await cancel_and_wait(*(loop.task for loop in loops))

    def _done(self, worker: str, task: asyncio.Task[None]) -> None:
        loop = self._loops.get(worker)
        owned = loop is not None and loop.task is task  # not cancelled, nor stopped, nor replaced since
        if owned:
            del self._loops[worker]
            self._episodes.forget(worker)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self._crash_waits.pop(worker, None)
            return
        self._target.repair_failed(worker, FetchFailure(f"the repair loop crashed: {exc!r}", kind=FailureKind.CRASHED))
        retry = ""
        if owned and self._target.needs_repair(worker):
            base = self._crash_waits.get(worker, self.retry_min_s)
            self._crash_waits[worker] = min(base * 2, self.crash_retry_max_s)
            wait = base * random.uniform(1.0, 1.0 + CRASH_JITTER)
            self._start(worker, wait)
            retry = f"; retried in {wait:.3g}s, the wait doubling to {self.crash_retry_max_s:g}s while it crashes"
        said = self._crash_said(worker)
        if said is None:
            return
        held, ago = said
        self._crash_lines.say(
            worker,
            "KV repair of worker %s crashed%s (a bug in this router); it stays out of routing until a repair of it "
            "succeeds%s",
            worker,
            f" again, {held + 1} times in {ago:.0f}s" if held else "",
            retry,
            exc_info=exc,
        )

    async def _run(self, worker: str, first_wait: float) -> None:
        if first_wait:  # a crashed loop's successor: its crash backoff
            await asyncio.sleep(first_wait)
        delay = self.retry_min_s
        while self._target.needs_repair(worker):
            loop = self._loops[worker]
            try:
                chunks = await self.fetch(worker, self._target.repair_request(worker))
            except FetchFailure as failure:
                loop.failures += 1
                self._target.repair_failed(worker, failure)
                self._log_failure(worker, loop, failure)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            if loop.failures >= ERROR_AFTER:
                self._episodes.ended(
                    worker, "KV repair of worker %s succeeded after %d failures", worker, loop.failures
                )
            loop.failures = 0
            delay = self.retry_min_s
            self._target.repair_reply(worker, chunks)

    def _log_failure(self, worker: str, loop: _Loop, failure: FetchFailure) -> None:
        now = self._clock()
        loop.last_failure, loop.last_kind = str(failure), failure.kind
        if loop.failures >= ERROR_AFTER and now - loop.last_error_log >= self.error_every_s:
            loop.last_error_log = now
            self._episodes.began(
                worker,
                "KV state of worker %s cannot be repaired (%d failures in a row, last: %s); it stays out of "
                "routing until a request on %s gets a complete answer (%s)",
                worker,
                loop.failures,
                failure,
                subjects.kvstate(self._ns, worker),
                # no responders: the shim's log may be clean, its NATS another than this router's
                "nobody subscribes to it on this router's NATS: is its shim running, and on this NATS?"
                if failure.kind is FailureKind.NO_RESPONDERS
                else "see its shim's log",
            )
        else:
            self._retry_lines.say(worker, "kvstate of worker %s: %s; retrying", worker, failure)

    def _shared(self, cause: str) -> Callable[[int], str]:
        """A summary's cause, judged when it is said: when more than half of the workers being
        repaired fail alike, the cause is likely one for all of them, not each worker's shim. Alike:
        of one kind (FetchFailure.kind), not one text: a fleet of hung shims of several sizes times
        out after several waits."""

        def judged(held: int) -> str:
            alike = Counter(loop.last_kind for loop in self._loops.values() if loop.failures and loop.last_kind)
            if not alike:
                return cause
            kind, failing = alike.most_common(1)[0]
            if failing * 2 <= len(self._loops):
                return cause
            why = next(loop.last_failure for loop in self._loops.values() if loop.failures and loop.last_kind == kind)
            return (
                f"{cause}; {failing} of the {len(self._loops)} workers being repaired fail alike ({kind}, e.g. "
                f"{why}): the cause is likely shared, not any one worker's: {self._shared_cause(kind)}"
            )

        return judged

    def _shared_cause(self, kind: FailureKind) -> str:
        """What a fleet failing alike by `kind` most likely shares: only a reply that never comes
        points at NATS or the shims; a byte limit is this router's own, a malformed reply a build's."""
        match kind:
            case FailureKind.BYTE_LIMIT:
                return (
                    "this router repairing more workers at once than its replies in flight may hold; each is "
                    "retried as they drain"
                )
            case FailureKind.MALFORMED:
                return "the shims answer in a form this router cannot read (another kvswitch build? docs/deployment.md)"
            case FailureKind.OVER_CAPACITY:
                return f"KV tiers larger than this router's index bound per worker ({LIMIT_HINT})"
            case FailureKind.NATS_ERROR:
                return "this router's NATS connection (its log says how)"
            case FailureKind.CRASHED:  # never shared so (a crashed loop's successor has no failures); for the match
                return "a bug in this router's repair loop (its traceback is in this log)"
            case FailureKind.TIMED_OUT | FailureKind.NO_RESPONDERS:
                return f"NATS permissions on {subjects.kvstate_all(self._ns)}, or the workers' shims not answering"

    async def fetch(self, worker: str, request: KvStateRequest) -> list[KvStateChunk]:
        """Every chunk of one kvstate reply, in order; FetchFailure otherwise."""
        async with self._in_flight:
            return await self._fetch(worker, request)

    async def _fetch(self, worker: str, request: KvStateRequest) -> list[KvStateChunk]:
        inbox = self._nc.new_inbox()
        chunks: list[KvStateChunk] = []
        sub: Subscription | None = None
        limit = self._target.reply_limit(worker)
        budget = _ReplyBudget(limit, max(_MIN_REPLY_BYTES, _REPLY_BYTES_PER_BLOCK * limit))
        per_block = self.request_timeout_s / BLOCKS_PER_WAIT  # see the module docstring
        # For the first chunk, by what the worker holds, not what it may: a hung shim holding a
        # few blocks must not keep a repair slot for the time a 64 M-block dump may take.
        slack = per_block * self._target.reply_size(worker)
        start = self._clock()
        deadline = start + self.fetch_timeout_s + slack
        wait = self.request_timeout_s + slack
        held = 0  # of self.reply_bytes, this reply's
        try:
            sub = await self._nc.subscribe(inbox)
            await self._nc.publish(subjects.kvstate(self._ns, worker), encode_msg(request), reply=inbox)
            while True:
                left = deadline - self._clock()
                if left <= 0:
                    raise _endless(deadline - start) if chunks else TimeoutError
                wait = self.request_timeout_s + (0.0 if chunks else slack)
                msg = await sub.next_msg(timeout=min(wait, left))
                if not msg.data and msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
                    raise FetchFailure("nobody answers (the shim may be starting)", kind=FailureKind.NO_RESPONDERS)
                budget.take_bytes(len(msg.data))
                if self.reply_bytes > held and self.reply_bytes + len(msg.data) > self.replies_bytes_limit:
                    raise FetchFailure(
                        f"the replies in flight hold {self.reply_bytes} bytes already; later",
                        kind=FailureKind.BYTE_LIMIT,
                    )
                self.reply_bytes += len(msg.data)
                held += len(msg.data)
                chunk = decode_msg(msg.data, KvStateChunk)
                _check_chunk(worker, chunk, len(chunks), chunks[0].epoch if chunks else chunk.epoch)
                deadline += per_block * budget.take_blocks(chunk)
                chunks.append(chunk)
                if chunk.final:
                    return chunks
        except TimeoutError:  # nats.errors.TimeoutError is one
            if chunks and self._clock() >= deadline:  # chunks that never end; no chunk at all is a timeout
                raise _endless(deadline - start) from None
            seen = f"{len(chunks)} chunks, then none" if chunks else "no reply"
            raise FetchFailure(f"{seen} within {wait:.1f}s", kind=FailureKind.TIMED_OUT) from None
        except _OverCapacity as exc:
            raise FetchFailure(f"bad reply: {exc}", kind=FailureKind.OVER_CAPACITY) from None
        except ProtocolError as exc:
            raise FetchFailure(f"bad reply: {exc}", kind=FailureKind.MALFORMED) from None
        except nats.errors.Error as exc:  # reconnecting, draining: try again later
            raise FetchFailure(f"NATS error: {exc}", kind=FailureKind.NATS_ERROR) from None
        finally:
            self.reply_bytes -= held
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()


def _endless(seconds: float) -> FetchFailure:
    return FetchFailure(f"bad reply: no final chunk within {seconds:g}s", kind=FailureKind.MALFORMED)


def _check_chunk(worker: str, chunk: KvStateChunk, index: int, epoch: int) -> None:
    """ProtocolError unless `chunk` is the next chunk of `worker`'s own reply."""
    if chunk.worker != worker:
        raise ProtocolError("KvStateChunk", f"names worker {chunk.worker!r}, asked {worker!r}")
    if chunk.chunk != index or chunk.epoch != epoch:
        raise ProtocolError("KvStateChunk", f"chunk {chunk.chunk} out of order after {index}")
    # The ingest applies a batch to the worker it asked, but a batch naming another one is no part
    # of this worker's state: the reply is forged or broken, and the next request asks for a dump.
    other = next((b.worker for b in chunk.batches if b.worker != worker), None)
    if other is not None:
        raise ProtocolError("KvStateChunk", f"carries a batch of worker {other!r}, asked {worker!r}")
    try:  # a bad dump would otherwise fail in the index, outside this backoff
        check_hashes(chunk.hashes)
    except ValueError as exc:
        raise ProtocolError("KvStateChunk", str(exc)) from None


@dataclass
class _ReplyBudget:
    """What one reply may still take: `blocks` dump hashes (more than the worker can hold is no
    honest state) and `bytes` on the wire (the chunks are kept until the final one)."""

    blocks: int
    bytes: int

    def take_bytes(self, n: int) -> None:
        self.bytes -= n
        if self.bytes < 0:
            raise ProtocolError("KvStateChunk", "the reply is larger than any state the worker can hold")

    def take_blocks(self, chunk: KvStateChunk) -> int:
        """The chunk's dump blocks."""
        n = hash_count(chunk.hashes)
        self.blocks -= n
        if self.blocks < 0:
            raise _OverCapacity("KvStateChunk", f"the dump holds more blocks than the worker can hold; {LIMIT_HINT}")
        return n
