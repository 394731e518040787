"""End to end, an engine that restarts under a live shim and is back before its health checks fail
(--health-failures x --health-interval-s, 2 s by default): only the KV event stream shows it. Until
2026-12-07 the shim reset its index and kept its worker id, epoch and record, the old run's block
size, KV capacity and context length with them; now the session ends and the worker registers anew
(docs/worker_shim.md, "Engine death"), as after a restart the health checks saw."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

import aiohttp
import pytest

from protocol import block_hashes
from router.service import RouterService
from tests.router.conftest import BLOCK, MODEL, Cluster, Worker, complete
from tests.router.polling import until

SHIM = {"health_interval_s": 1.0}  # the shim's default: a restart within 2 s passes its health checks


async def registered_anew(worker: Worker, old: str, *routers: RouterService) -> str:
    """Until `worker`'s shim registered under an id other than `old` and every router sees it, not
    `old`; its new id."""
    await until(lambda: worker.shim.registered.is_set() and worker.shim.worker_id not in (None, old), what="new id")
    new = worker.id

    for r in routers:
        await until(partial(_sees_alone, r, new, old), what="the router sees the new id alone")
    return new


def _sees_alone(router: RouterService, new: str, old: str) -> bool:
    return router.registry.get(new) is not None and router.registry.get(old) is None


async def test_a_worker_back_with_another_block_size_is_registered_with_it_and_excluded(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The audit's repro: the record kept block size 16 and 512 blocks (8 x the capacity), /ready
    excluded nothing, and every Stored of the new run was dropped as malformed, logged once."""
    await cluster.add_worker("prefill", shim=SHIM)
    d1 = await cluster.add_worker("decode", shim=SHIM)
    await cluster.add_worker("decode", shim=SHIM)
    r1 = await cluster.add_ready_router()
    old = d1.id
    d1.sim.config = d1.sim.config.replace(block_size=32, num_gpu_blocks=64).validate()
    await d1.sim.restart()
    new = await registered_anew(d1, old, r1)
    info = r1.registry.get(new)
    assert info is not None and (info.block_size, info.kv_total_blocks) == (32, 64)
    # Bootstrapping its index first (a new worker), then excluded for its block size for good.
    excluded: list[tuple[str, str]] = []
    async with asyncio.timeout(20):
        while excluded != [(new, "block_size")]:
            async with http.get(r1.url + "/ready") as resp:
                body = await resp.json()
            excluded = [(w["worker"], w["excluded"]) for w in body["worker_status"]]
            assert excluded in ([(new, "block_size")], [(new, "bootstrapping")]), excluded
            await asyncio.sleep(0.05)
    for i in range(6):
        st, _, hd = await complete(http, r1, list(range(5000 + i * 1000, 5000 + i * 1000 + 20 * BLOCK)), max_tokens=2)
        assert st == 200 and hd["x-kvswitch-decode-worker"] != new


async def test_a_worker_back_with_a_shorter_context_gets_no_prompt_past_it(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The audit's repro: the record said 32768 tokens while the engine took 1024, and a 2000-token
    prompt whose prefix it cached went to it and failed 400, four times in four, though the other
    worker serves it."""
    d1 = await cluster.add_worker("agg", shim=SHIM)
    await cluster.add_worker("agg", shim=SHIM)
    r1 = await cluster.add_ready_router(disagg="never")
    old = d1.id
    d1.sim.config = d1.sim.config.replace(max_model_len=1024).validate()
    await d1.sim.restart()
    new = await registered_anew(d1, old, r1)
    info = r1.registry.get(new)
    assert info is not None and info.max_model_len == 1024
    short = list(range(7000, 7000 + 50 * BLOCK))  # cached on d1, so routers prefer it
    async with http.post(d1.sim.url + "/v1/completions", json={"model": MODEL, "prompt": short, "max_tokens": 1}):
        pass
    hashes = block_hashes(short, BLOCK)
    await until(lambda: r1.index.find_matches(hashes).get(new, 0) == len(hashes), what="indexed on d1")
    for i in range(4):
        prompt = short + list(range(20000 + i * 1000, 20000 + i * 1000 + 1200))  # 2000 tokens
        st, body, hd = await complete(http, r1, prompt, max_tokens=4)
        assert st == 200, body
        assert hd["x-kvswitch-decode-worker"] != new


async def test_a_prefill_engine_restarted_before_its_kv_was_pulled_closes_no_pair(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit's repro: the prefill worker kept its id, so the pull that failed on its restarted
    engine closed the pair for 30 s with a WARNING blaming NIXL or a KV lease, and every request
    into that decode worker bypassed disaggregation (bypass_transfer_failing). A new id is a worker
    that left: its pairs are forgotten, and a pull that fails after it left is no pair's failure."""
    caplog.set_level(logging.WARNING, logger="router.transfer_health")
    p = await cluster.add_worker("prefill", shim=SHIM)
    d1 = await cluster.add_worker("decode", shim=SHIM, speedup=1.0, max_num_seqs=1)
    r1 = await cluster.add_ready_router(disagg="always")
    old = p.id
    blocker = asyncio.create_task(complete(http, r1, list(range(100, 200)), max_tokens=150, ignore_eos=True))
    await until(lambda: len(d1.sim.engine.running) == 1, what="d1 busy")
    task = asyncio.create_task(complete(http, r1, list(range(3000, 3000 + 40 * BLOCK)), max_tokens=4))
    await until(lambda: len(d1.sim.engine.waiting) >= 1, what="the decode leg queued on d1, its prefill done")
    await p.sim.restart()
    st, body, _ = await task
    assert st == 200 and body["kvswitch"]["outcome"] == "fallback_transfer_failed"
    assert (await blocker)[0] == 200
    await registered_anew(p, old, r1)
    assert r1.planner.disagg.transfers.workers() == []
    for i in range(3):
        st, body, _ = await complete(http, r1, list(range(9000 + i * 2000, 9000 + i * 2000 + 20 * BLOCK)), max_tokens=2)
        assert st == 200 and body["kvswitch"]["outcome"] == "remote_prefill", body["kvswitch"]
    assert not [r for r in caplog.records if r.name == "router.transfer_health" and r.levelno >= logging.WARNING]


async def test_the_only_worker_restarted_right_after_a_request_serves_on(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The audit's repro: the judgement of the request served just before the restart ran on, read
    the shim's index that the restart had voided, and flagged the healthy worker no_stored: out of
    routing for 12 events timeouts, every request 503 as it was the only worker (4 runs in 5). Its
    new session starts without the old run's judgements."""
    timeout = 0.5  # --events-timeout-s: judged 1 s after the request
    d1 = await cluster.add_worker("agg", shim={**SHIM, "events_timeout_s": timeout})
    r1 = await cluster.add_ready_router(disagg="never")
    old = d1.id
    st, _, _ = await complete(http, r1, list(range(7000, 7000 + 8 * BLOCK)), max_tokens=1)
    assert st == 200
    await d1.sim.restart()
    await registered_anew(d1, old, r1)
    await until(lambda: r1.ingest.synced, what="the new id's state synced")
    until_s = time.monotonic() + 2 * timeout + 1.0  # past the judgement of the request before the restart
    i = 0
    while time.monotonic() < until_s:
        i += 1
        st, body, _ = await complete(http, r1, [*range(100, 164), i], max_tokens=1)
        assert st == 200, body
        assert d1.shim.events.ok, d1.shim.events.why
        await asyncio.sleep(0.1)
    assert d1.shim.events.reported == 0
