"""A Discovery closed under a running watch ends the watch, an INFO line saying so: until a review
of 2026-12-08 its consumer got a CancelledError no one had asked for (gRPC cancels a closed
channel's calls), or, closed while the watch retried its read, an AssertionError."""

from __future__ import annotations

import asyncio
import logging

import pytest

from discovery import Discovery, Snapshot
from kvswitch.servers import EtcdServer
from protocol.config import EtcdSettings


async def test_a_watch_whose_client_is_closed_under_its_stream_ends(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="discovery.watch")
    d = await Discovery(EtcdSettings(endpoints=[etcd_url]), ns).connect()
    watch = d.watch_raw(f"/{ns}/w/")
    assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
    following = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0.3)  # waiting on etcd's answer
    await d.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(following, 5)
    assert f"watch /{ns}/w/: the etcd client was closed; the watch ends" in caplog.text


async def test_a_watch_whose_client_is_closed_while_it_retries_its_read_ends(
    ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="discovery.watch")
    etcd = EtcdServer().start()
    try:
        d = await Discovery(EtcdSettings(endpoints=[etcd.url]), ns).connect()
        watch = d.watch_raw(f"/{ns}/w/")
        assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
        following = asyncio.ensure_future(anext(watch))
        await asyncio.to_thread(etcd.stop)
        await asyncio.sleep(2)  # the stream broken, the read failing and retried
        assert "reading it failed" in caplog.text
        await d.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(following, 5)
        assert f"watch /{ns}/w/: the etcd client was closed; the watch ends" in caplog.text
    finally:
        etcd.close()
