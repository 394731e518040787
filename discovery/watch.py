"""Prefix watches as async iterators: one Snapshot, then Put/Deleted changes, then (after a
compaction that the watch cannot bridge) a fresh Snapshot that replaces everything before it.

A value that does not parse is never handed on as a value: its key reads as absent (left out of
the Snapshot, a Put of it reported as Deleted), and the event says why (`Snapshot.skipped`,
`Deleted.why`), so a consumer can report the bad record rather than lose it without a trace."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end

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

    Survives etcd restarts: the watch resumes from the last revision it saw, so changes made
    while it was reconnecting still arrive, in order.
    """
    start = prefix.encode()
    end = prefix_range_end(start)
    while True:
        try:
            assert client.kv is not None
            resp = await client.kv.get(start, end, timeout=5.0)
            break
        except (EtcdError, TimeoutError, grpc.aio.AioRpcError) as exc:
            failed(exc)
            log.warning("watch %s: initial read failed (%s); retrying", prefix, exc)
            await asyncio.sleep(retry_s)
    items: dict[str, V] = {}
    skipped: dict[str, str] = {}
    for kv in resp.kvs:
        name = _name(kv.key, start)
        try:
            items[name] = parse(kv.value)
        except ValueError as exc:
            skipped[name] = _skipped(prefix, name, exc, log_skipped)
    revision = resp.header.revision
    yield Snapshot(items, revision, skipped)
    async for event in _changes(client, prefix, start, end, revision + 1, parse, retry_s, failed, log_skipped):
        yield event


async def _changes(
    client: Etcd3Client,
    prefix: str,
    start: bytes,
    end: bytes,
    next_rev: int,
    parse: Callable[[bytes], V],
    retry_s: float,
    failed: Callable[[BaseException], None],
    log_skipped: bool,
) -> AsyncGenerator[WatchEvent[V], None]:
    while True:
        try:
            assert client.watch is not None
            async for resp in client.watch.watch(start, end, start_revision=next_rev):
                if resp.compact_revision > 0:
                    log.warning("watch %s: compacted past revision %d; re-reading", prefix, next_rev)
                    again = watch_prefix(client, prefix, parse, retry_s=retry_s, failed=failed, log_skipped=log_skipped)
                    async for event in again:
                        yield event
                    return
                for ev in resp.events:
                    name = _name(ev.kv.key, start)
                    rev = ev.kv.mod_revision
                    next_rev = max(next_rev, rev + 1)
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
            log.warning("watch %s: %s; resuming from revision %d", prefix, exc, next_rev)
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


def _name(key: bytes, prefix: bytes) -> str:
    # Never raises: one undecodable key must not end the watch, and with it every consumer's view.
    return key[len(prefix) :].decode(errors="backslashreplace")
