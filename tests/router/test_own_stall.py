"""A stall of the router's own loop (a paused VM, a long GC, a debugger) is said as its own and
leaves its workers routable: until 2026-12-07 a router paused 6 s woke to every worker `silent` (a
stall over twice the silence limit, read before the reports waiting in its socket), the fleet
check saying the model's every request was refused, and no line said the router had stalled."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from tests.router.conftest import Cluster, complete
from tests.router.polling import until


async def test_a_router_woken_from_a_stall_routes_to_its_workers_and_says_it_stalled(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router()
    [worker] = [st["worker"] for st in router.worker_listing()["worker_status"]]
    await until(lambda: router.view.liveness(worker) is not None, what="its first load report")
    caplog.set_level(logging.INFO)
    time.sleep(3.5)  # past twice the 1.5 s silence limit (0.5 s reports); nothing read meanwhile
    listing = router.worker_listing()["worker_status"]  # as a request planned on waking reads it
    assert all(st["routable"] for st in listing), listing
    status, _, _ = await complete(http, router, list(range(64)), max_tokens=2)
    assert status == 200
    await asyncio.sleep(0.2)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(line.startswith("this router's event loop was stalled 3.") for line in said), said
    assert not any("can take requests" in line or "no answer from etcd" in line for line in said), said


async def test_a_router_busy_on_waking_from_a_stall_still_routes_to_its_workers(cluster: Cluster) -> None:
    """The watch ticks as the loop wakes, then planning the queued requests holds it 0.2 s before it
    reads its workers' reports: that work became the "latest" stall and the pause an older one,
    credited one silence limit at most, so the worker read silent again (review of c244125)."""
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router()
    [worker] = [st["worker"] for st in router.worker_listing()["worker_status"]]
    await until(lambda: router.view.liveness(worker) is not None, what="its first load report")
    time.sleep(3.5)
    stalls = router.loop_watch.stalls
    for _ in range(1000):  # loop turns until the watch ticks; the reports are still unread
        if router.loop_watch.stalls != stalls:
            break
        await asyncio.sleep(0)
    assert router.loop_watch.stalls == stalls + 1
    time.sleep(0.2)  # a burst of work on waking
    listing = router.worker_listing()["worker_status"]
    assert all(st["routable"] for st in listing), listing
