"""The streaming client and the metrics scrape against a real in-process engine_sim."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from bench.summary import scrape_prefix_counters
from bench.trace import TokenSynth
from engine_sim import SimServer
from kvswitch.client import CompletionClient, discover_model, parse_server_timing


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with SimServer(speedup=50.0, num_gpu_blocks=1024, max_model_len=2048) as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_streaming_completion_records_ttft_gaps_and_exact_tokens(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    client = CompletionClient(session, await discover_model(session, sim.url))
    prompt = TokenSynth().expand([(1, 300)])
    result = await client.complete(sim.url, prompt, 12, request_id="t-1")
    assert result.ok, result.error
    assert (result.status, result.prompt_tokens, result.output_tokens) == (200, 300, 12)
    assert result.ttft_s is not None and result.e2e_s is not None
    assert 0 < result.ttft_s <= result.e2e_s
    assert len(result.itl_s) == 11  # one gap per token after the first
    assert result.decode_worker is None and result.prefill is None  # a bare engine sets no router headers
    assert result.server_ms == {}


def test_server_timing_reads_each_metrics_duration_in_ms() -> None:
    header = 'parse;dur=0.25, route;desc="admit and plan";dur=1.5 , worker;dur=abc, bare, ;dur=2, cache;dur="3"'
    assert parse_server_timing(header) == {"parse": 0.25, "route": 1.5, "cache": 3.0}
    assert parse_server_timing(None) == parse_server_timing("") == {}


async def test_a_refused_request_is_a_failed_result_not_an_exception(
    sim: SimServer, session: aiohttp.ClientSession
) -> None:
    client = CompletionClient(session, await discover_model(session, sim.url))
    result = await client.complete(sim.url, TokenSynth().expand([(1, 4000)]), 4, request_id="t-2")
    assert not result.ok and result.status == 400
    assert result.error is not None and "HTTP 400" in result.error


async def test_an_unreachable_server_is_a_failed_result(session: aiohttp.ClientSession) -> None:
    from kvswitch.servers import free_port

    client = CompletionClient(session, "m")
    result = await client.complete(f"http://127.0.0.1:{free_port()}", [300, 301], 2, request_id="t-3")
    assert not result.ok and result.error is not None and "Connect" in result.error


async def test_a_request_past_the_client_timeout_says_which_timeout(session: aiohttp.ClientSession) -> None:
    """A chaos run printed `errors: {'TimeoutError: ': 4421}`: aiohttp's total timeout has no text."""
    from kvswitch.servers import free_port

    stalled = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        await stalled.wait()
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", stall)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        client = CompletionClient(session, "m", timeout_s=0.2)
        result = await client.complete(f"http://127.0.0.1:{port}", [300, 301], 2, request_id="t-9")
    finally:
        stalled.set()
        await runner.cleanup()
    assert not result.ok and result.error == "TimeoutError: client timeout 0.2 s"


async def test_prefix_counters_count_a_repeated_prompt_as_hits(sim: SimServer, session: aiohttp.ClientSession) -> None:
    client = CompletionClient(session, await discover_model(session, sim.url))
    prompt = TokenSynth().expand([(5, 512)])
    before = await scrape_prefix_counters(session, [sim.url])
    for i in range(2):
        assert (await client.complete(sim.url, prompt, 2, request_id=f"t-4-{i}")).ok
    delta = await scrape_prefix_counters(session, [sim.url + "/metrics"]) - before
    assert delta.queries >= 1024  # both lookups counted, in tokens
    assert delta.hits >= 496  # the second finds the first's full blocks (the last token is always recomputed)
    assert delta.hit_rate is not None and 0 < delta.hit_rate < 1


@pytest.mark.parametrize("payload", [b'"a string"', b"[1, 2]", b"{not json"])
async def test_a_chunk_that_is_not_a_json_object_is_a_failed_result(
    payload: bytes, session: aiohttp.ClientSession
) -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + payload + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        result = await CompletionClient(session, "m").complete(f"http://127.0.0.1:{port}", [300], 2, request_id="t-5")
    finally:
        await runner.cleanup()
    assert not result.ok and result.error is not None and "malformed SSE chunk" in result.error


async def _serve(status: int, body: bytes, path: str = "/v1/completions") -> web.AppRunner:
    """A server answering `path` with `status` and `body` as is (an SSE stream when 200 on completions)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        return resp

    app = web.Application()
    app.router.add_route("*", path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


@pytest.mark.parametrize(
    "payload",
    [
        b'{"choices": [1]}',
        b'{"choices": "text"}',
        b'{"choices": [{"text": "a"}], "usage": "n/a"}',
        b'{"choices": [{"text": "a"}], "usage": {"completion_tokens": "many"}}',
        b'{"choices": [{"text": "a"}], "usage": {"completion_tokens": 1, "prompt_tokens": [1]}}',
        b'{"choices": [{"text": "' + b"a" * 600_000 + b'"}]}',  # past aiohttp's 512 KiB line limit
        b'{"choices": [{"text": "\xff"}]}',  # not UTF-8
        b"[" * 100_000,  # nested past the recursion limit
    ],
)
async def test_a_malformed_chunk_is_a_failed_result_naming_the_request_and_server(
    payload: bytes, session: aiohttp.ClientSession
) -> None:
    # Each raised (AttributeError, ValueError, LineTooLong, UnicodeDecodeError, RecursionError) and ended a whole
    # `bench replay`.
    runner = await _serve(200, b"data: " + payload + b"\n\ndata: [DONE]\n\n")
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        result = await CompletionClient(session, "m").complete(url, [300], 2, request_id="t-6")
    finally:
        await runner.cleanup()
    assert not result.ok and result.error is not None and result.error.startswith("malformed"), result.error
    assert result.error.endswith(f"(request t-6, {url})"), result.error


async def test_an_error_body_that_is_not_utf8_is_a_failed_result(session: aiohttp.ClientSession) -> None:
    runner = await _serve(502, b"\xff\xfe bad gateway")
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        result = await CompletionClient(session, "m").complete(url, [300], 2, request_id="t-7")
    finally:
        await runner.cleanup()
    assert not result.ok and result.status == 502 and result.error == "HTTP 502: \ufffd\ufffd bad gateway"


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"[1]", "not a model list"),
        (b"{not json", "not a model list"),
        (b'{"data": [{"name": "m"}]}', "not a model list"),
        (b"\xff", "not a model list"),
        (b'{"data": []}', "lists no model; pass --model"),
    ],
)
async def test_a_model_list_that_is_not_one_is_an_error_naming_the_url(
    body: bytes, said: str, session: aiohttp.ClientSession
) -> None:
    runner = await _serve(200, body, path="/v1/models")
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        with pytest.raises(RuntimeError, match=said) as caught:
            await discover_model(session, url)
    finally:
        await runner.cleanup()
    assert f"{url}/v1/models" in str(caught.value)


@pytest.mark.parametrize(
    ("tail", "ok"),
    [
        (b"", False),  # cut short, the connection closed cleanly: it counted as a whole answer
        (b"data: [DONE]\n\n", True),
        (b'data: {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 1}}\n\n', True),
    ],
)
async def test_a_stream_ended_without_done_or_its_usage_is_a_failed_result(
    tail: bytes, ok: bool, session: aiohttp.ClientSession
) -> None:
    two = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\n'
    runner = await _serve(200, two + tail)
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        result = await CompletionClient(session, "m").complete(url, [300], 16, request_id="t-7")
    finally:
        await runner.cleanup()
    assert result.ok is ok, result.error
    if not ok:
        assert result.error is not None and result.error.startswith("stream ended without [DONE] or its usage")
