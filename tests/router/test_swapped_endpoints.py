"""Two shims given each other's `--kv-events` / `--kv-replay` (a copy-paste slip) each read a live
stream of Stored events: until 2026-12-06 nothing fired, each published the other engine's cache
as its own worker's, and /ready said nothing. The endpoint probe (worker_shim.endpoint_probe) has
each shim's own engine serve a random prompt and looks for its block on the stream it reads.
Real sims, shims, router, NATS and etcd; the sims' traffic is sent to them directly, past the
shims, as another client of the engine would."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import aiohttp
import pytest

from engine_sim.config import SimConfig
from engine_sim.server import SimServer
from protocol.config import EtcdSettings, NatsSettings
from router.service import RouterService
from tests.router.conftest import BLOCK, Cluster, Worker, probe_settled
from tests.router.polling import until
from tests.worker_shim.cluster import complete
from worker_shim import ShimConfig, WorkerShim
from worker_shim.adapters import EngineError
from worker_shim.engine_events import EngineBatch
from worker_shim.event_health import EventProblem

TIMEOUT_S = 0.5  # --events-timeout-s: the probe's verdict waits this long after its answer


async def _pair(cluster: Cluster, *, swapped: bool, **shim_kw: Any) -> list[Worker]:
    sims = [SimServer(SimConfig(speedup=200.0, num_gpu_blocks=512, block_size=BLOCK)) for _ in range(2)]
    for sim in sims:
        await sim.start()
    workers = []
    for i, sim in enumerate(sims):
        events_of = sims[1 - i] if swapped else sim
        cfg: dict[str, Any] = {
            "engine": "vllm",
            "engine_url": sim.url,
            "role": "agg",
            "model": sim.config.model,
            "kv_events": events_of.events_endpoint,
            "kv_events_mode": "connect",
            "kv_replay": events_of.replay_endpoint,
            "namespace": cluster.ns,
            "lease_ttl": 10,
            "health_interval_s": 0.1,
            "drain_grace_s": 1.0,
            "events_timeout_s": TIMEOUT_S,
            **shim_kw,
        }
        shim = WorkerShim(
            ShimConfig(**cfg), NatsSettings(servers=[cluster.nats_url]), EtcdSettings(endpoints=[cluster.etcd_url])
        )
        workers.append(Worker("agg", sim, shim))
        cluster.workers.append(workers[-1])  # stopped by the fixture
    return workers


async def _start(workers: list[Worker]) -> None:
    for w in workers:
        await w.shim.start()
    for w in workers:
        await asyncio.wait_for(w.shim.registered.wait(), 20)


async def _traffic_until(workers: list[Worker], done: Any, what: str, timeout: float = 30.0) -> None:
    """Requests straight to each engine (fresh prompts: each stores blocks) until `done()`."""
    rng = random.Random(7)

    async def send() -> None:
        while True:
            for w in workers:
                await complete(w.sim.url, [rng.randrange(1, 4000) for _ in range(2 * BLOCK + 3)])
            await asyncio.sleep(0.1)

    task = asyncio.create_task(send())
    try:
        await until(done, timeout=timeout, what=what)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _excluded(router: RouterService, worker: Worker) -> str | None:
    (st,) = [s for s in router.worker_listing()["worker_status"] if s["worker"] == worker.id]
    return st["excluded"]  # type: ignore[no-any-return]


async def test_two_shims_with_each_others_endpoints_report_it_and_withhold_the_foreign_events(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    workers = await _pair(cluster, swapped=True)
    with caplog.at_level(logging.INFO, logger="worker_shim"):
        await _start(workers)
        router = await cluster.add_router()
        await _traffic_until(
            workers,
            lambda: all(EventProblem.OTHER_ENGINE in w.shim.events.problems for w in workers),
            "both shims to find their streams another engine's",
        )
    for w in workers:
        assert not w.shim.events.ok and "--kv-events" in w.shim.events.why and w.sim.url in w.shim.events.why
        assert w.shim.probe.confirmed == 0
        assert w.shim.canonical_hashes() == set()  # withheld: nothing of the other engine's cache
        _, body = w.shim.health_report()
        assert body["events_ok"] is False and "another engine's" in body["events_why"]
    await until(
        lambda: all(_excluded(router, w) == "events_down" for w in workers),
        what="the router to exclude both workers as events_down",
    )
    ready, body = router.readiness()
    assert not ready and {s["excluded"] for s in body["worker_status"]} == {"events_down"}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "another engine's" in r.getMessage()]
    assert len(errors) == 2  # once per shim, however often it probes again
    assert all("--no-endpoint-probe" in r.getMessage() for r in errors)  # the way out, for who wants no probe


async def test_a_healthy_pair_is_confirmed_and_never_flagged(cluster: Cluster) -> None:
    workers = await _pair(cluster, swapped=False)
    await _start(workers)
    router = await cluster.add_router()
    await _traffic_until(workers, lambda: all(w.shim.probe.confirmed >= 1 for w in workers), "both probes confirmed")
    for _ in range(20):  # traffic well past the verdict's wait: still nothing
        for w in workers:
            await complete(w.sim.url, [random.randrange(1, 4000) for _ in range(2 * BLOCK + 3)])
        await asyncio.sleep(0.1)
    for w in workers:
        assert w.shim.events.ok, w.shim.events.why
        assert w.shim.canonical_hashes()  # published as ever
    await until(lambda: all(_excluded(router, w) is None for w in workers), what="both workers routable")


async def test_a_probe_the_engine_refuses_gives_no_verdict(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    workers = await _pair(cluster, swapped=True)
    calls = 0

    async def refused(token_ids: list[int], request_id: str) -> int | None:
        nonlocal calls
        calls += 1
        raise EngineError(400, "engine_rejected", "Token id 999 is out of vocabulary")

    for w in workers:
        monkeypatch.setattr(w.shim.probe, "serve", refused)
    with caplog.at_level(logging.INFO, logger="worker_shim"):
        await _start(workers)
        for _ in range(30):
            for w in workers:
                await complete(w.sim.url, [random.randrange(1, 4000) for _ in range(2 * BLOCK + 3)])
            await asyncio.sleep(0.1)
    for w in workers:
        assert EventProblem.OTHER_ENGINE not in w.shim.events.problems
    assert calls == 2  # a refusal ends the tries on that connection
    assert sum(1 for r in caplog.records if r.levelno == logging.WARNING and "not checked" in r.getMessage()) == 2


async def test_a_probe_is_one_whole_request_on_the_engine_and_counted(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The probe's block shows on the stream before the engine answers (it publishes a step's
    events first): the confirmation must not abort the request, which the engine would count and
    log as an abort. Its work is what the shim counts and /metrics says."""
    workers = await _pair(cluster, swapped=False)
    await _start(workers)
    for w in workers:
        await probe_settled(w.shim)
        probe, stats = w.shim.probe, w.sim.engine.stats
        assert (probe.sent, probe.confirmed) == (1, 1)
        assert w.sim.faults.requests_seen == probe.sent and stats.finished == {"length": probe.sent}
        assert (stats.prompt_tokens, probe.prompt_tokens) == (BLOCK + 1, BLOCK + 1)
        assert stats.generation_tokens == probe.output_tokens == 1
        async with http.get(w.shim.http.url + "/metrics") as r:
            text = await r.text()
        assert "kvswitch_shim_endpoint_probes_total 1.0" in text
        assert "kvswitch_shim_endpoint_probes_confirmed_total 1.0" in text


async def test_no_endpoint_probe_sends_the_engine_nothing_and_judges_nothing(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """--no-endpoint-probe: the swapped pair goes undetected, as it did before the probe, and the
    engines serve their clients' requests only."""
    workers = await _pair(cluster, swapped=True, no_endpoint_probe=True)
    with caplog.at_level(logging.INFO, logger="worker_shim"):
        await _start(workers)
        sent = 0
        for _ in range(20):  # traffic well past a verdict's wait
            for w in workers:
                await complete(w.sim.url, [random.randrange(1, 4000) for _ in range(2 * BLOCK + 3)])
                sent += 1
            await asyncio.sleep(0.1)
    for w in workers:
        assert w.shim.events.ok and EventProblem.OTHER_ENGINE not in w.shim.events.problems
        assert (w.shim.probe.sent, w.shim.probe.settled) == (0, True)
        assert w.sim.faults.requests_seen == sent // 2  # the clients' requests, no probe
    said = [r for r in caplog.records if "--no-endpoint-probe" in r.getMessage()]
    assert len(said) == 2 and all(r.levelno == logging.INFO for r in said)  # once per shim


async def test_a_reset_while_the_engine_serves_a_probe_does_not_abort_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reset voids the pending probe and sends another; the first one's request still runs to
    its end on the engine (an abort would be a request the engine counts and logs as one no
    client made, and would leave the engine's counters short of the probes' known work)."""
    w = (await _pair(cluster, swapped=False))[0]
    resets: list[bool] = []
    seen = w.shim.probe.batch

    def batch(b: EngineBatch) -> None:
        resets.append(b.reset)
        seen(b)

    monkeypatch.setattr(w.shim.probe, "batch", batch)
    w.sim.faults.hang = True  # the engine takes the probe and steps no more: it stays in flight
    await w.shim.start()
    await until(lambda: w.sim.faults.requests_seen == 1, what="the probe on the engine")
    before = resets.count(True)
    w.shim.adapter.request_rebuild()  # a reset of the stream
    await until(lambda: resets.count(True) > before, what="the reset delivered")
    w.sim.faults.hang = False
    await probe_settled(w.shim)
    assert (w.shim.probe.sent, w.shim.probe.confirmed) == (2, 1)
    assert w.sim.engine.stats.finished == {"length": 2} and w.sim.faults.requests_seen == 2
    assert w.sim.engine.stats.prompt_tokens == w.shim.probe.prompt_tokens
