"""Prefix watches as async iterators: one Snapshot, then Put/Deleted changes, then (whenever the
watch must be made again: etcd restarted or compacted past it, a broken stream, a cancel) a fresh
Snapshot that replaces everything before it.

A value that does not parse is never handed on as a value: its key reads as absent (left out of
the Snapshot, a Put of it reported as Deleted), and the event says why (`Snapshot.skipped`,
`Deleted.why`), so a consumer can report the bad record rather than lose it without a trace. So is
a value too large for one read to carry, and, in a watch of leased records, a key held by no lease.

The prefix is read in pages (PAGE keys at most, fewer after a page too large for gRPC's 4 MiB
receive limit), all at the first page's revision: one unpaginated read of more than 4 MiB of values
failed for good, and the watch with it. A read that keeps failing is logged once per episode and
held in a `ReadHealth`, for a health check to name while the consumer holds a stale view."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

import grpc
from etcd3aio import Etcd3Client, EtcdError, EtcdUnauthenticatedError, prefix_range_end
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest, WatchResponse

from discovery.advice import CALL_FAILED, advice
from discovery.answer_deadline import StalledPast, answer_within
from discovery.lease import said
from discovery.next_pick import next_pick_wait
from protocol import subjects

__all__ = [
    "Deleted",
    "Put",
    "ReadHealth",
    "Snapshot",
    "WatchEvent",
    "keep_following",
    "read_retried",
    "watch_prefix",
]

log = logging.getLogger(__name__)
V = TypeVar("V")
T = TypeVar("T")
KeyValue: TypeAlias = Any  # etcd's mvccpb.KeyValue (generated, untyped): key, value, lease
PAGE = 256  # keys one read asks for: 256 worker records are ~0.5 MB, far below gRPC's 4 MiB
# A failing read is retried at double the delay each time (read_retried), up to this: a lease renews at 1 s too
# (discovery.lease.RETRY_MAX_S), and a worker set read later than that after etcd is back leaves
# the workers that registered anew unseen, their load reports dropped and requests refused.
READ_RETRY_MAX_S = 1.0
STALL_S = 5.0  # a read failing for longer is named (ReadHealth.trouble): an etcd restart takes less
READ_S = 5.0  # a read's wait for etcd's answer, each page's (_waits: less at first after a silent stream)
# What gRPC's client says of an answer over its receive limit (etcd says RESOURCE_EXHAUSTED too,
# for "too many requests", which a smaller page does not cure).
_TOO_LARGE = "larger than max"
NO_LEASE = (
    "it is held by no lease (put without one: by hand or by a tool), so it would outlive its owner: "
    "a record here lives exactly as long as its owner's lease"
)


class _Closed(Exception):
    """The etcd client was closed under a watch: it ends."""


class _Unconfirmed(Exception):
    """The read confirming a watch's created answer failed (why): the watch is made again at once."""


@contextlib.contextmanager
def _unless_closed(client: Etcd3Client) -> Iterator[None]:
    """A call cut by the client's close: gRPC cancels a closed channel's calls, a CancelledError in
    a task no one cancelled, which the watch's consumer would take for its own; _Closed instead."""
    try:
        yield
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if client.kv is None and task is not None and not task.cancelling():
            raise _Closed from None
        raise


class ReadHealth:
    """Whether a watch's read of its prefix is failing now, since when (`clock`) and why. While it
    fails the consumer holds what the watch yielded last (nothing before the first Snapshot);
    `trouble()` says so once it has lasted `after_s`, for a health check to name."""

    def __init__(self, after_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = STALL_S if after_s is None else after_s
        self.clock = clock
        self.since: float | None = None
        self.why = ""

    def trouble(self) -> str | None:
        """Once the read has failed for `after_s`: "reading it from etcd has failed for N s (why)";
        None while it works or has failed for less."""
        if self.since is None or (lasted := self.clock() - self.since) < self.after_s:
            return None
        return f"reading it from etcd has failed for {lasted:.0f} s ({self.why})"


# A watch asks etcd where it stands this often, and is made again when nothing came for SILENT_S:
# etcd's own progress notifications come every 10 minutes, and a hung member sends no error.
PROGRESS_S = 1.0
SILENT_S = 3.0
_PROGRESS = WatchRequest()
_PROGRESS.progress_request.SetInParent()  # an empty WatchProgressRequest


@dataclass(frozen=True, slots=True)
class Snapshot(Generic[V]):
    """Everything under the prefix as of `revision`; replaces whatever the consumer held."""

    items: dict[str, V]
    revision: int
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why its value did not parse
    created: dict[str, int] = field(default_factory=dict)  # name -> its key's create_revision (items')


@dataclass(frozen=True, slots=True)
class Put(Generic[V]):
    name: str
    value: V
    revision: int
    # its key's create_revision: the same on every watcher, and new when the key is created again (a
    # new lease); 0 in an event made by hand. The worker registry ranks workers by it (router.fleet_vote)
    created: int = 0


@dataclass(frozen=True, slots=True)
class Deleted:
    name: str
    revision: int
    why: str = ""  # set when the key is there but its new value did not parse: why


WatchEvent = Snapshot[V] | Put[V] | Deleted


async def watch_prefix(
    client: Etcd3Client,
    prefix: str,
    parse: Callable[[bytes], V],
    *,
    retry_s: float = 0.5,
    failed: Callable[[BaseException], None] = lambda exc: None,
    log_skipped: bool = True,
    exact: bool = False,
    leased: bool = False,
    health: ReadHealth | None = None,
    hurry: bool = True,
) -> AsyncGenerator[WatchEvent[V], None]:
    """Names are keys with the prefix cut off; a key that is not UTF-8 (anyone who may write
    under the prefix can put one) is named with its bad bytes escaped (`\\xff`), a name no id
    has, for the consumer to refuse. `parse` raises ValueError for a value to skip: the key reads
    as absent (a skipped Put is reported as Deleted, so a consumer never keeps a stale value) and
    the event says why; `log_skipped` logs each one naming its key (a consumer that reports them
    itself passes False). `exact`: watch the key `prefix` alone (named ""), not the keys under it.
    `leased`: a key held by no lease is skipped as a value that does not parse (NO_LEASE). `health`
    says while the read fails (ReadHealth). `hurry`: the read after a silent stream tries short
    waits first (_waits), where another member may answer; False for a client of one member, whose
    next pick is the hung one again (the short waits put the read's failure 8 s later).

    Survives etcd restarts, lost data and cancelled watches: whenever the watch has to be made
    again it reads the prefix anew and yields a fresh Snapshot, then watches from that read.
    Resuming from a revision is not enough: etcd back with less data (a lost data dir, a restore)
    has a lower revision, and a stream broken before etcd sent the changes it owed resumes past
    them (etcd3aio resumes after the revision etcd's answer carried, not after the last change).

    Ends (an INFO line) once the client is closed under it: until a review of 2026-12-08 the
    consumer got a CancelledError no one had asked for (gRPC cancels a closed channel's calls), or
    an AssertionError from the next read.
    """
    start = prefix.encode()
    end = start + b"\0" if exact else prefix_range_end(start)
    health = health if health is not None else ReadHealth()
    latest = 0  # the highest revision etcd has shown this watch: one lower means its data was replaced
    cancelled = ""  # why etcd cancelled the watch last, said once until a watch works again
    silent = False  # a watch went unanswered, said once until one is answered again
    unconfirmed = False  # the last watch broke as its confirming read failed (_went_back)
    while True:
        try:
            revision, kvs, too_large = await read_retried(
                _PagedRead(client, start, end, _waits((silent or unconfirmed) and hurry)),
                f"watch {prefix}",
                errors=(EtcdError, TimeoutError, grpc.aio.AioRpcError),
                first_s=retry_s,
                failed=failed,
                health=health,
            )
        except _Closed:
            log.info("watch %s: the etcd client was closed; the watch ends", prefix)
            return
        if revision < latest:
            log.warning(
                "watch %s: etcd's revision went back from %d to %d: its data was replaced (lost, or "
                "restored from a snapshot); what it holds now replaces all that was seen",
                prefix,
                latest,
                revision,
            )
        latest, unconfirmed = revision, False
        items: dict[str, V] = {}
        skipped: dict[str, str] = {}
        creations: dict[str, int] = {}
        for key, why in too_large.items():
            name = subjects.name_from_key(prefix, key)
            skipped[name] = _skipped(prefix, name, ValueError(why), log_skipped)
        for kv in kvs:
            name = subjects.name_from_key(prefix, kv.key)
            try:
                items[name] = _parsed(parse, kv, leased)
            except ValueError as exc:
                skipped[name] = _skipped(prefix, name, exc, log_skipped)
                continue
            creations[name] = kv.create_revision
        yield Snapshot(items, revision, skipped, creations)
        stream = _stream(client, start, end, revision + 1)
        try:
            async for wr in stream:
                if wr.compact_revision > 0:
                    log.warning(
                        "watch %s: etcd compacted its history to revision %d, past what this watch read; re-reading",
                        prefix,
                        wr.compact_revision,
                    )
                    break
                if wr.canceled:
                    reason = wr.cancel_reason or "no reason given"
                    # A refused token must be renewed before the watch is made again, or it is refused again.
                    failed(EtcdUnauthenticatedError(reason) if "auth token" in reason else EtcdError(reason))
                    if reason != cancelled:
                        log.error("watch %s: etcd cancelled it (%s); re-reading and watching again", prefix, reason)
                    cancelled = reason
                    break
                if silent:
                    log.info("watch %s: etcd answers again", prefix)
                    silent = False
                if wr.created:
                    # etcd's revision went back since the read: changes may be missed.
                    if wr.header.revision < latest and await _went_back(client, start, latest, failed):
                        log.info("watch %s: made again; re-reading", prefix)
                        break
                    if cancelled:
                        log.info("watch %s: etcd takes the watch again", prefix)
                    cancelled = ""
                latest = max(latest, wr.header.revision)
                for ev in wr.events:
                    name = subjects.name_from_key(prefix, ev.kv.key)
                    rev = ev.kv.mod_revision
                    if ev.type == ev.DELETE:
                        yield Deleted(name, rev)
                        continue
                    try:
                        value = _parsed(parse, ev.kv, leased)
                    except ValueError as exc:
                        yield Deleted(name, rev, _skipped(prefix, name, exc, log_skipped))
                        continue
                    yield Put(name, value, rev, ev.kv.create_revision)
        except StalledPast as exc:
            # Its re-waits spent by a stall of this process: etcd's answers may wait unread, so it
            # re-reads, but the silence is not etcd's (until a review of 2026-12-07 it was said so).
            log.info(
                "watch %s: this process was stalled %.1fs or more as etcd's answer came due (not etcd); "
                "re-reading and watching again",
                prefix,
                exc.stalled_s,
            )
        except TimeoutError:
            # A hung member (stopped, not closed) keeps the stream open and silent: no error comes.
            if not silent:
                log.warning("watch %s: no answer from etcd in %.0fs; re-reading and watching again", prefix, SILENT_S)
            silent = True
        except (EtcdError, grpc.aio.AioRpcError) as exc:
            failed(exc)
            log.warning("watch %s: %s; re-reading", prefix, said(exc))
        except _Unconfirmed as exc:
            # No sleep, short waits: the member the read went to may be hung, the next pick not.
            log.info("watch %s: made again, as %s; re-reading at once", prefix, exc)
            unconfirmed = True
            continue
        except _Closed:
            log.info("watch %s: the etcd client was closed; the watch ends", prefix)
            return
        finally:
            await stream.aclose()
        await asyncio.sleep(retry_s)


async def _stream(client: Etcd3Client, start: bytes, end: bytes, revision: int) -> AsyncGenerator[WatchResponse, None]:
    """etcd's answers to one watch from `revision`, asking where it stands every PROGRESS_S;
    TimeoutError once none comes in SILENT_S of its waking time (StalledPast where a stall of this
    process spent it: discovery.answer_deadline). Closing it ends the gRPC stream at once. Unlike
    etcd3aio's watch, a broken stream is not made again here (after a backoff of up to 5 s, from a
    revision past changes it may have missed): the caller reads anew and watches again."""

    async def requests() -> AsyncGenerator[WatchRequest, None]:
        yield WatchRequest(create_request=WatchCreateRequest(key=start, range_end=end, start_revision=revision))
        while True:
            await asyncio.sleep(PROGRESS_S)
            yield _PROGRESS

    service = client.watch
    if service is None:
        raise _Closed
    call = service._stub.Watch(requests(), metadata=service._metadata or None)
    answers = aiter(call)
    what = f"watch {start.decode(errors='backslashreplace')}"
    try:
        while True:
            try:
                # The read alone, never the consumer's work; a stall of this process is not etcd's.
                async with answer_within(SILENT_S, what):
                    with _unless_closed(client):
                        answer = await anext(answers)
            except StopAsyncIteration:
                return
            yield answer
    finally:
        call.cancel()


async def _went_back(client: Etcd3Client, key: bytes, latest: int, failed: Callable[[BaseException], None]) -> bool:
    """Whether etcd's revision is below `latest` now, by a linearizable read. A watch's created
    answer below it most often comes from a member a few ms behind the one the read asked, whose
    watch still brings every change once it catches up: before a review of 2026-12-08 that was
    taken for data replaced, re-read and a second Snapshot (20 of 150 watches, 3 members under
    puts). The watch passes nothing on meanwhile, so the read tries a silent stream's re-read's
    short waits (_waits), SILENT_S in all at most, where its full 5 s wait on a hung member held
    the changes back 5 s and more (review of 2026-12-08); _Unconfirmed once it fails (re-reading is safe)."""
    kv = client.kv
    if kv is None:
        raise _Closed
    left, tries = SILENT_S, 0
    for wait in _waits(True):
        if wait > left:
            break
        left, tries = left - wait, tries + 1
        try:
            with _unless_closed(client):
                resp = await kv.get(key, count_only=True, timeout=wait)
        except TimeoutError:
            continue
        except (EtcdError, grpc.aio.AioRpcError) as exc:
            failed(exc)
            raise _Unconfirmed(f"the read confirming etcd's revision failed ({said(exc)})") from exc
        return bool(resp.header.revision < latest)
    raise _Unconfirmed(f"the read confirming etcd's revision went unanswered ({tries} tries, {SILENT_S - left:.2f} s)")


async def read_retried(
    read: Callable[[], Awaitable[T]],
    what: str,
    *,
    errors: tuple[type[BaseException], ...],
    first_s: float = 0.5,
    advise: bool = False,
    failed: Callable[[BaseException], None] = lambda exc: None,
    health: ReadHealth | None = None,
) -> T:
    """`read()`, a read from etcd, until it answers. A failure (one of `errors`) is said once per
    episode at WARNING, `<what>: reading it failed (<why>); retrying, said again once it works`,
    and at INFO once it works again; told to `failed`, held in `health`, and retried after a delay
    that doubles from `first_s` up to READ_RETRY_MAX_S. Why is the etcd call's error (the one a
    DiscoveryError was raised from), with what to do about it (discovery.advice) where `advise`."""
    health = health if health is not None else ReadHealth()
    delay = first_s
    while True:
        try:
            got = await read()
        except errors as exc:
            failed(exc)
            call = exc if isinstance(exc, CALL_FAILED) or exc.__cause__ is None else exc.__cause__
            health.why = said(call)
            if health.since is None:
                health.since = health.clock()
                hint = f": {to_do}" if advise and (to_do := advice(exc)) else ""
                log.warning("%s: reading it failed (%s%s); retrying, said again once it works", what, health.why, hint)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max(READ_RETRY_MAX_S, first_s))
            continue
        if health.since is not None:
            log.info("%s: reading it works again, after %.1f s", what, health.clock() - health.since)
            health.since, health.why = None, ""
        return got


def _waits(hurried: bool) -> Iterator[float]:
    """Each try's wait for etcd's answer to a page: READ_S; after a silent stream (`hurried`), first
    the short waits of a lease's stream after one went unanswered (discovery.next_pick), the silent
    stream the first call left unanswered: its member may be hung and still take the balancer's
    pick, which the channel's other calls (a router's other watches and reads) move round. There the
    read waited out READ_S, the change it brought seen 8 s late (review of 2026-12-07)."""
    given_up, wait = 1, SILENT_S
    while hurried and (wait := next_pick_wait(given_up, wait, READ_S)) < READ_S:
        yield wait
        given_up += 1
    yield from itertools.repeat(READ_S)


class _PagedRead:
    """read_retried's read of [start, end): (revision, keys, keys left out -> why), as of the first
    page's revision, in pages of PAGE keys at most, each given the wait of `waits` now (the next
    after a page times out). A page that times out is asked again, at that revision: at once after
    a short wait (the next pick may be another member), else on read_retried's next call. Until a
    review of 2026-12-07 the read began again at page 1, and one of 3 pages or more went to a hung
    member on a channel balanced round 3 at every try: it never came whole. Any other failure
    begins it again (etcd may have compacted past the revision, or lost it). After a page too large
    for gRPC's receive limit, one key at a time, doubling after each page that fits; a value too
    large even alone is left out, with why."""

    def __init__(self, client: Etcd3Client, start: bytes, end: bytes, waits: Iterator[float]) -> None:
        self.client, self.start, self.end, self.waits = client, start, end, waits
        self.wait = next(waits)
        self._begin()

    def _begin(self) -> None:
        self.revision, self.key, self.limit = 0, self.start, PAGE
        self.kvs: list[KeyValue] = []
        self.too_large: dict[bytes, str] = {}

    async def __call__(self) -> tuple[int, list[KeyValue], dict[bytes, str]]:
        while True:
            try:
                with _unless_closed(self.client):
                    return await self._pages()
            except TimeoutError:
                timed_out, self.wait = self.wait, next(self.waits)
                if timed_out >= READ_S:
                    raise
            except Exception:
                self._begin()
                raise

    async def _pages(self) -> tuple[int, list[KeyValue], dict[bytes, str]]:
        kv = self.client.kv
        if kv is None:
            raise _Closed
        while True:
            try:
                resp = await kv.get(self.key, self.end, revision=self.revision, limit=self.limit, timeout=self.wait)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or _TOO_LARGE not in (exc.details() or ""):
                    raise
                if self.limit > 1:
                    self.limit = 1
                    continue
                # The next key's value alone is over the limit: name it from a read of its key alone.
                resp = await kv.get(
                    self.key, self.end, revision=self.revision, limit=1, keys_only=True, timeout=self.wait
                )
                self.revision = self.revision or resp.header.revision
                if not resp.kvs:  # deleted before the first page pinned a revision
                    return self.revision, self.kvs, self.too_large
                big = resp.kvs[0].key
                self.too_large[big] = f"its value is too large for one read ({said(exc)})"
                self.key = big + b"\0"
                continue
            self.revision = self.revision or resp.header.revision
            self.kvs.extend(resp.kvs)
            if not resp.more or not resp.kvs:
                return self.revision, self.kvs, self.too_large
            self.key = resp.kvs[-1].key + b"\0"
            self.limit = min(self.limit * 2, PAGE)


def _parsed(parse: Callable[[bytes], V], kv: KeyValue, leased: bool) -> V:
    value = parse(kv.value)  # first: a value that does not parse says so, leased or not
    if leased and not kv.lease:
        raise ValueError(NO_LEASE)
    return value


async def keep_following(
    follow: Callable[[], Awaitable[None]],
    what: str,
    *,
    first_s: float = 0.5,
    max_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run `follow()`, a consumer of a watch, for good: should it raise, log an ERROR with the
    traceback and run it again after a backoff that doubles from `first_s` up to `max_s` (back to
    `first_s` after a run that lasted `max_s`). A new watch starts with a Snapshot that replaces
    whatever the consumer held, so a crash costs the time until then, not the watch for good."""
    delay = first_s
    while True:
        started = clock()
        try:
            await follow()
            return
        except Exception as exc:
            delay = first_s if clock() - started >= max_s else delay
            log.error("%s crashed; watching again in %.1f s", what, delay, exc_info=exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_s)


def _skipped(prefix: str, name: str, exc: ValueError, say: bool) -> str:
    why = str(exc) or type(exc).__name__
    if say:
        log.warning("watch %s: ignoring the value under key %r: %s", prefix, name, why)
    return why
