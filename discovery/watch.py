"""Prefix watches as async iterators: one Snapshot, then Put/Deleted changes, then (after a
compaction that the watch cannot bridge) a fresh Snapshot that replaces everything before it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end

__all__ = ["Deleted", "Put", "Snapshot", "WatchEvent", "watch_prefix"]

log = logging.getLogger(__name__)
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Snapshot(Generic[V]):
    """Everything under the prefix as of `revision`; replaces whatever the consumer held."""

    items: dict[str, V]
    revision: int


@dataclass(frozen=True, slots=True)
class Put(Generic[V]):
    name: str
    value: V
    revision: int


@dataclass(frozen=True, slots=True)
class Deleted:
    name: str
    revision: int


WatchEvent = Snapshot[V] | Put[V] | Deleted


async def watch_prefix(
    client: Etcd3Client,
    prefix: str,
    parse: Callable[[bytes], V | None],
    *,
    retry_s: float = 0.5,
    failed: Callable[[BaseException], None] = lambda exc: None,
) -> AsyncGenerator[WatchEvent[V], None]:
    """Names are keys with the prefix cut off. `parse` returns None for a value to skip (it logs
    why); a skipped Put is reported as Deleted, so a consumer never keeps a stale value.

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
    for kv in resp.kvs:
        value = parse(kv.value)
        if value is not None:
            items[kv.key.decode()[len(prefix) :]] = value
    revision = resp.header.revision
    yield Snapshot(items, revision)
    async for event in _changes(client, prefix, start, end, revision + 1, parse, retry_s, failed):
        yield event


async def _changes(
    client: Etcd3Client,
    prefix: str,
    start: bytes,
    end: bytes,
    next_rev: int,
    parse: Callable[[bytes], V | None],
    retry_s: float,
    failed: Callable[[BaseException], None],
) -> AsyncGenerator[WatchEvent[V], None]:
    while True:
        try:
            assert client.watch is not None
            async for resp in client.watch.watch(start, end, start_revision=next_rev):
                if resp.compact_revision > 0:
                    log.warning("watch %s: compacted past revision %d; re-reading", prefix, next_rev)
                    async for event in watch_prefix(client, prefix, parse, retry_s=retry_s, failed=failed):
                        yield event
                    return
                for ev in resp.events:
                    name = ev.kv.key.decode()[len(prefix) :]
                    rev = ev.kv.mod_revision
                    next_rev = max(next_rev, rev + 1)
                    if ev.type == ev.DELETE:
                        yield Deleted(name, rev)
                        continue
                    value = parse(ev.kv.value)
                    yield Put(name, value, rev) if value is not None else Deleted(name, rev)
        except (EtcdError, grpc.aio.AioRpcError) as exc:
            failed(exc)
            log.warning("watch %s: %s; resuming from revision %d", prefix, exc, next_rev)
        await asyncio.sleep(retry_s)
