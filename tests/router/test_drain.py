"""The router's drain (RouterService.stop, on SIGTERM): the listener stays open while requests in
flight finish, `/ready` and new requests answer 503 (a client, or a load balancer that has not yet
dropped this router, retries elsewhere rather than meeting a refused connection); what still runs
when `drain_s` is over is ended with a 503 (a stream: an error event and `[DONE]`) and its legs
cancelled on the workers."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest

from router.service import RouterService, RouterStatus
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until
from tests.router.test_slow_readers import counted, cut_short, stalled_whole

SHUT_DOWN = "the router shut down before the request ended"


async def _events(resp: aiohttp.ClientResponse) -> list[bytes]:
    """Every SSE event's payload until the stream ends, however it ends (a cut one too)."""
    out = []
    try:
        async for line in resp.content:
            if line.startswith(b"data: "):
                out.append(line[6:].strip())
    except aiohttp.ClientPayloadError:
        pass
    return out


async def _long_stream(http: aiohttp.ClientSession, router: RouterService, max_tokens: int) -> aiohttp.ClientResponse:
    body = {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    resp = await http.post(router.url + "/v1/completions", json=body)
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: ")  # tokens are flowing
    return resp


async def _stopping(router: RouterService) -> asyncio.Task[None]:
    task = asyncio.create_task(router.stop())
    await until(lambda: router.status is RouterStatus.STOPPING, what="the router draining")
    return task


async def test_while_draining_new_requests_and_ready_are_503s_and_a_stream_in_flight_finishes(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add_worker("agg", speedup=4.0)
    router = await cluster.add_ready_router()
    url = router.url
    resp = await _long_stream(http, router, 300)
    stopping = await _stopping(router)

    async with http.get(url + "/ready") as r:
        ready: dict[str, Any] = await r.json()
        assert r.status == 503 and ready["ready"] is False
        assert any(p.startswith("draining (SIGTERM)") for p in ready["problems"]), ready["problems"]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        async with http.request("GET" if path == "/v1/models" else "POST", url + path, json=body) as r:
            refused: dict[str, Any] = await r.json()
            assert r.status == 503, (path, refused)
            assert refused["error"]["type"] == "ServiceUnavailableError" and refused["error"]["code"] == 503
            assert r.headers["Retry-After"] == "1" and r.headers["Connection"].lower() == "close"
    async with http.get(url + "/v1/models", headers={"Expect": "200-ok"}) as r:
        assert r.status == 503  # the drain's answer, ahead of a 417 (before: aiohttp's text 417)
    for alive in ("/health", "/ping"):
        async with http.get(url + alive) as r:
            assert r.status == 200, alive  # alive: liveness must not kill a draining router

    events = await _events(resp)
    assert events[-1] == b"[DONE]" and b'"error"' not in b"".join(events)
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    await asyncio.wait_for(stopping, 30)
    with pytest.raises(aiohttp.ClientConnectorError):  # the drain over, the listener is closed
        await http.get(url + "/ready")


async def test_at_the_end_of_the_drain_a_stream_gets_an_error_event_and_done_and_its_leg_is_cancelled(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    worker = await cluster.add_worker("agg", speedup=1.0)
    router = await cluster.add_router(config={"drain_s": 1.0})
    await cluster.ready(router)
    stream = await _long_stream(http, router, 20_000)  # minutes of tokens
    whole = asyncio.create_task(
        http.post(
            router.url + "/v1/completions",
            json={"model": MODEL, "prompt": list(range(1, 50)), "max_tokens": 20_000, "ignore_eos": True},
        )
    )
    legs = worker.shim.requests
    assert legs is not None
    await until(lambda: len(legs.inflight) == 2, what="both requests on the worker")

    with caplog.at_level(logging.INFO, logger="router.service"):
        await asyncio.wait_for(await _stopping(router), 30)
    # the operator's log says what the drain cut
    assert "2 requests still running after the 1s drain: ended with a 503" in caplog.text
    assert "s: 0 requests finished, 2 cut (answered 503, or an error event)" in caplog.text

    events = await _events(stream)
    assert events[-1:] == [b"[DONE]"], events[-3:]
    error = json.loads(events[-2])["error"]
    assert error == {"message": SHUT_DOWN, "type": "ServiceUnavailableError", "param": None, "code": 503}
    resp = await asyncio.wait_for(whole, 30)
    assert resp.status == 503 and (await resp.json())["error"]["message"] == SHUT_DOWN
    # The legs were cancelled on the worker, not left to run for minutes.
    await until(lambda: not legs.inflight, what="the worker's legs cancelled")


async def test_a_whole_answer_its_client_does_not_read_is_cut_at_the_drains_end(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Its head went out, so no 503 can follow: its connection is aborted and it counts as the
    drain's 503. Before, aiohttp wrote it after the handler had counted a 200, and the drain, which
    waits on handlers, neither waited for nor cut it."""
    await cluster.add_worker("agg", num_gpu_blocks=1024)
    router = await cluster.add_router(config={"drain_s": 1.0, "request_timeout_s": 60.0})
    await cluster.ready(router)
    sock = await stalled_whole(router)
    try:
        # Its booking is released when the answer's last chunk arrives, before it is written.
        await until(lambda: router.path.admission.throughput(MODEL).rate() > 0, what="the answer collected")
        with caplog.at_level(logging.WARNING, logger="kvswitch.router"):
            await asyncio.wait_for(await _stopping(router), 30)
        assert "still running after the 1s drain" in caplog.text
        assert (counted(router, 503), counted(router, 200)) == (1, 0)
        await cut_short(sock)
    finally:
        sock.close()


async def test_the_drains_end_and_the_stop_are_said_last(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 a router's log ended at "draining": neither how the drain ended nor that the
    stop was done (its lease revoked, its connections closed) was said."""
    await cluster.add_worker("agg", speedup=4.0)
    router = await cluster.add_ready_router()
    resp = await _long_stream(http, router, 100)
    caplog.set_level(logging.INFO)
    caplog.clear()
    stopping = await _stopping(router)
    events = await _events(resp)
    assert events[-1] == b"[DONE]" and b'"error"' not in b"".join(events)
    await asyncio.wait_for(stopping, 30)
    said = [r.getMessage() for r in caplog.records if r.name == "router.service"]
    assert said[-1] == f"router {router.router_id} stopped", said
    (drained,) = [line for line in said if line.startswith("drained in ")]
    assert drained.endswith("s: 1 requests finished, 0 cut (answered 503, or an error event)"), drained
    assert said.index(drained) < len(said) - 1
    revoked = [i for i, r in enumerate(caplog.records) if r.name.startswith("discovery") and "revoke" in r.getMessage()]
    stopped = next(i for i, r in enumerate(caplog.records) if r.getMessage() == said[-1])
    assert all(i < stopped for i in revoked), [r.getMessage() for r in caplog.records]
