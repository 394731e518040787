"""A LoRA adapter re-pointed at another path: vLLM 0.32 keys its blocks by name and path, so the
engine reuses none it cached from the old one, and the shim withdraws those chains from routers.
They stay withdrawn across a shim session restart (a lease lost, a health check too slow) while
the engine stays up, and a change made while the shim is between sessions is seen by the next."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from engine_sim import LoraModule
from protocol import block_hashes
from protocol.hashing import chain_salt
from router.service import RouterService
from tests.router.conftest import BLOCK, Cluster, Worker
from tests.router.polling import until

PROMPT = list(range(7000, 7640))  # 40 blocks
BODY = {"model": "sql", "prompt": PROMPT, "max_tokens": 2}
SALTED = set(block_hashes(PROMPT, BLOCK, salt=chain_salt("sql")))


async def _worker(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> tuple[Worker, RouterService]:
    monkeypatch.setattr("worker_shim.shim.ADAPTERS_POLL_S", 0.2)
    lora: dict[str, Any] = {"lora_modules": (LoraModule("sql", "/a"),), "runtime_lora_updating": True}
    worker = await cluster.add_worker("agg", shim={"busy_limit_s": 0.5}, **lora)
    router = await cluster.add_ready_router()
    return worker, router


async def _complete(http: aiohttp.ClientSession, router: RouterService) -> None:
    async with http.post(router.url + "/v1/completions", json=BODY) as r:
        assert r.status == 200, await r.text()


async def _repoint(http: aiohttp.ClientSession, worker: Worker) -> None:
    for path, body in (("unload", {"lora_name": "sql"}), ("load", {"lora_name": "sql", "lora_path": "/b"})):
        async with http.post(f"{worker.sim.url}/v1/{path}_lora_adapter", json=body) as r:
            assert r.status == 200


async def _restart_session(cluster: Cluster, router: RouterService, worker: Worker, between: Any = None) -> str:
    """The shim's health check too slow for a while: it deregisters and registers again, the
    engine staying up. `between` runs while it is out. The worker's new id."""
    sessions = worker.shim.sessions
    worker.sim.faults.health_delay_s = 3.0
    await until(lambda: not router.registry.workers(), what="the worker deregistered", timeout=20)
    if between is not None:
        await between()
    worker.sim.faults.health_delay_s = 0.0
    await until(lambda: len(router.registry.workers()) == 1, what="the worker registered again", timeout=30)
    await cluster.ready(router)
    assert worker.shim.sessions > sessions
    await asyncio.sleep(1.5)  # the new session's replay read, and several adapter polls
    return router.registry.workers()[0].worker


async def test_chains_withdrawn_stay_withdrawn_after_a_session_restart(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, router = await _worker(cluster, monkeypatch)
    await _complete(http, router)
    await until(lambda: router.index.worker_hashes(worker.id) >= SALTED, what="the adapter's chain indexed")
    await _repoint(http, worker)
    await until(lambda: not SALTED & router.index.worker_hashes(worker.id), what="the chain withdrawn")
    wid = await _restart_session(cluster, router, worker)
    assert not SALTED & router.index.worker_hashes(wid), "the new session's replay published them again"


async def test_a_path_changed_between_sessions_is_withdrawn_by_the_next(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, router = await _worker(cluster, monkeypatch)
    await _complete(http, router)
    await until(lambda: router.index.worker_hashes(worker.id) >= SALTED, what="the adapter's chain indexed")
    wid = await _restart_session(cluster, router, worker, between=lambda: _repoint(http, worker))
    assert not SALTED & router.index.worker_hashes(wid), "the old path's chain is credited"
