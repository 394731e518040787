"""Replay fidelity against two real in-process sims: never early, arrival order kept, round-robin
over URLs, every request's prompt and output exactly as the workload says."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from bench.replay import replay
from bench.summary import summarize
from bench.trace import TokenSynth
from bench.workloads import WorkItem
from engine_sim import SimServer


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    async with SimServer(speedup=50.0, num_gpu_blocks=1024) as a, SimServer(speedup=50.0, num_gpu_blocks=1024) as b:
        yield [a, b]


def _items() -> list[WorkItem]:
    # Deliberately out of order in the list: replay sends by arrival time.
    arrivals = [0.0, 0.4, 0.1, 0.1, 0.25, 0.6]
    return [WorkItem(t, ((i, 40 + 16 * i),), 2 + i, f"w{i}") for i, t in enumerate(arrivals)]


async def test_requests_go_out_in_arrival_order_never_early_at_speed(sims: list[SimServer]) -> None:
    items = _items()
    run = await replay(items, [s.url for s in sims], speed=2.0, progress=False)
    assert [r.index for r in run.results] == list(range(len(items)))
    for item, r in zip(items, run.results, strict=True):
        assert r.ok, r.error
        assert r.due_s == pytest.approx(item.arrival_s / 2.0)
        assert r.sent_s >= r.due_s
        assert (r.prompt_tokens, r.output_tokens, r.tag) == (item.input_len, item.output_len, item.tag)
    by_send = sorted(run.results, key=lambda r: r.sent_s)
    assert [r.due_s for r in by_send] == sorted(r.due_s for r in run.results)
    # Round-robin in the order of sending, starting with the first URL.
    assert [r.url for r in by_send] == [sims[i % 2].url for i in range(len(items))]
    assert run.wall_s >= max(r.due_s for r in run.results)


async def test_the_engine_receives_the_synthesised_tokens(sims: list[SimServer]) -> None:
    item = WorkItem(0.0, ((3, 64), (4, 20)), 1, "x")
    run = await replay([item, item], [sims[0].url], speed=1.0, synth=TokenSynth(7), progress=False)
    assert all(r.ok for r in run.results)
    cached = sims[0].engine.cached_block_prefixes()
    expected = TokenSynth(7).expand(item.segments)
    assert expected[:80] in cached  # the engine cached the prompt's full blocks, token for token


async def test_replay_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one URL"):
        await replay([], [], progress=False)
    with pytest.raises(ValueError, match="--speed"):
        await replay([], ["http://127.0.0.1:1"], speed=0.0, progress=False)


FAIL_AFTER_S = 0.6


async def _failing_server(mode: str) -> web.AppRunner:
    """bench-0 streams 3 tokens and finishes at once; bench-1 fails `FAIL_AFTER_S` after it was sent:
    an error answer (`http`), an error event mid-stream (`stream`), or a stall past the client's
    timeout (`timeout`)."""

    def chunk(obj: object) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def completions(request: web.Request) -> web.StreamResponse:
        if request.headers["X-Request-Id"] == "bench-1" and mode == "http":
            await asyncio.sleep(FAIL_AFTER_S)
            return web.Response(status=503, text="worker died")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if request.headers["X-Request-Id"] == "bench-0":
            for i in range(3):
                await resp.write(chunk({"choices": [{"text": f"t{i}"}]}))
            await resp.write(chunk({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 4}}))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        await resp.write(chunk({"choices": [{"text": "x"}]}))
        if mode == "timeout":
            await asyncio.sleep(2 * FAIL_AFTER_S)  # the client has given up by then
            return resp
        await asyncio.sleep(FAIL_AFTER_S)
        await resp.write(chunk({"error": {"message": "worker died"}}))
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


@pytest.mark.parametrize("mode", ["http", "stream", "timeout"])
async def test_a_failed_request_ends_when_it_failed_and_the_run_lasts_until_then(mode: str) -> None:
    runner = await _failing_server(mode)
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        items = [WorkItem(0.0, ((0, 4),), 3, "a"), WorkItem(0.0, ((1, 4),), 3, "b")]
        run = await replay(items, [url], model="m", progress=False, timeout_s=FAIL_AFTER_S)
    finally:
        await runner.cleanup()
    done, failed = run.results
    assert done.ok and done.e2e_s is not None and done.e2e_s < FAIL_AFTER_S / 2
    assert not failed.ok and failed.e2e_s is not None
    assert FAIL_AFTER_S <= failed.e2e_s <= run.wall_s
    s = summarize(run.results)
    # The run spans the failure's end: 3 tokens and 1 request over it, as on the virtual clock.
    first = min(r.sent_s for r in run.results)
    assert s.duration_s == pytest.approx(failed.sent_s + failed.e2e_s - first)
    assert s.duration_s >= FAIL_AFTER_S
    assert s.output_tokens_per_s == pytest.approx(3 / s.duration_s)
    assert s.requests_per_s == pytest.approx(1 / s.duration_s)
