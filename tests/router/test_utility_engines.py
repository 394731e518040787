"""/tokenize and /detokenize go only to workers whose engine serves the route (vLLM's): an SGLang
worker beside vLLM ones is never sent one, and a model SGLang workers alone serve is a 404 at once,
said nowhere in the log (end to end: router, shims, sims; the SGLang worker is a sim whose shim
registers as SGLang's would, and whose adapter refuses utility calls as SGLang's does)."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import msgspec
import pytest

from router.service import RouterService
from tests.router.conftest import MODEL, Cluster, Worker
from tests.router.polling import until
from worker_shim.adapters.base import EngineAdapter

SGLANG_MODEL = "sim-sglang"


async def _as_sglang(worker: Worker) -> list[str]:
    """Re-register `worker` as an SGLang engine's; the utility endpoints its adapter is asked."""
    worker.shim.config = msgspec.structs.replace(worker.shim.config, engine="sglang")
    worker.shim.adapter.kind = "sglang"  # type: ignore[misc]  # an instance of its own, as an SGLang shim has
    asked: list[str] = []

    async def refused(endpoint: str, body: dict[str, Any]) -> bytes:
        asked.append(endpoint)
        return await EngineAdapter.call(worker.shim.adapter, endpoint, body)  # SGLang's: the 404 naming it

    worker.shim.adapter.call = refused  # type: ignore[method-assign]
    assert worker.shim.registration is not None
    worker.shim.registration.update()
    return asked


async def _registered_as_sglang(router: RouterService, worker: Worker) -> None:
    await until(
        lambda: getattr(router.registry.get(worker.id), "engine", None) == "sglang", what="registered as SGLang"
    )


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name.startswith("router") and r.levelno >= logging.INFO
    ]


async def test_a_mixed_fleet_never_sends_a_utility_call_to_a_worker_without_the_route(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 every other call went to the SGLang worker first, whose shim's 404 was
    handed on to the vLLM one: a WARNING per episode, a permanent fact said as a failure."""
    await cluster.add_worker("agg")
    sglang = await cluster.add_worker("agg")
    asked = await _as_sglang(sglang)
    router = await cluster.add_ready_router(disagg="never")
    await _registered_as_sglang(router, sglang)
    caplog.set_level(logging.DEBUG, logger="router")
    caplog.clear()
    calls: list[tuple[str, dict[str, Any]]] = [
        ("/tokenize", {"prompt": "hello"}),
        ("/detokenize", {"tokens": [104, 105]}),
    ]
    for route, body in calls * 3:
        async with http.post(router.url + route, json={"model": MODEL, **body}) as resp:
            assert resp.status == 200, await resp.text()
    assert not _said(caplog), _said(caplog)
    assert asked == []


async def test_a_model_whose_engines_serve_no_utility_route_is_a_404_naming_why_said_nowhere(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 each call went to the SGLang worker, whose shim's 404 came back as a request
    'failed before its first output': an INFO line per call, a line per poll of a client."""
    await cluster.add_worker("agg")
    sglang = await cluster.add_worker("agg", model=SGLANG_MODEL)
    asked = await _as_sglang(sglang)
    router = await cluster.add_ready_router(disagg="never")
    await _registered_as_sglang(router, sglang)
    caplog.set_level(logging.DEBUG, logger="router")
    caplog.clear()
    answers = []
    for _ in range(3):
        async with http.post(router.url + "/tokenize", json={"model": SGLANG_MODEL, "prompt": "hi"}) as resp:
            answers.append((resp.status, "Retry-After" in resp.headers, await resp.json()))
    assert not _said(caplog), _said(caplog)
    message = (
        f"no worker of model {SGLANG_MODEL} serves /tokenize: its engines (sglang) have no such route; "
        "send it for a model that vllm engines serve"
    )
    error = {"error": {"message": message, "type": "NotFoundError", "param": None, "code": 404}}
    assert answers == [(404, False, error)] * 3
    assert asked == []
