"""A watch is made again within about a second of etcd answering again, as leases renew: etcd3aio's
watch backed off up to 5 s, so after a restart that lost leases new workers' keys went unseen (their
load reports dropped as unknown, every request a 503) for seconds after etcd was back."""

from __future__ import annotations

import asyncio
import time

from discovery import Discovery, Put, Snapshot
from kvswitch.servers import EtcdServer
from protocol.config import EtcdSettings


async def test_a_watch_sees_a_put_within_a_second_or_two_of_etcd_coming_back(ns: str) -> None:
    etcd = EtcdServer().start()
    try:
        settings = EtcdSettings(endpoints=[etcd.url])
        async with Discovery(settings, ns) as d:
            watch = d.watch_raw(f"/{ns}/w/")
            assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
            following = asyncio.ensure_future(anext(watch))
            await asyncio.sleep(0.2)
            await asyncio.to_thread(etcd.stop)
            await asyncio.sleep(3.5)  # etcd3aio's backoff reached 2 s, its next try 4 s on
            await asyncio.to_thread(etcd.start)
            async with Discovery(settings, ns) as writer:
                await writer.put_raw(f"/{ns}/w/a", b"1")
                back = time.monotonic()
                event = await asyncio.wait_for(following, 10)
                seen = time.monotonic() - back
            while not (isinstance(event, Put) or (isinstance(event, Snapshot) and "a" in event.items)):
                event = await asyncio.wait_for(anext(watch), 10)
                seen = time.monotonic() - back
            assert seen < 1.5, f"the put seen {seen:.1f}s after etcd answered again"
            await watch.aclose()
    finally:
        etcd.close()
