"""Fixtures for the router's tests: a plain NATS connection; for the end-to-end tests, simulated
engines at high speedup with a shim beside each, and RouterServices, all in-process against the
session's real nats-server and etcd."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client
from opentelemetry.trace import TracerProvider

from engine_sim.config import SimConfig
from engine_sim.server import SimServer
from protocol.config import EtcdSettings, NatsSettings
from router.service import RouterConfig, RouterService
from tests.router.polling import until
from worker_shim import ShimConfig, WorkerShim

BLOCK = 16
MODEL = "sim-llama"


@dataclass
class Worker:
    role: str
    sim: SimServer
    shim: WorkerShim

    @property
    def id(self) -> str:
        assert self.shim.worker_id is not None
        return self.shim.worker_id

    @property
    def requests_served(self) -> int:
        """The engine's generate requests less its shim's endpoint probes (add_worker): the ones
        routers and tests sent."""
        return self.sim.faults.requests_seen - self.shim.probe.sent


@dataclass
class Cluster:
    ns: str
    nats_url: str
    etcd_url: str
    workers: list[Worker] = field(default_factory=list)
    routers: list[RouterService] = field(default_factory=list)

    async def add_worker(self, role: str = "decode", shim: dict[str, Any] | None = None, **sim_kw: Any) -> Worker:
        """A sim (`sim_kw`: SimConfig fields) and a registered shim beside it (`shim`: ShimConfig
        fields), its endpoint probe settled: the sim's counters hold the probe's whole work (the
        shim's `probe.sent`, `probe.prompt_tokens`, `probe.output_tokens`), which tests that count
        engine work add, and the fault knobs `crash_after` / `hang_after` count the requests sent
        after it, as they counted a test's own before there was a probe."""
        faults = {k: sim_kw.pop(k) for k in ("crash_after", "hang_after") if k in sim_kw}
        cfg: dict[str, Any] = {"speedup": 200.0, "num_gpu_blocks": 512, "block_size": BLOCK, "role": role}
        cfg.update(sim_kw)
        sim = SimServer(SimConfig(**cfg))
        await sim.start()
        assert sim.events_endpoint is not None
        shim_cfg: dict[str, Any] = {
            "engine": "vllm",
            "engine_url": sim.url,
            "role": role,
            "model": sim.config.model,
            "kv_events": sim.events_endpoint,
            "kv_events_mode": "connect",
            "kv_replay": sim.replay_endpoint,
            "namespace": self.ns,
            "lease_ttl": 10,
            "health_interval_s": 0.1,
            "drain_grace_s": 1.0,
            "timing_profile": "h200:llama-3.1-8b",  # what the sims are timed from
        }
        shim_cfg.update(shim or {})
        worker_shim = WorkerShim(
            ShimConfig(**shim_cfg),
            NatsSettings(servers=[self.nats_url]),
            EtcdSettings(endpoints=[self.etcd_url]),
        )
        await worker_shim.start()
        await asyncio.wait_for(worker_shim.registered.wait(), 20)
        await probe_settled(worker_shim)
        for knob, n in faults.items():
            setattr(sim.faults, knob, None if n is None else sim.faults.requests_seen + n)
        worker = Worker(role, sim, worker_shim)
        self.workers.append(worker)
        return worker

    async def add_router(
        self,
        tracer_provider: TracerProvider | None = None,
        api_keys_file: str | None = None,
        config: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> RouterService:
        """A started router; `config`: RouterConfig fields beyond the cluster's, `overrides`: settings.

        Every sim, shim and router of this cluster shares the test's one event loop, which a loaded
        box can stall for seconds (seen in CI: leases of 2 s expired and workers re-registered under
        new ids; legs silent for 3 x 0.4 s were retried elsewhere). So leases of 10 s and stream
        heartbeats every 2 s, as liveness is not what these tests test; the subprocess clusters of
        test_e2e_liveness.py and tests/worker_shim test it with the real defaults."""
        cfg: dict[str, Any] = {
            "lease_ttl_s": 10,
            "seed": len(self.routers),
            "etcd": EtcdSettings(endpoints=[self.etcd_url]),
            **(config or {}),
        }
        overrides = {"stream_heartbeat_s": 2.0, **overrides}
        router = RouterService(
            RouterConfig(
                ns=self.ns,
                nats=NatsSettings(servers=[self.nats_url]),
                overrides=overrides,
                tracer_provider=tracer_provider,
                api_keys_file=api_keys_file,
                **cfg,
            )
        )
        await router.start()
        self.routers.append(router)
        return router

    async def ready(self, router: RouterService, workers: int | None = None) -> None:
        """The router sees `workers` workers (default: all) and its index is synced with every one: a
        router is ready with one decode worker routable, and a request before a prefill worker had
        synced found no prefill pool (clean-clone CI runs, twice in two sessions)."""
        n = len(self.workers) if workers is None else workers
        await until(
            lambda: router.ready and len(router.registry.workers()) == n and router.ingest.synced,
            what="router ready, its index synced",
        )

    async def add_ready_router(self, api_keys_file: str | None = None, **overrides: Any) -> RouterService:
        """A router that sees every worker added so far, its index synced."""
        router = await self.add_router(api_keys_file=api_keys_file, **overrides)
        await self.ready(router)
        return router

    async def agg_router(self, workers: int, **overrides: Any) -> RouterService:
        """`workers` aggregated workers and a ready router in front of them."""
        for _ in range(workers):
            await self.add_worker("agg")
        return await self.add_ready_router(**overrides)

    def by_id(self, worker_id: str) -> Worker:
        return next(w for w in self.workers if w.id == worker_id)

    async def close(self) -> None:
        for router in self.routers:
            await router.stop()
        for w in self.workers:
            await w.shim.stop()
            await w.sim.stop()


async def probe_settled(shim: WorkerShim) -> None:
    """Until `shim`'s endpoint probe has settled (worker_shim.endpoint_probe: one request on its
    engine per event connection), so that a test counts its engine's work from a known point."""
    await until(lambda: shim.probe.settled, what="the shim's endpoint probe settled")


@pytest.fixture
async def cluster(nats_url: str, etcd_url: str, ns: str) -> AsyncIterator[Cluster]:
    c = Cluster(ns, nats_url, etcd_url)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A plain NATS connection, for tests that play a shim or a peer replica."""
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def complete(
    http: aiohttp.ClientSession, router: RouterService, prompt: list[int] | str, **body: Any
) -> tuple[int, dict[str, Any], dict[str, str]]:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body}
    async with http.post(router.url + "/v1/completions", json=payload) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def busy_decode_fleet(
    cluster: Cluster, http: aiohttp.ClientSession
) -> tuple[RouterService, Worker, asyncio.Task[tuple[int, dict[str, Any], dict[str, str]]]]:
    """A prefill worker, one decode worker at H200 speed and a `slo_aware` router whose 1 ms TPOT
    SLO leaves that worker no room for a second request (a decode step of two sequences alone takes
    ~6 ms; TTFT SLO 20 s: a request may wait up to 10 s at admission), with a first, long request
    running on it. Returns the router, the decode worker and the first request's task."""
    await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode", speedup=1.0)
    router = await cluster.add_ready_router(
        conditional_disagg=True, conditional_disagg_policy="slo_aware", slo_itl_s=0.001, slo_ttft_s=20.0
    )
    first = asyncio.create_task(complete(http, router, list(range(64)), max_tokens=400, ignore_eos=True))
    await until(lambda: router.view.load(d.id).running >= 1, what="the first request running on d")
    return router, d, first
