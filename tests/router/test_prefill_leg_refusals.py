"""A request its engine refuses costs no remote prefill. The prefill leg's rewrites (max_tokens 1,
n 1, min_tokens 1, stream_options dropped) made such values valid there, so a whole prefill ran
before the decode engine refused the request; now the prefill engine refuses it at once, and the
decode engine, asked then, in the words the engine itself uses. A request the prefill engine alone
refuses (one started with other flags) is the decode engine's to serve (end to end: router, shims,
sims)."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import MODEL, Cluster

MESSAGES = [{"role": "user", "content": "tell me a story about the sea " * 40}]
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"max_tokens": 5, "min_tokens": 10}),
    ("completions", {"min_tokens": 17}),  # past vLLM's 16 when no max_tokens is given
    ("completions", {"max_tokens": 5, "n": 0}),
    ("completions", {"max_tokens": 10**6}),  # past max_model_len
    ("chat/completions", {"max_completion_tokens": 4, "min_tokens": 5}),
    ("chat/completions", {"max_completion_tokens": 10**6}),
    # a null where vLLM types the field `int` (its 400 int_type), not an absent field
    ("completions", {"max_tokens": 5, "priority": None}),
    ("completions", {"max_tokens": 5, "min_tokens": None}),
    ("chat/completions", {"max_completion_tokens": 5, "min_tokens": None}),
]


@pytest.mark.parametrize(("endpoint", "fields"), REFUSED)
async def test_a_request_its_engine_refuses_costs_no_remote_prefill(
    cluster: Cluster, http: aiohttp.ClientSession, endpoint: str, fields: dict[str, Any]
) -> None:
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    prompt = {"messages": MESSAGES} if endpoint.startswith("chat") else {"prompt": list(range(1000, 4000))}
    body = {"model": MODEL, **prompt, **fields}
    computed = p.sim.engine.stats.prefill_tokens_computed
    async with http.post(f"{router.url}/v1/{endpoint}", json=body) as resp:
        status, answer = resp.status, await resp.json()
    async with http.post(f"{d.sim.url}/v1/{endpoint}", json=body) as resp:  # the engine itself
        own = (resp.status, (await resp.json())["error"]["message"])
    assert own[0] == 400
    assert (status, answer["error"]["message"]) == own
    assert p.sim.engine.stats.prefill_tokens_computed == computed, "no remote prefill ran"
    assert router.dispatcher.refusals_overruled == {}  # both engines refused it: no prefill worker's fault
    # Nothing fell back: it keeps its decision's outcome, as a request refused on any path does
    # (until 2026-12-07 a fallback_prefill_refused, counted in fallbacks_total).
    async with http.get(f"{router.url}/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    fallbacks = {s.labels["cause"]: s.value for s in families["kvswitch_router_fallbacks"].samples}
    decisions = {s.labels["outcome"]: s.value for s in families["kvswitch_router_decisions"].samples}
    assert (fallbacks["prefill_refused"], decisions) == (0.0, {"remote_prefill": 1.0}), (fallbacks, decisions)


async def test_a_body_vllms_validators_refuse_is_refused_before_it_is_routed(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """`stream_options` without `stream` (which the prefill leg drops): vLLM's model validator
    refuses it before anything else; the router runs it too, so it routes nothing, not even a
    decision, and answers in the engine's words (until 2026-12-07 both legs were sent)."""
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    body = {"model": MODEL, "prompt": list(range(1000, 4000)), "max_tokens": 5,
            "stream_options": {"include_usage": True}}  # fmt: skip
    computed = p.sim.engine.stats.prefill_tokens_computed
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        routed = (resp.status, await resp.json())
    async with http.post(f"{d.sim.url}/v1/completions", json=body) as resp:
        own = (resp.status, await resp.json())
    assert routed == own and own[0] == 400, (routed, own)
    assert p.sim.engine.stats.prefill_tokens_computed == computed
    async with http.get(f"{router.url}/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    assert {s.labels["outcome"]: s.value for s in families["kvswitch_router_decisions"].samples} == {}


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]


async def test_a_request_the_prefill_engine_alone_refuses_is_served_by_the_decode_engine(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill engine without the decode engines' --enable-auto-tool-choice refuses every chat
    request with tools: until 2026-12-07 its 400 was the client's answer, and nothing said why."""
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode", enable_auto_tool_choice=True, tool_call_parser="hermes")
    router = await cluster.add_ready_router(disagg="always")
    caplog.set_level(logging.WARNING, logger="router")
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_completion_tokens": 4}
    async with http.post(f"{p.sim.url}/v1/chat/completions", json=body) as resp:  # the prefill engine itself
        refused = (resp.status, (await resp.json())["error"]["message"])
    assert refused[0] == 400
    computed = p.sim.engine.stats.prefill_tokens_computed
    for _ in range(2):
        async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
            status, answer, headers = resp.status, await resp.json(), resp.headers
        assert status == 200, answer
        outcome = (headers["x-kvswitch-decode-worker"], headers["x-kvswitch-prefill"], answer["kvswitch"]["outcome"])
        assert outcome == (d.id, "bypass", "fallback_prefill_refused"), answer
    assert p.sim.engine.stats.prefill_tokens_computed == computed, "no remote prefill ran"
    said = [r for r in caplog.records if r.levelno == logging.WARNING and p.id in r.getMessage()]
    assert len(said) == 1 and refused[1] in said[0].getMessage() and d.id in said[0].getMessage(), said
    async with http.get(f"{router.url}/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    fallbacks = {s.labels["cause"]: s.value for s in families["kvswitch_router_fallbacks"].samples}
    overruled = {
        s.labels["worker"]: s.value for s in families["kvswitch_router_worker_prefill_refusals_overruled"].samples
    }
    assert (fallbacks["prefill_refused"], fallbacks["prefill_failed"], overruled) == (2.0, 0.0, {p.id: 2.0})
