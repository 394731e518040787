"""End to end: the shim forwards the engine's step and latency counters, and the router fits the
worker's real speed against its timing profile from them (router.calibration)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.router.conftest import Cluster, complete
from tests.router.polling import until


async def test_a_router_learns_that_a_worker_runs_slower_than_its_profile(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # The engine takes twice the profile's time for every step: the profile is wrong by 2x.
    worker = await cluster.add_worker("agg", speedup=0.5)
    router = await cluster.add_ready_router(disagg="never")
    uncalibrated = await cluster.add_router(config={"calibrate": False}, disagg="never")
    await cluster.ready(uncalibrated)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(300)] for i in range(6)]
    replies = await asyncio.gather(
        *(complete(http, router, p, max_tokens=600, ignore_eos=True, temperature=0.0) for p in prompts)
    )
    assert [status for status, _, _ in replies] == [200] * 6
    await until(lambda: router.calibration is not None and router.calibration.warm_s(worker.id) > 4.0)
    assert router.calibration is not None
    k_decode, _, busy_s = router.calibration.factors()[worker.id]
    assert 1.7 <= k_decode <= 2.6, (k_decode, busy_s)  # ~1.85 here: the prior still pulls (docs)
    async with http.get(router.url + "/metrics") as resp:
        text = await resp.text()
    assert f'kvswitch_router_timing_scale{{part="decode",worker="{worker.id}"}}' in text
    assert uncalibrated.calibration is None  # --no-calibration: the profiles as registered
