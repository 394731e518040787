"""A frozen NATS node on real servers: a 3-node NATS cluster, simulated engines with their shims and
a router, every one given every node's URL. The node holding the router's connection is stopped
(SIGSTOP: its TCP connections stay open, as behind a partition that drops packets): the router, and
the shims on that node, must leave it for the healthy nodes within a few PING intervals and serve
again, saying which node they left. With nats-py's defaults (a PING every 120 s, 2 unanswered) every
request failed until the node was continued, 4-6 minutes if it never was.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest

from kvswitch.client import CompletionClient
from kvswitch.cluster import ClusterSpec, LocalCluster
from protocol.config import PING_INTERVAL_S, PINGS_UNANSWERED
from tests.runtime.frozen import frozen

NS = "frozen"
WORKERS = 3
PING_S = PING_INTERVAL_S[0]  # the shortest allowed, 2 s
# Noticed PINGS_UNANSWERED+1 intervals after the freeze at most, a connect try that may pick the
# frozen node again (2 s), each worker's next load report, and slack for a loaded machine: 30 s, far
# below the 240 s the old defaults needed at best (their first PING goes 120 s in).
SERVING_WITHIN_S = (PINGS_UNANSWERED + 1) * PING_S + 2.0 + 20.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    ping = ["--nats-ping-interval-s", str(PING_S)]
    spec = ClusterSpec(
        namespace=NS, agg=WORKERS, routers=1, speedup=10.0, nats_nodes=3, router_args=ping, shim_args=ping
    )
    c = LocalCluster(spec)
    try:
        c.start()
        c.wait_ready(timeout=90)
        yield c
    finally:
        c.stop()


def _connection_names(monitor_port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz", timeout=2) as resp:
        return [str(c.get("name", "")) for c in json.loads(resp.read())["connections"]]


def _ready(url: str) -> tuple[int, int, str]:
    """/ready's status, the workers it counts (0 when it says none) and its problems."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
        return exc.code, 0, str(body.get("problems"))
    return resp.status, int(body["workers"]), str(body.get("problems"))


def _until_ready(url: str, deadline: float) -> tuple[int, int, str]:
    """/ready polled until it is 200 with every worker, or `deadline`: each of the router's NATS
    connections (requests, KV events, load reports) pings on its own timer, so one held by the
    frozen node may leave it a few pings after the one that carries requests."""
    while (answer := _ready(url))[:2] != (200, WORKERS) and time.monotonic() < deadline:
        time.sleep(0.25)
    return answer


async def _until_serving(url: str, deadline: float) -> tuple[float | None, list[str]]:
    """Completions one after another until 5 in a row succeed (the time the first of them came
    back) or `deadline`; the failures seen."""
    failures: list[str] = []
    async with aiohttp.ClientSession() as session:
        client = CompletionClient(session, "sim-llama", timeout_s=5.0)
        streak_from: float | None = None
        streak, i = 0, 0
        while time.monotonic() < deadline:
            result = await client.complete(url, [700 + (i * 31 + k) % 30000 for k in range(48)], 8, request_id=f"f-{i}")
            i += 1
            if result.ok:
                streak_from = time.monotonic() if streak == 0 else streak_from
                streak += 1
                if streak == 5:
                    return streak_from, failures
            else:
                failures.append(result.error or str(result.status))
                streak = 0
                await asyncio.sleep(0.25)
    return None, failures


def test_the_router_leaves_a_frozen_nats_node_and_serves_again(cluster: LocalCluster) -> None:
    assert cluster.nats is not None
    url = cluster.router_urls[0]
    router = f"kvswitch-router-{NS}"  # the main connection: requests, replies and load reports
    holding = [n for n in cluster.nats.nodes if router in _connection_names(n.monitor_port)]
    assert len(holding) == 1, [_connection_names(n.monitor_port) for n in cluster.nats.nodes]
    victim = holding[0]
    assert victim.pid is not None
    assert asyncio.run(_until_serving(url, time.monotonic() + 30))[0] is not None, "not serving before the freeze"

    with frozen(victim.pid):
        stopped = time.monotonic()
        serving_from, failures = asyncio.run(_until_serving(url, stopped + SERVING_WITHIN_S))
        assert serving_from is not None, f"still failing {SERVING_WITHIN_S:.0f} s into the freeze: {failures[-3:]}"
        assert failures, "no request failed: the freeze did not reach the router"
        status, workers, problems = _until_ready(url, stopped + SERVING_WITHIN_S + (PINGS_UNANSWERED + 1) * PING_S)
        assert (status, workers) == (200, WORKERS), problems
        others = [n for n in cluster.nats.nodes if n is not victim]
        assert any(router in _connection_names(n.monitor_port) for n in others)
    router_log = next(c.log for c in cluster.children if c.name == "router-0").read_text()
    assert f"NATS connection {router}: {victim.url} answered none of its last {PINGS_UNANSWERED} PINGs" in router_log
    assert f"NATS connection {router}: moved from {victim.url}, which answered no PING, to nats://" in router_log
    print(f"serving again {serving_from - stopped:.1f} s into the freeze after {len(failures)} failed requests")
