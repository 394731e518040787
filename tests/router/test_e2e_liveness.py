"""Liveness in seconds, with real processes: `kill -9` of a shim ends its streams, its in-flight
remote prefills fall back, and new requests avoid it, each within 1.5 s (DESIGN amendments)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from kvswitch.cluster import ClusterSpec, LocalCluster

MODEL = "sim-llama"
LIMIT_S = 1.5


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    prefill, decode = request.param
    c = LocalCluster(
        ClusterSpec(
            prefill=prefill,
            decode=decode,
            routers=1,
            speedup=2.0,
            router_args=["--disagg", "always"] if prefill else ["--disagg", "never"],
        )
    )
    try:
        c.start()
        c.wait_ready(timeout=90)
        yield c
    finally:
        c.stop()


def _shim_of(cluster: LocalCluster, engine_url: str) -> int:
    port = engine_url.rsplit(":", 1)[-1]
    return next(c.proc.pid for c in cluster.children if c.name.startswith("shim-") and c.name.endswith(port))


async def _engine_of(http: aiohttp.ClientSession, router: str, worker: str) -> str:
    async with http.get(router + "/debug/index") as r:
        return str((await r.json())[worker]["engine_url"])


# Its bound is wall time: 3 heartbeats (1.2 s) leave 0.3 s of LIMIT_S to the processes' own
# scheduling, which a loaded box overran (the stream ended at 1.88 s): run serially.
@pytest.mark.timing
@pytest.mark.parametrize("cluster", [(0, 2)], indirect=True)
async def test_kill_9_of_a_shim_ends_its_stream_and_new_requests_avoid_it(cluster: LocalCluster) -> None:
    router = cluster.router_urls[0]
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": list(range(1, 200)), "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with http.post(router + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            victim = resp.headers["x-kvswitch-decode-worker"]
            await resp.content.readline()  # the first event: tokens are flowing
            os.kill(_shim_of(cluster, await _engine_of(http, router, victim)), signal.SIGKILL)
            killed = time.monotonic()
            tail = (await resp.read()).decode()
            ended = time.monotonic() - killed
        assert '"error"' in tail and tail.rstrip().endswith("data: [DONE]")
        assert ended <= LIMIT_S, f"the stream ended {ended:.2f}s after kill -9"
        # From 1.5 s after the kill on, no request goes to the dead worker; none fails meanwhile.
        await asyncio.sleep(max(0.0, killed + LIMIT_S - time.monotonic()))
        statuses, workers = [], set()
        for i in range(10):
            short = {"model": MODEL, "prompt": list(range(1000 + i * 50, 1200 + i * 50)), "max_tokens": 2}
            async with http.post(router + "/v1/completions", json=short) as r:
                statuses.append(r.status)
                workers.add(r.headers.get("x-kvswitch-decode-worker"))
        assert statuses == [200] * 10 and victim not in workers


@pytest.mark.parametrize("cluster", [(1, 1)], indirect=True)
async def test_kill_9_of_a_prefill_shim_falls_back_to_local_prefill_within_the_limit(cluster: LocalCluster) -> None:
    router = cluster.router_urls[0]
    async with aiohttp.ClientSession() as http:
        async with http.get(router + "/debug/index") as r:
            (prefill,) = [s["engine_url"] for s in (await r.json()).values() if s["role"] == "prefill"]
        # A long prompt: its remote prefill takes a while at 2x, long enough to kill under it.
        body = {"model": MODEL, "prompt": [1 + i % 30_000 for i in range(30_000)], "max_tokens": 2}
        request = asyncio.create_task(http.post(router + "/v1/completions", json=body))
        await asyncio.sleep(0.3)
        os.kill(_shim_of(cluster, prefill), signal.SIGKILL)
        killed = time.monotonic()
        resp = await request
        data = await resp.json()
        assert resp.status == 200, data
        assert data["kvswitch"]["outcome"] == "fallback_prefill_failed"
        assert time.monotonic() - killed <= LIMIT_S + 30_000 / 20_000  # detection, then the local prefill itself
