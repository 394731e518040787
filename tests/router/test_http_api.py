"""The OpenAI front door against a live cluster: the openai client, SSE bytes, errors, /debug/route,
/metrics, disconnects."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from protocol import block_hashes
from tests.router.conftest import BLOCK, MODEL, Cluster, complete
from tests.router.polling import until


@pytest.fixture
async def agg(cluster: Cluster) -> Cluster:
    await cluster.agg_router(1, disagg="never")
    return cluster


async def test_openai_client_streaming_and_not(agg: Cluster) -> None:
    router = agg.routers[0]
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused")
    try:
        done = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=5)
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 5
        assert done.usage.prompt_tokens == len(router.tokenizer.encode("hello world"))
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "explain the cache"}], max_tokens=4
        )
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "explain the cache"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            pieces += [c.delta.content or "" for c in chunk.choices]
        assert usage is not None and usage.completion_tokens == 6
        text_stream = await client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, stream=True)
        finishes = [c.choices[0].finish_reason async for c in text_stream if c.choices]
        assert finishes[-1] == "length"
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        await client.close()


async def test_sse_framing_matches_vllm(agg: Cluster, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "the cache", "max_tokens": 3, "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with http.post(agg.routers[0].url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-kvswitch-prefill"] == "agg"
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert {p["object"] for p in payloads} == {"text_completion"}


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [
        ("/v1/completions", "{not json", 400, "body"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ],
)
async def test_bad_requests_get_openai_errors(
    agg: Cluster, http: aiohttp.ClientSession, path: str, body: object, code: int, param: str
) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    async with http.post(agg.routers[0].url + path, data=data, headers={"Content-Type": "application/json"}) as r:
        assert r.status == code
        err = (await r.json())["error"]
    assert err["code"] == code and err["param"] == param and err["message"] and err["type"]


async def test_no_worker_is_503_and_ready_follows_the_registry(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    router = await cluster.add_router()
    await until(lambda: router.registry.models() == [] and router.readiness()[1]["problems"], what="registry read")
    async with http.get(router.url + "/ready") as r:
        assert r.status == 503  # nothing could serve a request
        assert "no decode or agg worker can take requests" in (await r.json())["problems"]
    worker = await cluster.add_worker("agg")
    await cluster.ready(router)
    async with http.get(router.url + "/ready") as r:
        assert r.status == 200
        body = await r.json()
    assert [w["worker"] for w in body["worker_status"] if w["routable"]] == [worker.id]
    await worker.shim.stop()
    await until(lambda: not router.registry.workers(), what="the worker to leave")
    async with http.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
        assert r.status in (404, 503)  # the model is gone with its only worker
    async with http.get(router.url + "/health") as r:
        assert r.status == 200


async def test_debug_route_explains_without_booking(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    await cluster.add_worker("prefill")
    d1 = await cluster.add_worker("decode")
    d2 = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(conditional_disagg=True)
    prompt = list(range(3000, 3320))  # 20 blocks
    await complete(http, router, prompt)
    hashes = block_hashes(prompt, BLOCK)
    # The prefill worker's events alone would fill the index; wait for the decode worker's.
    await until(lambda: 20 in (router.index.match(hashes).get(d.id) for d in (d1, d2)), what="indexed on decode")
    counts = dict(router.disagg.counts)
    async with http.post(router.url + "/debug/route", json={"model": MODEL, "prompt": [*prompt, 1, 2]}) as r:
        assert r.status == 200
        info = await r.json()
    assert info["isl"] == 322 and info["prompt_blocks"] == 20 and info["policy"] == "isl_bounding"
    holder = info["decode_worker"]
    by_worker = {c["worker"]: c for c in info["decode_candidates"]}
    assert by_worker[holder]["overlap_blocks"] == 20
    assert all(c["overlap_blocks"] == 0 for w, c in by_worker.items() if w != holder)
    assert by_worker[holder]["cost"] < min(c["cost"] for w, c in by_worker.items() if w != holder)
    assert info["outcome"] == "bypass_isl" and info["bypass"] and "eff_isl=2" in info["reason"]
    assert dict(router.disagg.counts) == counts, "a dry run counts nothing"
    assert d1.id in by_worker


async def test_metrics_report_requests_decisions_and_index(agg: Cluster, http: aiohttp.ClientSession) -> None:
    router = agg.routers[0]
    await complete(http, router, list(range(100)))
    await until(lambda: len(router.index) >= 6, what="indexed")
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    assert 'kvswitch_router_requests_total{code="200",endpoint="completions"} 1.0' in text
    assert 'kvswitch_router_decisions_total{outcome="aggregated"} 1.0' in text
    assert "kvswitch_router_ttft_seconds_count" in text and "kvswitch_router_itl_seconds_count" in text
    blocks = next(line for line in text.splitlines() if line.startswith("kvswitch_router_index_blocks "))
    assert float(blocks.split()[1]) >= 6


async def test_client_disconnect_cancels_on_the_worker(agg: Cluster, http: aiohttp.ClientSession) -> None:
    router, worker = agg.routers[0], agg.workers[0]
    body = {"model": MODEL, "prompt": "the cache", "max_tokens": 100000, "stream": True, "ignore_eos": True}
    resp = await http.post(router.url + "/v1/completions", json=body)
    await resp.content.readline()
    await until(lambda: bool(worker.sim.engine.running), what="the request to run")
    resp.close()
    await until(lambda: not worker.sim.engine.running and not worker.sim.engine.waiting, what="the cancel")
    await asyncio.sleep(0)
