"""The vLLM adapter's HTTP calls against a stand-in that checks what vLLM 0.32 checks: the JSON
content type, and the pass-through bodies per leg (the client's request as it is, only the P/D
fields, the stream flag and a prefill leg's one token forced), its events back byte for byte and
its own 400 body back as it is; and the model cards of vLLM's own /v1/models answer."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import json
import socket
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
from aiohttp import web

from engine_sim.request import SimRequest
from engine_sim.scheduler import Scheduler
from protocol import SamplingParams, Usage
from protocol.messages import (
    BAD_TRANSFER_HANDLE,
    ENDPOINT_CHAT,
    ENDPOINT_COMPLETIONS,
    PREFILL_STOPPED,
    RETRY_AFTER_MAX_S,
)
from tests.protocol.vllm_captures import FIXTURES
from tests.router.polling import until
from worker_shim import ShimConfig
from worker_shim.adapters import openai_http
from worker_shim.adapters.base import EngineError, LegRequest, ModelCard
from worker_shim.adapters.openai_http import model_cards
from worker_shim.adapters.vllm import PREFILL_TRANSFER_PARAMS, VllmAdapter, check_transfer_handle

FINISHED_0 = b'{"choices":[{"index":0,"text":"","finish_reason":"stop"}]}'
# vLLM 0.32's NixlConnector handle, as engine_sim returns it (engine_sim/scheduler.py _finish)
HANDLE: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[3, 4]],
    "remote_engine_id": "e1",
    "remote_request_id": "r1-0a1b2c3d",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
}
BUSY = b'{"error":{"message":"busy","type":"RateLimitError","param":null,"code":429}}'
EVENTS = [
    b'{"id":"cmpl-r1","choices":[{"index":0,"text":" a","token_ids":null}]}',
    b'{"id":"cmpl-r1","choices":[{"index":1,"text":" b"},{"index":0,"text":"","finish_reason":"stop"}]}',
]


async def _next_loop_turn() -> None:
    await asyncio.sleep(0)


class Engine:
    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        # a streamed answer: each item one write, and the write after it waits for `between()`
        self.writes = [b"data: " + e + b"\n\n" for e in EVENTS] + [b"data: [DONE]\n\n"]
        self.between: Callable[[], Awaitable[None]] = _next_loop_turn
        self.whole: bytes | None = None  # a whole answer's body as it is, in place of the default
        self.status = 200  # another: answered with BUSY and `retry_after`
        self.retry_after = ""

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
        if self.status != 200:
            headers = {"Retry-After": self.retry_after}
            return web.Response(status=self.status, body=BUSY, content_type="application/json", headers=headers)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for n, data in enumerate(self.writes):
                if n:
                    await self.between()
                await resp.write(data)
            return resp
        if self.whole is not None:
            return web.Response(body=self.whole, content_type="application/json")
        answer: dict[str, Any] = {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1}}
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = HANDLE
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
    seen: list[tuple[int, list[bytes]]] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.append((tokens, events))

    async def handed_over() -> None:  # the next event is written only once the last one was handed over
        before = len(seen)
        await until(lambda: len(seen) > before)

    eng.between = handed_over  # [DONE] too waits for the last event to be handed over
    params = {"model": "m", "stop": ["x"], "n": 2, "echo": True, "logprobs": 2, "seed": 3}
    out = await adapter.generate(leg(ENDPOINT_COMPLETIONS, params), on_output)
    path, body = eng.bodies[-1]
    assert path == "/v1/completions"
    assert body == {**params, "prompt": [7, 8, 9], "stream": True}  # nothing added to count tokens
    assert seen == [(1, [EVENTS[0]]), (1, [EVENTS[1]])]  # byte for byte; one token per choice with text
    assert out.finish_reason == "stop" and out.body == b""


async def test_events_that_arrive_together_are_handed_over_together(engine: tuple[Engine, VllmAdapter]) -> None:
    eng, adapter = engine
    seen: list[tuple[int, list[bytes]]] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.append((tokens, events))

    eng.writes = [b"".join(eng.writes)]  # one write: a shim that fell behind reads them in one go
    await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "n": 2}), on_output)
    assert seen == [(2, EVENTS)]


async def test_a_long_event_split_over_reads_passes_through_whole(engine: tuple[Engine, VllmAdapter]) -> None:
    eng, adapter = engine
    seen: list[bytes] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.extend(events)

    # a first chunk with a long prompt's prompt_logprobs, written (and read) in two pieces
    huge = json.dumps({"choices": [{"index": 0, "text": " a", "prompt_logprobs": [{"1": -0.5}] * 40_000}]})
    eng.writes = [b"data: " + huge.encode()[:70_000], huge.encode()[70_000:] + b"\n\n", b"data: [DONE]\n\n"]
    out = await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m"}), on_output)
    assert seen == [huge.encode()] and len(huge) > 400_000 and out.finish_reason is None


async def test_output_before_an_error_event_in_the_same_read_is_handed_over_first(
    engine: tuple[Engine, VllmAdapter],
) -> None:
    eng, adapter = engine
    seen: list[bytes] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.extend(events)

    error = b'{"error":{"message":"the engine ran out of KV cache","code":500}}'
    eng.writes = [b"data: " + EVENTS[0] + b"\n\ndata: " + error + b"\n\n"]
    with pytest.raises(EngineError):
        await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m"}), on_output)
    assert seen == [EVENTS[0]]


@pytest.mark.parametrize(
    ("params", "events"),
    [
        # n=2: choice 0 finished, choice 1 never did
        ({"n": 2}, [b'{"choices":[{"index":0,"text":" a"},{"index":1,"text":" b"}]}', FINISHED_0]),
        # the usage event asked for never came
        ({"stream_options": {"include_usage": True}}, [EVENTS[0], FINISHED_0]),
    ],
    ids=["n2_one_choice_unfinished", "usage_never_sent"],
)  # fmt: skip
async def test_a_stream_cut_after_a_finish_reason_without_done_is_the_engines_protocol_error(
    engine: tuple[Engine, VllmAdapter], params: dict[str, Any], events: list[bytes]
) -> None:
    """vLLM 0.32, SGLang and TensorRT-LLM end every stream they finish with [DONE]: a clean EOF
    before it is a cut answer, whatever finish_reason came (until 2026-12-06 one was enough, and
    the router gave the client the cut answer as a whole one). What came is still handed over."""
    eng, adapter = engine
    eng.writes = [b"data: " + e + b"\n\n" for e in events]
    seen: list[bytes] = []

    async def on_output(tokens: int, got: list[bytes], ids: list[int]) -> None:
        seen.extend(got)

    with pytest.raises(EngineError) as err:
        await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "stream": True, **params}), on_output)
    assert (err.value.code, err.value.kind) == (502, "engine_protocol") and "without [DONE]" in err.value.message
    assert seen == events
    eng.writes.append(b"data: [DONE]\n\n")  # the same stream, whole
    out = await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "stream": True, **params}), on_output)
    assert out.finish_reason == "stop"


async def test_an_engines_429_carries_its_retry_after(engine: tuple[Engine, VllmAdapter]) -> None:
    """The router passes it on when no worker takes the request (router.api_errors.leg_error)."""
    eng, adapter = engine
    eng.status, eng.retry_after = 429, "3"
    with pytest.raises(EngineError) as err:
        await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m"}), _ignore)
    assert (err.value.code, err.value.kind, err.value.retry_after_s) == (429, "engine_rejected", 3)
    assert err.value.body == BUSY and err.value.message == "busy"


@pytest.mark.parametrize(
    ("header", "seconds"),
    [(None, None), ("0", 0), (" 120 ", 120), ("-1", None), ("soon", None), ("1.5", None),
     ("Wed, 21 Oct 2015 07:28:00 GMT", 0)],
)  # fmt: skip
def test_retry_after_is_read_as_rfc_9110_says(header: str | None, seconds: int | None) -> None:
    assert openai_http.retry_after_s(header) == seconds


def test_a_retry_after_date_is_a_delay_from_now() -> None:
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30)
    assert 29 <= (openai_http.retry_after_s(email.utils.format_datetime(when, usegmt=True)) or 0) <= 31


async def _ignore(tokens: int, events: list[bytes], ids: list[int]) -> None:
    pass


async def test_a_line_that_never_ends_is_the_engines_protocol_error(
    engine: tuple[Engine, VllmAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine or proxy streaming one line with no newline was buffered until the deadline."""
    monkeypatch.setattr(openai_http, "MAX_LINE_BYTES", 4 << 20)
    eng, adapter = engine
    eng.writes = [b"data: " + b"x" * (1 << 20)] + [b"x" * (1 << 20)] * 8  # 9 MiB of one line
    seen: list[bytes] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.extend(events)

    with pytest.raises(EngineError) as err:
        await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m"}), on_output)
    assert (err.value.code, err.value.kind) == (502, "engine_protocol") and "without a newline" in err.value.message
    assert seen == []


def chat_chunk(index: int, delta: dict[str, Any], **extra: Any) -> bytes:
    """An event of vLLM 0.32's chat stream, its fields as it writes them."""
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return json.dumps({**head, "choices": [choice]}, separators=(",", ":")).encode()


ROLES = [chat_chunk(i, {"role": "assistant", "content": ""}) for i in (0, 1)]
KV_PULL_FAILED = b'{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}'


async def test_a_chat_echo_is_passed_through_but_counts_no_token(engine: tuple[Engine, VllmAdapter]) -> None:
    """vLLM streams a chat `echo` (the last message's content, when the reply has its role) after
    each choice's role chunk, before any output: also before the error of a failed KV pull, which
    counted as a token made the router take the pull for a success (no fallback)."""
    eng, adapter = engine
    seen: list[tuple[int, list[bytes]]] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.append((tokens, events))

    async def streamed(body: dict[str, Any], *events: bytes) -> tuple[int, list[bytes]]:
        eng.writes = [b"data: " + e + b"\n\n" for e in events]
        seen.clear()
        with contextlib.suppress(EngineError):
            await adapter.generate(leg(ENDPOINT_CHAT, body, transfer={"remote_engine_id": "e1"}), on_output)
        return sum(n for n, _ in seen), [e for _, got in seen for e in got]

    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]
    chat = {"model": "m", "messages": messages, "n": 2, "echo": True}
    echoes = [chat_chunk(i, {"content": "Once upon"}) for i in (0, 1)]
    assert await streamed(chat, *ROLES, *echoes, KV_PULL_FAILED) == (0, [*ROLES, *echoes])  # byte for byte
    parts = {"role": "assistant", "content": [{"type": "text", "text": "Once"}, {"type": "text", "text": "upon"}]}
    joined = [chat_chunk(i, {"content": "Once\nupon"}) for i in (0, 1)]  # as vLLM renders text parts
    assert await streamed({**chat, "messages": [parts]}, *ROLES, *joined, KV_PULL_FAILED) == (0, [*ROLES, *joined])

    # the output after it counts, its own text too; so does a reply that only looks like an echo
    output = chat_chunk(0, {"content": "Once upon"}, token_ids=None)
    chat["n"] = 1
    assert await streamed(chat, ROLES[0], echoes[0], output, b"[DONE]") == (1, [ROLES[0], echoes[0], output])
    user = {**chat, "messages": [{"role": "user", "content": "Once upon"}]}  # not the reply's role
    assert await streamed(user, ROLES[0], output, b"[DONE]") == (1, [ROLES[0], output])
    assert await streamed({**chat, "echo": False}, ROLES[0], output, b"[DONE]") == (1, [ROLES[0], output])


async def test_pass_through_bodies_per_leg(engine: tuple[Engine, VllmAdapter]) -> None:
    eng, adapter = engine
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "min_tokens": 4,
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "tools": [{"type": "function"}],
    }
    pre = await adapter.generate(leg(ENDPOINT_CHAT, chat, prefill_only=True), ignore)
    path, body = eng.bodies[-1]
    assert path == "/v1/chat/completions" and pre.transfer_params == HANDLE
    assert body["max_tokens"] == body["max_completion_tokens"] == 1 and body["n"] == 1 and body["stream"] is False
    assert body["min_tokens"] == 1 and "stream_options" not in body and "prompt" not in body
    assert body["kv_transfer_params"] == PREFILL_TRANSFER_PARAMS and body["tools"] == chat["tools"]
    whole = await adapter.generate(leg(ENDPOINT_CHAT, chat, stream=False, transfer=HANDLE), ignore)
    _, body = eng.bodies[-1]
    # unstreamed: no stream_options, which vLLM refuses beside `stream` false (test_leg_params.py)
    kept = {k: v for k, v in chat.items() if k != "stream_options"}
    assert body == {**kept, "stream": False, "kv_transfer_params": HANDLE}
    assert json.loads(whole.body)["choices"][0]["text"] == "x"  # the engine's body, kept for the client


@pytest.mark.parametrize("endpoint", ["", ENDPOINT_COMPLETIONS])
async def test_a_prefill_leg_that_stopped_without_a_handle_is_the_requests_not_the_engines(
    engine: tuple[Engine, VllmAdapter], endpoint: str
) -> None:
    """vLLM answers a prefill leg whose one token was an EOS or a stop id (where min_tokens did not
    mask it) with `kv_transfer_params: null` and finish_reason "stop": a kind routers do not hold
    against the worker. Ended on its length with none, the engine has no KV connector."""
    eng, adapter = engine
    for reason, kind in (("stop", PREFILL_STOPPED), ("length", "engine_protocol")):
        choice = {"index": 0, "text": "x", "token_ids": [5], "finish_reason": reason}
        eng.whole = json.dumps({"choices": [choice], "kv_transfer_params": None}).encode()
        with pytest.raises(EngineError) as caught:
            await adapter.generate(leg(endpoint, {"model": "m"}, prefill_only=True, stream=False), ignore)
        assert (caught.value.code, caught.value.kind) == (502, kind)
        assert "no kv_transfer_params" in caught.value.message
        assert eng.bodies[-1][1]["min_tokens"] == 1


@pytest.mark.parametrize(
    ("handle", "named"),
    [
        ({}, "no do_remote_prefill"),  # a proxy that rewrote the handle (2026-12-07)
        ({**HANDLE, "do_remote_prefill": False}, "do_remote_prefill false"),
        ({k: v for k, v in HANDLE.items() if k != "do_remote_prefill"}, "no do_remote_prefill"),
        ({**HANDLE, "do_remote_prefill": "true"}, 'do_remote_prefill "true"'),
        ({k: v for k, v in HANDLE.items() if k != "remote_host"}, "no remote_host"),
        ({**HANDLE, "remote_port": "5600"}, 'remote_port "5600"'),
        ({**HANDLE, "remote_port": True}, "remote_port true"),
    ],
)
@pytest.mark.parametrize("endpoint", ["", ENDPOINT_COMPLETIONS])
async def test_a_prefill_handle_a_decode_engine_would_not_pull_with_is_a_bad_transfer_handle(
    engine: tuple[Engine, VllmAdapter], endpoint: str, handle: dict[str, Any], named: str
) -> None:
    """A handle without `do_remote_prefill: true` makes vLLM's decode engine prefill the whole
    prompt again, and one without the side channel's host and port has nowhere to pull from: the
    leg fails (so the router falls back and counts it) rather than pass as a remote prefill, with its
    own kind: the engine returned a handle, so its flags are right (router.dispatch._prefill_fault)."""
    eng, adapter = engine
    choice = {"index": 0, "text": "x", "token_ids": [5], "finish_reason": "length"}
    eng.whole = json.dumps({"choices": [choice], "kv_transfer_params": handle}).encode()
    with pytest.raises(EngineError) as caught:
        await adapter.generate(leg(endpoint, {"model": "m"}, prefill_only=True, stream=False), ignore)
    assert (caught.value.code, caught.value.kind) == (502, BAD_TRANSFER_HANDLE)
    assert "kv_transfer_params" in caught.value.message and named in caught.value.message
    assert msgspec.json.encode(handle).decode()[:100] in caught.value.message  # what was received


def test_the_handles_nixl_connector_and_engine_sim_return_pass() -> None:
    """engine_sim's handle (vLLM 0.32's NixlConnector's, key for key, block ids per KV cache group),
    NixlConnector's older one (block ids one flat list) and the least the shim needs (host and port,
    no block ids). NixlConnector is the one P/D connector supported: MooncakeConnector's handle has
    no remote_host (its decode side pulls by remote_bootstrap_addr and transfer_id) and fails."""
    sim = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64, max_num_batched_tokens=256, max_num_seqs=8)
    sim.add_request(SimRequest("p", list(range(100)), max_tokens=1, remote_decode=True))
    (out,) = sim.step().outputs  # its prompt in one step, and its one token
    sim_handle = out.kv_transfer_params
    assert sim_handle is not None
    older = {**HANDLE, "remote_block_ids": [3, 4]}
    least = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "10.0.0.7", "remote_port": 5600}
    for handle in (sim_handle, HANDLE, older, least):
        check_transfer_handle(handle)
    mooncake = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[3, 4]],
        "remote_engine_id": "e1",
        "remote_bootstrap_addr": "http://10.0.0.7:8998",
        "tp_size": 1,
        "transfer_id": "xfer-r1",
    }
    with pytest.raises(EngineError) as caught:
        check_transfer_handle(mooncake)
    assert (caught.value.code, caught.value.kind) == (502, BAD_TRANSFER_HANDLE)
    assert "no remote_host" in caught.value.message


async def test_the_engines_own_400_body_comes_back(engine: tuple[Engine, VllmAdapter]) -> None:
    _, adapter = engine
    with pytest.raises(EngineError) as caught:
        await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "logprobs": 21}), ignore)
    assert caught.value.code == 400 and caught.value.message == "logprobs too big"
    assert json.loads(caught.value.body)["error"]["param"] == "logprobs"


async def ignore(tokens: int, events: list[bytes], ids: list[int]) -> None:
    pass


_CACHED = (
    b'{"choices":[{"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}'
)


@pytest.mark.parametrize(
    ("endpoint", "raw", "read"),
    [
        # vLLM 0.32's own whole answers
        (
            ENDPOINT_COMPLETIONS,
            (FIXTURES / "bs32" / "completion_nonstream_tokenids.json").read_bytes(),
            ("length", Usage(prompt_tokens=85, completion_tokens=8), []),
        ),
        (
            ENDPOINT_COMPLETIONS,
            (FIXTURES / "bs32" / "completion_nonstream_text.json").read_bytes(),
            ("length", Usage(prompt_tokens=103, completion_tokens=8), []),
        ),
        (
            ENDPOINT_CHAT,
            (FIXTURES / "bs32" / "chat_completion.json").read_bytes(),
            ("length", Usage(prompt_tokens=28, completion_tokens=8), []),
        ),
        (ENDPOINT_COMPLETIONS, _CACHED, ("stop", Usage(prompt_tokens=9, cached_tokens=4), [])),
        # the token-id leg: the ids per choice, bools and all, as the plain decode had them
        (
            "",
            b'{"choices":[{"text":"a","token_ids":[5,true,2.5,6],"finish_reason":"stop"},{"token_ids":[7]}]}',
            ("stop", Usage(), [5, True, 6, 7]),
        ),
        ("", b'{"choices":[{"text":"a","finish_reason":"stop"}]}', (502, "engine_protocol", "without token_ids")),
        # shapes the schema does not take read as they always did
        (
            ENDPOINT_COMPLETIONS,
            b'{"choices":null,"usage":{"prompt_tokens":3,"completion_tokens":1}}',
            (None, Usage(prompt_tokens=3, completion_tokens=1), []),
        ),
        (ENDPOINT_COMPLETIONS, b'{"choices":[1,{"finish_reason":7}],"usage":"no"}', ("7", Usage(), [])),
        (ENDPOINT_COMPLETIONS, b'{"error":{"message":"boom","code":507}}', (507, "engine_error", "boom")),
        (ENDPOINT_COMPLETIONS, b'{"error":null,"choices":[]}', (500, "engine_error", '{"error":null,"choices":[]}')),
        (ENDPOINT_COMPLETIONS, b'[{"choices":[]}]', (502, "engine_protocol", "not a JSON object")),
        (ENDPOINT_COMPLETIONS, b'{"choices":[{"finish_reason":"stop"', (502, "engine_protocol", "malformed JSON")),
        # not UTF-8 in a field the schema skips: the schema does not check it (before 2026-12-06, a 200)
        (
            ENDPOINT_COMPLETIONS,
            b'{"choices":[{"text":"x","finish_reason":"stop","prompt_logprobs":[null,{"7":"\xff"}]}]}',
            (502, "engine_protocol", "Invalid UTF-8"),
        ),
    ],
)
async def test_a_whole_answer_reads_as_it_always_did(
    engine: tuple[Engine, VllmAdapter], endpoint: str, raw: bytes, read: tuple[Any, ...]
) -> None:
    """The shim reads a whole answer's finish_reason, usage and token ids alone (the rest is
    skipped, never built): each reads as the plain decode read it, and fails as it failed."""
    eng, adapter = engine
    eng.whole = raw
    params = (
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if endpoint == ENDPOINT_CHAT else {"model": "m"}
    )
    if isinstance(read[0], int):
        with pytest.raises(EngineError) as err:
            await adapter.generate(leg(endpoint, params, stream=False), ignore)
        assert (err.value.code, err.value.kind) == read[:2] and read[2] in err.value.message
        return
    out = await adapter.generate(leg(endpoint, params, stream=False), ignore)
    assert (out.finish_reason, out.usage, out.token_ids) == read
    assert out.body == (raw if endpoint else b"")  # a pass-through answer goes on byte for byte


async def test_a_long_prompts_logprobs_are_not_built_to_read_a_whole_answer(engine: tuple[Engine, VllmAdapter]) -> None:
    """A completion on a long prompt with prompt_logprobs (193 MB at 130k tokens and 20): decoded
    into Python objects it held 8 times its size and the shim's loop for seconds, its heartbeats
    stopped, and the router asked for chunks it was still sending. Read, it holds its bytes."""
    eng, adapter = engine
    entry = {str(t): {"logprob": -1.25, "rank": r + 1, "decoded_token": " tok"} for r, t in enumerate(range(100, 120))}
    choice = {"index": 0, "text": " a", "finish_reason": "length", "prompt_logprobs": [None, *[entry] * 8000]}
    eng.whole = json.dumps({"choices": [choice], "usage": {"prompt_tokens": 8001, "completion_tokens": 1}}).encode()
    tracemalloc.start()
    try:
        out = await adapter.generate(
            leg(ENDPOINT_COMPLETIONS, {"model": "m", "prompt_logprobs": 20}, stream=False), ignore
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.body == eng.whole and (out.finish_reason, out.usage) == (
        "length",
        Usage(prompt_tokens=8001, completion_tokens=1),
    )
    assert len(eng.whole) > 10_000_000 and peak < 3 * len(eng.whole)  # the read buffer and the body; decoded: 5.6x


async def test_a_long_prompts_logprobs_are_not_built_to_read_a_streamed_event(
    engine: tuple[Engine, VllmAdapter],
) -> None:
    """vLLM streams a prompt's prompt_logprobs in the first event (37 MB for 32k tokens at 20): the
    shim decoded each event whole into Python objects, 8 times its size, and held its loop 0.5 s
    (2 s at 128k tokens) with every other leg's chunks and heartbeats. Read, it holds its bytes; the
    event still goes on byte for byte and counts its token."""
    eng, adapter = engine
    entry = {str(t): {"logprob": -1.25, "rank": r + 1, "decoded_token": " tok"} for r, t in enumerate(range(100, 120))}
    choice = {"index": 0, "text": " a", "logprobs": None, "prompt_logprobs": [None, *[entry] * 8000]}
    first = json.dumps({"id": "cmpl-r1", "choices": [choice]}).encode()
    data = b"data: " + first + b"\n\n"
    eng.writes = [data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
    eng.writes += [b"data: " + EVENTS[1] + b"\n\ndata: [DONE]\n\n"]
    seen: list[tuple[int, list[bytes]]] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.append((tokens, events))

    tracemalloc.start()
    try:
        out = await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "prompt_logprobs": 20}), on_output)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [e for _, events in seen for e in events] == [first, EVENTS[1]] and out.finish_reason == "stop"
    assert sum(tokens for tokens, _ in seen) == 2  # " a", then " b"
    assert len(first) > 10_000_000 and peak < 3 * len(first)  # the line and its payload; decoded: 6.6x


def _prompt_logprobs_event(tokens: int, decoded: str) -> bytes:
    """A completion's first streamed event with `prompt_logprobs` 20, each entry's token `decoded`."""
    entry = {str(t): {"logprob": -1.25, "rank": r + 1, "decoded_token": decoded} for r, t in enumerate(range(100, 120))}
    choice = {"index": 0, "text": " a", "logprobs": None, "prompt_logprobs": [None, *[entry] * (tokens - 1)]}
    return json.dumps({"id": "cmpl-r1", "choices": [choice]}, ensure_ascii=False).encode()


@pytest.mark.parametrize("tokens", [2, 100])
async def test_an_event_not_utf8_in_a_field_the_shim_skips_is_the_engines_protocol_error_at_any_size(
    engine: tuple[Engine, VllmAdapter], tokens: int
) -> None:
    """A small event is decoded plainly, which checks every string: not UTF-8 is a 502. A large one
    is read through a schema that skips the prompt's logprobs unchecked, and went on to the client
    as it was (before 2026-12-06). Both stop the stream where the event is, what came before sent."""
    eng, adapter = engine
    bad = _prompt_logprobs_event(tokens, "\u00e9").replace("\u00e9".encode(), b"\xe9")  # Latin-1, not UTF-8
    assert (len(bad) > openai_http._SCHEMA_BYTES) == (tokens > 2)
    eng.writes = [b"data: " + EVENTS[0] + b"\n\n", b"data: " + bad + b"\n\n", b"data: " + EVENTS[1] + b"\n\n"]
    seen: list[bytes] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.extend(events)

    with pytest.raises(EngineError) as err:
        await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "prompt_logprobs": 20}), on_output)
    assert (err.value.code, err.value.kind) == (502, "engine_protocol") and "Invalid UTF-8" in err.value.message
    assert seen == [EVENTS[0]]


@pytest.mark.parametrize(
    "bad", [b"[" + EVENTS[1] + b"]", b"null", b'"oops"', b"7"], ids=["array", "null", "string", "number"]
)
@pytest.mark.parametrize("pass_through", [True, False], ids=["pass-through", "token-ids"])
@pytest.mark.parametrize("schema_bytes", [0, 1 << 30], ids=["schema", "plain"])
async def test_a_streamed_event_that_is_no_json_object_is_the_engines_protocol_error(
    engine: tuple[Engine, VllmAdapter],
    bad: bytes,
    pass_through: bool,
    schema_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Until 2026-12-07 it was skipped with no word: the client got 1 token of 2 and a final ok,
    where a whole answer that is no object is a 502 (engine-side audit). What came before it is
    sent first, as for any error mid-stream. Read plainly (a small event) or through the schema."""
    monkeypatch.setattr(openai_http, "_SCHEMA_BYTES", schema_bytes)
    eng, adapter = engine
    eng.writes = [b"data: " + EVENTS[0] + b"\n\n", b"data: " + bad + b"\n\n", b"data: " + EVENTS[1] + b"\n\n"]
    eng.writes.append(b"data: [DONE]\n\n")
    seen: list[tuple[int, list[bytes], list[int]]] = []

    async def on_output(tokens: int, events: list[bytes], ids: list[int]) -> None:
        seen.append((tokens, events, ids))

    params = {"model": "m"} if pass_through else {}
    endpoint = ENDPOINT_COMPLETIONS if pass_through else ""
    if not pass_through:
        eng.writes[0] = b'data: {"choices":[{"index":0,"text":" a","token_ids":[5]}]}\n\n'
    with pytest.raises(EngineError) as err:
        await adapter.generate(leg(endpoint, params), on_output)
    assert (err.value.code, err.value.kind) == (502, "engine_protocol") and "not a JSON object" in err.value.message
    assert seen == ([(1, [EVENTS[0]], [])] if pass_through else [(1, [], [5])])


@pytest.mark.parametrize("piece", [5, 1 << 20])
def test_a_large_event_in_utf8_is_read_whatever_the_pieces_it_is_checked_in(
    piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Characters of 2, 3 and 4 bytes, cut by the edges of the pieces its UTF-8 is checked in."""
    monkeypatch.setattr(openai_http, "_UTF8_PIECE", piece)
    payload = _prompt_logprobs_event(100, "\u00e9\u2014\U0001f600")
    assert len(payload) > openai_http._SCHEMA_BYTES
    assert openai_http._fold_lines(openai_http.Result(), [b"data: " + payload], pass_through=True) == (
        1,
        [payload],
        False,
    )
    cut = payload[: -len('\U0001f600"}}]}]}'.encode()) + 1] + b'"}}]}]}'  # the 4-byte character's first byte alone
    count, events, end = openai_http._fold_lines(openai_http.Result(), [b"data: " + cut], pass_through=True)
    assert (count, events) == (0, []) and isinstance(end, msgspec.DecodeError) and "UTF-8" in str(end)


@pytest.mark.parametrize(
    ("event", "tokens"),
    [
        ({"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0]}}]}, 1),
        ({"choices": [{"index": 0, "text": "", "logprobs": None}]}, 0),
        ({"choices": [{"index": 0, "text": "", "logprobs": {}}]}, 0),
        ({"choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": []}}]}, 1),
        ({"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "prompt_logprobs": [None]}]}, 2),
        ({"choices": "none", "usage": None}, 0),  # no shape the schema takes: read whole, as before
    ],
)
@pytest.mark.parametrize("schema_bytes", [0, 1 << 30])
def test_a_streamed_events_tokens_are_counted_from_the_fields_read(
    event: dict[str, Any], tokens: int, schema_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event is read for its choices' ids, text, delta and whether their logprobs are empty; the
    rest (a long prompt's prompt_logprobs) is skipped unbuilt. A large event is read through the
    schema, a small one (every token's) decoded plainly, which costs it less: the same count."""
    monkeypatch.setattr(openai_http, "_SCHEMA_BYTES", schema_bytes)
    payload = json.dumps(event).encode()
    assert openai_http._fold_lines(openai_http.Result(), [b"data: " + payload], pass_through=True) == (
        tokens,
        [payload],
        False,
    )


def test_model_cards_are_read_from_vllms_own_models_answer() -> None:
    cards = model_cards((FIXTURES / "bs32" / "v1_models.json").read_bytes())
    assert cards == {"tiny-llama": ModelCard(2048, root="tiny-llama")}


def test_lora_adapters_are_the_cards_whose_parent_is_the_model() -> None:
    """vLLM 0.32's own answers: an adapter's card has the model as `parent` and no max_model_len;
    one loaded at run time appears, unloaded it goes."""
    assert model_cards((FIXTURES / "bs32" / "v1_models_lora.json").read_bytes()) == {
        "tiny-llama": ModelCard(2048, root="tiny-llama"),
        "tiny-lora": ModelCard(parent="tiny-llama", root="tiny-lora"),
    }
    loaded = model_cards((FIXTURES / "bs32" / "v1_models_lora_loaded.json").read_bytes())
    assert loaded is not None and loaded["tiny-lora-2"] == ModelCard(parent="tiny-llama", root="tiny-lora")


def test_a_model_served_under_two_names_has_a_card_per_name_and_one_root() -> None:
    """vLLM 0.32 with --served-model-name tiny-alias tiny-llama: the adapter's parent is the first."""
    assert model_cards((FIXTURES / "bs32" / "v1_models_aliases.json").read_bytes()) == {
        "tiny-alias": ModelCard(2048, root="tiny-llama"),
        "tiny-llama": ModelCard(2048, root="tiny-llama"),
        "tiny-lora": ModelCard(parent="tiny-alias", root="tiny-lora"),
    }


@pytest.mark.parametrize(
    ("raw", "cards"),
    [
        (b"not json", None),
        (b"[]", None),
        (b'{"data": {}}', None),
        (
            b'{"data": [{"id": "m", "max_model_len": true}, {"id": "n", "parent": 3, "root": 4}, {"id": 5}]}',
            {"m": ModelCard(), "n": ModelCard()},
        ),
        (b'{"data": [{"id": "a", "parent": "m"}]}', {"a": ModelCard(parent="m")}),
    ],
)
def test_a_models_answer_without_lengths_or_ids(raw: bytes, cards: dict[str, ModelCard] | None) -> None:
    assert model_cards(raw) == cards


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("99999999999999999999", RETRY_AFTER_MAX_S), (str(RETRY_AFTER_MAX_S + 1), RETRY_AFTER_MAX_S),
     ("\u00b2", None), ("\u0663", None), ("Fri, 31 Dec 9999 23:59:59 GMT", RETRY_AFTER_MAX_S)],
)  # fmt: skip
def test_a_retry_after_past_a_day_is_a_day_and_only_ascii_digits_are_seconds(header: str, seconds: int | None) -> None:
    """'99999999999999999999' overflowed the final chunk's encoder (past 2**64 - 1): the leg got no
    final chunk and the router took the worker for unreachable; '²' (a digit to str.isdigit) raised
    ValueError."""
    assert openai_http.retry_after_s(header) == seconds


async def test_an_engine_that_refuses_connections_is_said_in_a_few_words() -> None:
    """Each call's error names the engine's host and port, not aiohttp's whole ConnectionKey (until
    2026-12-07 its repr, ~480 characters, in every leg's error, log line and client 503); the
    tokenizer probe's too, which until 2026-12-08 said the engine "answered 503" though it never
    answered."""
    with socket.socket() as sock:  # bound, never listening: a connect is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        adapter = VllmAdapter(
            ShimConfig(engine="vllm", engine_url=f"http://127.0.0.1:{port}", model="m", kv_events="tcp://127.0.0.1:1")
        )
        await adapter.open()
        try:
            refused = f"connection refused 127.0.0.1:{port}"
            calls: list[tuple[Callable[[], Awaitable[object]], str]] = [
                (lambda: adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "stream": True}), ignore), refused),
                (lambda: adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m"}), ignore), refused),
                (lambda: adapter.serve_probe([7, 8, 9], "probe-1"), refused),
                (adapter.tokenizer_fingerprint, refused),
            ]
            for call, said in calls:
                with pytest.raises(EngineError) as err:
                    await call()
                assert (err.value.code, err.value.kind, err.value.message) == (503, "engine_unavailable", said)
        finally:
            await adapter.close()


async def test_a_stream_the_engine_drops_is_said_in_a_few_words() -> None:
    """A connection lost mid-answer (StreamCut) names the URL and what aiohttp said, not its repr."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        event = b"data: " + EVENTS[0] + b"\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        writer.close()  # no last chunk: cut mid-answer

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    adapter = VllmAdapter(
        ShimConfig(engine="vllm", engine_url=f"http://127.0.0.1:{port}", model="m", kv_events="tcp://127.0.0.1:1")
    )
    await adapter.open()
    try:
        with pytest.raises(openai_http.StreamCut) as err:
            await adapter.generate(leg(ENDPOINT_COMPLETIONS, {"model": "m", "stream": True}), ignore)
        assert err.value.message == f"http://127.0.0.1:{port}/v1/completions: response payload is not completed"
    finally:
        await adapter.close()
        server.close()
        await server.wait_closed()
