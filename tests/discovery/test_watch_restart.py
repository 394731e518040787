"""A watch survives an etcd restart on the same data dir and sees what changed after it."""

from __future__ import annotations

import asyncio

from discovery import Deleted, Discovery, Put, Snapshot
from kvswitch.servers import EtcdServer
from protocol import WorkerInfo
from protocol.config import EtcdSettings


def _worker(wid: str) -> WorkerInfo:
    return WorkerInfo(worker=wid, model="m", role="prefill", engine="vllm", block_size=16)


async def test_watch_resumes_after_etcd_restart(ns: str) -> None:
    etcd = EtcdServer().start()
    try:
        settings = EtcdSettings(endpoints=[etcd.url])
        async with Discovery(settings, ns) as obs:
            watch = obs.watch_workers()
            assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
            async with Discovery(settings, ns) as before:
                first = await before.register_worker(_worker, ttl=30)
                put = await asyncio.wait_for(anext(watch), 5)
                assert isinstance(put, Put) and put.name == first.hex_id
                await before.release(first)
                deleted = await asyncio.wait_for(anext(watch), 5)
                assert isinstance(deleted, Deleted)
                await before.close()

            await asyncio.to_thread(etcd.restart)

            async with Discovery(settings, ns) as after:
                second = await after.register_worker(_worker, ttl=30)
                # The watch made again reads anew: a Snapshot, holding the new worker or followed by its Put.
                event = await asyncio.wait_for(anext(watch), 20)
                assert isinstance(event, Snapshot) and first.hex_id not in event.items
                if second.hex_id not in event.items:
                    event = await asyncio.wait_for(anext(watch), 5)
                    assert isinstance(event, Put) and event.name == second.hex_id
                assert event.revision > put.revision
            await watch.aclose()
    finally:
        etcd.close()
