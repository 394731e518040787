"""A request no plan serves on a fleet whose decode workers cannot prefill locally
(WorkerInfo.local_prefill false, an SGLang decode server), through the router's HTTP layer: the
client's 503 with Retry-After, not a 500. Until the review of a0d58d8 (finding 1) the planner
asserted a plan where router.disagg may find none (its decode workers' bypass refused, no remote
prefill to serve them), and the client got 500 InternalServerError, on a first plan and on a retry's
alike; the retry's 503 said only "no worker could serve the request" (finding 2).

The decode shim here fronts an engine_sim that does prefill; EngineAdapter.decode_prefills patched
false makes it register as an SGLang decode server does."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest

from router.api_errors import NO_LOCAL_PREFILL_WHY
from router.leg import NO_LOCAL_PREFILL
from router.request_path import NO_WORKER_RETRY_S
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster, Worker, complete
from tests.router.polling import until
from worker_shim.adapters.base import EngineAdapter

CANNOT = "its decode workers cannot prefill locally and no prefill worker of their engine can serve it"


@pytest.fixture(autouse=True)
def _decode_cannot_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EngineAdapter, "decode_prefills", False)


async def _registered(router: RouterService, decode: Worker) -> None:
    def read() -> bool:
        info = router.registry.get(decode.id)
        return info is not None and not info.local_prefill

    await until(read, what="the decode worker registered with local_prefill false")


def _refused(status: int, body: dict[str, Any], headers: dict[str, str], message: str) -> None:
    assert status == 503, body
    assert body["error"]["type"] == "ServiceUnavailableError" and body["error"]["code"] == 503, body
    assert message in body["error"]["message"], body
    assert headers["Retry-After"] == str(NO_WORKER_RETRY_S), headers


async def test_a_failed_remote_prefill_with_no_other_prefill_worker_is_the_clients_503(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """disagg=never plans a bypass, made remote (`remote_no_local_prefill`); the only prefill worker
    hangs past prefill_timeout_s, and the retry finds no other: 503 no_local_prefill, its worker ids
    in the router's log alone."""
    p = await cluster.add_worker("prefill", hang_after=0)
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="never", prefill_timeout_s=0.3)
    await _registered(router, d)
    caplog.set_level(logging.WARNING, logger="router")
    status, body, headers = await complete(http, router, list(range(200)))
    _refused(status, body, headers, NO_LOCAL_PREFILL_WHY)
    assert body["error"]["message"] == NO_LOCAL_PREFILL_WHY
    assert p.id not in body["error"]["message"] and d.id not in body["error"]["message"]
    said = [r.getMessage() for r in caplog.records if NO_LOCAL_PREFILL in r.getMessage()]
    assert any(p.id in m and d.id in m and "cannot prefill locally" in m for m in said), said


@pytest.mark.parametrize("extra", [{"n": 2}, {"prompt_logprobs": 1}], ids=["n", "prompt_logprobs"])
async def test_a_request_no_transfer_handle_serves_is_refused_as_for_no_worker(
    cluster: Cluster, http: aiohttp.ClientSession, extra: dict[str, Any]
) -> None:
    """docs/router.md: a bypass the decode worker cannot serve, and no handle serves the request."""
    await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router()
    await _registered(router, d)
    status, body, headers = await complete(http, router, list(range(200)), **extra)
    _refused(status, body, headers, CANNOT)
    status, body, _ = await complete(http, router, list(range(200)))  # a plain one goes remote
    assert status == 200, body


async def test_a_decode_worker_with_no_prefill_worker_is_refused_as_for_no_worker(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router()
    await _registered(router, d)
    status, body, headers = await complete(http, router, list(range(200)))
    _refused(status, body, headers, CANNOT)
    async with http.post(router.url + "/debug/route", json={"model": MODEL, "prompt": list(range(200))}) as resp:
        explained = await resp.json()
        _refused(resp.status, explained, dict(resp.headers), CANNOT)  # it asserted a plan too


async def test_a_decode_worker_that_leaves_is_forgotten_by_the_once_said_line(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """The service's removal of a worker reaches Disaggregator.forget: the names of departed decode
    workers whose bypasses went remote were kept for the router's life."""
    await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="never")
    await _registered(router, d)
    caplog.set_level(logging.INFO, logger="router")
    status, body, _ = await complete(http, router, list(range(200)))
    assert status == 200, body
    assert any(d.id in r.getMessage() and "cannot prefill locally" in r.getMessage() for r in caplog.records)
    gone = d.id
    assert gone in router.planner.disagg._no_local_said
    await d.shim.stop()
    await until(lambda: router.registry.get(gone) is None, what="the decode worker gone from the registry")
    assert gone not in router.planner.disagg._no_local_said
