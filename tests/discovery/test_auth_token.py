"""With etcd authentication on, a process outlives its token: etcd forgets every token when it
restarts (and each one after --auth-token-ttl). Puts, watches and the shutdown's revoke then get a
new one, where they used to fail with "invalid auth token" for good."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from discovery import Discovery, DiscoveryError, Put, Snapshot
from kvswitch.servers import EtcdServer
from protocol import WorkerInfo
from protocol.config import EtcdSettings


def _worker(wid: str) -> WorkerInfo:
    return WorkerInfo(worker=wid, model="m", role="agg", engine="vllm", block_size=16)


def _turn_auth_on(url: str) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "KVSWITCH_ETCD_ROOT_PASSWORD": "r",
        "KVSWITCH_ETCD_ROUTER_PASSWORD": "o",
        "KVSWITCH_ETCD_WORKER_PASSWORD": "w",
    }
    argv = [sys.executable, "-m", "kvswitch", "secrets", "--namespace", "sc", "--etcd-endpoint", url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "etcd authentication on" in out.stdout, out.stderr


async def test_puts_and_watches_get_a_new_token_after_etcd_restarts() -> None:
    etcd = EtcdServer().start()
    try:
        _turn_auth_on(etcd.url)
        async with Discovery(EtcdSettings(endpoints=[etcd.url], user="worker", password="w"), "sc") as d:
            await d.put_raw("/sc/workers/before", b"{}")
            watch = d.watch_raw("/sc/workers/")
            first = await asyncio.wait_for(anext(watch), 5)
            assert isinstance(first, Snapshot) and set(first.items) == {"before"}
            etcd.restart()  # every token it gave out is gone
            refused = 0
            async with asyncio.timeout(10):
                while True:
                    try:
                        await d.put_raw("/sc/workers/after", b"{}")
                        break
                    except DiscoveryError as exc:
                        assert "invalid auth token" in str(exc) or "not reachable" in str(exc), exc
                        refused += 1
                        await asyncio.sleep(0.1)
            event = await asyncio.wait_for(anext(watch), 10)  # the watch re-created with the new token
            assert isinstance(event, Put) and event.name == "after"
            assert d.token is not None and d.token.renewals >= 1
            await watch.aclose()
    finally:
        etcd.close()


async def test_a_lease_is_revoked_on_close_after_etcd_restarts_with_a_new_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Keep-alives carry no token check, so nothing else finds the token forgotten before the
    shutdown's revoke; a revoke that fails leaves the worker's key for routers to use a TTL longer."""
    etcd = EtcdServer().start()
    try:
        _turn_auth_on(etcd.url)
        settings = EtcdSettings(endpoints=[etcd.url], user="worker", password="w")
        async with Discovery(settings, "sc") as d:
            lease = await d.register_worker(_worker, ttl=30)
            etcd.restart()
            await asyncio.sleep(1.0)  # the keep-alive stream is back (with the old token)
            with caplog.at_level(logging.WARNING, logger="discovery.lease"):
                await d.release(lease)
            assert d.token is not None and d.token.renewals == 1
            async with Discovery(EtcdSettings(endpoints=[etcd.url], user="router", password="o"), "sc") as reader:
                watch = reader.watch_workers()
                snapshot = await asyncio.wait_for(anext(watch), 5)
                await watch.aclose()
        assert isinstance(snapshot, Snapshot) and snapshot.items == {}  # the key went with the lease
        assert not [r for r in caplog.records if "revoke failed" in r.getMessage()]
    finally:
        etcd.close()
