"""A watch on an etcd member that lost its leader (cut off from its cluster) fails loudly: without
etcd's `hasleader` metadata the member kept the stream open and silent for as long as the cut lasted,
the router's workers and peers stale with no word of it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from discovery import Discovery, Snapshot
from kvswitch.servers import EtcdCluster
from protocol.config import EtcdSettings
from tests.router.polling import until


async def test_a_watch_on_a_member_without_a_leader_fails_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with EtcdCluster(3) as cluster:
        settings = EtcdSettings(endpoints=[cluster.urls[0]]).validate()
        async with Discovery(settings, "leader") as d:
            watch = d.watch_raw("/leader/workers/")
            assert isinstance(await asyncio.wait_for(anext(watch), 10), Snapshot)
            waiting = asyncio.create_task(anext(watch))
            with caplog.at_level(logging.WARNING):
                for member in cluster.members[1:]:  # the majority gone: member 0 has no leader
                    member.close(now=True)
                await until(lambda: "UNAVAILABLE" in caplog.text, timeout=20, what="the watch failing")
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await watch.aclose()
