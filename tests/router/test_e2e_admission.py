"""End to end through real NATS, etcd, shims and simulated engines: admission keeps one model's
overload, and one client's absurd request, from costing other requests their room."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.router.conftest import Cluster, busy_decode_fleet, complete
from tests.router.polling import until


async def test_one_request_with_an_absurd_max_tokens_leaves_the_decode_worker_its_room(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # slo_aware at its default SLOs: a decode worker running one request has room for more. One
    # request asking 2**63-1 tokens (the engine refuses it) counts as no longer than the model's
    # context in the policy's mean lengths, so the next normal request is still served beside the
    # running one, not held at admission until it ends.
    await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode", speedup=1.0)
    router = await cluster.add_ready_router(conditional_disagg=True, conditional_disagg_policy="slo_aware")
    first = asyncio.create_task(complete(http, router, list(range(64)), max_tokens=400, ignore_eos=True))
    await until(lambda: router.view.load(d.id).running >= 1, what="the first request running on d")
    status, body, _ = await complete(http, router, list(range(200, 264)), max_tokens=2**63 - 1)
    assert status == 400 and "cannot be greater than max_model_len" in body["error"]["message"], body
    status, body, headers = await complete(http, router, list(range(300, 364)))
    assert status == 200, body
    assert headers["x-kvswitch-decode-worker"] == d.id and not first.done()
    status, body, _ = await first
    assert status == 200 and body["usage"]["completion_tokens"] == 400


async def test_a_model_with_room_is_served_while_another_models_request_waits(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # Model A's decode worker has no room for a second request (busy_decode_fleet), which waits at
    # admission until the first ends; a request for model B, whose agg worker idles, is served at
    # once beside it.
    b = await cluster.add_worker("agg", model="sim-b")
    router, _, first = await busy_decode_fleet(cluster, http)
    waiting = asyncio.create_task(complete(http, router, list(range(1000, 1064))))
    await until(lambda: router.path.admission.depth == 1, what="model A's second request waiting at admission")
    status, body, headers = await complete(http, router, list(range(6000, 6064)), model="sim-b")
    assert status == 200, body
    assert headers["x-kvswitch-decode-worker"] == b.id
    assert not first.done() and not waiting.done() and router.path.admission.depth == 1
    for task in (first, waiting):
        status, body, _ = await task
        assert status == 200, body
