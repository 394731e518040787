"""Discovery's registration helpers and watches against a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import pytest

from discovery import Deleted, Discovery, KeyTaken, Put, Snapshot, WatchEvent
from protocol import RouterInfo, WorkerInfo
from protocol.config import EtcdSettings


def _worker(wid: str, **kw: object) -> WorkerInfo:
    return WorkerInfo(worker=wid, model="m", role="decode", engine="vllm", block_size=16, **kw)  # type: ignore[arg-type]


async def _next(it: AsyncIterator[WatchEvent[WorkerInfo]], timeout: float = 10.0) -> WatchEvent[WorkerInfo]:
    return await asyncio.wait_for(anext(it), timeout)


async def test_registered_worker_is_seen_by_a_watcher(etcd_url: str, ns: str) -> None:
    async with (
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as reg,
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as obs,
    ):
        watch = obs.watch_workers()
        first = await _next(watch)
        assert isinstance(first, Snapshot) and first.items == {}
        lease = await reg.register_worker(lambda wid: _worker(wid, kv_total_blocks=99))
        event = await _next(watch)
        assert isinstance(event, Put)
        assert event.name == lease.hex_id == event.value.worker
        assert event.value.kv_total_blocks == 99
        # A new watcher gets it in its snapshot.
        snap = await _next(obs.watch_workers())
        assert isinstance(snap, Snapshot) and set(snap.items) == {lease.hex_id}
        await watch.aclose()


async def test_clean_shutdown_revokes_the_lease_at_once(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as obs:
        watch = obs.watch_workers()
        await _next(watch)
        reg = await Discovery(EtcdSettings(endpoints=[etcd_url]), ns).connect()
        lease = await reg.register_worker(_worker, ttl=30)
        assert isinstance(await _next(watch), Put)
        started = time.monotonic()
        await reg.close()
        await reg.close()  # safe twice
        event = await _next(watch, timeout=5.0)
        assert isinstance(event, Deleted) and event.name == lease.hex_id
        assert time.monotonic() - started < 2.0, "revoke must not wait for the TTL"
        await watch.aclose()


_HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from discovery import Discovery
    from protocol import WorkerInfo
    from protocol.config import EtcdSettings

    async def main():
        d = await Discovery(EtcdSettings(endpoints=[sys.argv[1]]), sys.argv[2]).connect()
        lease = await d.register_worker(
            lambda w: WorkerInfo(worker=w, model="m", role="agg", engine="vllm", block_size=16), ttl=2)
        print(lease.hex_id, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_worker_whose_process_dies_disappears_within_ttl_plus_one_second(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as obs:
        watch = obs.watch_workers()
        await _next(watch)
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, etcd_url, ns], stdout=subprocess.PIPE)
        try:
            assert proc.stdout is not None
            wid = (await asyncio.to_thread(proc.stdout.readline)).decode().strip()
            put = await _next(watch)
            assert isinstance(put, Put) and put.name == wid
            await asyncio.sleep(3.0)  # longer than the TTL: renewals must have kept it
            proc.kill()
            proc.wait()
            killed = time.monotonic()
            event = await _next(watch, timeout=6.0)
            assert isinstance(event, Deleted) and event.name == wid
            assert time.monotonic() - killed <= 2 + 1.0
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        await watch.aclose()


async def test_lease_lost_when_etcd_revokes_it(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        lease = await d.register_worker(_worker, ttl=5)
        assert d.client.lease is not None
        await d.client.lease.revoke(lease.id)
        await asyncio.wait_for(lease.lost.wait(), timeout=5.0)
        assert "expired" in lease.lost_reason


async def test_create_again_under_its_own_lease_puts_the_new_value_and_under_another_is_key_taken(
    etcd_url: str, ns: str
) -> None:
    """The key held by the lease given already (an earlier attempt whose answer was lost) takes the
    value given; held by another lease, KeyTaken names the holder and its value, and the key stays."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        key = f"/{ns}/engines/h:8000"
        ours, rival = await d.grant(30), await d.grant(30)
        await d.create(key, b"first", ours)
        await d.create(key, b"second", ours)
        assert d.client.kv is not None
        read = await d.client.kv.get(key, timeout=5.0)
        assert [(kv.lease, bytes(kv.value)) for kv in read.kvs] == [(ours.id, b"second")]
        with pytest.raises(KeyTaken) as taken:
            await d.create(key, b"rival", rival)
        assert (taken.value.holder, taken.value.value) == (ours.id, b"second")
        assert await d.holder(key) == ours.id


async def test_held_reads_a_keys_holder_and_value_as_a_create_would_find_them(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        key = f"/{ns}/engines/h:8000"
        assert await d.held(key) is None
        lease = await d.grant(30)
        await d.create(key, b"claim", lease)
        held = await d.held(key)
        assert held is not None and (held.key, held.holder, held.value) == (key, lease.id, b"claim")
        await d.put(key, b"by hand")
        held = await d.held(key)
        assert held is not None and (held.holder, held.value) == (0, b"by hand")


async def test_router_registration_and_watch(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        lease = await d.register_router(
            lambda rid: RouterInfo(router=rid, http_url="http://127.0.0.1:1", started_at=1.0)
        )
        snap = await asyncio.wait_for(anext(d.watch_routers()), 5.0)
        assert isinstance(snap, Snapshot)
        assert snap.items[lease.hex_id].http_url == "http://127.0.0.1:1"


async def test_worker_id_must_be_the_lease_id(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        with pytest.raises(ValueError, match="must be the lease id"):
            await d.register_worker(lambda _wid: _worker("not-the-lease"))


async def test_malformed_value_is_skipped_not_fatal(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        await d.put_raw(f"/{ns}/workers/bogus", b"{not json")
        lease = await d.register_worker(_worker)
        snap = await asyncio.wait_for(anext(d.watch_workers()), 5.0)
        assert isinstance(snap, Snapshot) and set(snap.items) == {lease.hex_id}
        await d.delete(f"/{ns}/workers/bogus")


async def test_unreachable_etcd_is_a_clear_error(ns: str) -> None:
    from discovery import DiscoveryError
    from kvswitch.servers import free_port

    with pytest.raises(DiscoveryError, match="is not reachable"):
        await Discovery(EtcdSettings(endpoints=[f"http://127.0.0.1:{free_port()}"]), ns).connect(timeout=1.0)
