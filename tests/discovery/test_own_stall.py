"""A stall of this process (a paused VM, a long GC, a debugger) past a watch's or a lease's
deadline for etcd's answer is no silence of etcd's: until 2026-12-07 a router paused 6 s woke to
"no answer from etcd" from each watch and its lease, the loop's timers running before it read the
answers waiting in its socket (discovery.answer_deadline)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator

import pytest

import discovery.watch as watch_module
from discovery import Discovery, Put, Snapshot, WatchEvent
from discovery.watch import SILENT_S
from protocol.config import EtcdSettings
from tests.discovery.test_hung_member import SilentStream


async def test_a_watch_through_a_stall_of_its_process_is_not_made_again(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        watch = d.watch_raw(f"/{ns}/w/")
        assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
        following = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.2)
        time.sleep(SILENT_S + 0.5)  # the process stopped past the watch's deadline
        await asyncio.sleep(0.5)
        await d.put_raw(f"/{ns}/w/a", b"1")
        event = await asyncio.wait_for(following, 5)
        assert isinstance(event, Put) and event.name == "a", "a watch made again yields a Snapshot"
        await watch.aclose()
    assert "no answer from etcd" not in caplog.text
    assert f"watch /{ns}/w/: this process was stalled" in caplog.text


async def test_a_watch_stalled_past_its_re_waits_names_the_stall_not_etcd(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stalls that spend its re-waits too end the wait with StalledPast: until a review of
    2026-12-07 the watch took it for a plain TimeoutError and said "no answer from etcd" at WARNING.
    A 0.4 s wait (one re-wait of 0.4 s) and two 1 s stalls, each past a deadline, make it in 2 s."""
    monkeypatch.setattr(watch_module, "SILENT_S", 0.4)
    caplog.set_level(logging.INFO)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]).validate(), ns) as d:
        await d.put_raw(f"/{ns}/w/a", b"1")
        assert d.client.watch is not None
        stub = d.client.watch._stub
        opened = stub.Watch
        silent = [SilentStream()]  # the first stream; the one made again is etcd's own
        monkeypatch.setattr(stub, "Watch", lambda *a, **kw: silent.pop() if silent else opened(*a, **kw))
        watch: AsyncGenerator[WatchEvent[bytes], None] = d.watch_raw(f"/{ns}/w/")
        assert isinstance(await anext(watch), Snapshot)
        following = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.05)  # waiting for the stream's answer
        time.sleep(1.0)  # past the deadline: waits 0.4 s more, its last re-wait
        await asyncio.sleep(0.01)
        time.sleep(1.0)  # past that one too
        try:
            event = await asyncio.wait_for(following, 5)
        finally:
            following.cancel()
            await watch.aclose()
        assert isinstance(event, Snapshot) and event.items == {"a": b"1"}, event  # read anew
    said = [r.getMessage() for r in caplog.records if r.name == "discovery.watch"]
    assert not [line for line in said if "no answer from etcd" in line], said
    stalled = [line for line in said if "stalled" in line]
    assert len(stalled) == 1, said
    assert re.fullmatch(
        rf"watch /{ns}/w/: this process was stalled \d+\.\ds or more as etcd's answer came due \(not etcd\); "
        "re-reading and watching again",
        stalled[0],
    ), said


async def test_a_lease_through_a_stall_of_its_process_sees_etcd_answering(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        lease = await d.grant(ttl=3)  # renewed every 1 s, an answer waited for 2 s
        before = lease.unrenewed_s
        await asyncio.sleep(0.01)
        while lease.unrenewed_s >= before:  # until just renewed: the stall ends within the TTL
            before = lease.unrenewed_s
            await asyncio.sleep(0.01)
        time.sleep(2.5)
        await asyncio.sleep(1.5)
        assert lease.outages == 0 and lease.unrenewed_s < 1.5
    assert "etcd does not answer" not in caplog.text
    assert f"lease {lease.hex_id}: this process was stalled" in caplog.text


async def test_a_lease_stalled_past_its_ttl_names_the_stall_not_etcd(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the TTL no re-wait is left (the lease must try another member within it): until
    2026-12-07 a shim stopped 10 s woke to "etcd does not answer" of its lease."""
    caplog.set_level(logging.INFO)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        lease = await d.grant(ttl=2)  # renewed every 0.67 s, an answer waited for 1 s
        before = lease.unrenewed_s
        await asyncio.sleep(0.01)
        while lease.unrenewed_s >= before:  # until just renewed
            before = lease.unrenewed_s
            await asyncio.sleep(0.01)
        time.sleep(2.6)  # past the TTL: the renewals due meanwhile went unsent
        await asyncio.sleep(0.5)
        assert lease.outages == 1
        await lease.stop_keep_alive()
    warned = [r.getMessage() for r in caplog.records if r.name == "discovery.lease" and r.levelno >= logging.WARNING]
    assert not any("etcd does not answer" in line for line in warned), warned
    assert any(line.startswith(f"lease {lease.hex_id}: this process was stalled 1.") for line in warned), warned
