"""End to end, faults between a shim and its engine that the router must see through: an engine
the shim takes for hung (no progress for --stall-limit-s) with legs in flight on it, one it takes
out as busy or down, whose legs run on, watched, until they end or it hangs, an engine that answers
429, and a stream the engine (or a proxy before it) cuts after a finish_reason, without [DONE]."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from engine_sim.config import SimConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_port
from protocol.config import EtcdSettings, NatsSettings
from protocol.messages import RETRY_AFTER_MAX_S
from router.service import RouterService
from tests.router.conftest import BLOCK, MODEL, Cluster, Worker, complete, probe_settled
from tests.router.polling import until
from worker_shim import ShimConfig, WorkerShim

# vLLM's error body, as its create_error_response writes it, for a 429 (a gateway's or a rate
# limiter's before the engine; vLLM itself answers with this shape)
BUSY = b'{"error":{"message":"too many requests in flight","type":"RateLimitError","param":null,"code":429}}'
Answer = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse | None]]


class EngineProxy:
    """A pass-through in front of a sim; while `answer` is set, it answers the generation requests
    itself (None: passed on)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.answer: Answer | None = None
        self.answered = 0
        self.health: int | None = None  # set: /health answers this status itself
        self.probe_delay_s = 0.0  # /health and /metrics answer this late (an API server too loaded)
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path in ("/health", "/metrics") and self.probe_delay_s:
            await asyncio.sleep(self.probe_delay_s)
        if request.path == "/health" and self.health is not None:
            return web.Response(status=self.health)
        raw = await request.read()
        if self.answer is not None and request.path in ("/v1/completions", "/v1/chat/completions"):
            own = await self.answer(request, json.loads(raw))
            if own is not None:
                self.answered += 1
                return own
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(
            request.method, self.upstream + str(request.rel_url), data=raw, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
            return resp

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()


async def proxied_worker(cluster: Cluster, **settings: Any) -> tuple[Worker, EngineProxy]:
    """An agg worker whose shim reaches its sim through an EngineProxy (cluster.add_worker's
    settings otherwise, `settings`: ShimConfig fields over them); the proxy stops with the cluster's
    workers (the caller's finally)."""
    sim = SimServer(SimConfig(speedup=200.0, num_gpu_blocks=512, block_size=BLOCK, role="agg"))
    await sim.start()
    proxy = EngineProxy(sim.url)
    await proxy.start()
    shim = WorkerShim(
        ShimConfig(
            engine="vllm",
            engine_url=proxy.url,
            role="agg",
            model=sim.config.model,
            kv_events=sim.events_endpoint,
            kv_events_mode="connect",
            kv_replay=sim.replay_endpoint,
            namespace=cluster.ns,
            lease_ttl=10,
            health_interval_s=0.1,
            drain_grace_s=1.0,
            timing_profile="h200:llama-3.1-8b",
            **settings,
        ),
        NatsSettings(servers=[cluster.nats_url]),
        EtcdSettings(endpoints=[cluster.etcd_url]),
    )
    await shim.start()
    await asyncio.wait_for(shim.registered.wait(), 20)
    await probe_settled(shim)
    worker = Worker("agg", sim, shim)
    cluster.workers.append(worker)
    return worker, proxy


def all_routable(router: RouterService) -> bool:
    return all(s.routable for s in router.eligibility.statuses(router.registry.workers()))


async def stream(http: aiohttp.ClientSession, url: str, **body: Any) -> tuple[int, list[bytes], float]:
    """A streamed completion: its status, its SSE payloads, and how long it took."""
    started = time.monotonic()
    payload = {"model": MODEL, "prompt": list(range(1, 400)), "max_tokens": 8, "stream": True, **body}
    async with http.post(url + "/v1/completions", json=payload) as resp:
        raw = await resp.read()
    events = [line[6:] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    return resp.status, events, time.monotonic() - started


# --- an engine the shim takes for hung, with legs in flight ----------------------------------------


async def test_a_leg_on_an_engine_taken_for_hung_is_retried_on_another_worker_at_once(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Before: the hung worker's shim deregistered it after its stall limit, but its legs ran on,
    heartbeats beating, so the router read them alive until the request's deadline: a 504 at 25 s
    where a healthy second worker could have answered at once."""
    shim = {"stall_limit_s": 2.0}
    workers = [await cluster.add_worker("agg", shim=shim), await cluster.add_worker("agg", shim=shim)]
    router = await cluster.add_router(config={"request_timeout_s": 25.0})
    await cluster.ready(router)
    prompt = list(range(1, 400))
    status, _, headers = await complete(http, router, prompt)  # its blocks now cached on one worker
    assert status == 200
    hung = next(w for w in workers if w.id == headers["x-kvswitch-decode-worker"])
    healthy = next(w for w in workers if w is not hung)
    hung.sim.faults.hang_after = hung.sim.faults.requests_seen  # the next request hangs its engine
    started = time.monotonic()
    status, body, headers = await complete(http, router, prompt, max_tokens=8)
    took = time.monotonic() - started
    assert status == 200, body
    assert hung.sim.faults.hang and hung.sim.faults.requests_seen > 0  # it went to the hung engine first
    assert headers["x-kvswitch-decode-worker"] == healthy.id
    assert body["kvswitch"]["attempts"] == 2 and body["usage"]["completion_tokens"] == 8
    assert took < 12.0, took  # the stall limit (2 s) and the watchdog's look, not the 25 s deadline
    assert hung.shim.requests is not None
    assert hung.shim.requests.outcomes[("agg", "engine_unavailable")] == 1
    assert not hung.shim.requests.inflight
    hung.sim.faults.hang = False


async def test_a_stream_under_way_on_an_engine_taken_for_hung_ends_with_an_error_event(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """A leg that had streamed tokens cannot be retried: its client gets an error event and [DONE]
    once the shim takes the engine for hung, not at the request's deadline."""
    w = await cluster.add_worker("agg", shim={"stall_limit_s": 2.0}, speedup=1.0)
    router = await cluster.add_router(config={"request_timeout_s": 25.0})
    await cluster.ready(router)
    payload = {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": 3000, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    events: list[bytes] = []
    async with http.post(router.url + "/v1/completions", json=payload) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
                if len(events) == 3:
                    w.sim.faults.hang = True  # the engine stops mid-stream
    took = time.monotonic() - started
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and "failed while streaming" in error["message"], error
    assert took < 15.0, took
    assert w.shim.requests is not None and w.shim.requests.outcomes[("agg", "engine_unavailable")] == 1
    w.sim.faults.hang = False


async def read_stream(
    http: aiohttp.ClientSession, url: str, payload: dict[str, Any], on_event: Callable[[int], None]
) -> list[bytes]:
    """A streamed completion's SSE payloads; `on_event(n)` after the n-th."""
    events: list[bytes] = []
    async with http.post(url + "/v1/completions", json=payload) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
                on_event(len(events))
    return events


def whole(events: list[bytes], tokens: int) -> None:
    """A stream of `tokens` tokens that ended well: no error event, finish_reason length."""
    assert events[-1] == b"[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    assert not [b for b in bodies if "error" in b], bodies[-1]
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for b in bodies if b["choices"] and b["choices"][0]["text"]) == tokens


async def test_a_busy_engine_late_on_its_health_checks_keeps_its_streams(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """/health unanswered past --busy-limit-s while the engine streams steadily (vLLM under
    saturation misses 2 s deadlines): deregistered, its streams left to finish. Before, they were cut
    with an error event: with the default limits at 33 s, after 6,086 tokens, no gap over 0.12 s."""
    # busy_limit_s 2: deregistered on the second late check (2.5 s apart: the 2 s probe and the
    # interval), after ~2,000 of the 6,000 tokens at speedup 2
    w = await cluster.add_worker("agg", shim={"busy_limit_s": 2.0, "health_interval_s": 0.5}, speedup=2.0)
    router = await cluster.add_ready_router()
    payload = {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": 6000, "ignore_eos": True, "stream": True}
    w.sim.faults.health_delay_s = 2.5  # past the shim's 2 s probe: busy; generation untouched

    out_at: list[int] = []  # the events read while the worker was deregistered

    def taken_out(n: int) -> None:
        if not w.shim.registered.is_set():
            out_at.append(n)

    with caplog.at_level(logging.WARNING, logger="worker_shim.shim"):
        events = await read_stream(http, router.url, payload, taken_out)
    whole(events, 6000)
    assert out_at and out_at[0] < 5000, out_at[:1]  # it streamed on, deregistered
    assert w.shim.requests is not None and w.shim.requests.outcomes[("agg", "ok")] == 1
    assert w.shim.requests.outcomes[("agg", "engine_unavailable")] == 0
    assert "has not answered a health check" in caplog.text and "left to finish, watched for a stall" in caplog.text
    w.sim.faults.health_delay_s = 0.0


async def test_a_busy_engine_late_on_health_and_metrics_keeps_its_non_streamed_leg(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """One API server too loaded to answer /health or /metrics in time, its engine working. Before,
    a non-streamed leg (no output to show until its end) was cut past --busy-limit-s: the late
    step and KV readings read as "nothing moved since the checks began to fail"."""
    w, proxy = await proxied_worker(cluster, busy_limit_s=3.0)
    try:
        w.sim.faults.slowdown = 100.0  # about half a real H200's speed: some seconds of decode
        router = await cluster.add_ready_router()
        payload = {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": 2500, "ignore_eos": True}
        started = time.monotonic()
        task = asyncio.create_task(http.post(router.url + "/v1/completions", json=payload))
        assert w.shim.requests is not None
        await until(lambda: bool(w.shim.requests and w.shim.requests.inflight), what="the leg")
        proxy.probe_delay_s = 2.5  # past the shim's 2 s health probe: busy
        await until(lambda: not w.shim.registered.is_set(), timeout=20, what="deregistered as busy")
        async with await task as resp:
            assert resp.status == 200, await resp.text()
            body = await resp.json()
        assert body["usage"]["completion_tokens"] == 2500
        assert time.monotonic() - started > 5.0  # it ran past the busy limit's deregistration
        assert w.shim.requests.outcomes[("agg", "ok")] == 1
        assert w.shim.requests.outcomes[("agg", "engine_unavailable")] == 0
    finally:
        proxy.probe_delay_s = 0.0
        await proxy.stop()


async def test_a_leg_left_running_on_a_busy_engine_is_ended_once_that_engine_hangs(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Deregistered as busy, its stream left to run: the engine then stops stepping. The stall
    watchdog still watches the legs left running, and ends this one about --stall-limit-s after the
    hang. Before, legs left running were watched no more: it hung to the request's deadline."""
    stall_limit_s = 4.0
    w = await cluster.add_worker(
        "agg", shim={"busy_limit_s": 2.0, "health_interval_s": 0.5, "stall_limit_s": stall_limit_s}, speedup=1.0
    )  # busy_limit_s 2: deregistered on the second late check (2.5 s apart: the 2 s probe and the interval)
    router = await cluster.add_router(config={"request_timeout_s": 60.0})
    await cluster.ready(router)
    payload = {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": 6000, "ignore_eos": True, "stream": True}
    w.sim.faults.health_delay_s = 2.5  # past the shim's 2 s probe: busy; generation untouched
    hung_at: list[float] = []
    left_running: list[int] = []

    def hang_once_left_running(n: int) -> None:
        if not w.shim.registered.is_set() and not hung_at:
            left_running.append(n)
            if len(left_running) == 100:  # a hundred events streamed after the deregistration
                w.sim.faults.hang = True
                hung_at.append(time.monotonic())

    try:
        events = await asyncio.wait_for(read_stream(http, router.url, payload, hang_once_left_running), 40)
        ended_at = time.monotonic()
        assert hung_at, "the stream ended before the engine hung"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 502 and "failed while streaming" in error["message"], error
        assert w.shim.requests is not None
        assert w.shim.requests.outcomes[("agg", "engine_unavailable")] == 1
        # The stall limit, the watchdog's looks 2.5 s apart (/health late) and fresh readings.
        assert stall_limit_s - 0.5 < ended_at - hung_at[0] < stall_limit_s + 8.0, ended_at - hung_at[0]
    finally:
        w.sim.faults.hang = False
        w.sim.faults.health_delay_s = 0.0


@pytest.mark.parametrize("failures", [2, 1])
async def test_a_draining_engine_refusing_its_health_checks_keeps_its_streams(
    cluster: Cluster, http: aiohttp.ClientSession, failures: int
) -> None:
    """SGLang on SIGTERM: /health 503 while it finishes the requests it has. Before, the shim took it
    for down after --health-failures checks and cut its streams within 2 s; later (2026-12-06) still
    with --health-failures 1, the first failed check its own "since the checks began to fail"."""
    w, proxy = await proxied_worker(cluster, health_failures=failures)
    try:
        w.sim.faults.slowdown = 100.0  # about half a real H200's speed: some seconds of stream
        router = await cluster.add_ready_router()
        payload = {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": 1000, "ignore_eos": True,
                   "stream": True}  # fmt: skip

        def drain(n: int) -> None:
            if n == 20:
                proxy.health = 503

        events = await read_stream(http, router.url, payload, drain)
        whole(events, 1000)
        assert not w.shim.registered.is_set()
        assert w.shim.requests is not None and w.shim.requests.outcomes[("agg", "ok")] == 1
    finally:
        await proxy.stop()


async def test_a_leg_on_an_engine_down_and_hung_is_ended_by_the_stall_watchdog(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """/health failing and nothing moving: deregistered at once, the leg ended with a retryable 503
    by the stall watchdog, --stall-limit-s on. Failed checks prove no hang (a draining engine
    fails them while it finishes its work): before, such a leg was ended at once."""
    stall_limit_s = 3.0
    w, proxy = await proxied_worker(cluster, stall_limit_s=stall_limit_s)
    try:
        router = await cluster.add_router(config={"request_timeout_s": 25.0})
        await cluster.ready(router)
        w.sim.faults.hang = True
        task = asyncio.create_task(complete(http, router, list(range(1, 40)), max_tokens=4))
        assert w.shim.requests is not None
        await until(lambda: bool(w.shim.requests and w.shim.requests.inflight), what="the leg")
        started = time.monotonic()
        proxy.health = 503
        await until(lambda: not w.shim.registered.is_set(), what="deregistered as down")
        assert w.shim.requests.inflight, "the down path ended the leg"
        status, _, _ = await task
        assert status == 503
        assert stall_limit_s - 0.5 < time.monotonic() - started < stall_limit_s + 6.0
        assert w.shim.requests.outcomes[("agg", "engine_unavailable")] == 1
        w.sim.faults.hang = False
    finally:
        await proxy.stop()


async def test_a_decode_leg_pulling_on_an_engine_that_hangs_is_ended_by_the_stall_watchdog(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """A decode engine hung (and late on /health: deregistered as busy) while its leg waits for its
    KV pull. A pull is exempt for one stall limit from its start, then judged like any other work:
    the leg ends with a 503 after one more stall limit without progress. Before, the pull's exempt
    leg counted as "moved", the busy path left it running, unwatched, to the request's deadline."""
    stall_limit_s = 4.0
    await cluster.add_worker("prefill")
    d = await cluster.add_worker(
        "decode", shim={"busy_limit_s": 3.0, "health_interval_s": 0.5, "stall_limit_s": stall_limit_s}
    )
    router = await cluster.add_router(config={"request_timeout_s": 60.0}, disagg="always")
    await cluster.ready(router)
    d.sim.faults.hang = True
    try:
        request = asyncio.create_task(complete(http, router, list(range(400)), max_tokens=5))
        assert d.shim.requests is not None
        await until(lambda: bool(d.shim.adapter.pulling), timeout=20, what="the decode leg's pull")
        started = time.monotonic()
        d.sim.faults.health_delay_s = 2.5
        status, body, _ = await asyncio.wait_for(request, 40)
        took = time.monotonic() - started
        assert status == 503, body
        assert d.shim.requests.outcomes[("decode", "engine_unavailable")] == 1
        # Exempt for one stall limit, judged for a second; the watchdog looks 2.5 s apart.
        assert 2 * stall_limit_s - 0.5 < took < 2 * stall_limit_s + 8.0, took
    finally:
        d.sim.faults.hang = False
        d.sim.faults.health_delay_s = 0.0


# --- an engine's 429 ---------------------------------------------------------------------------------


async def refuse(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    return web.Response(status=429, body=BUSY, content_type="application/json", headers={"Retry-After": "1"})


async def test_an_engines_429_is_retried_on_another_worker(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    """Before: a 502 "the worker failed while serving the request", never retried."""
    busy, proxy = await proxied_worker(cluster)
    try:
        await cluster.add_worker("agg")
        router = await cluster.add_ready_router()
        proxy.answer = refuse
        answers = [await complete(http, router, list(range(i * 100, i * 100 + 40)), max_tokens=2) for i in range(6)]
        assert [status for status, _, _ in answers] == [200] * 6, answers
        assert proxy.answered > 0  # some went to the busy engine first
        assert router.dispatcher.retries == proxy.answered
        assert all(headers["x-kvswitch-decode-worker"] != busy.id for _, _, headers in answers)
        assert all_routable(router), "a busy engine is no failed worker"
    finally:
        await proxy.stop()


async def test_an_engines_429_on_every_worker_is_the_clients_429_with_its_retry_after(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    _, proxy = await proxied_worker(cluster)
    try:
        router = await cluster.add_ready_router()
        proxy.answer = refuse
        caplog.set_level(logging.INFO, logger="router")
        caplog.clear()
        for streamed in (False, True):
            payload = {"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 2, "stream": streamed}
            async with http.post(router.url + "/v1/completions", json=payload) as resp:
                assert resp.status == 429, await resp.text()
                assert resp.headers["Retry-After"] == "1"
                assert await resp.read() == BUSY  # the engine's own words, as for its other refusals
        assert all_routable(router)
        # Told apart from the router's own admission 429s (requests_total counts both alike).
        async with http.get(router.url + "/metrics") as resp:
            text = await resp.text()
        assert 'kvswitch_router_engine_refusals_total{status="429"} 2.0' in text
        assert 'kvswitch_router_engine_refusals_total{status="408"} 0.0' in text
        # An overloaded fleet is no fault: each such request is said at INFO, as an engine's other
        # refusals are (until 2026-12-07 a WARNING per request, with no cap).
        said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("router")]
        assert [level for level, _ in said] == [logging.INFO] * 2, said
        assert all("failed before its first output" in line and line.endswith("a 429") for _, line in said), said
    finally:
        await proxy.stop()


async def test_an_engines_retry_after_past_a_day_is_a_day_and_the_worker_stays_routable(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Retry-After 99999999999999999999: the shim's final chunk overflowed its encoder and never went
    ("Task exception was never retrieved"), and the router, hearing nothing after the last
    heartbeat, took the worker for unreachable."""

    async def far_off(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        headers = {"Retry-After": "99999999999999999999"}
        return web.Response(status=429, body=BUSY, content_type="application/json", headers=headers)

    w, proxy = await proxied_worker(cluster)
    try:
        router = await cluster.add_ready_router()
        proxy.answer = far_off
        started = time.monotonic()
        payload = {"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 2}
        async with http.post(router.url + "/v1/completions", json=payload) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == str(RETRY_AFTER_MAX_S)
        assert time.monotonic() - started < 5.0
        assert all_routable(router)
        assert w.shim.requests is not None and not w.shim.requests.inflight
    finally:
        await proxy.stop()


# --- a stream cut after a finish_reason, without [DONE] ----------------------------------------------


def cut_after(*events: bytes) -> Answer:
    """The engine's stream: `events`, then a clean EOF with no [DONE] (and no usage event)."""

    async def answer(request: web.Request, body: dict[str, Any]) -> web.StreamResponse | None:
        if not body.get("stream"):
            return None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(b"data: " + event + b"\n\n")
        await resp.write_eof()
        return resp

    return answer


def event(index: int, text: str, finish: str | None) -> bytes:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                       "choices": [choice]}).encode()  # fmt: skip


async def test_a_stream_cut_after_one_finish_reason_is_no_whole_answer(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """n=2 with choice 1 unfinished, and include_usage asked with its usage event never sent: before,
    the router added [DONE] and the client took the cut answer for a whole one."""
    w, proxy = await proxied_worker(cluster)
    try:
        router = await cluster.add_ready_router()
        assert w.shim.requests is not None
        cases: list[tuple[dict[str, Any], Answer]] = [
            ({"n": 2}, cut_after(event(0, " a", None), event(1, " b", None), event(0, " c", "length"))),
            ({"stream_options": {"include_usage": True}}, cut_after(event(0, " a", None), event(0, " c", "length"))),
        ]
        for extra, answer in cases:
            proxy.answer = answer
            status, events, _ = await stream(http, router.url, max_tokens=2, **extra)
            assert status == 200 and events[-1] == b"[DONE]"
            error = json.loads(events[-2])["error"]  # after the events it did send, an error, not a whole answer
            assert error["code"] == 502, events
        assert w.shim.requests.outcomes[("agg", "engine_protocol")] == 2
        await until(lambda: w.shim.requests is not None and not w.shim.requests.inflight, what="legs ended")
    finally:
        await proxy.stop()
