"""The OpenAI front door against a live cluster: the openai client, the engine's own answers passed
through (the same request sent to the sim directly and through the router gives the same choices),
the engine's own 400s, the router's errors as OpenAI JSON (routes, methods, body and header limits,
oversized integers, deep nesting, half-sent bodies, NATS's payload limit), a streamed event over
that limit passed on whole, tokenizer refusals, /debug/route, /metrics, disconnects, and the loop
staying responsive while a huge prompt is refused or tokenized."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import nats
import openai
import pytest
from nats.aio.msg import Msg
from tokenizers import Tokenizer, models, pre_tokenizers

from protocol import GenerateRequest, ResponseChunk, block_hashes, decode_msg, subjects
from protocol.tokenizer import BuiltinTokenizer
from protocol.version import BUILD
from router import api_errors, http_api
from router.http_api import HttpLimits
from router.policies import Outcome
from router.policies import Path as RoutePath
from router.request_context import RequestShape
from runtime.nats_flush import flush
from tests.protocol.vllm_captures import FIXTURES
from tests.router.conftest import BLOCK, MODEL, Cluster, complete
from tests.router.polling import until
from tests.router.test_tokenization import VOCAB


@pytest.fixture
async def agg(cluster: Cluster) -> Cluster:
    # a tool parser, as vLLM serves tools only with one (test_a_tool_choice_needs_the_engines_tool_parser)
    await cluster.add_worker("agg", enable_prompt_tokens_details=True, enable_request_id_headers=True,
                             enable_auto_tool_choice=True, tool_call_parser="hermes")  # fmt: skip
    await cluster.add_ready_router(disagg="never")
    return cluster


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any, dict[str, str]]:
    return await answer(http, "POST", url, body)


async def answer(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, request_id: str | None = None
) -> tuple[int, Any, dict[str, str]]:
    """Status, body (JSON when it parses, else text) and lower-cased headers of one request."""
    headers = {"Content-Type": "application/json"} | ({"X-Request-Id": request_id} if request_id else {})
    data = None if body is None else body if isinstance(body, str | bytes) else json.dumps(body)
    async with http.request(method, url, data=data, headers=headers) as r:
        raw = await r.read()
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw.decode(errors="replace")
        return r.status, parsed, {k.lower(): v for k, v in r.headers.items()}


def sse(raw: str) -> list[Any]:
    events = raw.split("\n\n")
    assert events[-1] == "", "the stream ends with a blank line"
    assert all(e.startswith("data: ") for e in events[:-1])
    return [
        e.removeprefix("data: ") if e == "data: [DONE]" else json.loads(e.removeprefix("data: ")) for e in events[:-1]
    ]


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, list[Any], dict[str, str]]:
    async with http.post(url, json={**body, "stream": True}) as r:
        return r.status, sse((await r.read()).decode()), {k.lower(): v for k, v in r.headers.items()}


def assert_openai_error(status: int, body: Any, code: int, param: str | None = None) -> None:
    assert status == code, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == code and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """What must match between two answers to the same request: all but the id, clock and the
    kvswitch route, and the cache-hit count (the second request finds the first one's blocks)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created", "kvswitch")}
    usage = dict(out.get("usage") or {})
    usage.pop("prompt_tokens_details", None)
    out["usage"] = usage
    return out


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
        chat_stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "explain the cache"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in chat_stream:
            if chunk.usage is not None:
                usage = chunk.usage
            pieces += [c.delta.content or "" for c in chunk.choices]
        assert usage is not None and usage.completion_tokens == 6
        assert "".join(pieces)
        text_stream = await client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, stream=True)
        finishes = [c.choices[0].finish_reason async for c in text_stream if c.choices]
        assert finishes[-1] == "length"
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        await client.close()


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "the cache holds the prefix", "max_tokens": 12, "stop": [" ka"], "seed": 3},
        {"prompt": "the cache holds", "max_tokens": 5, "n": 3, "seed": 1},
        {"prompt": [[600, 601], [500, 501, 502]], "max_tokens": 4, "n": 2},
        {"prompt": "echo me", "max_tokens": 3, "echo": True, "logprobs": 2},
        {"prompt": [700, 701, 702], "max_tokens": 4, "logprobs": 3, "frequency_penalty": 0.5, "top_k": 5},
        {"prompt": "the end", "max_tokens": 6, "stop_token_ids": [400, 401, 402], "include_stop_str_in_output": True},
        {"prompt": "the cache holds", "max_tokens": 5.0, "n": "2", "seed": 2},  # vLLM reads them as 5 and 2
    ],
    ids=["stop", "n", "batch", "echo-logprobs", "token-ids-logprobs", "stop-token-ids", "lax-integers"],
)
async def test_completions_are_the_engines_own(agg: Cluster, http: aiohttp.ClientSession, body: dict[str, Any]) -> None:
    router, sim = agg.routers[0], agg.workers[0].sim
    request = {"model": MODEL, **body}
    s1, via_router, headers = await post(http, router.url + "/v1/completions", request)
    s2, direct, _ = await post(http, sim.url + "/v1/completions", request)
    assert s1 == s2 == 200, (via_router, direct)
    assert without_ids(via_router) == without_ids(direct)
    assert via_router["id"] == headers["x-request-id"] and via_router["id"].startswith("cmpl-")
    assert via_router["kvswitch"]["decode_worker"] == agg.workers[0].id
    # streamed: the same choices, piece by piece
    _, events, _ = await stream(http, router.url + "/v1/completions", request)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finish: dict[int, Any] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finish[c["index"]] = (c["finish_reason"], c["stop_reason"])
    assert texts == {c["index"]: c["text"] for c in direct["choices"]}
    assert finish == {c["index"]: (c["finish_reason"], c["stop_reason"]) for c in direct["choices"]}
    assert all(c.get("token_ids") is None for e in events[:-1] for c in e["choices"]), "ids the client did not ask for"


@pytest.mark.parametrize(
    ("extra", "keeps_text", "routed"),
    [
        ({}, False, None),
        ({"echo": 1}, True, None),  # vLLM's lax boolean: echoed as written, not as decoded ids
        ({"truncate_prompt_tokens": 3}, True, 3),  # the engine's tokenizer truncates (keeps a BOS)
        ({"truncate_prompt_tokens": 3, "truncation_side": "left"}, False, 3),  # vLLM slices the ids
    ],
    ids=["ids", "echo", "truncate", "truncate-left"],
)
async def test_the_leg_keeps_the_text_when_the_engines_answer_depends_on_it(
    agg: Cluster, http: aiohttp.ClientSession, extra: dict[str, Any], keeps_text: bool, routed: int | None
) -> None:
    router, worker = agg.routers[0], agg.workers[0]
    nc = await nats.connect(agg.nats_url)
    legs: list[GenerateRequest] = []

    async def collect(msg: Msg) -> None:
        legs.append(decode_msg(msg.data, GenerateRequest))

    await nc.subscribe(subjects.gen(router.ns, "agg", worker.id), cb=collect)
    await flush(nc)
    text = "the quick brown fox jumps over the lazy dog"
    request = {"model": MODEL, "prompt": text, "max_tokens": 3, **extra}
    status, via, _ = await post(http, router.url + "/v1/completions", request)
    _, direct, _ = await post(http, worker.sim.url + "/v1/completions", request)
    await until(lambda: bool(legs), what="the leg")
    await nc.close()
    assert status == 200 and without_ids(via) == without_ids(direct)
    (leg,) = legs
    assert (leg.params.get("prompt") == text) is keeps_text
    ids = BuiltinTokenizer().encode(text)
    assert leg.token_ids == (ids if routed is None else ids[-routed:])


async def test_the_headers_vllm_reads_reach_the_engine(agg: Cluster, http: aiohttp.ClientSession) -> None:
    # vLLM 0.32 takes a priority (X-Vllm-Priority) and a session id (X-Session-ID) from headers.
    router, worker = agg.routers[0], agg.workers[0]
    assert worker.shim.adapter is not None
    seen: list[dict[str, str]] = []
    generate = worker.shim.adapter.generate

    async def recording(leg: Any, on_output: Any) -> Any:
        seen.append(dict(leg.headers))
        return await generate(leg, on_output)

    worker.shim.adapter.generate = recording  # type: ignore[method-assign]
    sent = {"X-Vllm-Priority": "-3", "X-Session-ID": "chat-42", "X-Other": "not the engine's"}
    async with http.post(
        router.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2}, headers=sent
    ) as r:
        assert r.status == 200
    (headers,) = seen
    assert headers["X-Vllm-Priority"] == "-3" and headers["X-Session-ID"] == "chat-42"
    assert "X-Other" not in headers


@pytest.mark.parametrize(
    ("headers", "body", "priority"),
    [
        ({}, {}, 0),
        ({}, {"priority": "7"}, 7),
        ({"X-Vllm-Priority": "-3"}, {"priority": 7}, -3),
        ({"X-Vllm-Priority": "x"}, {"priority": 2}, 2),
    ],
)
async def test_a_request_waits_at_the_router_in_its_vllm_priority(
    agg: Cluster, http: aiohttp.ClientSession, headers: dict[str, str], body: dict[str, Any], priority: int
) -> None:
    """The header over the body's, as vLLM takes them (router.admission orders its line so); a
    header that is no integer is the engine's to refuse, and the body's is kept meanwhile."""
    router = agg.routers[0]
    shapes: list[RequestShape] = []
    open_job = router.path.open

    async def recording(*args: Any, **kwargs: Any) -> Any:
        shapes.append(kwargs["shape"])
        return await open_job(*args, **kwargs)

    router.path.open = recording  # type: ignore[method-assign]
    req = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **body}
    async with http.post(router.url + "/v1/completions", json=req, headers=headers) as r:
        await r.read()
    assert [s.priority for s in shapes] == [priority]


async def test_a_chats_truncation_is_routed_as_the_engine_applies_it(agg: Cluster, http: aiohttp.ClientSession) -> None:
    router = agg.routers[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 60}], "max_tokens": 2}
    _, whole, _ = await post(http, router.url + "/debug/route", body)
    _, cut, _ = await post(http, router.url + "/debug/route", {**body, "truncate_prompt_tokens": 4})
    assert whole["isl"] > 60 and cut["isl"] == 4


async def test_one_small_context_worker_neither_truncates_other_workers_prompts_nor_takes_them(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # Before, the model's context was the least its workers registered: one worker registering 64
    # cut every `truncate_prompt_tokens: -1` prompt to 63 tokens, on its 4096 peers too, and
    # /v1/models said 64. Now the length most register serves, and the odd worker is left out.
    big = [await cluster.add_worker("agg", max_model_len=4096) for _ in range(2)]
    router = await cluster.add_ready_router(disagg="never")
    small = await cluster.add_worker("agg", max_model_len=64)
    await until(lambda: MODEL in router.registry.context_conflicts, what="the small worker's record")
    prompt = list(range(100, 400))
    body = {"model": MODEL, "max_tokens": 2, "truncate_prompt_tokens": -1}
    for i in range(6):
        async with http.post(router.url + "/v1/completions", json={**body, "prompt": prompt[i:]}) as r:
            answer = await r.json()
        assert r.status == 200 and answer["usage"]["prompt_tokens"] == 300 - i, answer
        assert answer["kvswitch"]["decode_worker"] in {w.id for w in big}
    async with http.get(router.url + "/v1/models") as r:
        (card,) = (await r.json())["data"]
    assert card["id"] == MODEL and card["max_model_len"] == 4096
    async with http.get(router.url + "/ready") as r:
        assert r.status == 200
        warnings = (await r.json())["warnings"]
    assert [w for w in warnings if "max_model_len" in w and f"64 on {small.id}" in w], warnings


@pytest.mark.parametrize("named_by", ["header", "body"])
async def test_the_clients_request_id_names_the_answer_as_vllm_names_it(
    agg: Cluster, http: aiohttp.ClientSession, named_by: str
) -> None:
    """vLLM names an answer `cmpl-<X-Request-Id>`, else `cmpl-<body request_id>`; through the
    router the same, on every leg, with the header echoed."""
    router, sim = agg.routers[0], agg.workers[0].sim
    headers = {"X-Request-Id": "trace-42"} if named_by == "header" else {}
    named = {"request_id": "trace-42"} if named_by == "body" else {}
    for path, prefix, body in (
        ("/v1/completions", "cmpl-", {"prompt": "name me", "max_tokens": 2}),
        ("/v1/chat/completions", "chatcmpl-", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):
        for url in (router.url, sim.url):
            request = {"model": MODEL, **body, **named}
            async with http.post(url + path, json=request, headers=headers) as r:
                assert r.status == 200 and (await r.json())["id"] == prefix + "trace-42", url
                if named_by == "header":
                    assert r.headers["X-Request-Id"] == "trace-42", url
            async with http.post(url + path, json={**request, "stream": True}, headers=headers) as r:
                events = sse((await r.read()).decode())
            assert {e["id"] for e in events[:-1]} == {prefix + "trace-42"}, url
    async with http.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
        assert r.headers["x-request-id"] == (await r.json())["id"], "no id given: the router's own, as before"


async def test_concurrent_requests_may_share_a_client_request_id(agg: Cluster, http: aiohttp.ClientSession) -> None:
    """A client's X-Request-Id names answers, the router's own ids key them: reusing one for
    concurrent requests on one worker costs none of them."""
    router = agg.routers[0]

    async def one() -> tuple[int, str]:
        body = {"model": MODEL, "prompt": "same id", "max_tokens": 8, "ignore_eos": True}
        async with http.post(router.url + "/v1/completions", json=body, headers={"X-Request-Id": "dup"}) as r:
            return r.status, (await r.json())["id"]

    assert await asyncio.gather(*(one() for _ in range(4))) == [(200, "cmpl-dup")] * 4


def server_timing(headers: dict[str, str]) -> dict[str, float]:
    parts = [m.split(";dur=") for m in headers["server-timing"].split(", ")]
    return {name: float(dur) for name, dur in parts}


@pytest.mark.parametrize("streamed", [True, False])
async def test_server_timing_puts_the_engines_wait_in_worker_not_in_the_routers_parts(
    agg: Cluster, http: aiohttp.ClientSession, streamed: bool
) -> None:
    router, sim = agg.routers[0], agg.workers[0].sim
    sim.faults.hang_after = sim.faults.requests_seen  # the next request hangs in the engine

    async def resume() -> float:
        """The ms from sending the request to seeing the engine hold it."""
        await until(lambda: sim.faults.hang, what="the engine to hang on the request")
        reached = time.perf_counter()
        await asyncio.sleep(0.3)
        sim.faults.hang_after = None
        sim.faults.hang = False
        return (reached - sent) * 1e3

    sent = time.perf_counter()  # the router's clock too: all in this process
    resumed = asyncio.create_task(resume())
    request = {"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 4}
    if streamed:
        status, _, headers = await stream(http, router.url + "/v1/completions", request)
    else:
        status, _, headers = await post(http, router.url + "/v1/completions", request)
    reached_engine_ms = await resumed
    assert status == 200
    timing = server_timing(headers)
    assert set(timing) == {"parse", "route", "worker"}
    assert timing["worker"] >= 300.0  # ms: the engine held the prefill that long
    # The router's parts ended before the engine had the request, so none of its wait is in them.
    # Bounded by that, not by a fixed figure: a loaded box that stalls this process (all of the
    # cluster shares its loop) for 100 ms between the request's arrival and its plan is no bug.
    assert timing["parse"] > 0 and timing["route"] > 0
    assert timing["parse"] + timing["route"] <= reached_engine_ms, (timing, reached_engine_ms)


async def test_stop_strings_are_cut_and_reported(agg: Cluster, http: aiohttp.ClientSession) -> None:
    router = agg.routers[0]
    request = {"model": MODEL, "prompt": "the cache holds the prefix", "max_tokens": 12, "seed": 3}
    _, free, _ = await post(http, router.url + "/v1/completions", request)
    words = free["choices"][0]["text"].split(" ")
    stop = " " + words[3]
    _, stopped, _ = await post(http, router.url + "/v1/completions", {**request, "stop": [stop]})
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == free["choices"][0]["text"][: free["choices"][0]["text"].index(stop)]


@pytest.mark.parametrize(
    "extra",
    [
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "auto",
        },
        {"response_format": {"type": "json_object"}, "presence_penalty": 1.5, "n": 2, "seed": 5},
        {"stop": ["ka"], "max_completion_tokens": 9, "stream_options": None},
    ],
    ids=["tools", "response-format-n", "stop"],
)
async def test_chat_parameters_reach_the_engine(
    agg: Cluster, http: aiohttp.ClientSession, extra: dict[str, Any]
) -> None:
    router, sim = agg.routers[0], agg.workers[0].sim
    request = {"model": MODEL, "messages": [{"role": "user", "content": "say something"}], "max_tokens": 6, **extra}
    s1, via_router, _ = await post(http, router.url + "/v1/chat/completions", request)
    s2, direct, _ = await post(http, sim.url + "/v1/chat/completions", request)
    assert s1 == s2 == 200, (via_router, direct)
    assert without_ids(via_router) == without_ids(direct)


async def test_a_tool_choice_needs_the_engines_tool_parser(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    """An engine started without --enable-auto-tool-choice (vLLM's default) refuses any tool_choice
    but "none", `tools` alone ("auto") too: its 400 comes back through the router as it is."""
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    sim = cluster.workers[0].sim
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = {"model": MODEL, "messages": [{"role": "user", "content": "say something"}], "max_tokens": 6}
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"tools": tools}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
        ({"tools": tools, "tool_choice": "required"}, 'tool_choice="required" requires --tool-call-parser to be set'),
    ]
    for extra, message in refusals:
        s1, via_router, _ = await post(http, router.url + "/v1/chat/completions", {**request, **extra})
        s2, direct, _ = await post(http, sim.url + "/v1/chat/completions", {**request, **extra})
        assert s1 == s2 == 400 and via_router == direct, (via_router, direct)
        assert direct["error"] == {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    s1, _, _ = await post(http, router.url + "/v1/chat/completions", {**request, "tools": tools, "tool_choice": "none"})
    assert s1 == 200


async def test_chat_with_logprobs_and_cached_tokens_is_the_engines_own(
    agg: Cluster, http: aiohttp.ClientSession
) -> None:
    router, sim = agg.routers[0], agg.workers[0].sim
    messages = [{"role": "system", "content": "a long shared system prompt " * 8}, {"role": "user", "content": "hi"}]
    request = {"model": MODEL, "messages": messages, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    _, via_router, _ = await post(http, router.url + "/v1/chat/completions", request)
    _, direct, _ = await post(http, sim.url + "/v1/chat/completions", request)
    assert without_ids(via_router) == without_ids(direct)
    assert via_router["id"].startswith("chatcmpl-")
    assert len(via_router["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    _, again, _ = await post(http, router.url + "/v1/chat/completions", request)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK  # the engine's cache hit, reported


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "n": 2, "temperature": 0}, None),
        ({"prompt": list(range(400, 400 + 40000))}, None),  # longer than the context
    ],
    ids=["max_tokens", "temperature", "logprobs", "greedy-n", "too-long"],
)
async def test_the_engines_own_400s_come_back_as_they_are(
    agg: Cluster, http: aiohttp.ClientSession, body: dict[str, Any], param: str | None
) -> None:
    request = {"model": MODEL, **body}
    s1, via_router, _ = await post(http, agg.routers[0].url + "/v1/completions", request)
    s2, direct, _ = await post(http, agg.workers[0].sim.url + "/v1/completions", request)
    assert s1 == s2 == 400
    assert via_router == direct
    if param is not None:
        assert param in json.dumps(via_router["error"])


DEEP_IN_AN_OBJECT = '{"model": "sim-llama", "prompt": "[[[", "x": ' + "[" * 10_000 + "]" * 10_000 + "}"
USER_X = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", "{not json", "body.1"),  # vLLM's: the offset
        ("/v1/completions", "[1, 2]", None),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "maybe"}, "body.stream"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "1e3"}, "body.max_tokens"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "kv_transfer_params": {"remote_host": "10.0.0.1"}},
            "kv_transfer_params",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2**64}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 2**70}}, None),
        ("/v1/completions", '{"model": "sim-llama", "prompt": "x", "temperature": 1e400}', "body"),
        ("/v1/completions", "[" * 10_000 + "]" * 10_000, "body"),
        (
            "/v1/completions",
            '{"model": "sim-llama", "prompt": "' + "[" * 10 + '", "x": ' + "[" * 10_000 + "]" * 10_000 + "}",
            "body",
        ),
        # {"messages": []}: vLLM's words, no param (tests/router/test_answers_as_the_engine.py)
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []},
            "body.chat_template_kwargs",
        ),
        # A template is code the router would run: refused, as vLLM refuses it, unless trusted.
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            None,  # vLLM's names none (until 2026-12-07 "chat_template")
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}{% endfor %}"},
            },
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "chat_template": "{{ 1 }}",
                "chat_template_kwargs": {"chat_template": "{{ 2 }}"},
            },
            "chat_template",
        ),
    ],
)
async def test_the_routers_own_400s_are_openai_json(
    agg: Cluster, http: aiohttp.ClientSession, path: str, body: Any, param: str | None
) -> None:
    status, out, _ = await post(http, agg.routers[0].url + path, body)
    assert_openai_error(status, out, 400, param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", None, "application/json ;x"]
)
async def test_a_body_not_sent_as_application_json_is_refused_as_vllm_refuses_it(
    agg: Cluster, http: aiohttp.ClientSession, path: str, content_type: str | None
) -> None:
    """vLLM's JSON routes take application/json alone (a browser may post text/plain from any web
    page without a CORS preflight); the router read any body as JSON."""
    body = {"model": MODEL, "prompt": "abc", "messages": [{"role": "user", "content": "hi"}], "tokens": [1, 2]}
    answers = []
    for url in (agg.routers[0].url, agg.workers[0].sim.url):
        headers = {"Content-Type": content_type} if content_type else {}
        async with http.post(url + path, data=json.dumps(body).encode(), headers=headers,
                             skip_auto_headers=["Content-Type"]) as r:  # fmt: skip
            answers.append((r.status, await r.json(content_type=None)))
    assert answers[0] == answers[1]
    assert answers[0][0] == 400 and "Unsupported Media Type" in answers[0][1]["error"]["message"]


_OOPS = b'{"prompt": oops}'  # `oops` at character 11


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
@pytest.mark.parametrize(
    ("content_type", "data", "said"),
    [
        ("application/vnd.api+json", _OOPS, "'loc': 'body.11'"),
        ("application/merge-patch+json", _OOPS, "'loc': 'body.11'"),
        ("application/json ;x", _OOPS, "'loc': 'body.11'"),
        ("application/vnd.api+json", json.dumps({"model": MODEL, "prompt": "abc"}).encode(), "Unsupported Media"),
        ("application/vnd.api+json", b'{"prompt": NaN}', "Unsupported Media"),  # json.loads reads NaN
        ("application/vnd.api+json", b"", "Unsupported Media"),
        ("text/plain", _OOPS, "Unsupported Media"),
    ],
)
async def test_a_json_media_type_vllm_decodes_first_gets_its_decode_error(
    agg: Cluster, http: aiohttp.ClientSession, path: str, content_type: str, data: bytes, said: str
) -> None:
    """FastAPI decodes an `application/*+json` body (and `application/json ;...`) as JSON before vLLM's
    validate_json_request refuses its media type, so a malformed one gets its json_invalid error; the
    router answered "Unsupported Media Type" whatever such a body held."""
    answers = []
    for url in (agg.routers[0].url, agg.workers[0].sim.url):
        async with http.post(url + path, data=data, headers={"Content-Type": content_type}) as r:
            answers.append((r.status, await r.json(content_type=None)))
    assert answers[0] == answers[1], answers
    assert answers[0][0] == 400 and said in answers[0][1]["error"]["message"], answers


@pytest.mark.parametrize("stream", [False, True])
async def test_a_text_prompt_past_the_context_gets_the_engines_own_error(
    agg: Cluster, http: aiohttp.ClientSession, stream: bool
) -> None:
    """vLLM tokenizes a text prompt only to max_model_len + 1 and says "at least" that many tokens;
    sent as the router's ids, the engine named the whole count instead."""
    request = {"model": MODEL, "prompt": "hello there world " * 12_000, "max_tokens": 3, "stream": stream}
    s1, via_router, _ = await post(http, agg.routers[0].url + "/v1/completions", request)
    s2, direct, _ = await post(http, agg.workers[0].sim.url + "/v1/completions", request)
    assert s1 == s2 == 400
    assert via_router == direct
    assert "at least" in via_router["error"]["message"]


_LONG_TEXT = "hello" + " the" * 150_000  # 150k tokens: with every routed id beside it, a 1 MB leg


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": _LONG_TEXT, "max_tokens": 3}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": _LONG_TEXT}]}),
        ("/v1/completions", {"model": MODEL, "prompt": [300 + i % 20_000 for i in range(400_000)]}),
        ("/v1/completions", {"model": MODEL, "prompt": [300] * 32_769, "stream": True}),  # "at least" the limit + 1
    ],
)
async def test_a_prompt_far_past_the_context_gets_the_engines_own_400(
    agg: Cluster, http: aiohttp.ClientSession, path: str, request_body: dict[str, Any]
) -> None:
    """A text or chat prompt past the context went to the engine as the client's text with every
    routed id beside it, and a 150k-token one was NATS's 413 (1,050,427 bytes); so was a token-id
    prompt past ~349k ids. Each gets vLLM's 400, as the engine answers it directly."""
    s1, via_router, _ = await post(http, agg.routers[0].url + path, request_body)
    s2, direct, _ = await post(http, agg.workers[0].sim.url + path, request_body)
    assert s1 == s2 == 400 and via_router == direct
    assert via_router["error"]["message"].startswith("This model's maximum context length is 32768 tokens")


def test_a_token_id_prompt_past_the_context_is_refused_in_vllms_words() -> None:
    """vLLM 0.32's own refusal of 2,100 token ids at a context of 2,048, byte for byte."""
    captured = json.loads((FIXTURES / "bs32" / "error_prompt_too_long_tokenids.json").read_bytes())
    assert api_errors.prompt_too_long(2048, 2100).body() == captured


async def test_tokenize_and_detokenize_are_a_workers_engines_own(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    """vLLM's /tokenize and /detokenize through the router: the engine's own answers and refusals,
    every form, an answer over NATS's payload limit whole, on whichever worker, prefill included."""
    prefill = await cluster.add_worker("prefill")
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router()
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/tokenize", {"prompt": "hello world", "return_token_strs": True}),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}),
        ("/tokenize", {"prompt": "ab " * 150_000}),  # a 1.6 MB answer: over NATS's 1 MB payload limit
        ("/detokenize", {"tokens": [104, 105]}),
        ("/detokenize", {"tokens": "x"}),  # the engine's own 400
    ]
    for path, body in cases * 2:  # calls take the workers in turn
        direct = await post(http, prefill.sim.url + path, {"model": MODEL, **body})
        routed = await post(http, router.url + path, {"model": MODEL, **body})
        assert routed[:2] == direct[:2], (path, str(body)[:80])
    probes = [w.shim.probe.prompt_tokens for w in cluster.workers]  # conftest.add_worker
    assert [w.sim.engine.prefill_tokens_computed for w in cluster.workers] == probes, "no generation"
    served = [sum(w.shim.requests.outcomes.values()) for w in cluster.workers if w.shim.requests is not None]
    assert served == [len(cases), len(cases)], "each worker in turn"
    status, out, _ = await post(http, router.url + "/tokenize", {"model": "no-such-model", "prompt": "x"})
    assert_openai_error(status, out, 404, "model")
    status, out, _ = await post(http, router.url + "/detokenize", [1, 2])
    assert_openai_error(status, out, 400)
    async with http.get(router.url + "/version") as r:
        assert r.status == 200 and await r.json() == {"version": BUILD}


async def test_a_lax_boolean_stream_streams_through_the_router(agg: Cluster, http: aiohttp.ClientSession) -> None:
    # vLLM 0.32 reads "yes" as true: the router streamed it, and engine_sim answered 400.
    request = {"model": MODEL, "prompt": "a b c", "max_tokens": 3, "stream": "yes", "echo": "off"}
    for url in (agg.workers[0].sim.url, agg.routers[0].url):
        async with http.post(url + "/v1/completions", json=request) as r:
            raw = (await r.read()).decode()
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream"), (url, raw)
        events = sse(raw)
        assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]), url


async def test_unknown_model_route_and_method(agg: Cluster, http: aiohttp.ClientSession) -> None:
    url = agg.routers[0].url
    status, out, _ = await post(http, url + "/v1/completions", {"model": "no-such-model", "prompt": "x"})
    assert_openai_error(status, out, 404, "model")
    status, out, _ = await post(http, url + "/v1/nothing", {})
    assert_openai_error(status, out, 404)
    assert out["error"]["message"] == "no route /v1/nothing"
    for path in ("/v1/responses", "/v1/messages", "/v1/embeddings", "/v1/chat/completions/render"):
        status, out, _ = await post(http, url + path, {"model": MODEL, "input": "x"})  # vLLM serves these
        assert_openai_error(status, out, 404)
        assert "kvswitch routes /v1/completions and /v1/chat/completions" in out["error"]["message"], path
        assert "send other vLLM endpoints to an engine directly" in out["error"]["message"], path
    async with http.get(url + "/v1/completions") as r:
        assert_openai_error(r.status, await r.json(), 405)
        assert "POST" in r.headers["Allow"]


async def test_head_is_answered_as_vllm_answers_it(agg: Cluster, http: aiohttp.ClientSession) -> None:
    """vLLM's GET routes answer HEAD with a 405 saying `Allow: GET`, but /metrics (Prometheus's
    app); the router answered HEAD with a 200 on all of them, its 405s saying `Allow: GET,HEAD`.
    /ping's says `Allow: GET` too, though POST is served, as vLLM's (its GET route first): until
    2026-12-07 the router's said `GET,POST`."""
    router, sim = agg.routers[0].url, agg.workers[0].sim.url
    for path in ("/health", "/ping", "/ready", "/version", "/v1/models"):
        async with http.head(router + path) as r:
            assert (r.status, r.headers["Allow"]) == (405, "GET"), path
    async with http.put(router + "/ping") as r:
        assert_openai_error(r.status, await r.json(), 405)
        assert r.headers["Allow"] == "GET"
    for method in ("GET", "POST"):
        async with http.request(method, router + "/ping") as r:
            assert r.status == 200, method
    for path in ("/health", "/ping", "/version", "/v1/models"):
        async with http.head(sim + path) as r:
            assert r.status == 405, path
    for url in (router, sim):
        async with http.post(url + "/v1/models") as r:
            assert (r.status, r.headers["Allow"]) == (405, "GET"), url
        async with http.head(url + "/metrics") as r:
            assert r.status == 200, url


async def test_ping_is_vllms_name_for_health(agg: Cluster, http: aiohttp.ClientSession) -> None:
    """vLLM's SageMaker liveness route, GET and POST, answers as /health (it was a 404)."""
    url = agg.routers[0].url
    health = await answer(http, "GET", url + "/health")
    for method in ("GET", "POST"):
        status, out, headers = await answer(http, method, url + "/ping")
        assert (status, out) == health[:2] and status == 200, method
        assert headers["content-type"].startswith("application/json")
    async with http.post(agg.workers[0].sim.url + "/ping") as r:  # as the engine answers it
        assert r.status == 200


async def test_bodies_and_headers_over_the_limits_are_413_and_431(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    limit = HttpLimits().max_body_bytes
    big = json.dumps({"model": MODEL, "prompt": "a " * (limit // 2 + 10)})
    status, out, _ = await post(http, router.url + "/v1/completions", big)
    assert_openai_error(status, out, 413, "body")
    assert str(limit) in out["error"]["message"]

    async def chunked() -> Any:  # no Content-Length: the limit is found while reading
        for _ in range(limit // (1 << 20) + 2):
            yield b" " * (1 << 20)

    json_type = {"Content-Type": "application/json"}
    async with http.post(router.url + "/v1/completions", data=chunked(), headers=json_type) as r:
        assert_openai_error(r.status, await r.json(), 413)
    async with http.get(router.url + "/v1/models", headers={"X-Big": "x" * 20_000}) as r:
        assert_openai_error(r.status, await r.json(), 431)
    many = {f"X-H{i}": "1" for i in range(300)}
    async with http.get(router.url + "/v1/models", headers=many) as r:
        assert_openai_error(r.status, await r.json(), 431)


async def _raw_status(url: str, request: bytes) -> int:
    """The status of the answer to `request`, sent as bytes on a connection of its own."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            return int((await reader.readuntil(b"\r\n")).split()[1])
    finally:
        writer.close()


async def test_every_refusal_before_routing_is_counted_in_requests_total(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """413, 400 (bad JSON), 404, 405, 417 and what aiohttp's parser refuses (431, 400) each
    count once, under a fixed label (docs/router.md, "Metrics"); until 2026-12-07 the 417 and the
    parser's refusals were in no count."""
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(config={"http_limits": HttpLimits(max_body_bytes=4096)}, disagg="never")
    url = router.url

    def count(endpoint: str, code: int) -> float:
        labels = {"endpoint": endpoint, "code": str(code)}
        return router.metrics.registry.get_sample_value("kvswitch_router_requests_total", labels) or 0.0

    assert (await post(http, url + "/v1/completions", "x" * 5000))[0] == 413
    assert (await post(http, url + "/v1/completions", "{not json"))[0] == 400
    assert (await post(http, url + "/v1/nothing", {}))[0] == 404
    async with http.get(url + "/v1/completions") as r:
        assert r.status == 405
    expect = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Type: application/json\r\n"
    assert await _raw_status(url, expect + b"Content-Length: 2\r\n\r\n") == 417
    assert await _raw_status(url, b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"x" * 20_000 + b"\r\n\r\n") == 431
    assert await _raw_status(url, b"GET / HTTP/1.1\r\nbad header\r\n\r\n") == 400
    assert count("completions", 413) == 1 and count("completions", 400) == 1
    assert count("unrouted", 404) == 1 and count("unrouted", 405) == 1
    assert count("tokenize", 417) == 1
    assert count("unparsed", 431) == 1 and count("unparsed", 400) == 1


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "one-header-line-at-a-time"])
async def test_a_connection_that_completes_no_request_head_is_closed_at_the_idle_timeout(
    cluster: Cluster, trickle: bool
) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_router(config={"http_limits": HttpLimits(idle_timeout_s=0.5)}, disagg="never")
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    started = time.monotonic()
    try:
        if trickle:  # each line well inside the timeout: the head as a whole is what is timed
            writer.write(b"GET /v1/models HTTP/1.1\r\n")
            for i in range(40):
                await asyncio.sleep(0.1)
                # A close with our bytes unread arrives as a reset, which sets the reader's
                # exception rather than its EOF: the transport closing sees both.
                if reader.at_eof() or writer.is_closing():
                    break
                writer.write(b"X-Slow-%d: 1\r\n" % i)
        assert await asyncio.wait_for(reader.read(), timeout=5.0) == b""  # closed, nothing answered
    except ConnectionResetError:
        pass
    finally:
        writer.close()
    assert time.monotonic() - started < 0.5 + 1.5  # the timeout, slack


async def test_a_half_sent_body_is_answered_within_the_body_timeout(cluster: Cluster) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_router(config={"http_limits": HttpLimits(body_timeout_s=0.5)}, disagg="never")
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model": "sim-llama", "pro'
        )
        await writer.drain()
        started = time.monotonic()
        raw = await asyncio.wait_for(reader.read(), timeout=5.0)  # answered, then closed
        assert time.monotonic() - started < 0.5 + 1.0 + 1.0  # the body timeout, the lingering close, slack
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == 408


async def test_a_prompt_over_the_nats_payload_limit_is_413_naming_it(agg: Cluster, http: aiohttp.ClientSession) -> None:
    router = agg.routers[0]
    limit = router.dispatcher._nc.max_payload
    request = {"model": MODEL, "prompt": [300] * 1000, "user": "u" * limit}  # within the context
    status, out, _ = await post(http, router.url + "/v1/completions", request)
    assert_openai_error(status, out, 413)
    assert str(limit) in out["error"]["message"] and "max_payload" in out["error"]["message"]
    assert agg.workers[0].id not in json.dumps(out)


async def test_a_streamed_event_over_the_nats_payload_limit_reaches_the_client_whole(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # Room for the 12 k-token prompt. The sim computes its 12 k prompt logprobs in the event loop
    # the shim and the router share here, which on a loaded box stalls them for seconds: liveness
    # is not under test, so a lease longer than the cluster's.
    await cluster.add_worker("agg", shim={"lease_ttl": 30}, num_gpu_blocks=2048)
    router = await cluster.add_ready_router(disagg="never")
    sim = cluster.workers[0].sim
    prompt = [300 + i % 5000 for i in range(12_000)]
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 5}
    s1, via_router, _ = await stream(http, router.url + "/v1/completions", request)
    s2, direct, _ = await stream(http, sim.url + "/v1/completions", request)
    assert s1 == s2 == 200, via_router[-1]
    assert len(json.dumps(direct[0])) > router.dispatcher._nc.max_payload, "the echo alone is over the limit"
    assert via_router[-1] == direct[-1] == "[DONE]"
    drop = ("id", "created")
    assert [{k: v for k, v in e.items() if k not in drop} for e in via_router[:-1]] == [
        {k: v for k, v in e.items() if k not in drop} for e in direct[:-1]
    ]


async def test_errors_mid_stream_carry_no_internal_text(agg: Cluster, http: aiohttp.ClientSession) -> None:
    router, worker = agg.routers[0], agg.workers[0]
    labels = {"endpoint": "completions", "code": "502"}
    before = router.metrics.registry.get_sample_value("kvswitch_router_requests_total", labels) or 0.0
    body = {"model": MODEL, "prompt": "the cache", "max_tokens": 30000, "stream": True, "ignore_eos": True}
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()
        await worker.sim.crash()
        raw = (await resp.read()).decode()
    events = raw.strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    # not a 503 "no worker could serve the request", as it was until 2026-12-06: one was serving it
    assert (error["code"], error["message"]) == (502, "the worker serving the request failed while streaming it")
    counted = router.metrics.registry.get_sample_value("kvswitch_router_requests_total", labels)
    assert counted == before + 1, "counted as the worker's failure, as docs/router.md's Metrics says"
    assert worker.id not in raw and worker.sim.url not in raw and "Error(" not in raw


async def test_a_503_found_by_the_leg_says_retry_after_as_one_found_by_planning(
    agg: Cluster, http: aiohttp.ClientSession
) -> None:
    """A worker that answers 503 (draining) with no other to retry on: the client got the same "no
    worker" 503 as planning gives, without its Retry-After."""
    router, worker = agg.routers[0], agg.workers[0]
    legs = worker.shim.requests
    assert legs is not None
    legs.accepting = False
    try:
        async with http.post(
            router.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
        ) as resp:
            assert resp.status == 503 and resp.headers.get("Retry-After") == "5", await resp.text()
            assert (await resp.json())["error"]["message"] == "no worker could serve the request"
    finally:
        legs.accepting = True


async def test_a_prefill_legs_400_comes_back_as_the_engines_400(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    await cluster.add_worker("prefill")
    decode = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    request = {"model": MODEL, "prompt": list(range(300, 400)), "logprobs": 21}
    status, out, _ = await post(http, router.url + "/v1/completions", request)
    _, direct, _ = await post(http, decode.sim.url + "/v1/completions", request)
    assert status == 400 and out == direct
    assert router.dispatcher.fallbacks == 0, "an engine's refusal is no reason to prefill locally"
    ok, whole, headers = await post(http, router.url + "/v1/completions", {**request, "logprobs": 2})
    assert ok == 200 and headers["x-kvswitch-prefill"] == "remote" and whole["choices"][0]["logprobs"]


async def test_text_prompts_are_refused_for_workers_with_another_tokenizer(
    cluster: Cluster, http: aiohttp.ClientSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    worker = await cluster.add_worker("agg")
    with caplog.at_level(logging.ERROR, logger="router.tokenization"):
        router = await cluster.add_router(config={"tokenizer": str(tmp_path)}, disagg="never")
        await cluster.ready(router)
    status, out, _ = await post(http, router.url + "/v1/completions", {"model": MODEL, "prompt": "hello world"})
    assert_openai_error(status, out, 503)
    assert "tokenizer" in out["error"]["message"]
    status, out, _ = await post(http, router.url + "/v1/completions", {"model": MODEL, "prompt": [3, 4, 5]})
    assert status == 200, out  # token ids need no tokenizer
    async with http.get(router.url + "/ready") as r:
        ready = await r.json()
    assert [w["worker"] for w in ready["tokenizer"]["text_refused"]] == [worker.id]
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and worker.id in r.getMessage()]
    assert len(logged) == 1


async def test_the_loop_answers_while_a_huge_prompt_is_refused_or_tokenized(
    agg: Cluster, http: aiohttp.ClientSession
) -> None:
    router = agg.routers[0]

    async def health_while(task: asyncio.Task[Any]) -> int:
        answered = 0
        while not task.done():
            async with http.get(router.url + "/health") as r:
                assert r.status == 200
            answered += 1
            await asyncio.sleep(0.01)
        return answered

    huge = json.dumps({"model": MODEL, "prompt": "word " * 10_000_000})  # 50 MB
    refused = asyncio.create_task(post(http, router.url + "/v1/completions", huge))
    assert await health_while(refused) >= 1
    status, out, _ = await refused
    assert_openai_error(status, out, 413)

    big_text = ("the cache holds the prefix\n" * 150_000)[:4_000_000]  # 4 MB: allowed, tokenized on a thread
    big = {"model": MODEL, "prompt": big_text, "max_tokens": 1}
    tokenizing = asyncio.create_task(post(http, router.url + "/debug/route", big))
    answered = await health_while(tokenizing)
    status, out, _ = await tokenizing
    assert status == 200 and out["isl"] == len(router.tokenizer.encode(big_text))
    assert answered >= 2, "the event loop stalled while the prompt was tokenized"


async def test_no_worker_is_503_and_ready_follows_the_registry(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    router = await cluster.add_router()
    none = (  # nothing could serve a request, and it says where it looked
        "no decode or agg worker can take requests: no worker is registered under "
        f"/{cluster.ns}/workers/ in etcd (this router's --namespace is {cluster.ns}; workers registered "
        "under another namespace are not seen)"
    )
    await until(lambda: none in router.readiness()[1]["problems"], what="registry read")
    async with http.get(router.url + "/ready") as r:
        assert r.status == 503
        assert none in (await r.json())["problems"]
    worker = await cluster.add_worker("agg")
    await cluster.ready(router)
    async with http.get(router.url + "/ready") as r:
        assert r.status == 200
        body = await r.json()
    assert body["worker_status"] == [] and body["excluded_by_reason"] == {}  # a routable worker is not listed
    async with http.get(router.url + "/debug/workers") as r:
        assert r.status == 200
        listing = await r.json()
    assert [w["worker"] for w in listing["worker_status"] if w["routable"]] == [worker.id]
    assert body["tokenizer"] == {"router": "builtin", "text_refused": [], "text_refused_total": 0}
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
    assert all(c["decode_context"] >= 0.0 for c in by_worker.values())  # the shims' count, 0 when idle
    assert info["outcome"] == "bypass_isl" and info["bypass"] and "eff_isl=2" in info["reason"]
    assert dict(router.disagg.counts) == counts, "a dry run counts nothing"
    assert d1.id in by_worker


async def test_metrics_report_requests_decisions_and_index(agg: Cluster, http: aiohttp.ClientSession) -> None:
    router = agg.routers[0]
    await complete(http, router, list(range(100)))
    status, _, _ = await stream(http, router.url + "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
    assert status == 200
    await until(lambda: len(router.index) >= 6, what="indexed")
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"  # the format it is
    assert 'kvswitch_router_requests_total{code="200",endpoint="completions"} 2.0' in text
    assert 'kvswitch_router_decisions_total{outcome="aggregated"} 2.0' in text
    assert 'kvswitch_router_prompt_tokens_total{reach="prompt"} 103.0' in text  # 100 + 3 prompt tokens
    assert "kvswitch_router_ttft_seconds_count" in text and "kvswitch_router_itl_seconds_count" in text
    blocks = next(line for line in text.splitlines() if line.startswith("kvswitch_router_index_blocks "))
    assert float(blocks.split()[1]) >= 6
    memory = next(line for line in text.splitlines() if line.startswith("kvswitch_router_index_memory_bytes "))
    assert float(memory.split()[1]) > 0


async def test_client_disconnect_cancels_on_the_worker(agg: Cluster, http: aiohttp.ClientSession) -> None:
    router, worker = agg.routers[0], agg.workers[0]
    body = {"model": MODEL, "prompt": "the cache", "max_tokens": 30000, "stream": True, "ignore_eos": True}
    resp = await http.post(router.url + "/v1/completions", json=body)
    await resp.content.readline()
    await until(lambda: bool(worker.sim.engine.running), what="the request to run")
    resp.close()
    await until(lambda: not worker.sim.engine.running and not worker.sim.engine.waiting, what="the cancel")
    await asyncio.sleep(0)


# --- a whole answer's `kvswitch` member ------------------------------------------------------------

_ROUTE = {"decode_worker": "w1", "prefill": "agg", "prefill_worker": None, "outcome": "aggregated", "attempts": 1}


@pytest.mark.parametrize(
    ("parts", "built"),
    [
        ([b'{"id":"c1"}'], b'{"id":"c1","kvswitch":'),
        ([b'{"id":', b'"c1"', b"}"], b'{"id":"c1","kvswitch":'),  # the brace alone in its piece
        ([b'{"id":"c1"  \n', b"}", b" \r\n", b"\n"], b'{"id":"c1","kvswitch":'),  # whitespace across pieces
        ([b"{ ", b" }"], b'{"kvswitch":'),  # an empty object takes no comma
    ],
)
def test_the_route_goes_on_a_whole_answer_as_its_last_member(parts: list[bytes], built: bytes) -> None:
    body = b"".join(http_api._with_route(parts, _ROUTE))
    assert body.startswith(built) and json.loads(body)["kvswitch"] == _ROUTE and body.endswith(b"}}")


@pytest.mark.parametrize("parts", [[], [b" ", b"\n"], [b"[1]"], [b'{"a":1}', b" x"]])
def test_a_whole_answer_that_is_no_object_is_a_502(parts: list[bytes]) -> None:
    with pytest.raises(api_errors.ApiError) as err:
        http_api._with_route(parts, _ROUTE)
    assert err.value.code == 502


@pytest.mark.parametrize("shown", [True, False], ids=["route-shown", "route-not-shown"])
async def test_a_whole_answer_is_built_with_no_copy_of_its_body(shown: bool) -> None:
    """The route went on a whole answer joined, trimmed, sliced and concatenated: five copies of
    the body on the loop (0.42 s for 150 MB). Now none: its pieces, with its route or without
    (router.route_info), written in slices (_write_whole)."""
    parts = [b'{"choices":[{"text":"', *[b"x" * (1 << 20)] * 16, b'"}]}\n']
    job = SimpleNamespace(
        plan=SimpleNamespace(decode=SimpleNamespace(worker="w1"), prefill=None),
        path=RoutePath.AGG,
        transfer=None,
        outcome=Outcome.AGGREGATED,
        attempts=1,
        prefill_worker=None,
    )
    chunks = [ResponseChunk(request_id="r1", seq=i, body=p, final=i == len(parts) - 1) for i, p in enumerate(parts)]

    async def stream(_job: Any, _arrived: float) -> AsyncIterator[ResponseChunk]:
        for chunk in chunks:
            yield chunk

    handlers = cast(Any, SimpleNamespace(path=SimpleNamespace(stream=stream)))
    ids, timing = http_api._Ids("r1", "r1", "cmpl-r1"), http_api._Timing(time.perf_counter())
    size = sum(map(len, parts))
    tracemalloc.start()
    try:
        resp, body = await http_api._Handlers._whole(handlers, cast(Any, job), ids, timing, shown)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    answer = json.loads(b"".join(body))
    assert resp.content_length == sum(map(len, body))
    assert answer["choices"][0]["text"] == "x" * (16 << 20)
    assert (answer["kvswitch"]["decode_worker"] if shown else answer.get("kvswitch")) == ("w1" if shown else None)
    assert ("x-kvswitch-decode-worker" in resp.headers) == shown
    assert peak < 0.5 * size  # its pieces alone; five copies held up to three at once
