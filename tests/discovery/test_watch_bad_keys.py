"""A key that is not UTF-8 under a watched prefix is named with its bad bytes escaped, in the first
snapshot and as a change: the watch goes on (it used to end for good on UnicodeDecodeError)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from discovery import Deleted, Discovery, Put, Snapshot
from protocol import WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings

BAD = b"\xff\xfe"


@pytest.fixture
async def disc(etcd_url: str, ns: str) -> AsyncIterator[Discovery]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        yield d


def _worker(wid: str) -> WorkerInfo:
    return WorkerInfo(worker=wid, model="m", role="agg", engine="vllm", block_size=16)


async def _put_bad_key(disc: Discovery) -> None:
    assert disc.client.kv is not None
    lease = await disc.grant(30)  # a record held by no lease is refused (NO_LEASE), whatever its key
    key = subjects.workers_prefix(disc.ns).encode() + BAD
    await disc.client.kv.put(key, encode_json(_worker("x")), lease=lease.id, timeout=5.0)


async def test_a_key_that_is_not_utf8_is_named_escaped_in_the_snapshot(disc: Discovery) -> None:
    await _put_bad_key(disc)
    watch = disc.watch_workers()
    snapshot = await asyncio.wait_for(anext(watch), 5)
    assert isinstance(snapshot, Snapshot) and list(snapshot.items) == ["\\xff\\xfe"]
    await watch.aclose()


async def test_a_key_that_is_not_utf8_does_not_end_the_watch(disc: Discovery) -> None:
    watch = disc.watch_workers()
    assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
    await _put_bad_key(disc)
    bad = await asyncio.wait_for(anext(watch), 5)
    assert isinstance(bad, Put) and bad.name == "\\xff\\xfe"
    lease = await disc.register_worker(_worker, ttl=30)
    good = await asyncio.wait_for(anext(watch), 5)
    assert isinstance(good, Put) and good.name == lease.hex_id
    await disc.release(lease)
    assert isinstance(await asyncio.wait_for(anext(watch), 5), Deleted)
    await watch.aclose()


async def test_keep_following_runs_a_crashed_consumer_again_with_backoff(caplog: pytest.LogCaptureFixture) -> None:
    from discovery.watch import keep_following  # here: the module's other tests run on older code too

    caplog.set_level(logging.ERROR, logger="discovery.watch")
    runs: list[float] = []

    async def follow() -> None:
        runs.append(asyncio.get_running_loop().time())
        if len(runs) < 3:
            raise RuntimeError("consumer bug")

    await asyncio.wait_for(keep_following(follow, "the test watch", first_s=0.05, max_s=1.0), 5)
    assert len(runs) == 3
    assert runs[1] - runs[0] >= 0.05 and runs[2] - runs[1] >= 0.1  # the backoff doubles
    crashes = [r for r in caplog.records if "the test watch crashed" in r.getMessage()]
    assert len(crashes) == 2 and all(r.exc_info is not None for r in crashes)
