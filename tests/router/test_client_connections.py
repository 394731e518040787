"""The router's open-file limit and its client connections (router.client_connections): the soft
limit is raised to the hard one at start, and the connections are capped below it, a new one past
the cap closing the connection idle longest, or, none idle, refused (a routed request answered 503,
`/health`, `/ping`, `/ready` and `/metrics` answered as always). Until 2026-12-07 the router kept
systemd's 1024, and ~1,000 idle connections ran it out of descriptors: libuv (uvloop) then accepted
and closed every new connection with no log line, `/health` reset. The first two run the router as
a process under `prlimit`, against the session's real NATS and etcd; the rest run it in process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvswitch.servers import dying_with_parent, free_port
from router.api_errors import _JsonErrorHandler
from router.client_connections import FD_RESERVE
from router.metrics import RouterMetrics, StateFigures
from router.service import RouterService
from router.start_door import StartDoor
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


_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
_PING = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"  # vLLM's SageMaker liveness route
_METRICS = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
_COMPLETION = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
)


def _answer(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    """An HTTP/1.1 answer read to the connection's end: its status line, headers (lower-cased
    names) and body; ("", {}, b"") for a connection closed with no answer."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status, {k.lower(): v for k, _, v in (line.partition(": ") for line in lines)}, body


async def test_past_the_cap_with_every_connection_busy_new_ones_get_probes_answered_and_requests_503(
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
        # A burst: all five connected before any sends. Until 2026-12-07 each refused one was taken
        # for idle and closed, with no answer, for the next; and /health was 503, so a liveness probe
        # failed for as long as the router was at its cap and the router was killed, every stream with it.
        burst = [await asyncio.open_connection(host, int(port)) for _ in range(5)]
        accepted = ("kvswitch_router_client_connections", "kvswitch_router_client_connections_shed_total")
        await until(  # each open, or closed for another (the old code)
            lambda: (sample(accepted[0]) or 0) + (sample(accepted[1], how="idle_closed") or 0) == 13,
            what="the burst accepted",
        )
        for (_, writer), request in zip(burst, (_HEALTH, _PING, _METRICS, _COMPLETION, _COMPLETION), strict=True):
            writer.write(request)
        async with asyncio.timeout(10):  # read to the end: each connection is closed after its answer
            answers = [_answer(await reader.read()) for reader, _ in burst]
        for _, writer in burst:
            writer.close()
        for status, headers, body in answers[:2]:  # /health and /ping
            assert status == "HTTP/1.1 200 OK" and headers["connection"] == "close", (status, headers, body)
            assert b'"status"' in body
        metrics, metrics_headers, metrics_body = answers[2]
        assert metrics == "HTTP/1.1 200 OK" and metrics_headers["connection"] == "close", answers[2]
        assert b"kvswitch_router_client_connections_cap 8.0" in metrics_body
        for status, headers, body in answers[3:]:
            assert status == "HTTP/1.1 503 Service Unavailable", (status, headers, body)
            assert headers["connection"] == "close" and headers["retry-after"] == "1"
            error = msgspec.json.decode(body)["error"]
            assert error["type"] == "ServiceUnavailableError" and "client connections" in error["message"]
        # Counted as sent: the two probes answered are none.
        assert sample("kvswitch_router_client_connections_shed_total", how="refused") == 2
        assert sample("kvswitch_router_client_connections_shed_total", how="idle_closed") == 0
    finally:
        for s in busy:
            s.close()
    await until(lambda: (sample("kvswitch_router_client_connections") or 0) < 8, what="the busy ones closed")
    async with aiohttp.ClientSession() as http, http.get(router.url + "/health") as resp:
        assert resp.status == 200


# In process: the door's own server, each connection a real aiohttp RequestHandler on a transport
# with no socket, so the loop turns between a request read and its task can be stepped through.

_CAP = 2  # fd_limit FD_RESERVE + 2: the limit less its reserve
_BACKLOG = FD_RESERVE // 2  # the refused connections held at most (ClientConnections.backlog)
_IN_FLIGHT = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
_STATE = frozenset({"_waiter", "_request_in_progress", "_messages", "_force_close", "_close"})


class _Transport(asyncio.Transport):
    """A connection's transport with no socket: what is written is kept; close() tells the
    protocol a loop turn later, as asyncio's own transports do."""

    def __init__(self, protocol: asyncio.BaseProtocol) -> None:
        super().__init__()
        self.sent = bytearray()
        self._protocol = protocol
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            asyncio.get_running_loop().call_soon(self._protocol.connection_lost, None)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Door:
    """A started door whose requests go to an app with /health and a /v1/completions held until
    `release` is set."""

    def __init__(self, server: web.Server, metrics: RouterMetrics, release: asyncio.Event) -> None:
        self.server = server
        self.metrics = metrics
        self.release = release

    def connect(self) -> tuple[RequestHandler, _Transport]:
        handler = self.server()
        transport = _Transport(handler)
        handler.connection_made(transport)
        return handler, transport

    def shed(self, how: str) -> float | None:
        return self.metrics.registry.get_sample_value("kvswitch_router_client_connections_shed_total", {"how": how})


@contextlib.asynccontextmanager
async def _door(monkeypatch: pytest.MonkeyPatch, cap: int = _CAP) -> AsyncIterator[_Door]:
    monkeypatch.setattr("router.start_door.fd_limit", lambda: FD_RESERVE + cap)
    metrics = RouterMetrics(StateFigures)
    door = StartDoor("127.0.0.1", 0, health=lambda: {"status": "ok"}, readiness=lambda: (True, {}),
                     waiting=lambda: "", metrics=metrics, idle_timeout_s=75)  # fmt: skip
    await door.open()
    release = asyncio.Event()

    async def completions(_request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    runner = await door.hand_over(app)
    assert runner.server is not None
    try:
        yield _Door(runner.server, metrics, release)
    finally:
        release.set()
        await runner.cleanup()


async def _busy(door: _Door, n: int) -> list[RequestHandler]:
    handlers = [door.connect()[0] for _ in range(n)]
    for handler in handlers:
        handler.data_received(_IN_FLIGHT)
    await until(lambda: all(h._request_in_progress for h in handlers), 5, what="the requests in flight")
    return handlers


async def test_the_caps_warning_and_metric_help_name_every_probe(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Both said "503 to all but /health, /ready and /metrics" once /ping was answered too."""
    with caplog.at_level(logging.WARNING, "router.client_connections"):
        async with _door(monkeypatch) as door:
            await _busy(door, _CAP)
            door.connect()  # none idle: refused
            scrape = (await door.metrics.render_off_loop()).decode()
    warning = next(r.getMessage() for r in caplog.records if "at the cap" in r.getMessage())
    shed = "# HELP kvswitch_router_client_connections_shed_total "
    help_text = next(line for line in scrape.splitlines() if line.startswith(shed))
    for said in (warning, help_text):
        assert "/health, /ping, /ready and /metrics" in said, said


async def test_a_request_read_whose_task_has_not_started_is_not_taken_for_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    async with _door(monkeypatch) as door:
        read, read_out = door.connect()
        waiting, _ = door.connect()
        await until(lambda: read._waiter is not None and waiting._waiter is not None, 5, what="both waiting")
        read.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0)  # its start() takes the request and makes its task; on 3.11 it runs a turn later
        if sys.version_info < (3, 12):
            assert read._waiter is None and not read._messages and not read._request_in_progress, "not the window"
        door.connect()  # at the cap: the connection idle longest is the one just read
        assert not read._force_close and waiting._force_close
        assert door.shed("idle_closed") == 1
        await until(lambda: read_out.sent.startswith(b"HTTP/1.1 200 OK"), 5, what="the request read answered")


async def test_shedding_looks_at_the_connection_idle_longest_not_at_each_busy_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked: list[RequestHandler] = []

    class Looked(_JsonErrorHandler):
        __slots__ = ()

        def __getattribute__(self, name: str) -> Any:
            if name in _STATE:
                looked.append(self)
            return super().__getattribute__(name)

    async with _door(monkeypatch, cap=50) as door:
        busy = await _busy(door, 49)  # the oldest: a scan in order of age reads each of them first
        idle, _ = door.connect()
        await until(lambda: idle._waiter is not None, 5, what="the idle one waiting")
        for handler in [*busy, idle]:
            handler.__class__ = Looked
        door.connect()
        assert {id(h) for h in looked} == {id(idle)}, f"{len({id(h) for h in looked})} connections looked at"
        assert idle._force_close and door.shed("idle_closed") == 1


async def test_a_refused_connection_is_never_shed_for_the_next_and_each_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _door(monkeypatch) as door:
        await _busy(door, _CAP)
        refused = [door.connect() for _ in range(5)]  # a burst: each made before any sends
        await asyncio.sleep(0.05)
        assert not any(h._force_close for h, _ in refused)
        assert door.shed("refused") == 0  # counted as the 503 goes
        for handler, _ in refused:
            handler.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await until(lambda: all(out.is_closing() for _, out in refused), 5, what="each refused one closed")
        assert [bytes(out.sent).split(b"\r\n")[0] for _, out in refused] == [b"HTTP/1.1 503 Service Unavailable"] * 5
        assert door.shed("refused") == 5 and door.shed("idle_closed") == 0 and door.shed("dropped") == 0


async def test_past_the_backlog_of_refused_connections_a_new_one_is_closed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _door(monkeypatch) as door:
        await _busy(door, _CAP)
        refused = [door.connect()[0] for _ in range(_BACKLOG)]
        newest, out = door.connect()
        assert newest._force_close and out.is_closing() and not out.sent
        assert not any(h._force_close for h in refused)
        assert door.shed("dropped") == 1 and door.shed("idle_closed") == 0


async def test_a_refused_connection_with_no_request_head_is_closed_after_its_short_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # raising=False: the old code, with no such wait, held each to the idle timeout (75 s)
    monkeypatch.setattr("router.client_connections.REFUSED_HEAD_S", 0.2, raising=False)
    async with _door(monkeypatch) as door:
        await _busy(door, _CAP)
        (_, silent_out), (partial, partial_out), (prompt, prompt_out) = [door.connect() for _ in range(3)]
        partial.data_received(b"GET /heal")  # a head begun, never finished
        prompt.data_received(_IN_FLIGHT)  # its request at once: answered, not timed out
        await until(lambda: silent_out.is_closing() and partial_out.is_closing(), 5, what="the unheard ones closed")
        assert not silent_out.sent and not partial_out.sent
        assert prompt_out.sent.startswith(b"HTTP/1.1 503 Service Unavailable")
        assert door.shed("silent") == 2 and door.shed("refused") == 1 and door.shed("dropped") == 0


async def test_past_the_backlog_a_new_connection_closes_the_refused_one_waiting_longest_for_its_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Until the review of 2026-12-07 the backlog's worth of refused connections sending nothing had
    # every new one closed, a liveness probe's included, until the idle timeout (75 s).
    monkeypatch.setattr("router.client_connections.REFUSED_GRACE_S", 0.1, raising=False)
    async with _door(monkeypatch) as door:
        await _busy(door, _CAP)
        refused = [door.connect() for _ in range(_BACKLOG)]
        oldest, oldest_out = refused[0]
        oldest.data_received(b"GET /heal")  # part of a head: still waiting for the whole of it
        await asyncio.sleep(0.15)
        probe, probe_out = door.connect()
        assert oldest._force_close and oldest_out.is_closing() and not probe._force_close
        assert not any(h._force_close for h, _ in refused[1:])
        assert door.shed("silent") == 1 and door.shed("dropped") == 0
        probe.data_received(_HEALTH)
        await until(probe_out.is_closing, 5, what="the probe answered and closed")
        assert probe_out.sent.startswith(b"HTTP/1.1 200 OK")
