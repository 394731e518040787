"""A streaming client that stops reading, or reads slower than its worker writes (audit
router_stream D1): before, its request outlived --request-timeout for as long as its TCP connection
lived, and the router held the engine's whole answer for it, with its booking, unbounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from typing import Any

import aiohttp
import pytest

import router.dispatch
from router.leg import Leg, LegError
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster, Worker
from tests.router.polling import until

BOUND = 64 << 10  # the queue bound in the test that overflows it


async def stalled_stream(router: RouterService, max_tokens: int) -> socket.socket:
    """A streamed completion from a client with a tiny receive buffer that never reads it."""
    host, port = router.url.split("//")[1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    body = {"model": MODEL, "prompt": "hi " * 10, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    data = json.dumps({**body, "logprobs": 5}).encode()  # logprobs: long events
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    await loop.sock_sendall(sock, head.encode() + b"\r\n\r\n" + data)
    return sock


async def stalled_whole(router: RouterService) -> socket.socket:
    """A whole (not streamed) completion of several MB (20 prompt logprobs for each of 4,000 prompt
    tokens) from a client with a tiny receive buffer that never reads it."""
    host, port = router.url.split("//")[1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    body = {"model": MODEL, "prompt": list(range(1, 4001)), "max_tokens": 1, "prompt_logprobs": 20}
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    await loop.sock_sendall(sock, head.encode() + b"\r\n\r\n" + data)
    return sock


async def cut_short(sock: socket.socket) -> None:
    """What the client then reads ends short of the whole answer's Content-Length (its connection
    aborted): a 200 head, part of the body, then the end of the connection."""
    got = b""
    async with asyncio.timeout(5):
        with contextlib.suppress(ConnectionResetError):
            while part := await asyncio.get_running_loop().sock_recv(sock, 1 << 16):
                got += part
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
    assert head.startswith(b"HTTP/1.1 200") and len(body) < length, (head, len(body), length)


def writes_stuck(router: RouterService) -> bool:
    """The router's writes to the client have stopped: its leg's chunks pile up unread. Waited for
    before the deadline, so the deadline finds the writer stuck (under load a slower sim had not
    filled the sockets by then, and the request ended at its deadline as a leg timeout instead)."""
    return any(leg.queued > 64 << 10 for leg in router.dispatcher._legs.values())


def counted(router: RouterService, code: int) -> float:
    labels = {"endpoint": "completions", "code": str(code)}
    return router.metrics.registry.get_sample_value("kvswitch_router_requests_total", labels) or 0.0


def clean(router: RouterService) -> bool:
    """No leg, no booking here or in the view the peers share, no request in flight."""
    return (
        not router.dispatcher.inflight_legs
        and not router.view._by_router
        and router.path.planner.ledger.live == 0
        and router.path.inflight == 0
    )


def generating(w: Worker) -> bool:
    return bool(w.sim.engine.running or w.sim.engine.waiting)


async def test_a_client_that_stops_reading_is_cut_at_its_deadline(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.http_api")
    await cluster.add_worker("agg", speedup=20.0)
    # 8 s: in a full run at load ~10 (2026-12-07) the sim took over 4.5 s to fill the sockets
    router = await cluster.add_router(config={"request_timeout_s": 8.0})
    await cluster.ready(router)
    sock = await stalled_stream(router, 30_000)
    try:
        await until(lambda: writes_stuck(router), timeout=7.5, what="the router's writes to the client stuck")
        # before: the leg, its queue and its booking stayed until the client closed the socket
        await until(lambda: clean(router), timeout=10.0, what="the request ended at its 8 s deadline")
        assert counted(router, 504) == 1
        said = [r.getMessage() for r in caplog.records if "stopped reading its stream" in r.getMessage()]
        assert len(said) == 1 and "--request-timeout" in said[0], said
        got = b""
        async with asyncio.timeout(5):  # the connection closed, without the body's end: aborted
            with contextlib.suppress(ConnectionResetError):
                while part := await asyncio.get_running_loop().sock_recv(sock, 1 << 16):
                    got += part
        assert b"data: [DONE]" not in got and not got.endswith(b"0\r\n\r\n")
    finally:
        sock.close()


async def test_a_client_that_stops_reading_a_whole_answer_is_cut_at_its_deadline(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Before (client-fault audit): aiohttp wrote a whole answer after its handler had counted it a
    200, waiting for the client for ever, so the router held its body (25 MB each) past any deadline."""
    caplog.set_level(logging.INFO, logger="router.http_api")
    await cluster.add_worker("agg", num_gpu_blocks=1024)
    router = await cluster.add_router(config={"request_timeout_s": 4.0})
    await cluster.ready(router)
    sent = time.monotonic()
    sock = await stalled_whole(router)
    try:
        await until(lambda: counted(router, 504) == 1, timeout=8.0, what="the write cut at the 4 s deadline")
        assert time.monotonic() - sent > 3.5  # the write waited for the client until the deadline
        assert counted(router, 200) == 0  # its head went out, its body did not: never answered
        said = [r.getMessage() for r in caplog.records if "stopped reading its answer" in r.getMessage()]
        assert len(said) == 1 and "--request-timeout" in said[0], said
        await cut_short(sock)
    finally:
        sock.close()
    assert clean(router)


async def test_a_whole_answer_keeps_its_content_length(cluster: Cluster) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    body = {"model": MODEL, "prompt": "hi " * 10, "max_tokens": 4}
    async with aiohttp.ClientSession() as http, http.post(router.url + "/v1/completions", json=body) as resp:
        got = await resp.read()
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/json"
        assert int(resp.headers["Content-Length"]) == len(got) and "Transfer-Encoding" not in resp.headers
        assert json.loads(got)["kvswitch"]["decode_worker"]
    assert counted(router, 200) == 1


async def test_a_client_that_falls_too_far_behind_ends_its_leg_at_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(router.dispatch, "MAX_QUEUED_BYTES", BOUND)
    peak = 0
    push = Leg.push

    def recording(leg: Leg, item: Any, size: int = 0) -> None:
        nonlocal peak
        push(leg, item, size)
        peak = max(peak, leg.queued)

    monkeypatch.setattr(Leg, "push", recording)
    w = await cluster.add_worker("agg", speedup=20.0)
    served = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(served)
    # What the drop left, seen before the request's handler runs again: once it reads the 408 the
    # request ends, at once when it was not stuck writing to the client (a loaded host).
    at_drop: list[tuple[int, int, int, int]] = []
    drop = Leg.drop

    def dropping(leg: Leg, error: LegError) -> None:
        drop(leg, error)
        legs, path = served.dispatcher.inflight_legs, served.path
        at_drop.append((legs, path.inflight, path.planner.ledger.live, sum(map(len, served.view._by_router.values()))))

    monkeypatch.setattr(Leg, "drop", dropping)
    sock = await stalled_stream(served, 30_000)  # about 8 s of generation at this speedup
    loop = asyncio.get_running_loop()
    try:
        await until(lambda: served.dispatcher.slow_readers == 1, timeout=5.0, what="the leg dropped")
        assert b"kvswitch_router_slow_readers_total 1.0" in served.metrics.render()
        # the leg and its booking are gone while the request is in flight, and its engine is
        # freed while the client still reads nothing
        assert at_drop == [(0, 1, 0, 0)], at_drop
        await until(lambda: not generating(w), timeout=3.0, what="the leg cancelled on its worker")
        assert peak <= BOUND + served.dispatcher._nc.max_payload, peak
        got = b""
        async with asyncio.timeout(10):
            while not got.endswith(b"0\r\n\r\n"):  # the chunked body's end
                got += await loop.sock_recv(sock, 1 << 16)
    finally:
        sock.close()
    events = got.split(b"\r\n\r\n", 1)[1]
    assert events.rstrip(b"\r\n0").endswith(b"data: [DONE]"), events[-300:]
    error = json.loads(events.rsplit(b"data: ", 2)[1].split(b"\n")[0])["error"]
    assert error["code"] == 408 and "read the stream too slowly" in error["message"], error
    await until(lambda: clean(served), what="the request ended")
    assert counted(served, 408) == 1


async def test_a_booking_is_freed_when_the_answers_last_chunk_arrives_not_when_it_is_read(
    cluster: Cluster,
) -> None:
    w = await cluster.add_worker("agg", speedup=200.0, num_gpu_blocks=2048)  # room for the whole answer's KV
    router = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(router)
    sock = await stalled_stream(router, 15_000)  # about 2.7 MB: more than the sockets hold, less than the bound
    try:
        await until(lambda: router.dispatcher.inflight_legs == 1, what="the leg sent")
        await until(lambda: not generating(w), what="the engine done")
        # before: held until the client had read it all, up to the deadline (30 s) or forever; the
        # last chunks' way from the engine to the router may take seconds on a loaded 2-core box
        await until(
            lambda: not router.view._by_router and router.path.planner.ledger.live == 0,
            timeout=10.0,
            what="the booking freed",
        )
        assert router.dispatcher.inflight_legs == 1 and router.path.inflight == 1  # still being sent
    finally:
        sock.close()
    await until(lambda: clean(router), what="the request ended")


async def test_a_stream_its_client_reads_is_written_without_a_timer_per_chunk(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write under the transport's high-water mark cannot wait, so it needs no deadline timer:
    one cost ~5 µs on every streamed chunk. The client that stops reading is still cut (above)."""
    timers = 0
    timeout = asyncio.timeout

    def counting(delay: float | None) -> asyncio.Timeout:
        nonlocal timers
        timers += sys._getframe(1).f_code.co_name == "_sent"
        return timeout(delay)

    monkeypatch.setattr(asyncio, "timeout", counting)
    await cluster.add_worker("agg", speedup=50.0)
    router = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(router)
    body = {"model": MODEL, "prompt": "hi " * 10, "max_tokens": 40, "stream": True, "ignore_eos": True}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        events = [line async for line in resp.content if line.startswith(b"data: {")]
    assert resp.status == 200 and len(events) == 40
    assert timers == 0


class _Buffered:
    """A socket transport 20 KiB behind: under asyncio's high-water mark (64 KiB), over its low one."""

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16384, 65536

    def get_write_buffer_size(self) -> int:
        return 20000

    def write(self, data: bytes) -> None:
        pass

    def writelines(self, data: object) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


async def test_a_write_while_the_protocol_is_still_paused_keeps_its_deadline() -> None:
    """Paused over the high-water mark, writing stays paused until the buffer falls under the low
    one: a client that read down to 20 KiB and stopped held write_eof for good (final read of the
    per-chunk timer change)."""
    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.http_writer import StreamWriter

    from router.http_api import _sent

    loop = asyncio.get_running_loop()
    transport = _Buffered()
    protocol = BaseProtocol(loop)
    protocol.connection_made(transport)  # type: ignore[arg-type]
    protocol.pause_writing()
    writer = StreamWriter(protocol, loop)
    writer.enable_chunking()
    request = type("Request", (), {"transport": transport, "protocol": protocol})()
    sent = await asyncio.wait_for(_sent(request, b"data: [DONE]\n\n", writer.write_eof, time.monotonic() + 0.3), 3)
    assert sent is False


async def test_a_whole_answer_just_under_the_high_water_mark_keeps_its_deadline() -> None:
    """web.Response holds its head until write_eof: a body a few hundred bytes under the high-water
    mark passed _sent's no-timer test, and with the kernel's buffers full its write_eof waited on
    the client for ever (review of the whole-answer deadline)."""
    from types import SimpleNamespace

    from aiohttp import web

    from router.client_buffers import ClientBuffers
    from router.http_api import _Handlers

    result: dict[str, tuple[int, str]] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        fd = request.transport.get_extra_info("socket").fileno()  # type: ignore[union-attr]
        with contextlib.suppress(BlockingIOError):
            while True:  # the kernel's send buffer full, the transport's own empty
                os.write(fd, b"x" * 65536)
        _, high = request.transport.get_write_buffer_limits()  # type: ignore[union-attr]
        body = [b"y" * (high - 300)]
        resp = web.StreamResponse(headers={"x-pad": "p" * 300})
        resp.content_length = len(body[0])
        job = SimpleNamespace(deadline=time.monotonic() + 0.5, request=SimpleNamespace(request_id="r1"))
        buffers = ClientBuffers(1 << 30, tuple, lambda leg: asyncio.sleep(0))
        this = SimpleNamespace(
            drain=SimpleNamespace(ended=lambda: False),
            path=SimpleNamespace(dispatcher=SimpleNamespace(buffers=buffers)),
        )
        result["r"] = await asyncio.wait_for(_Handlers._write_whole(this, request, job, resp, body), 5)  # type: ignore[arg-type]
        return resp

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        await until(lambda: "r" in result, timeout=8.0, what="the whole answer's write to end")
        assert result["r"][0] == 504
    finally:
        sock.close()
        await runner.cleanup()
