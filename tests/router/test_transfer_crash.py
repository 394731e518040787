"""A decode engine that crashes with transfer-fed legs queued fails them as `engine_unavailable`:
its failed-pull counter never counts those, so they must not hide the silent pull failures
(`kv_load_failure_policy: recompute`) that come after its restart (real nats, etcd, sims)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.router.conftest import Cluster, complete
from tests.router.polling import until


async def test_a_decode_engine_crash_hides_no_later_silent_pull_failure(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    p_ok = await cluster.add_worker("prefill")
    d = await cluster.add_worker(
        "decode", speedup=1.0, max_num_seqs=1, kv_load_failure_policy="recompute", restart_after_crash_s=0.5
    )
    router = await cluster.add_ready_router(disagg="always", prefill_timeout_s=20.0)
    await until(lambda: router.view.liveness(d.id) is not None, what="load report")
    long = asyncio.create_task(complete(http, router, list(range(64)), max_tokens=3000, ignore_eos=True))
    await until(lambda: len(d.sim.engine.running) == 1, what="the long request running on d")
    queued = [
        asyncio.create_task(complete(http, router, list(range(1000 * k, 1000 * k + 200)), max_tokens=2))
        for k in (1, 2, 3)
    ]
    await until(lambda: len(d.sim.engine.waiting) == 3, what="3 transfer-fed legs queued on d")
    await d.sim.crash("test")  # the decode engine dies, and comes back 0.5 s later
    await asyncio.gather(long, *queued)
    await until(lambda: d.sim.status.name == "RUNNING" and d.shim.worker_id is not None, what="d back", timeout=30)
    await until(
        lambda: router.registry.get(d.id) is not None and router.view.liveness(d.id) is not None,
        what="the router sees d again",
        timeout=30,
    )
    # From now on the only prefill worker frees its KV at once: every pull into d fails, silently.
    await p_ok.shim.stop()
    bad = await cluster.add_worker("prefill", kv_lease_duration=1e-6)
    await until(
        lambda: router.path.explain("sim-llama", list(range(5000, 5400)), text=False)["prefill_worker"] == bad.id,
        what="the bad prefill worker routable",
    )
    status, body, _ = await complete(http, router, list(range(6000, 6400)), max_tokens=2)
    assert (status, body["kvswitch"]["outcome"]) == (200, "remote_prefill")
    assert d.sim.engine.stats.failed_transfers == 1
    await until(lambda: d.shim.transfers.total >= 1, what="the shim counting the silent failure")
    await until(lambda: router.planner.disagg.transfers.failing(d.id, bad.id), what="the router closing that path")
