"""One budget for the bytes a replica holds for all its clients (router.client_buffers,
--client-buffer-mib). Before (slow-consumer audit, 2026-12-07), only each stream was bounded (8 MiB):
100 streaming clients that stopped reading held 8.2 MB each, 30 whole answers 818 MB until their
deadline with the engines idle, nothing refused or showed it, and kvswitch_router_inflight_requests
read 0 while the answers were still held."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

import aiohttp
import pytest

from router.dispatch import Dispatcher
from router.leg import Leg
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until
from tests.router.test_slow_readers import clean, counted, cut_short, stalled_stream, stalled_whole

BUDGET = 256 << 10


def sample(router: RouterService, name: str, labels: dict[str, str] | None = None) -> float:
    value = router.metrics.registry.get_sample_value(name, labels or {})
    assert value is not None, name
    return value


async def read_to_end(sock: socket.socket) -> bytes:
    got = b""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        with contextlib.suppress(ConnectionResetError):
            while not got.endswith(b"0\r\n\r\n") and (part := await loop.sock_recv(sock, 1 << 16)):
                got += part
    return got


async def test_slow_streams_are_held_under_one_budget_the_furthest_behind_cut_first(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The most held for clients after any chunk came, and at each cut the cut stream's queue with
    # the longest of the others'.
    peak = chunk = 0
    push = Leg.push

    def recording(leg: Leg, item: Any, size: int = 0) -> None:
        nonlocal peak, chunk
        push(leg, item, size)
        peak, chunk = max(peak, leg.owner.buffers.held), max(chunk, size)

    monkeypatch.setattr(Leg, "push", recording)
    at_cut: list[tuple[int, int]] = []
    over_budget = Dispatcher._over_budget

    async def cutting(d: Dispatcher, leg: Leg) -> None:
        at_cut.append((leg.queued, max(other.queued for other in d._streams())))
        await over_budget(d, leg)

    monkeypatch.setattr(Dispatcher, "_over_budget", cutting)
    await cluster.add_worker("agg", speedup=50.0, num_gpu_blocks=8192)
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": BUDGET})
    await cluster.ready(router)
    buffers = router.dispatcher.buffers
    slow = [await stalled_stream(router, 30_000) for _ in range(3)]
    try:
        await until(lambda: buffers.held > BUDGET // 2, timeout=10.0, what="the slow clients' chunks held")
        # the gauge reads what is held (no chunk comes between the two reads: no await between them)
        assert sample(router, "kvswitch_router_client_buffered_bytes") == buffers.held > 0
        assert sample(router, "kvswitch_router_client_buffer_budget_bytes") == BUDGET
        # a client that reads, beside them, is served whole
        body = {"model": MODEL, "prompt": "hi " * 10, "max_tokens": 300, "stream": True, "ignore_eos": True}
        async with http.post(f"{router.url}/v1/completions", json={**body, "logprobs": 5}) as resp:
            lines = [line async for line in resp.content if line.startswith(b"data: ")]
        assert resp.status == 200 and lines[-1] == b"data: [DONE]\n", lines[-2:]
        assert len(lines) == 301 and not any(b'"error"' in line for line in lines)
        await until(lambda: router.dispatcher.slow_readers == 3, timeout=15.0, what="the three slow streams cut")
        cut = {"what": "stream"}
        assert sample(router, "kvswitch_router_client_buffer_cuts_total", cut) == 3
        assert b"kvswitch_router_slow_readers_total 3.0" in router.metrics.render()
        assert at_cut and all(mine == most for mine, most in at_cut), at_cut
        assert peak <= BUDGET + chunk, (peak, chunk)
        for sock in slow:
            events = (await read_to_end(sock)).split(b"\r\n\r\n", 1)[1]
            assert events.rstrip(b"\r\n0").endswith(b"data: [DONE]"), events[-300:]
            error = json.loads(events.rsplit(b"data: ", 2)[1].split(b"\n")[0])["error"]
            assert error["code"] == 408 and "read the stream too slowly" in error["message"], error
            assert "--client-buffer-mib" in error["message"], error
    finally:
        for sock in slow:
            sock.close()
    await until(lambda: clean(router), what="the requests ended")
    assert counted(router, 408) == 3 and counted(router, 200) == 1
    assert buffers.held == 0 and sample(router, "kvswitch_router_client_buffered_bytes") == 0


async def test_an_answer_still_being_written_counts_in_flight(cluster: Cluster) -> None:
    """The engine is done and the leg ended, but the answer is still being written to a client that
    reads nothing: until 2026-12-07 the gauge read 0 then."""
    await cluster.add_worker("agg", num_gpu_blocks=1024)
    router = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(router)
    sock = await stalled_whole(router)
    try:
        await until(lambda: router.dispatcher.inflight_legs == 1, what="its leg sent")
        await until(lambda: not router.dispatcher.inflight_legs, timeout=10.0, what="its leg ended")
        assert counted(router, 200) == counted(router, 504) == 0  # not answered yet
        assert router.path.inflight == 1 and sample(router, "kvswitch_router_inflight_requests") == 1
    finally:
        sock.close()
    await until(lambda: clean(router), what="the request ended")
    assert sample(router, "kvswitch_router_inflight_requests") == 0


async def test_whole_answers_past_the_budget_end_the_one_held_before(cluster: Cluster) -> None:
    await cluster.add_worker("agg", num_gpu_blocks=1024)
    probe = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(probe)
    sock = await stalled_whole(probe)
    try:  # the size of one answer, held while its client reads nothing; the gauge reads it
        await until(lambda: probe.dispatcher.buffers.held > 0, timeout=10.0, what="an answer held")
        size = probe.dispatcher.buffers.held
        assert sample(probe, "kvswitch_router_client_buffered_bytes") == size
    finally:
        sock.close()
    await until(lambda: clean(probe), what="the probe's request ended")
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": size * 3 // 2})
    await cluster.ready(router)
    buffers = router.dispatcher.buffers
    first = await stalled_whole(router)
    second: socket.socket | None = None
    try:
        await until(lambda: buffers.held == size, timeout=10.0, what="the first answer held")
        second = await stalled_whole(router)
        # the second, held, ends the first: both would be over the budget
        await until(lambda: counted(router, 408) == 1, timeout=10.0, what="the first answer ended")
        await cut_short(first)
        assert buffers.held == size and buffers.cuts == {"answer": 1}
        assert sample(router, "kvswitch_router_client_buffer_cuts_total", {"what": "answer"}) == 1
        assert router.path.inflight == 1 and counted(router, 504) == 0
    finally:
        first.close()
        if second is not None:
            second.close()
    await until(lambda: clean(router), what="the requests ended")
    assert buffers.held == 0


async def test_a_whole_answer_larger_than_the_budget_is_refused_before_its_head(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add_worker("agg", num_gpu_blocks=1024)
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": 64 << 10})
    await cluster.ready(router)
    body = {"model": MODEL, "prompt": list(range(1, 2001)), "max_tokens": 1, "prompt_logprobs": 20}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        error = (await resp.json())["error"]
    assert resp.status == 503 and "--client-buffer-mib" in error["message"], error
    assert router.dispatcher.buffers.cuts == {"answer": 1} and router.dispatcher.buffers.held == 0
