"""A request in flight while the router's own NATS connection is down fails as that, with no
worker blamed (a nats-server of the test's own, killed under a stream; outage audit of 2026-12-06).

Before, each leg in flight ended as `worker_silent`, its worker was left out as unreachable, and
the request was retried or fell back across the fleet into the same dead connection, to end in
"no worker could serve the request"."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from kvswitch.servers import NatsServer
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until


@pytest.fixture
def own_nats() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


@pytest.fixture
def nats_url(own_nats: NatsServer) -> str:  # the cluster's, this test's own server
    return own_nats.url


async def test_a_stream_in_flight_through_the_routers_nats_outage_fails_as_that_blaming_no_worker(
    cluster: Cluster, http: aiohttp.ClientSession, own_nats: NatsServer
) -> None:
    worker = await cluster.add_worker("agg", speedup=2.0)
    router = await cluster.add_router(disagg="never", stream_heartbeat_s=0.2)
    await cluster.ready(router)
    body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 4000, "stream": True}
    events: list[str] = []
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            events.append(text.removeprefix("data: "))
            if len(events) == 3:
                own_nats.kill()
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert errors and errors[0]["code"] == 503, events[-3:]
    assert errors[0]["message"] == (
        "the router has lost its NATS connection and is reconnecting: no worker can be reached"
    )
    assert router.dispatcher.retries == 0
    (status,) = [s for s in router.readiness()[1]["worker_status"] if s["worker"] == worker.id]
    assert status["excluded"] is None, status  # not left out as unreachable
    own_nats.launch()
    await asyncio.to_thread(own_nats.wait_healthy)
    await until(lambda: router.readiness()[0], what="the router ready again")
