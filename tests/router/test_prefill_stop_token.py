"""A remote prefill whose one sampled token is a client's stop token id, end to end (router, shim,
sim). vLLM's KV connectors return kv_transfer_params only for a prefill that ended on its length,
which the sim now mirrors: such a leg ended "stop" with no handle, and the router left the prefill
worker out for 30 s as one without a KV connector. The vLLM prefill leg's min_tokens 1 masks the
stop id; a leg that stops all the same falls back without blaming its worker."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest

from router.service import RouterService
from tests.router.conftest import MODEL, Cluster, Worker
from worker_shim.adapters import vllm

PROMPT = "the quick brown fox jumps over the lazy dog " * 3


async def _post(http: aiohttp.ClientSession, router: RouterService, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    async with http.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(), resp.headers["x-kvswitch-outcome"]


async def _first_token(http: aiohttp.ClientSession, router: RouterService) -> int:
    """The token the sims sample first for PROMPT (the same on either: seeded by the prompt)."""
    answer, outcome = await _post(http, router, {"max_tokens": 1, "return_token_ids": True})
    assert outcome == "remote_prefill"
    return int(answer["choices"][0]["token_ids"][0])


def _left_in(router: RouterService, worker: Worker) -> None:
    _, ready = router.readiness()
    assert not ready.get("excluded_by_reason"), ready
    assert worker.id in {c["worker"] for c in router.path.explain(MODEL, [1, 2, 3], text=False)["prefill_candidates"]}


# vLLM's pydantic reads "8" and 8.0 as 8 (the router too): until 2026-12-06 the shim took them for
# values the engine refuses and sent the leg the client's limit, without min_tokens 1
@pytest.mark.parametrize("limit", [8, "8", 8.0], ids=["int", "text", "float"])
async def test_a_prefill_whose_first_token_is_a_stop_id_still_runs_remotely(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, limit: Any
) -> None:
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    first = await _first_token(http, router)
    pulled = d.sim.engine.stats.external_kv_tokens
    with caplog.at_level(logging.WARNING):
        answer, outcome = await _post(http, router, {"max_tokens": limit, "stop_token_ids": [first]})
    # the decode leg samples the client's first token, the stop id: an empty answer, as vLLM's
    assert outcome == "remote_prefill"
    assert (answer["choices"][0]["finish_reason"], answer["choices"][0]["text"]) == ("stop", "")
    assert d.sim.engine.stats.external_kv_tokens > pulled, "the decode worker pulled the prefilled prompt"
    # WARNING and above only: records before the block reach caplog at whatever level an earlier test
    # of this process left the router's loggers (its INFO "serving" line read as a warning in CI).
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("router") and r.levelno >= logging.WARNING]
    _left_in(router, p)


async def test_a_prefill_leg_that_stops_without_a_handle_falls_back_and_leaves_its_worker_in(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As before min_tokens 1 (or an engine that ignores it): the leg stops on the stop id and vLLM
    returns no kv_transfer_params. The request's token did it, not the engine: it falls back, and
    the worker stays in for the next request, with no WARNING about a missing KV connector."""
    body = vllm.engine_body

    def unmasked(leg):  # type: ignore[no-untyped-def]
        path, sent = body(leg)
        sent.pop("min_tokens", None)
        return path, sent

    monkeypatch.setattr(vllm, "engine_body", unmasked)
    p = await cluster.add_worker("prefill")
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    first = await _first_token(http, router)
    with caplog.at_level(logging.WARNING):
        answer, outcome = await _post(http, router, {"max_tokens": 8, "stop_token_ids": [first]})
    assert outcome == "fallback_prefill_failed"
    assert (answer["choices"][0]["finish_reason"], answer["choices"][0]["text"]) == ("stop", "")
    assert not [r for r in caplog.records if r.name == "router.eligibility" and r.levelno >= logging.WARNING]
    _left_in(router, p)
    _, outcome = await _post(http, router, {"prompt": "another prompt entirely " * 4, "max_tokens": 4})
    assert outcome == "remote_prefill"
