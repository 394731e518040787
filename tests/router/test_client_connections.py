"""The router's open-file limit and its client connections (router.client_connections): the soft
limit is raised to the hard one at start, and the connections are capped below it, a new one past
the cap closing the connection idle longest, or, none idle, answered 503. Until 2026-12-07 the
router kept systemd's 1024, and ~1,000 idle connections ran it out of descriptors: libuv (uvloop)
then accepted and closed every new connection with no log line, `/health` reset. The router runs
as a process under `prlimit`, against the session's real NATS and etcd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvswitch.servers import dying_with_parent, free_port
from router.service import RouterService
from tests.router.conftest import Cluster
from tests.router.polling import until

SOFT, HARD = 256, 512  # a soft limit the flood below would exhaust, a hard one the router raises it to
CAP = HARD - 256  # the limit less its reserve (router.client_connections.FD_RESERVE)

pytestmark = pytest.mark.skipif(
    shutil.which("prlimit") is None or not os.path.isdir("/proc/self/fd"), reason="needs prlimit and /proc"
)


@contextlib.contextmanager
def _router(port: int, nats_url: str, etcd_url: str, ns: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    argv = ["router", "--http-port", str(port), "--namespace", ns, "--nats-servers", nats_url,
            "--etcd-endpoints", etcd_url, "--no-api-keys"]  # fmt: skip
    limited = ["prlimit", f"--nofile={SOFT}:{HARD}", "--", sys.executable, "-m", "kvswitch", *argv]
    command, preexec = dying_with_parent(limited)
    with log.open("wb") as err:
        # setpriv and prlimit exec in place: the child's pid is the router's
        proc = subprocess.Popen(command, preexec_fn=preexec, stdout=subprocess.DEVNULL, stderr=err)  # noqa: PLW1509
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _nofile(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc/pid/limits")


def _session() -> aiohttp.ClientSession:
    """Each request on a connection of its own, as a probe's: none kept from before the flood."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def _health(http: aiohttp.ClientSession, base: str) -> int:
    async with http.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return resp.status


async def _metric(http: aiohttp.ClientSession, base: str, line_start: str) -> float:
    async with http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {line_start} on /metrics")


async def _started(http: aiohttp.ClientSession, base: str, proc: subprocess.Popen[bytes]) -> None:
    async with asyncio.timeout(30):
        while True:
            assert proc.poll() is None, "the router exited"
            with contextlib.suppress(aiohttp.ClientConnectionError):
                if await _health(http, base) == 200:
                    return
            await asyncio.sleep(0.05)


async def test_the_router_raises_its_open_file_limit_and_caps_connections_below_it(
    nats_url: str, etcd_url: str, ns: str, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "router.log"
    base = f"http://127.0.0.1:{port}"
    async with _session() as http:
        with _router(port, nats_url, etcd_url, ns, log) as proc:
            await _started(http, base, proc)
            assert _nofile(proc.pid) == (HARD, HARD), "the soft limit was not raised to the hard one"
            assert await _metric(http, base, "kvswitch_router_client_connections_cap") == CAP


async def test_a_flood_of_idle_connections_past_the_fd_limit_leaves_health_answering(
    nats_url: str, etcd_url: str, ns: str, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "router.log"
    base = f"http://127.0.0.1:{port}"
    flood: list[socket.socket] = []
    async with _session() as http:
        with _router(port, nats_url, etcd_url, ns, log) as proc:
            await _started(http, base, proc)
            try:
                for _ in range(HARD + 100):  # more than the router could hold open, raised limit and all
                    flood.append(socket.create_connection(("127.0.0.1", port)))
                await asyncio.sleep(0.5)  # every connection accepted (or, on the old code, dropped)
                fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
                assert fds < HARD, f"{fds} descriptors open under a limit of {HARD}"
                for _ in range(3):  # each a new connection past the cap
                    assert await _health(http, base) == 200
                shed = await _metric(http, base, 'kvswitch_router_client_connections_shed_total{how="idle_closed"}')
                assert shed >= len(flood) - CAP
                assert await _metric(http, base, "kvswitch_router_client_connections") <= CAP
            finally:
                for s in flood:
                    s.close()
            await until(lambda: "client connections back to" in log.read_text(), 10, what="the episode's end logged")
    lines = log.read_text().splitlines()
    warnings = [line for line in lines if "WARNING" in line and f"client connections at the cap of {CAP}" in line]
    assert len(warnings) == 1, lines[-20:]  # once for the episode, not per connection
    assert f"open-file limit {HARD}" in warnings[0]
    assert any("INFO" in line and "client connections back to" in line for line in lines), lines[-20:]


async def test_past_the_cap_with_every_connection_busy_a_new_one_is_answered_503(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # raising=False: the old code, with no such hook, fails on what it answers
    monkeypatch.setattr("router.start_door.fd_limit", lambda: 256 + 8, raising=False)  # a cap of 8
    router: RouterService = await cluster.add_router()
    host, port = router.url.removeprefix("http://").split(":")

    def sample(name: str, **labels: str) -> float | None:
        return router.metrics.registry.get_sample_value(name, labels)

    busy: list[socket.socket] = []
    try:
        for _ in range(8):  # each a request whose body has not come: in flight until the client goes
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")  # fmt: skip
            busy.append(s)
        await until(lambda: sample("kvswitch_router_client_connections") == 8, what="8 connections open")
        async with aiohttp.ClientSession() as http, http.get(router.url + "/health") as resp:
            assert resp.status == 503 and resp.headers["Connection"] == "close"
            assert resp.headers["Retry-After"] == "1"
            error = (await resp.json())["error"]
        assert error["type"] == "ServiceUnavailableError" and "client connections" in error["message"]
        assert sample("kvswitch_router_client_connections_shed_total", how="refused") == 1
        assert sample("kvswitch_router_client_connections_shed_total", how="idle_closed") == 0
    finally:
        for s in busy:
            s.close()
    await until(lambda: (sample("kvswitch_router_client_connections") or 0) < 8, what="the busy ones closed")
    async with aiohttp.ClientSession() as http, http.get(router.url + "/health") as resp:
        assert resp.status == 200
