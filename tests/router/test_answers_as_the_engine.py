"""A client pointed at the router instead of a vLLM 0.32 engine sees the engine's own answers: the
same request sent to the router and to a sim directly (engine_sim copies vLLM's HTTP layer) gets
the same X-Request-Id on every answer, errors included, the same serving of a request that names
no model, and the same stream Content-Type (tests/fixtures/vllm-0.32's real capture has it)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from engine_sim.lora import LoraModule
from router.http_api import HttpLimits
from tests.router.conftest import MODEL, Cluster
from tests.router.test_http_api import answer, assert_openai_error, post, without_ids

_OK = {"model": MODEL, "prompt": "hello world the cache", "max_tokens": 5}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "explain the cache"}], "max_tokens": 4}


@pytest.fixture
async def one_model(cluster: Cluster) -> Cluster:
    """One agg sim, as vLLM runs with --enable-request-id-headers, and a router without --model."""
    await cluster.add_worker("agg", max_model_len=128, enable_request_id_headers=True,
                             lora_modules=(LoraModule("sql", "/adapters/sql"),))  # fmt: skip
    await cluster.add_ready_router(disagg="never")
    return cluster


# Answered by the engine through the router, or by the router itself as the engine would.
_BOTH = [
    ("POST", "/v1/completions", _OK, 200),
    ("POST", "/v1/completions", {**_OK, "stream": True}, 200),
    ("POST", "/v1/chat/completions", _CHAT, 200),
    ("POST", "/v1/completions", {**_OK, "temperature": "hot"}, 400),  # the engine's own 400
    ("POST", "/v1/completions", {**_OK, "prompt": list(range(10, 210))}, 400),  # over max_model_len
    ("POST", "/v1/completions", {**_OK, "stream": True, "prompt": list(range(10, 210))}, 400),
    ("POST", "/v1/chat/completions", {**_CHAT, "model": "nope"}, 404),
    ("POST", "/v1/completions", '{"model": ', 400),  # not JSON
    ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}, 200),
    ("POST", "/tokenize", {"model": "nope", "prompt": "hi"}, 404),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [104, 105]}, 200),
    ("POST", "/detokenize", {"model": MODEL, "tokens": "x"}, 400),
    ("GET", "/v1/models", None, 200),
    ("POST", "/v1/nothing", {}, 404),
    ("GET", "/v1/completions", None, 405),
]


async def test_every_answer_echoes_the_clients_request_id_as_vllm_does(
    one_model: Cluster, http: aiohttp.ClientSession
) -> None:
    """vLLM's --enable-request-id-headers sets X-Request-Id on every answer: the client's, else a
    fresh one. The router set it on routed 200s only, so a gateway could not match its failures."""
    router, sim = one_model.routers[0], one_model.workers[0].sim
    for method, path, body, code in _BOTH:
        for url in (router.url, sim.url):
            status, out, headers = await answer(http, method, url + path, body, request_id="gw-1")
            assert status == code, (url, path, body, out)
            assert headers.get("x-request-id") == "gw-1", (url, path, body)
            # none sent: an id all the same, as vLLM's uuid4 (a routed answer's is its `id`)
            status, out, headers = await answer(http, method, url + path, body)
            assert status == code and headers.get("x-request-id"), (url, path, body)


async def test_the_routers_own_refusals_echo_the_clients_request_id(cluster: Cluster) -> None:
    """What only the router refuses (a body over its limit, a field only it may set) carries the
    client's id too."""
    await cluster.add_worker("agg")
    router = await cluster.add_router(config={"http_limits": HttpLimits(max_body_bytes=1024)}, disagg="never")
    await cluster.ready(router)
    async with aiohttp.ClientSession() as http:
        for body, code, param in (
            ({**_OK, "prompt": "x" * 2000}, 413, "body"),
            ({**_OK, "kv_transfer_params": {"remote_host": "10.0.0.1"}}, 400, "kv_transfer_params"),
        ):
            status, out, headers = await answer(http, "POST", router.url + "/v1/completions", body, "gw-7")
            assert_openai_error(status, out, code, param)
            assert headers.get("x-request-id") == "gw-7", out


# What the router refuses itself, in the body vLLM's validation handler writes (engine_sim's).
_VALIDATION: list[tuple[str, Any]] = [
    ("/v1/completions", {**_OK, "n": "two"}),
    ("/v1/completions", {**_OK, "n": 2.5}),
    ("/v1/completions", {**_OK, "n": None}),  # a completion's n takes no null (chat's does)
    ("/v1/completions", {**_OK, "stream": "maybe"}),
    ("/v1/completions", {**_OK, "max_tokens": "x"}),
    ("/v1/completions", {**_OK, "max_tokens": "x", "n": "two"}),  # both, in vLLM's field order
    ("/v1/completions", {**_OK, "model": 5}),
    ("/v1/completions", {**_OK, "seed": 2**70}),
    ("/v1/completions", {**_OK, "stream": True, "stream_options": "x"}),
    ("/v1/completions", {**_OK, "stream": True, "stream_options": {"include_usage": "maybe"}}),
    ("/v1/completions", {**_OK, "add_special_tokens": "maybe"}),
    ("/v1/completions", {**_OK, "truncate_prompt_tokens": 3, "truncation_side": 5}),
    ("/v1/completions", '{"model": '),
    ("/v1/chat/completions", '{"model": "x", "messages": [}'),
    ("/v1/completions", "[1, 2]"),
    ("/v1/completions", ""),
    ("/v1/chat/completions", {k: v for k, v in _CHAT.items() if k != "messages"}),
    ("/v1/chat/completions", {**_CHAT, "messages": []}),
    ("/v1/chat/completions", {**_CHAT, "max_completion_tokens": 1.5, "n": "x"}),
    ("/v1/chat/completions", {**_CHAT, "add_generation_prompt": "maybe"}),
    ("/v1/chat/completions", {**_CHAT, "tools": {"type": "function"}}),
    ("/v1/chat/completions", {**_CHAT, "documents": [{"title": 5}]}),
    ("/v1/chat/completions", {**_CHAT, "chat_template_kwargs": []}),
    # a client's own template, vLLM refusing it without --trust-request-chat-template (its default)
    ("/v1/chat/completions", {**_CHAT, "chat_template": "{{ 1 }}"}),
    ("/v1/chat/completions", {**_CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
    ("/v1/chat/completions", {**_CHAT, "chat_template_kwargs": {"chat_template": 5}}),
    ("/tokenize", {"model": 5, "prompt": "hi"}),
    # the prompt's refusals, in vLLM's words and with its `param` (null where it names none)
    ("/v1/completions", {**_OK, "prompt": ""}),
    ("/v1/completions", {**_OK, "prompt": None}),
    ("/v1/completions", {k: v for k, v in _OK.items() if k != "prompt"}),
    ("/v1/completions", {**_OK, "prompt": []}),
    ("/v1/completions", {**_OK, "prompt": [[]]}),
    ("/v1/completions", {**_OK, "prompt": [[1, 2], []]}),
    ("/v1/completions", {**_OK, "prompt": 5}),
    ("/v1/completions", {**_OK, "prompt": [1, 2.5]}),
    ("/v1/completions", {**_OK, "prompt": [1, -2]}),
    ("/v1/completions", {**_OK, "prompt": [1, 2**32]}),
    ("/v1/completions", {**_OK, "prompt": [[1, 2**33], [3, -2]]}),
    # an id the router cannot hash (2^32 or more) in a prompt past the context: vLLM's length check first
    ("/v1/completions", {**_OK, "prompt": [2**32, *range(10, 210)]}),
    ("/v1/completions", {**_OK, "prompt": [[5, 6], [2**32, *range(10, 210)]]}),
    # vLLM's model validators read the raw body before its fields are typed: theirs is the 400
    ("/v1/completions", {"model": MODEL, "max_tokens": "x"}),
    ("/v1/completions", {**_OK, "prompt": "", "n": "x"}),
    ("/v1/completions", {**_OK, "stream_options": {"include_usage": True}, "n": "x"}),
    ("/v1/completions", {**_OK, "stream_options": "x"}),
    ("/v1/completions", {**_OK, "cache_salt": "", "max_tokens": "x"}),
    ("/v1/chat/completions", {**_CHAT, "tools": [], "n": "x"}),
    ("/v1/chat/completions", {**_CHAT, "continue_final_message": True, "add_generation_prompt": True, "n": "x"}),
    ("/v1/chat/completions", {**_CHAT, "stream_options": "x"}),
    # what only the router may set, refused only where the engine would take the body
    ("/v1/completions", {**_OK, "kv_transfer_params": {"remote_host": "10.0.0.1"}, "n": "x"}),
    ("/v1/completions", {**_OK, "kv_transfer_params": "x"}),
    ("/v1/completions", {**_OK, "vllm_xargs": "x"}),
    ("/v1/completions", {"model": MODEL, "kv_transfer_params": {"remote_host": "10.0.0.1"}}),
]


async def test_the_routers_own_400s_are_the_engines_to_the_byte(
    one_model: Cluster, http: aiohttp.ClientSession
) -> None:
    """A field the router reads and vLLM's model refuses: the router answered in its own words
    (`"type": "BadRequestError"`, `param` "n"), vLLM in its validation handler's ("Bad Request",
    "body.n", pydantic's errors)."""
    router, sim = one_model.routers[0], one_model.workers[0].sim
    for path, body in _VALIDATION:
        direct = await post(http, sim.url + path, body)
        routed = await post(http, router.url + path, body)
        assert routed[0] == direct[0] == 400, (path, body, routed[1], direct[1])
        assert routed[1] == direct[1], (path, body)


async def test_an_id_the_router_cannot_hash_is_served_when_the_truncation_cuts_it(
    one_model: Cluster, http: aiohttp.ClientSession
) -> None:
    """vLLM truncates a prompt before its engine judges the ids: the router refused an id of 2^32
    or more as it read the body, so such a request the engine serves was a 400."""
    router, sim = one_model.routers[0], one_model.workers[0].sim
    for prompt in ([2**32, 5, 6], [[2**33, 5, 6], [7, 8, 9]]):
        body = {**_OK, "prompt": prompt, "truncate_prompt_tokens": 2}
        direct = await post(http, sim.url + "/v1/completions", body)
        routed = await post(http, router.url + "/v1/completions", body)
        assert routed[0] == direct[0] == 200, (prompt, routed[1], direct[1])
        assert routed[1]["usage"] == direct[1]["usage"], prompt
        assert routed[1]["usage"]["prompt_tokens"] == 2 * len(routed[1]["choices"]), prompt


_NO_MODEL: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "hello world the cache", "max_tokens": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "explain the cache"}], "max_tokens": 4}),
    ("/tokenize", {"prompt": "hello world"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
]


async def test_a_request_naming_no_model_is_served_by_the_one_model_as_vllm_serves_it(
    one_model: Cluster, http: aiohttp.ClientSession
) -> None:
    """vLLM 0.32 serves a request without `model` with its own model (serving.py's
    _is_model_supported); the router refused it with a 400 unless it ran with --model."""
    router, sim = one_model.routers[0], one_model.workers[0].sim
    for path, body in _NO_MODEL:
        direct = await post(http, sim.url + path, body)
        routed = await post(http, router.url + path, body)
        assert routed[0] == direct[0] == 200, (path, body, routed[1])
        if path == "/tokenize":
            assert routed[1] == direct[1], body
        else:
            assert routed[1]["model"] == direct[1]["model"] == MODEL
            assert without_ids(routed[1]) == without_ids(direct[1]), body
    # vLLM reads an empty name as none too (`if not model_name`; engine_sim 404s it)
    status, out, _ = await post(http, router.url + "/v1/completions", {**_NO_MODEL[0][1], "model": ""})
    assert status == 200 and out["model"] == MODEL, out


async def test_with_several_models_a_request_naming_none_is_a_400_naming_them(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add_worker("agg")
    await cluster.add_worker("agg", model="other-llama")
    router = await cluster.add_ready_router(disagg="never")
    for path, body in _NO_MODEL:
        status, out, _ = await post(http, router.url + path, body)
        assert_openai_error(status, out, 400, "model")
        assert out["error"]["message"] == f"'model' is required: this router serves other-llama, {MODEL}", path


async def test_a_stream_has_vllms_content_type(one_model: Cluster, http: aiohttp.ClientSession) -> None:
    """Starlette's, as the real vLLM 0.32 capture has it: `text/event-stream; charset=utf-8`."""
    router, sim = one_model.routers[0], one_model.workers[0].sim
    for path, body in (("/v1/completions", _OK), ("/v1/chat/completions", _CHAT)):
        types = []
        for url in (router.url, sim.url):
            status, _, headers = await answer(http, "POST", url + path, {**body, "stream": True})
            assert status == 200
            types.append(headers["content-type"])
        assert types == ["text/event-stream; charset=utf-8"] * 2, path
