"""Prefix watches as async iterators: one Snapshot, then Put/Deleted changes, then (whenever the
watch must be made again: etcd restarted or compacted past it, a broken stream, a cancel) a fresh
Snapshot that replaces everything before it.

A value that does not parse is never handed on as a value: its key reads as absent (left out of
the Snapshot, a Put of it reported as Deleted), and the event says why (`Snapshot.skipped`,
`Deleted.why`), so a consumer can report the bad record rather than lose it without a trace."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

import grpc
from etcd3aio import Etcd3Client, EtcdError, EtcdUnauthenticatedError, prefix_range_end
from etcd3aio._protobuf import RangeResponse, WatchResponse

from protocol import subjects

__all__ = ["Deleted", "Put", "Snapshot", "WatchEvent", "keep_following", "watch_prefix"]

log = logging.getLogger(__name__)
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Snapshot(Generic[V]):
    """Everything under the prefix as of `revision`; replaces whatever the consumer held."""

    items: dict[str, V]
    revision: int
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why its value did not parse


@dataclass(frozen=True, slots=True)
class Put(Generic[V]):
    name: str
    value: V
    revision: int


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
) -> AsyncGenerator[WatchEvent[V], None]:
    """Names are keys with the prefix cut off; a key that is not UTF-8 (anyone who may write
    under the prefix can put one) is named with its bad bytes escaped (`\\xff`), a name no id
    has, for the consumer to refuse. `parse` raises ValueError for a value to skip: the key reads
    as absent (a skipped Put is reported as Deleted, so a consumer never keeps a stale value) and
    the event says why; `log_skipped` logs each one naming its key (a consumer that reports them
    itself passes False).

    Survives etcd restarts, lost data and cancelled watches: whenever the watch has to be made
    again it reads the prefix anew and yields a fresh Snapshot, then watches from that read.
    Resuming from a revision is not enough: etcd back with less data (a lost data dir, a restore)
    has a lower revision, and a stream broken before etcd sent the changes it owed resumes past
    them (etcd3aio resumes after the revision etcd's answer carried, not after the last change).
    """
    start = prefix.encode()
    end = prefix_range_end(start)
    latest = 0  # the highest revision etcd has shown this watch: one lower means its data was replaced
    cancelled = ""  # why etcd cancelled the watch last, said once until a watch works again
    while True:
        resp = await _read(client, prefix, start, end, retry_s, failed)
        revision = resp.header.revision
        if revision < latest:
            log.warning(
                "watch %s: etcd's revision went back from %d to %d: its data was replaced (lost, or "
                "restored from a snapshot); what it holds now replaces all that was seen",
                prefix,
                latest,
                revision,
            )
        latest = revision
        items: dict[str, V] = {}
        skipped: dict[str, str] = {}
        for kv in resp.kvs:
            name = subjects.name_from_key(prefix, kv.key)
            try:
                items[name] = parse(kv.value)
            except ValueError as exc:
                skipped[name] = _skipped(prefix, name, exc, log_skipped)
        yield Snapshot(items, revision, skipped)
        assert client.watch is not None
        # An async generator, typed as an iterator: closing it ends the gRPC stream at once.
        stream = cast(
            "AsyncGenerator[WatchResponse, None]", client.watch.watch(start, end, start_revision=revision + 1)
        )
        created = False
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
                if wr.created:
                    # Made again by etcd3aio after the stream broke, or etcd's revision went back
                    # since the read: changes may be missed either way.
                    if created or wr.header.revision < latest:
                        log.info("watch %s: made again; re-reading", prefix)
                        break
                    created = True
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
                        value = parse(ev.kv.value)
                    except ValueError as exc:
                        yield Deleted(name, rev, _skipped(prefix, name, exc, log_skipped))
                        continue
                    yield Put(name, value, rev)
        except (EtcdError, grpc.aio.AioRpcError) as exc:
            failed(exc)
            log.warning("watch %s: %s; re-reading", prefix, exc)
        finally:
            await stream.aclose()
        await asyncio.sleep(retry_s)


async def _read(
    client: Etcd3Client,
    prefix: str,
    start: bytes,
    end: bytes,
    retry_s: float,
    failed: Callable[[BaseException], None],
) -> RangeResponse:
    while True:
        try:
            assert client.kv is not None
            return await client.kv.get(start, end, timeout=5.0)
        except (EtcdError, TimeoutError, grpc.aio.AioRpcError) as exc:
            failed(exc)
            log.warning("watch %s: reading failed (%s); retrying", prefix, exc)
            await asyncio.sleep(retry_s)


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
