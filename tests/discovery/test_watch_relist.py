"""A watch made again reads everything anew (a fresh Snapshot): resuming from a revision missed
changes when etcd came back with less data, and when the stream broke before etcd had sent the
changes it owed."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from discovery import Discovery, Snapshot, WatchEvent
from discovery import watch as watch_module
from kvswitch.servers import EtcdServer
from protocol import WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings
from tests.discovery.following import follow


def _worker(wid: str) -> WorkerInfo:
    return WorkerInfo(worker=wid, model="m", role="agg", engine="vllm", block_size=16)


async def _follow(
    watch: AsyncGenerator[WatchEvent[WorkerInfo], None], held: dict[str, WorkerInfo], want: set[str], timeout: float
) -> list[WatchEvent[WorkerInfo]]:
    """Apply the watch's events to `held` until it holds exactly `want`; the events seen."""
    return await follow(watch, held, lambda h: set(h) == want, timeout)


@pytest.mark.parametrize("open_stream", [True, False], ids=["watching", "between-read-and-watch"])
async def test_etcd_back_with_lost_data_is_read_anew(
    ns: str, caplog: pytest.LogCaptureFixture, open_stream: bool
) -> None:
    """etcd back on an empty data dir (lost, or restored from an older snapshot) has a lower
    revision: a watch resumed after the old one waited for revisions that were never coming. So
    did one first made (after its read) only once etcd was back."""
    etcd = EtcdServer().start()
    try:
        settings = EtcdSettings(endpoints=[etcd.url])
        async with Discovery(settings, ns) as router, Discovery(settings, ns) as shim:
            for i in range(10):  # history the new etcd will not have
                await shim.put_raw(f"/{ns}/other/{i}", b"x")
            watch = router.watch_workers()
            held: dict[str, WorkerInfo] = {}
            if open_stream:  # the Snapshot first: the old worker comes as a Put, on the open stream
                assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
            old = await shim.register_worker(_worker, ttl=30)
            await _follow(watch, held, {old.hex_id}, 5)
            await asyncio.to_thread(etcd.stop)
            shutil.rmtree(etcd.workdir / "data")
            await asyncio.to_thread(etcd.start)
            with caplog.at_level(logging.WARNING, logger="discovery.watch"):
                new = await shim.register_worker(_worker, ttl=30)
                seen = await _follow(watch, held, {new.hex_id}, 10)  # the old worker's key is gone with the data
            await watch.aclose()
        assert any(isinstance(event, Snapshot) for event in seen)
        assert any("revision went back" in r.getMessage() for r in caplog.records)
    finally:
        etcd.close()


async def test_changes_etcd_owed_when_the_stream_broke_arrive(ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """20 workers register between the watch's read and its watch; etcd dies right after it
    answers `created`, before it sends them: etcd3aio resumed after them, and they never came."""
    etcd = EtcdServer().start()
    try:
        settings = EtcdSettings(endpoints=[etcd.url])
        names = {f"w{i}" for i in range(20)}
        async with Discovery(settings, ns) as router, Discovery(settings, ns) as shim:
            assert router.client.kv is not None
            get, watch_stream = router.client.kv.get, watch_module._stream
            killed = asyncio.Event()
            lease = await shim.grant(30)  # a worker record held by no lease is refused

            async def read_then_others_register(*args: Any, **kwargs: Any) -> Any:
                resp = await get(*args, **kwargs)
                if not killed.is_set():
                    for name in sorted(names):
                        await shim.put(subjects.worker_key(ns, name), encode_json(_worker(name)), lease)
                return resp

            async def dies_after_created(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                async for resp in watch_stream(*args, **kwargs):
                    if resp.created and not killed.is_set():
                        etcd.kill()
                        killed.set()
                    yield resp

            monkeypatch.setattr(router.client.kv, "get", read_then_others_register)
            monkeypatch.setattr(watch_module, "_stream", dies_after_created)
            watch = router.watch_workers()
            held: dict[str, WorkerInfo] = {}
            first = await asyncio.wait_for(anext(watch), 5)
            assert isinstance(first, Snapshot) and first.items == {}
            following = asyncio.create_task(_follow(watch, held, names, 20))
            await asyncio.wait_for(killed.wait(), 5)
            await asyncio.to_thread(etcd.start)
            await following
            await watch.aclose()
    finally:
        etcd.close()
