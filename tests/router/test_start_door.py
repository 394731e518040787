"""The router listens before NATS and etcd answer (router.start_door): `/health` 200 while it waits,
`/ready` and requests a 503 naming what it waits for, then its own app on the same port with no
refused connection between. Until 2026-12-06 nothing listened until NATS and then etcd had answered,
so a router started while NATS was down failed its liveness probe and was restarted for as long as
NATS stayed down (deploy/k8s/base/router.yaml: CrashLoopBackOff)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvswitch.servers import NatsServer, dying_with_parent, free_port
from protocol.config import EtcdSettings, NatsSettings
from router.http_api import HttpLimits
from router.metrics import RouterMetrics, StateFigures
from router.service import RouterConfig, RouterService, RouterStatus
from router.start_door import StartDoor
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


async def _until(check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    """Polls `check` (an HTTP answer: no event to wait on) until it holds."""
    async with asyncio.timeout(timeout):
        while True:
            if await check():
                return
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _router_process(port: int, nats_url: str, etcd_url: str, ns: str) -> AsyncIterator[subprocess.Popen[bytes]]:
    argv = ["router", "--http-port", str(port), "--namespace", ns, "--nats-servers", nats_url,
            "--etcd-endpoints", etcd_url]  # fmt: skip
    command, preexec = dying_with_parent([sys.executable, "-m", "kvswitch", *argv])
    proc = subprocess.Popen(command, preexec_fn=preexec, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: PLW1509
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_router_waiting_for_nats_is_alive_says_why_it_is_not_ready_and_serves_once_nats_is_up(
    etcd_url: str, ns: str, http: aiohttp.ClientSession
) -> None:
    nats = NatsServer(port=free_port())  # its port told the router before it listens: given, never drawn again
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with _router_process(port, nats.url, etcd_url, ns) as proc:
        refused_after_up: list[str] = []
        answered = asyncio.Event()

        async def probe_health() -> None:
            """As a liveness probe: once /health has answered, it must never fail (nor the hand-over)."""
            while True:
                try:
                    async with http.get(f"{base}/health") as resp:
                        if resp.status != 200:
                            refused_after_up.append(f"/health {resp.status}")
                        answered.set()
                except aiohttp.ClientConnectionError as exc:
                    if answered.is_set():
                        refused_after_up.append(repr(exc))
                await asyncio.sleep(0.01)

        prober = asyncio.create_task(probe_health())
        try:
            async with asyncio.timeout(30):
                await answered.wait()
            assert proc.poll() is None
            waiting = "connecting to NATS (--nats-servers; the log names the servers and the error)"
            status, health = await _get(http, f"{base}/health")
            assert (status, health) == (200, {"status": "starting"})
            status, ready = await _get(http, f"{base}/ready")
            assert status == 503 and ready["ready"] is False
            assert f"the router is starting: {waiting}" in ready["problems"], ready
            assert nats.url.split("//")[1] not in str(ready)  # no key on /ready: the flag, not the address
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                error = (await resp.json())["error"]
            assert error["type"] == "ServiceUnavailableError" and waiting in error["message"], error
            assert nats.url.split("//")[1] not in error["message"]
            async with http.post(f"{base}/v1/completions", json=body, headers={"Expect": "200-ok"}) as resp:
                assert resp.status == 503  # the door's answer, not a 417 (before: aiohttp's text 417)
            async with http.get(f"{base}/metrics") as resp:
                assert resp.status == 200
                assert 'kvswitch_router_requests_total{code="503",endpoint="starting"} 2.0' in await resp.text()

            await asyncio.to_thread(nats.start)
            cluster = Cluster(ns, nats.url, etcd_url)
            try:
                await cluster.add_worker("agg")

                async def ready_now() -> bool:
                    assert proc.poll() is None, "the router exited"
                    return (await _get(http, f"{base}/ready"))[0] == 200

                await _until(ready_now, 30)
                async with http.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
            finally:
                await cluster.close()
        finally:
            prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await prober
            nats.stop()
        assert refused_after_up == [], refused_after_up[:5]


async def test_a_router_waiting_for_etcd_says_so_on_ready(nats_url: str, ns: str, http: aiohttp.ClientSession) -> None:
    with socket.socket() as silent:  # accepts connections and never answers: the etcd client waits
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        etcd = f"http://127.0.0.1:{silent.getsockname()[1]}"
        router = RouterService(
            RouterConfig(ns=ns, nats=NatsSettings(servers=[nats_url]), etcd=EtcdSettings(endpoints=[etcd]))
        )
        start = asyncio.create_task(router.start())
        try:
            await until(lambda: bool(router.url), what="the router listening")
            want = "the router is starting: connecting to etcd (--etcd-endpoints)"

            async def names_etcd() -> bool:
                status, body = await _get(http, f"{router.url}/ready")
                assert status == 503
                assert etcd.split("//")[1] not in str(body)
                return want in body["problems"]

            await _until(names_etcd, 8)  # the etcd client gives up after 10 s
            assert (await _get(http, f"{router.url}/health")) == (200, {"status": "starting"})
            assert (await _get(http, f"{router.url}/ping")) == (200, {"status": "starting"})  # vLLM's name
        finally:
            await _cancelled(start)
    with pytest.raises(aiohttp.ClientConnectionError):  # stopped while it started: the port is closed
        await _get(http, f"{router.url}/health")


async def test_a_wrong_method_at_the_start_door_is_the_routers_405(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """HEAD on /health, /ping or /ready at the door was its 503 "starting, send again" (its catch-all
    route took the method the path's own routes refused), counted as endpoint="starting": the
    router's app answers it 405, saying Allow. The door's 405s are the app's (router.routes)."""
    metrics = RouterMetrics(StateFigures)
    door = StartDoor("127.0.0.1", 0, health=lambda: {"status": "starting"}, readiness=lambda: (False, {}),
                     waiting=lambda: "connecting to NATS", metrics=metrics, idle_timeout_s=5)  # fmt: skip
    url = await door.open()
    router = await cluster.add_router()
    try:
        wrong = [("HEAD", "/health"), ("HEAD", "/ping"), ("HEAD", "/ready"), ("POST", "/health"),
                 ("PUT", "/ping"), ("DELETE", "/ready"), ("POST", "/metrics")]  # fmt: skip
        for method, path in wrong:
            answers = []
            for base in (url, router.url):
                async with http.request(method, base + path) as resp:
                    answers.append((resp.status, resp.headers.get("Allow"), await resp.read()))
            assert answers[0] == answers[1], (method, path, answers)
            allow = "GET,HEAD" if path == "/metrics" else "GET"  # /ping: vLLM says GET alone (router.routes)
            assert answers[0][:2] == (405, allow), (method, path, answers)
        async with http.head(url + "/metrics") as resp:
            assert resp.status == 200
        async with http.post(url + "/v1/completions") as resp:  # a route the door does not serve
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        sample = metrics.registry.get_sample_value
        assert sample("kvswitch_router_requests_total", {"endpoint": "unrouted", "code": "405"}) == len(wrong)
        assert sample("kvswitch_router_requests_total", {"endpoint": "starting", "code": "503"}) == 1
    finally:
        await door.close()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, bytes]:
    """One request on a connection of the caller's (kept alive), its status and body."""
    writer.write(request)
    await writer.drain()
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
        return int(lines[0].split()[1]), await reader.readexactly(length)


async def test_a_connection_opened_while_the_router_starts_is_answered_by_the_router_once_started(
    etcd_url: str, ns: str
) -> None:
    """The door and the router's app are one server: until 2026-12-06 the app got a server of its
    own at the switch and the door closed every connection it held, so a request sent on one just
    after (a client's keep-alive, or one it had just opened) met a reset, not an answer."""
    nats = NatsServer(port=free_port())  # its port told the router before it listens: given, never drawn again
    router = RouterService(
        RouterConfig(ns=ns, nats=NatsSettings(servers=[nats.url]), etcd=EtcdSettings(endpoints=[etcd_url]))
    )
    start = asyncio.create_task(router.start())
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await until(lambda: bool(router.url), what="the router listening")
        host, port = router.url.removeprefix("http://").rsplit(":", 1)
        conns = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        health = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"
        assert await _exchange(*conns[0], health) == (200, b'{"status":"starting"}')  # the door's, kept alive
        # conns[1] sends nothing yet: open, its request to come after the switch
        await asyncio.to_thread(nats.start)
        async with asyncio.timeout(30):
            await start
        # the workers read (none): before that the router's app says it is starting, as the door did
        await until(lambda: not [p for p in router.readiness()[1]["problems"] if "not been read" in p])
        body = b'{"model":"' + MODEL.encode() + b'","prompt":"hello","max_tokens":2}'
        post = b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        post += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        for conn in conns:
            status, answer = await _exchange(*conn, post)
            # the router's own answer (no worker serves the model), where the door's is a 503 "starting"
            assert status == 404 and b"does not exist" in answer, answer
            assert await _exchange(*conn, health) == (200, b'{"status":"running"}')
    finally:
        for _, writer in conns:
            writer.close()
        await _cancelled(start)
        await router.stop()
        nats.stop()


async def test_the_start_door_closes_a_connection_idle_for_idle_timeout_s(ns: str) -> None:
    """docs/security.md: a connection that sends nothing is closed after --idle-timeout-s, while the
    router starts too (the start door kept aiohttp's 75 s until 2026-12-06)."""
    down = [f"nats://127.0.0.1:{free_port()}"]  # nothing listens: the start waits for NATS for good
    router = RouterService(
        RouterConfig(
            ns=ns,
            http_limits=HttpLimits(idle_timeout_s=1.0),
            nats=NatsSettings(servers=down),
            etcd=EtcdSettings(endpoints=[f"http://127.0.0.1:{free_port()}"]),
        )
    )
    start = asyncio.create_task(router.start())
    try:
        await until(lambda: bool(router.url), what="the router listening")
        host, port = router.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        opened = time.monotonic()
        try:
            async with asyncio.timeout(5):
                assert await reader.read() == b""  # closed by the router, nothing said
            assert time.monotonic() - opened < 3
        finally:
            writer.close()
        assert router.status is RouterStatus.STARTING  # still waiting for NATS all the while
    finally:
        await _cancelled(start)


async def _cancelled(start: asyncio.Task[Any]) -> None:
    """Cancel the router's start and wait for it to end: again each second, as Python 3.11's
    asyncio.wait_for (in nats-py's connect) may swallow a cancel that lands as its inner connect
    fails, and the start went on retrying NATS until the test's 120 s timeout (clean-clone CI of
    2026-12-07)."""
    while not start.done():
        start.cancel()
        await asyncio.wait({start}, timeout=1.0)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        start.result()
