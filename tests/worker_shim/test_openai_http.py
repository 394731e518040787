"""The vLLM adapter's HTTP calls against a stand-in that checks what vLLM 0.32 checks: the JSON
content type, and the pass-through bodies per leg (the client's request as it is, only the P/D
fields, the stream flag and a prefill leg's one token forced), its events back byte for byte and
its own 400 body back as it is."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from protocol import SamplingParams
from protocol.messages import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from worker_shim import ShimConfig
from worker_shim.adapters.base import EngineError, LegRequest
from worker_shim.adapters.vllm import PREFILL_TRANSFER_PARAMS, VllmAdapter

EVENTS = [
    b'{"id":"cmpl-r1","choices":[{"index":0,"text":" a","token_ids":null}]}',
    b'{"id":"cmpl-r1","choices":[{"index":1,"text":" b"},{"index":0,"text":"","finish_reason":"stop"}]}',
]


class Engine:
    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    async def tokenize(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":  # vLLM: 400 Unsupported Media Type
            return web.json_response({"error": {"message": "Only 'application/json' is allowed"}}, status=400)
        return web.json_response({"tokens": [1, 2, 3]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        assert request.content_type == "application/json"
        body = await request.json()
        self.bodies.append((request.path, body))
        if body.get("logprobs") == 21:
            return web.json_response({"error": {"message": "logprobs too big", "param": "logprobs"}}, status=400)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for e in EVENTS:
                await resp.write(b"data: " + e + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        answer: dict[str, Any] = {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1}}
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = {"remote_engine_id": "e1"}
        return web.json_response(answer)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, VllmAdapter]]:
    eng = Engine()
    app = web.Application()
    app.router.add_post("/tokenize", eng.tokenize)
    app.router.add_post("/v1/completions", eng.generate)
    app.router.add_post("/v1/chat/completions", eng.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    adapter = VllmAdapter(
        ShimConfig(engine="vllm", engine_url=f"http://127.0.0.1:{port}", model="m", kv_events="tcp://127.0.0.1:1")
    )
    await adapter.open()
    yield eng, adapter
    await adapter.close()
    await runner.cleanup()


def leg(endpoint: str, params: dict[str, Any], **kw: Any) -> LegRequest:
    return LegRequest(
        request_id="r1",
        model="m",
        token_ids=[7, 8, 9],
        sampling=SamplingParams(),
        endpoint=endpoint,
        params=params,
        **kw,
    )


async def test_the_tokenizer_probe_says_it_sends_json(engine: tuple[Engine, VllmAdapter]) -> None:
    _, adapter = engine
    assert (await adapter.tokenizer_fingerprint() or "").startswith("tok-")


async def test_a_stream_passes_the_engines_events_through_and_counts_tokens(
    engine: tuple[Engine, VllmAdapter],
) -> None:
    eng, adapter = engine
    seen: list[tuple[int, bytes | None]] = []

    async def on_output(tokens: int, event: bytes | None, ids: list[int]) -> None:
        seen.append((tokens, event))

    params = {"model": "m", "stop": ["x"], "n": 2, "echo": True, "logprobs": 2, "seed": 3}
    out = await adapter.generate(leg(ENDPOINT_COMPLETIONS, params), on_output)
    path, body = eng.bodies[-1]
    assert path == "/v1/completions"
    assert body == {**params, "prompt": [7, 8, 9], "stream": True}  # nothing added to count tokens
    assert seen == [(1, EVENTS[0]), (1, EVENTS[1])]  # byte for byte; one token per choice with text
    assert out.finish_reason == "stop" and out.body == b""


async def test_pass_through_bodies_per_leg(engine: tuple[Engine, VllmAdapter]) -> None:
    eng, adapter = engine

    async def ignore(tokens: int, event: bytes | None, ids: list[int]) -> None:
        pass

    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "min_tokens": 4,
        "max_tokens": 50,
        "stream_options": {"include_usage": True},
        "n": 3,
        "tools": [{"type": "function"}],
    }
    pre = await adapter.generate(leg(ENDPOINT_CHAT, chat, prefill_only=True), ignore)
    path, body = eng.bodies[-1]
    assert path == "/v1/chat/completions" and pre.transfer_params == {"remote_engine_id": "e1"}
    assert body["max_tokens"] == body["max_completion_tokens"] == 1 and body["n"] == 1 and body["stream"] is False
    assert "min_tokens" not in body and "stream_options" not in body and "prompt" not in body
    assert body["kv_transfer_params"] == PREFILL_TRANSFER_PARAMS and body["tools"] == chat["tools"]
    whole = await adapter.generate(leg(ENDPOINT_CHAT, chat, stream=False, transfer={"remote_engine_id": "e1"}), ignore)
    _, body = eng.bodies[-1]
    assert body == {**chat, "stream": False, "kv_transfer_params": {"remote_engine_id": "e1"}}
    assert json.loads(whole.body)["choices"][0]["text"] == "x"  # the engine's body, kept for the client


async def test_the_engines_own_400_body_comes_back(engine: tuple[Engine, VllmAdapter]) -> None:
    _, adapter = engine

    async def ignore(tokens: int, event: bytes | None, ids: list[int]) -> None:
        pass

    with pytest.raises(EngineError) as caught:
        await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "logprobs": 21}), ignore)
    assert caught.value.code == 400 and caught.value.message == "logprobs too big"
    assert json.loads(caught.value.body)["error"]["param"] == "logprobs"
