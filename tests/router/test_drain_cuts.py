"""Requests the drain's end cuts where they wait on something other than their worker (router.http_api's
Drain): a stream's last write to a client that reads no more, a whole answer's wait for room among
the clients' buffers, /debug/route's wait for its body. One front door (make_app, served by
FrontDoorRunner as the router serves it) with a stand-in request path, so each cut lands where the
test holds its request; test_drain.py has the cluster's cuts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web

from protocol import GenerateRequest, ResponseChunk
from protocol.messages import ENDPOINT_COMPLETIONS
from router.api_errors import FrontDoorRunner
from router.client_buffers import ClientBuffers
from router.http_api import SHUT_DOWN, Drain, make_app
from router.leg import Leg
from router.metrics import RouterMetrics, StateFigures
from router.policies import Outcome
from router.policies import Path as RoutePath
from router.tokenization import BuiltinPromptTokenizer, Tokenization
from router.tracing import RequestTracer
from tests.router.polling import until

MODEL = "m"


class _Path:
    """A request path (router.request_path's RequestPath) whose worker answers `chunks`."""

    def __init__(self, chunks: list[ResponseChunk], buffers: ClientBuffers | None = None) -> None:
        self.metrics = RouterMetrics(StateFigures)
        self.tracer = RequestTracer()
        self.dispatcher = SimpleNamespace(leg_failures=lambda log, utility=False: None, buffers=buffers)
        self.default_model = None
        self._chunks = chunks
        self.streamed = False  # the handler closed its chunks: the answer's last write is next

    def vllm_only(self, name: str | None) -> bool:
        return False

    def resolve_model(self, name: str | None) -> str:
        return MODEL

    def max_model_len(self, model: str) -> int | None:
        return None

    async def open(self, leg: GenerateRequest, span: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(
            request=leg,
            deadline=time.monotonic() + 60,
            plan=SimpleNamespace(decode=SimpleNamespace(worker="w1")),
            path=RoutePath.AGG,
            outcome=Outcome.AGGREGATED,
            attempts=1,
            prefill_worker=None,
        )

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        yield

    def release(self, job: Any) -> None:
        pass

    async def stream(self, job: Any, arrived: float) -> AsyncIterator[ResponseChunk]:
        try:
            for chunk in self._chunks:
                yield chunk
        finally:
            self.streamed = True

    def counted(self, code: int) -> float:
        labels = {"endpoint": ENDPOINT_COMPLETIONS, "code": str(code)}
        return self.metrics.registry.get_sample_value("kvswitch_router_requests_total", labels) or 0.0


@contextlib.asynccontextmanager
async def _front_door(path: _Path, drain: Drain) -> AsyncIterator[int]:
    """The front door's port."""
    app = make_app(
        cast(Any, path),
        Tokenization(BuiltinPromptTokenizer()),
        health=dict,
        readiness=lambda: (True, {}),
        index_state=dict,
        worker_listing=dict,
        drain=drain,
    )
    runner = FrontDoorRunner(app, metrics=path.metrics)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _post(port: int, route: str, body: dict[str, Any]) -> socket.socket:
    """A client that sent its request and reads nothing yet, its receive buffer small."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    raw = json.dumps(body).encode()
    head = f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    await loop.sock_sendall(sock, head.encode() + raw)
    return sock


async def _read_to_end(sock: socket.socket) -> bytes:
    """All the client gets until its connection ends (closed or aborted)."""
    loop = asyncio.get_running_loop()
    got = b""
    async with asyncio.timeout(10):
        with contextlib.suppress(ConnectionResetError):
            while part := await loop.sock_recv(sock, 1 << 16):
                got += part
    return got


async def test_a_stream_cut_in_its_last_write_is_aborted_with_no_second_head() -> None:
    """Its [DONE] waits in its last write for a client that reads no more when the drain ends. The
    cut there reached _generate, which answered a fresh 503: aiohttp wrote a second HTTP head on the
    connection after the stream's 200. Its connection is aborted now, counted 503."""
    big = b'"' + b"y" * (1 << 20) + b'"'  # over what the transport and the kernel hold for its client
    chunks = [
        ResponseChunk(request_id="r1", seq=0, events=[b'{"n":0}']),
        ResponseChunk(request_id="r1", seq=1, events=[big], final=True),
    ]
    path, drain = _Path(chunks), Drain()
    async with _front_door(path, drain) as port:
        sock = await _post(port, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "stream": True})
        try:
            await until(lambda: path.streamed, 10, "the stream's last write")
            assert await asyncio.wait_for(drain.finish(0.1), 10) == (0, 1)  # cut, not finished
            got = await _read_to_end(sock)
        finally:
            sock.close()
    assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"HTTP/1.1 ") == 1, got[-300:]
    assert SHUT_DOWN.encode() not in got and b"[DONE]" not in got
    assert (path.counted(503), path.counted(200)) == (1, 0)


async def test_a_whole_answer_cut_while_it_waits_for_room_gets_the_drains_503() -> None:
    """Its room among the clients' buffers is made by cutting a stalled stream, and the drain ends
    while that cut runs (ClientBuffers.admit): its head has not gone out. It was taken for one that
    had, its connection aborted with no answer; it gets the drain's 503 now."""
    budget = 1 << 20
    cutting = asyncio.Event()

    async def cut(leg: Leg) -> None:  # a stalled stream's cut that has not ended when the drain does
        cutting.set()
        await asyncio.Event().wait()

    stalled = SimpleNamespace(queued=budget, taken_at=time.monotonic() - 60)
    buffers = ClientBuffers(budget, lambda: [cast(Leg, stalled)], cut)
    buffers.held = budget  # the stalled stream's queue, as its Leg counts it
    answer = ResponseChunk(request_id="r1", seq=0, body=b'{"id":"c1"}', final=True)
    path, drain = _Path([answer], buffers), Drain()
    async with _front_door(path, drain) as port:
        sock = await _post(port, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
        try:
            await asyncio.wait_for(cutting.wait(), 10)
            assert await asyncio.wait_for(drain.finish(0.1), 10) == (0, 1)
            got = await _read_to_end(sock)
        finally:
            sock.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"Connection: close" in head, got
    assert json.loads(body)["error"]["message"] == SHUT_DOWN
    assert (path.counted(503), path.counted(200)) == (1, 0)


async def test_debug_route_cut_while_it_reads_its_body_gets_the_drains_503() -> None:
    """Its handler caught only ApiError: cut by the drain, its connection closed with no answer. It
    gets the drain's 503 now, as every request the drain cuts but a stream does."""
    path, drain = _Path([]), Drain()
    async with _front_door(path, drain) as port:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            head = b"POST /debug/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
            await loop.sock_sendall(sock, head + b"Expect: 100-continue\r\n\r\n")
            # Its 100 goes out as its handler reads the body, which this client never sends.
            continued = b"HTTP/1.1 100 Continue\r\n\r\n"
            async with asyncio.timeout(10):
                got = b""
                while len(got) < len(continued):
                    got += await loop.sock_recv(sock, len(continued) - len(got))
            assert got == continued
            assert await asyncio.wait_for(drain.finish(0.1), 10) == (0, 1)
            got = await _read_to_end(sock)
        finally:
            sock.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"Connection: close" in head, got
    assert json.loads(body)["error"]["message"] == SHUT_DOWN


class _Stalled(_Path):
    """Its worker's second chunk is more than a client that reads no more takes: the handler waits in
    that write (`writing`), not its stream's last, and the worker sends nothing after it."""

    def __init__(self, chunks: list[ResponseChunk]) -> None:
        super().__init__(chunks)
        self.writing = False

    async def stream(self, job: Any, arrived: float) -> AsyncIterator[ResponseChunk]:
        try:
            yield self._chunks[0]
            self.writing = True  # the handler takes the next chunk straight into its write
            yield self._chunks[1]
            await asyncio.Event().wait()
        finally:
            self.streamed = True


def _stalling_chunks() -> list[ResponseChunk]:
    big = b'"' + b"y" * (1 << 20) + b'"'  # over what the transport and the kernel hold for its client
    return [
        ResponseChunk(request_id="r1", seq=0, events=[b'{"n":0}']),
        ResponseChunk(request_id="r1", seq=1, events=[big]),
    ]


async def test_a_stream_cut_in_a_write_before_its_last_is_aborted_and_counted_503() -> None:
    """Cut in a mid-stream write, its error event and [DONE] then wait behind that write's bytes, for
    a client that reads no more. The cut was taken there, but the last write raised it again at once
    (aiohttp awaits the drain waiter the cut cancelled), where it read as its client leaving: counted
    499. It is the drain's: its connection is aborted once the drain's grace passed, counted 503."""
    path, drain = _Stalled(_stalling_chunks()), Drain()
    async with _front_door(path, drain) as port:
        sock = await _post(port, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "stream": True})
        try:
            await until(lambda: path.writing, 10, "the stream's second write")
            assert await asyncio.wait_for(drain.finish(0.1), 10) == (0, 1)
            # A client that reads no more: not before its request was counted. The drain's finish
            # can give up its wait first on a loaded box (CI once), and a client reading within the
            # grace gets the rest, [DONE] and a kept-alive connection that no read ends.
            await until(lambda: path.counted(503) + path.counted(499) + path.counted(200) > 0, 10, "counted")
            got = await _read_to_end(sock)
        finally:
            sock.close()
    assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"HTTP/1.1 ") == 1, got[:300]
    assert SHUT_DOWN.encode() not in got and b"[DONE]" not in got
    assert (path.counted(503), path.counted(499), path.counted(200)) == (1, 0, 0)


class _StalledClosing(_Stalled):
    """_Stalled, its chunks' close held until `closed` is set: its client can read what was queued."""

    def __init__(self, chunks: list[ResponseChunk]) -> None:
        super().__init__(chunks)
        self.closed = asyncio.Event()

    async def stream(self, job: Any, arrived: float) -> AsyncIterator[ResponseChunk]:
        try:
            async for chunk in super().stream(job, arrived):
                yield chunk
        finally:
            await self.closed.wait()


async def _read_until(sock: socket.socket, end: bytes) -> bytes:
    """What the client gets until it has `end` (its stream's last bytes)."""
    loop = asyncio.get_running_loop()
    got = b""
    async with asyncio.timeout(10):
        while end not in got:
            part = await loop.sock_recv(sock, 1 << 16)
            assert part, got[-300:]
            got += part
    return got


async def test_a_stream_cut_in_a_write_before_its_last_sends_that_writes_events_once() -> None:
    """Its write had queued its events when the cut took it, waiting for its client. They were kept to
    go out again with the error event: a client that read on got them twice. It gets them once now,
    then the drain's error event and [DONE]."""
    chunks = _stalling_chunks()
    big = chunks[1].events[0]
    path, drain = _StalledClosing(chunks), Drain()
    async with _front_door(path, drain) as port:
        sock = await _post(port, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "stream": True})
        try:
            await until(lambda: path.writing, 10, "the stream's second write")
            finishing = asyncio.create_task(drain.finish(0.1))
            await until(lambda: path.streamed, 10, "the cut stream's close")
            got = await _read_until(sock, big + b"\n\n")  # all it queued: its writes go on
            path.closed.set()
            got += await _read_until(sock, b"\r\n0\r\n\r\n")
            assert await asyncio.wait_for(finishing, 10) == (0, 1)
        finally:
            sock.close()
    assert got.count(big) == 1
    events = re.findall(rb"data: ([^\n]*)\n\n", got)
    assert json.loads(events[-2])["error"]["message"] == SHUT_DOWN and events[-1] == b"[DONE]"
    assert (path.counted(503), path.counted(200)) == (1, 0)


async def test_a_stream_cut_in_a_write_before_its_last_ends_for_a_client_that_reads_on() -> None:
    """Cut in a mid-stream write, its client reading only from then on: its last write raised the cut
    again at once (aiohttp's drain waiter, which the cut cancelled, stays until the transport's
    writing resumes), and the connection was aborted with that write's bytes queued, though its
    client was taking them. The last write waits for the transport now, in the drain's grace: the
    client gets all it was sent once, then the drain's error event and [DONE], counted 503."""
    chunks = _stalling_chunks()
    big = chunks[1].events[0]
    path, drain = _Stalled(chunks), Drain()
    async with _front_door(path, drain) as port:
        sock = await _post(port, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "stream": True})
        try:
            await until(lambda: path.writing, 10, "the stream's second write")
            finishing = asyncio.create_task(drain.finish(0.1))
            await until(lambda: path.streamed, 10, "the cut stream's close")  # its cut taken, its bytes queued
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # it reads on, at its own pace
            got = await _read_until(sock, b"\r\n0\r\n\r\n")  # not aborted: the stream's end
            assert await asyncio.wait_for(finishing, 10) == (0, 1)
        finally:
            sock.close()
    assert got.count(big) == 1
    events = re.findall(rb"data: ([^\n]*)\n\n", got)
    assert json.loads(events[-2])["error"]["message"] == SHUT_DOWN and events[-1] == b"[DONE]"
    assert (path.counted(503), path.counted(499), path.counted(200)) == (1, 0, 0)
