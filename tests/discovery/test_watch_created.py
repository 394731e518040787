"""The worker watch hands on each key's etcd create_revision (`Put.created`, `Snapshot.created`):
the same on every watcher, kept while the key is rewritten, new when it is created again. The
router breaks a tie of a model's block size or max_model_len by it (router.fleet_vote)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from discovery import Discovery, Put, Snapshot
from protocol import WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings


@pytest.fixture
async def disc(etcd_url: str, ns: str) -> AsyncIterator[Discovery]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        yield d


def _record(wid: str, epoch: int = 0) -> bytes:
    return encode_json(WorkerInfo(worker=wid, model="m", role="decode", engine="vllm", block_size=16, epoch=epoch))


async def test_a_keys_create_revision_comes_with_its_puts_and_snapshots(disc: Discovery) -> None:
    key = subjects.worker_key(disc.ns, "00000a")
    other = subjects.worker_key(disc.ns, "00000b")
    lease = await disc.grant(30)  # a worker record held by no lease is refused
    await disc.put(key, _record("00000a"), lease)
    await disc.put(other, _record("00000b"), lease)
    watch = disc.watch_workers()
    snapshot = await asyncio.wait_for(anext(watch), 5)
    assert isinstance(snapshot, Snapshot)
    first, second = snapshot.created["00000a"], snapshot.created["00000b"]
    assert 0 < first < second
    await disc.put(key, _record("00000a", epoch=1), lease)  # rewritten: the same key
    rewritten = await asyncio.wait_for(anext(watch), 5)
    assert isinstance(rewritten, Put) and rewritten.created == first and rewritten.revision > second
    await disc.delete(key)
    await asyncio.wait_for(anext(watch), 5)
    await disc.put(key, _record("00000a"), lease)  # created again (a shim started again): the newest
    again = await asyncio.wait_for(anext(watch), 5)
    assert isinstance(again, Put) and again.created == again.revision > second
    await watch.aclose()
