"""A fuzzed HTTP suite against a real router (real nats-server, etcd, a sim and its shim): valid
OpenAI bodies mutated (keys dropped, values replaced by wrong types, huge and negative integers,
deep nesting, unicode, unknown keys), raw bytes that are not JSON, and odd methods and paths. The
router must never answer 5xx, and every error it answers is OpenAI JSON."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.conftest import MODEL, Cluster

pytestmark = pytest.mark.timeout(600)

COMPLETION = {"model": MODEL, "prompt": "the cache holds the prefix", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
# Keys whose value scales the engine's work: fuzzed only with values refused before any work, or small.
WORK = {
    "n",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "best_of",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
}

huge_ints = st.one_of(
    st.integers(min_value=2**63, max_value=2**200), st.integers(min_value=-(2**200), max_value=-(2**63) - 1)
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    huge_ints,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
work_values = st.one_of(
    st.integers(min_value=-5, max_value=3),
    huge_ints,
    # No digits: "99999" is 99999 to vLLM's lax parsing (and the router's), so n or max_tokens as
    # a numeric string is real work, which took a test run past 17 GB.
    st.text(max_size=5).filter(lambda s: not any(c.isdigit() for c in s)),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.none(),
)
keys = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "echo",
        "logit_bias",
        "tools",
        "tool_choice",
        "response_format",
        "add_special_tokens",
        "chat_template_kwargs",
        "annotations",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "user",
        "stop_token_ids",
        *sorted(WORK),
    ]
) | st.text(min_size=1, max_size=12)


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body: dict[str, Any] = json.loads(json.dumps(CHAT if chat else COMPLETION))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["set", "drop", "deep", "messages", "prompt"]))
        if op == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif op == "set":
            key = draw(keys)
            body[key] = draw(work_values if key in WORK else json_values)
        elif op == "deep":
            body[draw(keys.filter(lambda k: k not in WORK))] = nested(draw(st.integers(min_value=1, max_value=200)))
        elif op == "messages":
            body["messages"] = draw(
                st.lists(
                    st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]), json_values), max_size=3
                )
            )
        else:
            body["prompt"] = draw(
                st.one_of(
                    st.text(max_size=60),
                    st.lists(st.integers(min_value=-3, max_value=2**33), max_size=5),
                    st.lists(json_values, max_size=3),
                )
            )
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, json.dumps(body).encode()


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.sampled_from([b"", b"null", b"[]", b"{}", b'{"prompt": 1e999}', b"[" * 5000 + b"]" * 5000, b'"\\ud800"']),
)


@pytest.fixture
async def router_url(cluster: Cluster) -> str:
    # Leases that outlive a loaded box's stalls: a worker whose lease lapsed would rightly get 503s.
    await cluster.add_worker("agg", shim={"lease_ttl": 30}, max_model_len=2048)
    router = await cluster.add_router(config={"lease_ttl_s": 30}, disagg="never")
    await cluster.ready(router)
    return router.url


async def check(http: aiohttp.ClientSession, method: str, url: str, data: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    async with http.request(method, url, data=data, headers=headers) as r:
        raw = await r.read()
    assert r.status < 500, (r.status, data[:300], raw[:300])
    if r.status >= 400:
        err = json.loads(raw)["error"]
        assert err["code"] == r.status and isinstance(err["message"], str) and err["type"], raw[:300]
    elif r.headers.get("Content-Type", "").startswith("application/json"):
        assert "choices" in json.loads(raw)
    else:
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=mutated())
async def test_mutated_bodies_get_no_5xx_and_only_openai_errors(
    router_url: str, http: aiohttp.ClientSession, request: tuple[str, bytes]
) -> None:
    path, data = request
    await check(http, "POST", router_url + path, data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/debug/route", "/v1/nothing", "/v1/models"]),
    method=st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH"]),
    data=raw_bodies,
)
async def test_raw_bytes_methods_and_paths_get_no_5xx(
    router_url: str, http: aiohttp.ClientSession, path: str, method: str, data: bytes
) -> None:
    if method == "GET" and path == "/v1/models":
        return  # the one 200 without an OpenAI body shape to check here
    await check(http, method, router_url + path, data)


@pytest.mark.parametrize("header", ["X-Request-Id", "X-Vllm-Priority", "X-Session-ID"])
async def test_a_passed_header_that_is_not_utf8_is_a_400_naming_it_not_a_500(cluster: Cluster, header: str) -> None:
    # aiohttp hands such bytes on as lone surrogates, which no message to the worker can carry: each
    # request was a 500 with an ERROR traceback
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 3}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + header.encode() + b": ab\xff\xfecd\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 400"), head
