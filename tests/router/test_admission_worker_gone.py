"""A model's only worker vanishes (`kill -9` of its shim) while requests wait at admission for it,
and nothing else reports to this router: the waiters get the 503 a new request would get (the
worker named, with Retry-After), not a 429 "no worker had room" when their wait runs out. A worker
turning silent comes with no notification; until 2026-12-05 nothing offered the waiters again
(admission audit, round 6, #1)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp

from engine_sim.config import SimConfig
from engine_sim.server import SimServer
from kvswitch.servers import dying_with_parent
from router.eligibility import Exclusion
from router.request_path import NO_WORKER_RETRY_S
from router.service import RouterService
from tests.router.conftest import BLOCK, Cluster, complete
from tests.router.polling import until

# TPOT SLO 1 ms: a decode worker running one request has no room for a second (tests.router.conftest
# busy_decode_fleet); TTFT SLO 20 s: a request may wait 10 s at admission.
SETTINGS: dict[str, Any] = {
    "conditional_disagg": True,
    "conditional_disagg_policy": "slo_aware",
    "slo_itl_s": 0.001,
    "slo_ttft_s": 20.0,
}


def _spawn_shim(sim: SimServer, nats_url: str, etcd_url: str, ns: str, lease_ttl: int) -> subprocess.Popen[bytes]:
    """The worker's shim in a process of its own, so that it can die without a word."""
    argv = ["shim", "--engine", "vllm", "--engine-url", sim.url, "--role", "decode", "--model", sim.config.model,
            "--kv-events", str(sim.events_endpoint), "--kv-events-mode", "connect",
            "--kv-replay", str(sim.replay_endpoint), "--http-port", "0", "--timing-profile", "h200:llama-3.1-8b",
            "--namespace", ns, "--nats-servers", nats_url, "--etcd-endpoints", etcd_url,
            "--lease-ttl", str(lease_ttl)]  # fmt: skip
    command, preexec = dying_with_parent([sys.executable, "-m", "kvswitch", *argv])  # a test killed leaves none
    out = subprocess.DEVNULL
    return subprocess.Popen(command, preexec_fn=preexec, stdout=out, stderr=out)  # noqa: PLW1509 (one prctl)


def _sees_only(router: RouterService, exclusion: Exclusion | None) -> bool:
    return [s.exclusion for s in router.eligibility.statuses(router.registry.workers())] == [exclusion]


def _sees_one_routable(router: RouterService) -> bool:
    return router.ready and _sees_only(router, None)


Answer = tuple[int, dict[str, Any], dict[str, str]]


@contextlib.asynccontextmanager
async def _a_waiter_when_the_worker_dies(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    nats_url: str,
    etcd_url: str,
    ns: str,
    reoffer_s: float | None = None,
    lease_ttl: int = 10,
    **settings: Any,
) -> AsyncIterator[tuple[RouterService, str, asyncio.Task[Answer], asyncio.Task[Answer]]]:
    """The only worker runs `other`'s request; a request waits for it at `router`, which has none on
    it (so no request's end wakes its waiters when the worker dies); then the worker's shim is
    killed. Yields the router, the worker, the waiting request and the running one. `reoffer_s`:
    the router's periodic offer, its default when None; `lease_ttl`: the shim's --lease-ttl."""
    sim = SimServer(SimConfig(speedup=1.0, num_gpu_blocks=512, block_size=BLOCK, role="decode"))
    await sim.start()
    shim = _spawn_shim(sim, nats_url, etcd_url, ns, lease_ttl)
    try:
        other = await cluster.add_router(**settings)
        router = await cluster.add_router(**settings)
        if reoffer_s is not None:
            router.path.admission._reoffer_s = reoffer_s
        for r in (other, router):
            await until(partial(_sees_one_routable, r), timeout=60, what="the worker routable")
        (worker,) = [info.worker for info in router.registry.workers()]
        running = asyncio.create_task(complete(http, other, list(range(64)), max_tokens=3000, ignore_eos=True))
        await until(lambda: router.view.load(worker).running >= 1, what="the first request running, seen by router")
        head = asyncio.create_task(complete(http, router, list(range(1000, 1064))))
        await until(lambda: router.path.admission.depth == 1, what="a request waiting at admission")
        shim.kill()
        await asyncio.to_thread(shim.wait, 10)
        yield router, worker, head, running
    finally:
        if shim.poll() is None:
            shim.kill()
            shim.wait()
        await sim.stop()


async def test_waiters_of_a_vanished_only_worker_get_its_503_not_a_429(
    cluster: Cluster, http: aiohttp.ClientSession, nats_url: str, etcd_url: str, ns: str
) -> None:
    async with _a_waiter_when_the_worker_dies(cluster, http, nats_url, etcd_url, ns, **SETTINGS) as fleet:
        router, worker, head, running = fleet
        await until(partial(_sees_only, router, Exclusion.SILENT), what="the worker silent to the router")
        behind = asyncio.create_task(complete(http, router, list(range(2000, 2064))))  # queues behind the head
        for task in (head, behind):
            # Old code: the head got 429 "no worker had room within 10.0s" (Retry-After 10) when its
            # wait ran out, and the request behind it the 503 only then.
            status, body, headers = await task
            assert status == 503, body
            assert worker in body["error"]["message"] and "silent" in body["error"]["message"], body
            assert headers["Retry-After"] == str(NO_WORKER_RETRY_S)
        assert router.path.admission.timed_out == 0 and router.path.admission.depth == 0
        await running  # ended, whichever way, by the worker's death


async def test_waiters_get_the_503_when_their_models_last_worker_leaves_the_registry(
    cluster: Cluster, http: aiohttp.ClientSession, nats_url: str, etcd_url: str, ns: str
) -> None:
    """The removal notifies (service._on_worker_remove): with the periodic offer off, the head is
    answered 503 'no ... worker is registered' when the lease goes (5 s), not 429 at its 20 s wait."""
    settings = {**SETTINGS, "slo_ttft_s": 40.0}
    # reoffer_s: the removal's notify alone
    async with _a_waiter_when_the_worker_dies(
        cluster, http, nats_url, etcd_url, ns, 3600.0, lease_ttl=5, **settings
    ) as fleet:
        served, _, head, running = fleet
        status, body, _ = await head
        assert status == 503 and "registered" in body["error"]["message"], body
        assert served.path.admission.timed_out == 0 and served.path.admission.depth == 0
        await running
