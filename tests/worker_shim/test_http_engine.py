"""What the adapters of HTTP-served engines share (worker_shim.adapters.http_engine): a body that
is not UTF-8 is the engine's protocol error, naming the byte, never a UnicodeDecodeError, whose
repr carries the whole body into the log (the audit's bad_engine_proxy.py `nonutf8`: an ERROR,
a traceback and a 21,269-character line at each load poll)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from protocol import ConfigError, SamplingParams
from tests.worker_shim.cluster import served
from worker_shim import ShimConfig
from worker_shim.adapters import EngineAdapter, EngineError, EngineHealth, make_adapter
from worker_shim.adapters.base import LegRequest
from worker_shim.adapters.http_engine import HttpEngineAdapter, utf8_text
from worker_shim.adapters.sglang import SglangAdapter
from worker_shim.config import EngineKind

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
METRICS = {
    "vllm": FIXTURES / "vllm-0.32" / "bs32" / "metrics_after.txt",
    "sglang": FIXTURES / "sglang" / "metrics.txt",
    "trtllm": FIXTURES / "trtllm" / "metrics.json",
}

# a token-id leg: SGLang's own /generate
LEG = LegRequest(request_id="r1", model="m", token_ids=[7, 8, 9], sampling=SamplingParams())


async def _ignore(tokens: int, events: list[bytes], ids: list[int]) -> None:
    pass


def test_a_body_that_is_not_utf8_is_the_engines_protocol_error_naming_the_byte() -> None:
    assert utf8_text(b"vllm:x 1\n", "http://e/metrics") == "vllm:x 1\n"
    with pytest.raises(EngineError) as err:
        utf8_text(b"# HELP \xc3( x\n", "http://e/metrics")
    assert (err.value.code, err.value.kind) == (502, "engine_protocol")
    assert err.value.message == "http://e/metrics is not UTF-8 text (byte 7)"
    assert err.value.__cause__ is None and err.value.__suppress_context__  # the body stays out of the log


async def _failure(engine: EngineKind, call: str) -> tuple[str, EngineError]:
    body = b"\xff\xfe" + METRICS[engine].read_bytes()

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with served(app) as url:
        adapter: EngineAdapter = make_adapter(
            ShimConfig(engine=engine, engine_url=url, model="m", kv_events="tcp://127.0.0.1:9")
        )
        await adapter.open()
        try:
            with pytest.raises(EngineError) as err:
                await getattr(adapter, call)()
        finally:
            await adapter.close()
    return url, err.value


@pytest.mark.parametrize(("engine", "call"), [("vllm", "load"), ("vllm", "limits"), ("sglang", "load")])
async def test_a_prometheus_metrics_not_utf8_fails_as_the_engines_protocol_error(engine: EngineKind, call: str) -> None:
    url, err = await _failure(engine, call)
    assert (err.code, err.kind, err.message) == (502, "engine_protocol", f"{url}/metrics is not UTF-8 text (byte 0)")


@pytest.mark.parametrize("call", ["load", "limits"])
async def test_a_trtllm_metrics_that_is_not_utf8_fails_as_the_engines_protocol_error(call: str) -> None:
    """TensorRT-LLM's /metrics is JSON, which msgspec decodes from the bytes: already an EngineError."""
    url, err = await _failure("trtllm", call)
    assert (err.code, err.kind) == (502, "engine_protocol") and err.message.startswith(
        f"{url}/metrics answered no JSON"
    )


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
async def test_an_engine_that_refuses_connections_is_said_in_a_few_words(engine: EngineKind) -> None:
    """Its host and port, not aiohttp's whole ConnectionKey (until 2026-12-07 its repr, ~480
    characters, in every such error); SGLang's /generate too, its own call."""
    with socket.socket() as sock:  # bound, never listening: a connect is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        adapter: EngineAdapter = make_adapter(
            ShimConfig(engine=engine, engine_url=f"http://127.0.0.1:{port}", model="m", kv_events="tcp://127.0.0.1:9")
        )
        await adapter.open()
        try:
            assert isinstance(adapter, HttpEngineAdapter)
            calls: list[Callable[[], Awaitable[object]]] = [lambda: adapter.fetch("/metrics")]
            if isinstance(adapter, SglangAdapter):
                calls.append(lambda: adapter.generate(LEG, _ignore))
            for call in calls:
                with pytest.raises(EngineError) as err:
                    await call()
                said = (err.value.code, err.value.kind, err.value.message)
                assert said == (503, "engine_unavailable", f"connection refused 127.0.0.1:{port}")
        finally:
            await adapter.close()


def _engine_app(health: int | None) -> web.Application:
    """A stand-in engine whose /health answers `health` (None: no such route, aiohttp's 404)."""

    async def answer(_request: web.Request) -> web.Response:
        assert health is not None
        return web.Response(status=health)

    app = web.Application()
    if health is not None:
        app.router.add_get("/health", answer)
    return app


async def _misdirected(engine: EngineKind, url: str) -> tuple[EngineHealth, ConfigError | None]:
    adapter = make_adapter(ShimConfig(engine=engine, engine_url=url, model="m", kv_events="tcp://127.0.0.1:9"))
    await adapter.open()
    try:
        return await adapter.health(), await adapter.misdirected()
    finally:
        await adapter.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
async def test_an_openai_base_url_given_for_the_engines_is_a_wrong_engine_url_naming_the_one_that_answers(
    engine: EngineKind,
) -> None:
    """The operator walkthrough's case: --engine-url http://127.0.0.1:8000/v1, vLLM's /v1/health a
    404 and its /health a 200; the shim waited for good at INFO ("its /health is down")."""
    async with served(_engine_app(200)) as url:
        health, wrong = await _misdirected(engine, url + "/v1")
    assert health is EngineHealth.DOWN and wrong is not None
    assert (wrong.setting, wrong.value) == ("engine_url", url + "/v1")
    said = str(wrong)
    assert f"{url}/v1/health answers 404: a server is there, but not the {engine} engine's API" in said
    assert f"{url}/health answers 200: give --engine-url {url}" in said


async def test_a_path_whose_root_serves_no_health_either_is_asked_about_not_advised() -> None:
    async with served(_engine_app(None)) as url:
        _, wrong = await _misdirected("vllm", url + "/api/")
    assert wrong is not None and f"{url}/health answers 404: is --engine-url {url}?" in str(wrong)


async def test_a_server_with_no_health_route_at_a_url_without_a_path_is_a_wrong_engine_url() -> None:
    app = web.Application()

    async def post_only(_request: web.Request) -> web.Response:
        return web.Response()

    app.router.add_post("/health", post_only)
    async with served(app) as url:
        health, wrong = await _misdirected("vllm", url)
    assert health is EngineHealth.DOWN and wrong is not None
    assert f"{url}/health answers 405" in str(wrong) and "is --engine-url the engine's URL?" in str(wrong)


@pytest.mark.parametrize("health", [503, 500, 200])
async def test_an_engine_that_serves_its_health_route_is_no_wrong_engine_url(health: int) -> None:
    async with served(_engine_app(health)) as url:
        _, wrong = await _misdirected("vllm", url)
    assert wrong is None


async def test_an_engine_that_refuses_connections_is_no_wrong_engine_url() -> None:
    with socket.socket() as sock:  # bound, never listening: a connect is refused
        sock.bind(("127.0.0.1", 0))
        health, wrong = await _misdirected("vllm", f"http://127.0.0.1:{sock.getsockname()[1]}/v1")
    assert health is EngineHealth.DOWN and wrong is None


async def test_a_lost_late_health_probe_leaves_the_late_answers_of_the_next_ones_counted() -> None:
    """A busy engine answers every /health 2.5 s late, past the 2 s probe, but the first probe's
    request is lost (a silently dead connection). Until 2026-12-07 that probe, left to run on past
    its timeout with no read limit, hung until TCP gave up, and every newer late probe was cancelled
    meanwhile: no answer counted (`answered_at` stayed None over 6 probes), and the stall watchdog
    took the answering engine for frozen. The late probe ends half the stall limit past its timeout;
    the next one takes its place."""
    lost = asyncio.Event()
    requests = 0

    async def health(_request: web.Request) -> web.Response:
        nonlocal requests
        requests += 1
        if requests == 1:
            await lost.wait()  # never answered while the test runs
            return web.Response(text="ok")
        await asyncio.sleep(2.5)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    async with served(app) as url:
        adapter = make_adapter(ShimConfig(engine="vllm", engine_url=url, model="m", stall_limit_s=2.0))
        await adapter.open()
        seen: list[float | None] = []
        try:
            since = time.monotonic()
            for _ in range(4):  # each BUSY after 2 s, the next 0.5 s on: sent at 0, 2.5, 5, 7.5 s
                assert await adapter.health() is EngineHealth.BUSY
                answered_at = adapter.silence.answered_at
                seen.append(None if answered_at is None else answered_at - since)
                await asyncio.sleep(0.5)
        finally:
            lost.set()
            await adapter.close()
    # the lost probe ends at 3 s; the second (sent at 2.5 s) is then the late one, answered at 5 s,
    # the third at 7.5 s: each late answer after the lost one counts
    answers = sorted({at for at in seen if at is not None})
    assert len(answers) == 2 and 4.5 < answers[0] < answers[1], seen
