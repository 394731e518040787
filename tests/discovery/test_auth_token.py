"""With etcd authentication on, a process outlives its token: etcd forgets every token when it
restarts (and each one after --auth-token-ttl). Puts, watches and the shutdown's revoke then get a
new one, where they used to fail with "invalid auth token" for good."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import subprocess
import sys
import urllib.request
from typing import Any

import pytest

from discovery import Discovery, DiscoveryError, Put, Snapshot
from kvswitch.servers import EtcdServer
from protocol import WorkerInfo
from protocol.config import EtcdSettings
from tests.discovery.following import follow


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
            # The watch (re-created with the new token) sees the put, or reads anew if it had to be made again.
            event = await asyncio.wait_for(anext(watch), 10)
            if isinstance(event, Snapshot) and "after" not in event.items:
                event = await asyncio.wait_for(anext(watch), 10)
            assert (isinstance(event, Put) and event.name == "after") or (
                isinstance(event, Snapshot) and set(event.items) == {"before", "after"}
            )
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


def _grant_worker_read_of_other(url: str) -> None:
    """An auth change through etcd's gateway that concerns no key kvswitch uses."""

    def call(path: str, body: dict[str, object], token: str | None = None) -> dict[str, Any]:
        headers = {"Authorization": token} if token else {}
        req = urllib.request.Request(f"{url}/v3/{path}", json.dumps(body).encode(), headers, method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            return dict(json.loads(resp.read()))

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    root = call("auth/authenticate", {"name": "root", "password": "r"})["token"]
    perm = {"permType": "READ", "key": b64("/other/"), "range_end": b64("/other0")}
    call("auth/role/grant", {"name": "worker", "perm": perm}, root)


async def test_a_watch_etcd_cancels_is_said_and_made_again_with_a_new_token(caplog: pytest.LogCaptureFixture) -> None:
    """After an auth change and a restart, etcd cancels the watch re-created with the old token
    ("invalid auth token"): it used to sit on the dead stream, silent, the worker set frozen."""
    etcd = EtcdServer().start()
    try:
        _turn_auth_on(etcd.url)
        async with (
            Discovery(EtcdSettings(endpoints=[etcd.url], user="router", password="o"), "sc") as router,
            Discovery(EtcdSettings(endpoints=[etcd.url], user="worker", password="w"), "sc") as shim,
        ):
            held: dict[str, WorkerInfo] = {}
            watch = router.watch_workers()
            first = await shim.register_worker(_worker, ttl=30)
            await follow(watch, held, lambda h: first.hex_id in h, 5)  # the watch stream is open
            _grant_worker_read_of_other(etcd.url)
            with caplog.at_level(logging.INFO, logger="discovery.watch"):
                await asyncio.to_thread(etcd.restart)
                async with asyncio.timeout(10):
                    while True:
                        try:
                            second = await shim.register_worker(_worker, ttl=30)
                            break
                        except DiscoveryError:
                            await asyncio.sleep(0.1)  # the shim's own token is renewed meanwhile
                await follow(watch, held, lambda h: second.hex_id in h, 10)
            await watch.aclose()
            assert router.token is not None and router.token.renewals >= 1
            cancels = [r for r in caplog.records if "etcd cancelled it" in r.getMessage()]
            assert cancels and cancels[0].levelno == logging.ERROR and "invalid auth token" in cancels[0].getMessage()
    finally:
        etcd.close()
