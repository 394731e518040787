"""The TensorRT-LLM adapter's P/D legs against a stand-in answering as trtllm-serve's code does: a
context leg its worker finished itself, a handle naming no context request, and the engine's own
failures of a generation-only leg (a 400, a cut stream), which routers must see as a failed pull.

Upstream (NVIDIA/TensorRT-LLM): a context-only request that ends on its first token (an EOS or a
stop) carries `ctx_request_id: null` ("there is no kv-cache transfer", PR #15027), and trtllm-serve's
own orchestrator sends it no generation leg (openai_disagg_service.py `_need_gen`). A failed pull
fails the request with "Error in kv cache transfer for generation requests" (py_executor
`_check_cache_transfer_errors`), which openai_server.py answers with `create_error_response(str(e))`:
400 BadRequestError; a streamed request's 200 is sent by then, so its stream is cut. Its request
validation answers 400 `{"error": str(exc)}`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
from aiohttp import web

from protocol import GenerateRequest, SamplingParams
from protocol.messages import BAD_TRANSFER_HANDLE, ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, PREFILL_STOPPED, TransferHandle
from tests.worker_shim.cluster import decode_leg_final, served
from worker_shim import ShimConfig
from worker_shim.adapters.base import EngineAdapter, EngineError, LegRequest
from worker_shim.adapters.openai_http import StreamCut
from worker_shim.adapters.trtllm import TrtllmAdapter, check_transfer_handle

HANDLE = {"request_type": "context_only", "first_gen_tokens": [42], "ctx_request_id": 77,
          "encoded_opaque_state": "b3BhcXVl", "draft_tokens": None}  # fmt: skip
PULL_FAILED = "Error in kv cache transfer for generation requests"
# The C++ (TensorRT engine) executor's refusals of a request its validation failed (executorImpl.cpp
# Executor::Impl::fetchNewRequests, LlmRequest::validate), as openai_server.py answers them: 400.
FETCH_REFUSED = "Encountered an error when fetching new request: [TensorRT-LLM][ERROR] "
CPP_REFUSALS = [
    # streamed requests only: a streamed generation leg meets it where its non-streamed context leg did not
    f"{FETCH_REFUSED}Assertion failed: Request sequence length is potentially greater than max input length. This "
    "cannot be run unless streaming is disabled, context chunking is enabled or the GUARANTEED_NO_EVICT scheduling "
    "policy is used",
    f"{FETCH_REFUSED}Prompt length (5000) exceeds maximum input length (4096). Set log level to info and check "
    "TRTGptModel logs for how maximum input length is set",
    f"{FETCH_REFUSED}Assertion failed: Request is specified with GuidedDecodingParams, but GuidedDecoder is not "
    "setup. Please provide a valid GuidedDecodingConfig to setup GuidedDecoder.",
]


def _context_answer(finish: str | None, handle: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    """trtllm-serve's answer to a context-only leg (postprocess_handlers.py)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": None, "disaggregated_params": handle}
    choice.update({"message": {"role": "assistant", "content": ""}} if chat else {"text": "", "token_ids": None})
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    return {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": usage}  # fmt: skip


def _bad_request(message: str) -> tuple[int, dict[str, Any]]:
    """openai_server.py create_error_response's defaults: what any exception in a handler becomes."""
    return 400, {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}


def _answering(answer: dict[str, Any], status: int = 200, seen: list[dict[str, Any]] | None = None) -> Any:
    """A route answering every request with `answer`; the bodies it got in `seen`."""

    async def handle(request: web.Request) -> web.Response:
        if seen is not None:
            seen.append(await request.json())
        return web.json_response(answer, status=status)

    return handle


def _leg(
    *, transfer: dict[str, Any] | None = None, stream: bool = False, agg: bool = False, **params: Any
) -> LegRequest:
    """A pass-through leg: a generation-only one with `transfer`, else a context-only one unless `agg`."""
    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 20, **params}
    return LegRequest("r", "m", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20), stream=stream,
                      prefill_only=transfer is None and not agg, endpoint=ENDPOINT_COMPLETIONS,
                      params=body, transfer=transfer)  # fmt: skip


async def _ignore(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
    pass


@asynccontextmanager
async def _adapter(handler: Any) -> AsyncIterator[TrtllmAdapter]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    async with served(app) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            yield adapter
        finally:
            await adapter.close()


# --- a context leg its worker finished itself ------------------------------------------------------


@pytest.mark.parametrize(
    ("finish", "endpoint", "kind"),
    [
        ("stop", ENDPOINT_COMPLETIONS, PREFILL_STOPPED),  # an EOS or a stop as its first token
        ("tool_calls", ENDPOINT_CHAT, PREFILL_STOPPED),  # a chat's "stop" with a tool call parsed
        (None, ENDPOINT_COMPLETIONS, "engine_protocol"),
        ("cancelled", ENDPOINT_COMPLETIONS, "engine_protocol"),
    ],
)
async def test_a_context_leg_its_worker_finished_is_no_transfer_handle(
    finish: str | None, endpoint: str, kind: str
) -> None:
    """Until 2026-12-07 any dict was a handle: the decode leg went out with `ctx_request_id: null`,
    and the generation worker ran the request on from its first token without stop checks (fixed
    upstream only by PR #16691). Now the router falls back to local prefill, and holds a "stop"
    (the request's own token, as vLLM's prefill_stopped) against no worker."""
    handle = {**HANDLE, "first_gen_tokens": [2], "ctx_request_id": None}
    async with _adapter(_answering(_context_answer(finish, handle, chat=endpoint == ENDPOINT_CHAT))) as adapter:
        leg = _leg(stop=["\n"])
        leg.endpoint = endpoint
        if endpoint == ENDPOINT_CHAT:
            leg.params = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
        with pytest.raises(EngineError) as caught:
            await adapter.generate(leg, _ignore)
    assert (caught.value.code, caught.value.kind) == (502, kind)
    assert "its context worker finished the request itself" in caught.value.message


@pytest.mark.parametrize("finish", ["length", "not_finished"])
async def test_a_context_leg_that_left_its_kv_hands_it_on(finish: str) -> None:
    async with _adapter(_answering(_context_answer(finish, HANDLE))) as adapter:
        out = await adapter.generate(_leg(), _ignore)
    assert out.transfer_params == HANDLE


@pytest.mark.parametrize(
    ("handle", "named"),
    [
        ({**HANDLE, "ctx_request_id": None}, "ctx_request_id null"),
        ({k: v for k, v in HANDLE.items() if k != "ctx_request_id"}, "no ctx_request_id"),
        ({**HANDLE, "ctx_request_id": "77"}, 'ctx_request_id "77"'),
        ({**HANDLE, "ctx_request_id": True}, "ctx_request_id true"),
        ({**HANDLE, "ctx_request_id": 77.0}, "ctx_request_id 77.0"),
    ],
)
async def test_a_handle_naming_no_context_request_is_a_bad_transfer_handle(handle: dict[str, Any], named: str) -> None:
    """A context leg that ended on its length with no integer ctx_request_id: a generation worker
    given it has nothing to pull (routers advise on the handle, not on a missing connector)."""
    async with _adapter(_answering(_context_answer("length", handle))) as adapter:
        with pytest.raises(EngineError) as caught:
            await adapter.generate(_leg(), _ignore)
    assert (caught.value.code, caught.value.kind) == (502, BAD_TRANSFER_HANDLE)
    assert named in caught.value.message and json.dumps(handle, separators=(",", ":"))[:80] in caught.value.message
    check_transfer_handle(HANDLE)  # the fixture's handle (completion_context_only.json) passes


# --- the engine's failures of a generation-only leg ------------------------------------------------


@pytest.mark.parametrize(
    ("params", "answer", "code"),
    [
        ({}, _bad_request(PULL_FAILED), 500),  # its KV pull failed
        ({}, _bad_request(f"{PULL_FAILED}; poisoned transfer buffer requires process restart"), 500),
        ({}, _bad_request("CUDA error: an illegal memory access was encountered"), 500),  # its step failed
        # the client's own, which the context leg (one token of one sequence) did not meet
        ({}, (400, {"error": "[{'type': 'value_error', 'loc': ('body',)}]"}), 400),
        ({}, _bad_request("1 validation error for CompletionRequest\nstream_options ..."), 400),
        (
            {"max_tokens": 9000},
            _bad_request("The sum of prompt length (5) ... should not exceed max_seq_len (4096)"),
            400,
        ),
        *[({}, _bad_request(message), 400) for message in CPP_REFUSALS],  # the C++ executor's validation
        ({}, _bad_request("Prompt length (5000) exceeds maximum input length (4096)"), 400),
        ({}, _bad_request("Request sequence length is potentially greater than max input length"), 400),
        ({}, _bad_request("The sum of prompt length and max_tokens exceeds maximum sequence length (4096)"), 400),
        ({"n": 3, "best_of": 2}, _bad_request("best_of (2) cannot be less than n (3)"), 400),
        ({"n": "3"}, _bad_request("beam width 3 exceeds max_beam_width 1"), 400),
        ({"n": 3}, _bad_request(PULL_FAILED), 500),  # named so, it is the engine's whatever was asked
        ({}, (429, {"error": {"message": "busy"}}), 429),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_generation_only_legs_400_is_the_engines_failure_unless_it_may_be_the_clients(
    params: dict[str, Any], answer: tuple[int, dict[str, Any]], code: int, stream: bool
) -> None:
    """trtllm-serve answers a failed pull with 400: until 2026-12-07 the client got it as its own
    refusal (`engine_rejected`), no router counted a failed transfer or fell back, and the shim
    counted no failed pull. The context leg took the same body, so a 400 is the engine's; but not one
    about what only this leg asks for (the client's n and max_tokens: the context leg asks for one
    token of one sequence), nor a validation refusal."""

    status, body = answer
    seen: list[dict[str, Any]] = []
    async with _adapter(_answering(body, status, seen)) as adapter:
        with pytest.raises(EngineError) as caught:
            await adapter.generate(_leg(transfer=HANDLE, stream=stream, **params), _ignore)
    assert seen[0]["disaggregated_params"]["request_type"] == "generation_only"
    err = caught.value
    assert err.code == code
    if code == 500:
        assert err.kind == "engine_error" and err.body == b"", "a failure, not a refusal for the client"
        assert "its engine failed" in err.message
    else:
        assert err.kind == "engine_rejected" and err.body, "the engine's own refusal, for the client"


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("Encountered an error in forwardAsync function: [TensorRT-LLM][ERROR] CUDA runtime error", 500),
        (PULL_FAILED.replace("generation", "context"), 500),
        ("The sum of prompt length (9000), query length (0) should not exceed max_num_tokens (8192)", 400),
    ],
)
@pytest.mark.parametrize("role", ["prefill", "agg"])
async def test_a_400_naming_the_engines_failure_is_a_500_on_any_leg(message: str, code: int, role: str) -> None:
    """A context or whole leg's other 400s stay the client's: nothing else asked the engine first."""
    status, body = _bad_request(message)
    async with _adapter(_answering(body, status)) as adapter:
        with pytest.raises(EngineError) as caught:
            await adapter.generate(_leg(agg=role == "agg"), _ignore)
    assert (caught.value.code, caught.value.kind) == (
        (500, "engine_error") if code == 500 else (400, "engine_rejected")
    )


# --- a streamed answer cut after its 200 -----------------------------------------------------------


@asynccontextmanager
async def _cutting(events: int) -> AsyncIterator[str]:
    """An engine that sends its 200 and `events` SSE events, then drops the connection with no last
    chunk: what uvicorn does once trtllm-serve's stream generator raises."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(events):
            event = b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("transfer", "events", "code"),
    [(HANDLE, 0, 500), (HANDLE, 1, 503), (None, 0, 503)],
    ids=["generation-only", "after-output", "agg"],
)
async def test_a_generation_only_stream_cut_before_any_output_is_the_engines_failure(
    transfer: dict[str, Any] | None, events: int, code: int
) -> None:
    """trtllm-serve cuts a streamed generation-only request whose pull failed (its 200 went before):
    until 2026-12-07 a 503 `engine_unavailable`, an engine gone, which no router counts as a failed
    pull. One cut after output pulled its KV, and a whole request's pulled none: still the cut."""
    async with _cutting(events) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            with pytest.raises(EngineError) as caught:
                await adapter.generate(_leg(transfer=transfer, stream=True, agg=True), _ignore)
        finally:
            await adapter.close()
    assert caught.value.code == code
    assert (caught.value.kind == "engine_error") == (code == 500)
    assert isinstance(caught.value, StreamCut) == (code == 503)


# --- through the shim ------------------------------------------------------------------------------


async def test_a_failed_pull_on_trtllm_serve_counts_and_reaches_the_router_as_one(nats_url: str, ns: str) -> None:
    """The shim counts a transfer-fed leg its engine failed before any output (transfer_failures)
    and the router, on the final chunk's 500 `engine_error`, falls back to local prefill and closes
    the pair for a while (router.dispatch, router.transfer_health)."""
    status, body = _bad_request(PULL_FAILED)
    req = GenerateRequest(
        request_id="r1", model="m", token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4),
        endpoint=ENDPOINT_COMPLETIONS, params={"prompt": [1, 2, 3], "max_tokens": 4},
        disagg=TransferHandle(engine="trtllm", params=HANDLE),
    )  # fmt: skip
    async with _adapter(_answering(body, status)) as adapter:
        final, failed = await decode_leg_final(nats_url, ns, cast(EngineAdapter, adapter), req)
    error = final.error
    assert error is not None and (error.code, error.kind, error.body) == (500, "engine_error", b"")
    assert failed == ["leg"]
