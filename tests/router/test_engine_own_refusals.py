"""What vLLM's model alone refuses of a body (its validators of the raw JSON, its dict types) is the
router's 400 only for a model vLLM engines alone serve: a model an SGLang worker serves gets such a
body through to its engine, whose own answer it is, since SGLang takes them (end to end: router,
shims, sims; the SGLang worker is a sim whose shim registers as SGLang's would)."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until

SGLANG_MODEL = "sim-sglang"
_M = [{"role": "user", "content": "tell me a story about the sea"}]
BODIES: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"prompt": list(range(1000, 1100)), "max_tokens": 2, "stream_options": {"include_usage": True}},
     "Stream options can only be defined when `stream=True`."),
    ("completions", {"prompt": list(range(1000, 1100)), "max_tokens": 2, "cache_salt": "tenant/1"},
     "Parameter 'cache_salt' must be at most 128 characters"),
    ("chat/completions", {"messages": _M, "max_tokens": 2, "tools": []}, "`tools` must not be an empty array."),
]  # fmt: skip


async def _routed(http: aiohttp.ClientSession, url: str) -> float:
    """The requests the router has routed to a worker (its decisions, of every outcome)."""
    async with http.get(f"{url}/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    return sum(s.value for s in families["kvswitch_router_decisions"].samples if s.name.endswith("_total"))


async def test_a_body_only_vllm_refuses_reaches_an_sglang_model_and_is_refused_for_a_vllm_one(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add_worker("agg")
    s = await cluster.add_worker("agg", model=SGLANG_MODEL)
    s.shim.config = msgspec.structs.replace(s.shim.config, engine="sglang")
    s.shim.adapter.kind = "sglang"  # type: ignore[misc]  # an instance of its own, as an SGLang shim has
    assert s.shim.registration is not None
    s.shim.registration.update()
    router = await cluster.add_ready_router()
    await until(lambda: getattr(router.registry.get(s.id), "engine", None) == "sglang", what="registered as SGLang")
    for route, body, message in BODIES:
        for model, reaches in ((MODEL, False), (SGLANG_MODEL, True)):
            sent = {**body, "model": model}
            before = await _routed(http, router.url)
            async with http.post(f"{router.url}/v1/{route}", json=sent) as resp:
                status, answer = resp.status, await resp.json()
            # engine_sim refuses it as vLLM does: the SGLang worker's answer is its engine's 400
            assert (status, message in answer["error"]["message"]) == (400, True), (model, answer)
            assert await _routed(http, router.url) - before == (1 if reaches else 0), (model, route, body)
            async with http.post(f"{router.url}/debug/route", json=sent) as resp:
                assert resp.status == (200 if reaches else 400), (model, await resp.text())
