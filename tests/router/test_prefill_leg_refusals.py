"""A request its engine refuses costs no remote prefill. The prefill leg's rewrites (max_tokens 1,
n 1, min_tokens 1, stream_options dropped) made such values valid there, so a whole prefill ran
before the decode engine refused the request; now the prefill engine refuses it at once, in the
words the engine itself uses (end to end: router, shims, sims)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.router.conftest import MODEL, Cluster

MESSAGES = [{"role": "user", "content": "tell me a story about the sea " * 40}]
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"max_tokens": 5, "min_tokens": 10}),
    ("completions", {"min_tokens": 17}),  # past vLLM's 16 when no max_tokens is given
    ("completions", {"max_tokens": 5, "stream_options": {"include_usage": True}}),  # no stream
    ("completions", {"max_tokens": 5, "n": 0}),
    ("completions", {"max_tokens": 10**6}),  # past max_model_len
    ("chat/completions", {"max_completion_tokens": 4, "min_tokens": 5}),
    ("chat/completions", {"max_completion_tokens": 10**6}),
    # a null where vLLM types the field `int` (its 400 int_type), not an absent field
    ("completions", {"max_tokens": 5, "n": None}),
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
