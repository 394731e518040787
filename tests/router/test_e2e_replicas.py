"""Several router replicas: a late one reaches the same index; together they spread load."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp

from tests.router.conftest import Cluster, complete
from tests.router.polling import until


async def test_a_replica_started_late_serves_with_an_identical_index(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    first = await cluster.agg_router(2, disagg="never")
    await asyncio.gather(*(complete(http, first, list(range(i, i + 400))) for i in range(0, 4000, 400)))
    await until(lambda: len(first.index) >= 10 * 25, what="the first replica to index every prompt")
    late = await cluster.add_ready_router(disagg="never")
    await until(lambda: late.index.dump() == first.index.dump(), what="identical indexes")
    assert len(late.index) >= 250
    status, _, headers = await complete(http, late, [*list(range(400, 800)), 1, 2, 3])
    assert status == 200
    # the prompt's prefix lives where the first replica sent it; the late one knows that too
    assert (
        first.index.find_matches(late.planner.context("x", "sim-llama", list(range(400, 800))).hashes)[
            headers["x-kvswitch-decode-worker"]
        ]
        == 25
    )


async def test_two_replicas_under_a_shared_prefix_keep_worker_load_balanced(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    for _ in range(3):
        await cluster.add_worker("agg")
    routers = [await cluster.add_router(disagg="never", temperature=0.1) for _ in range(2)]
    for r in routers:
        await cluster.ready(r)
    shared = list(range(10_000, 10_512))  # 32 blocks every request starts with
    requests = [
        complete(http, routers[i % 2], shared + list(range(20_000 + 64 * i, 20_064 + 64 * i)), max_tokens=40)
        for i in range(60)
    ]
    # All 60 in flight at once, however a loaded box spreads their arrival: the engines hold them
    # until every one is routed. Else the first ones finish (speedup 200) before the last arrive,
    # the fleet is idle again, and the late ones rightly go to the prefix's holders alone.
    seen = sum(w.sim.faults.requests_seen for w in cluster.workers)
    for w in cluster.workers:
        w.sim.faults.hang = True
    sent = asyncio.gather(*requests)
    await until(lambda: sum(w.sim.faults.requests_seen for w in cluster.workers) == seen + 60, what="all 60 routed")
    for w in cluster.workers:
        w.sim.faults.hang = False
    results = await sent
    assert all(status == 200 for status, _, _ in results)
    per_worker = Counter(h["x-kvswitch-decode-worker"] for _, _, h in results)
    counts = [per_worker.get(w.id, 0) for w in cluster.workers]
    ratio = max(counts) / max(min(counts), 1)
    print(f"requests per worker {counts}, max/min ratio {ratio:.2f}")
    assert min(counts) > 0 and ratio <= 3.0, counts
