"""A remote request's booking on its decode worker, end to end (real NATS, etcd, shims and engine_sim
at real speed): its blocks count there until that worker's engine has them, as on the bypass path.
Until 2026-12-05 they stopped counting at the decode worker's first load report after the *prefill*
leg ended, so a request waiting there for KV room dropped out of the router's view of that worker,
and the decode guard let bypasses onto it (bookings audit, D1).

The decode sim has 256 blocks. A (a 2048-token prompt: 128 blocks) decodes on it; B, another
2048-token prompt, does not fit beside it (129 + 128 > 256), so d's engine keeps B waiting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.service import RouterService
from tests.router.conftest import BLOCK, MODEL, Cluster, Worker
from tests.router.polling import until

PROMPT = 2048
BLOCKS = PROMPT // BLOCK
A_PROMPT = list(range(1, PROMPT + 1))
B_PROMPT = list(range(5001, 5001 + PROMPT))

Requests = list[asyncio.Task[int]]


@pytest.fixture
async def requests(cluster: Cluster, http: aiohttp.ClientSession) -> AsyncIterator[Requests]:
    """The test's requests, cancelled (their clients gone) before the cluster stops."""
    tasks: Requests = []
    yield tasks
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _fleet(cluster: Cluster, **overrides: Any) -> tuple[RouterService, Worker]:
    await cluster.add_worker("prefill", speedup=1.0)
    d = await cluster.add_worker("decode", speedup=1.0, num_gpu_blocks=256)
    return await cluster.add_ready_router(**overrides), d


def _post(
    requests: Requests, http: aiohttp.ClientSession, router: RouterService, prompt: list[int], stream: bool
) -> asyncio.Task[int]:
    """A request of 1500 output tokens (222 blocks with its prompt): it outlasts every check."""

    async def post() -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "stream": stream}
        async with http.post(router.url + "/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status

    requests.append(asyncio.create_task(post()))
    return requests[-1]


def _uncovered(router: RouterService, d: Worker) -> int:
    """d's blocks the router counts beyond d's own report: bookings no report covers yet."""
    load = router.view.load(d.id)
    return load.active_blocks - load.kv_used_blocks


async def _a_decoding(
    requests: Requests, http: aiohttp.ClientSession, router: RouterService, d: Worker, stream: bool
) -> None:
    """A decoding on d, its booking there handed over to d's reports: counted once. A whole
    answer's remote decode leg hands over at the shim's `prefilled` chunk, a stream at its first
    token; without them A's blocks would count twice until it ends."""
    a = _post(requests, http, router, A_PROMPT, stream)
    await until(
        lambda: a.done() or (d.sim.engine.num_blocks_in_use > BLOCKS and _uncovered(router, d) == 0),
        what="A decoding on d, counted once",
    )
    assert not a.done(), f"A ended ({a.result()}) while its blocks still counted twice on d"


@pytest.mark.parametrize(("disagg", "stream"), [("always", False), ("always", True), ("never", False)])
async def test_a_request_waiting_on_its_decode_worker_stays_counted_there(
    cluster: Cluster, http: aiohttp.ClientSession, requests: Requests, disagg: str, stream: bool
) -> None:
    router, d = await _fleet(cluster, disagg=disagg)
    await _a_decoding(requests, http, router, d, stream)
    _post(requests, http, router, B_PROMPT, stream)
    seen: list[tuple[int, int, int]] = []

    def b_waiting_and_reported() -> bool:
        load = router.view.load(d.id)
        if not (d.sim.engine.waiting and load.waiting):
            return False
        # B waits in d's engine and d's report says so: a report made after B's decode leg was sent
        seen.append((load.active_blocks, load.kv_used_blocks, d.sim.engine.num_blocks_in_use))
        return True

    await until(b_waiting_and_reported, what="B waiting on d, in d's load report")
    active, reported, held = seen[-1]
    assert active - reported >= BLOCKS, f"d counts {active} blocks ({reported} reported) for {held} held + B's {BLOCKS}"


async def test_the_decode_guard_sees_a_remote_request_waiting_on_its_worker(
    cluster: Cluster, http: aiohttp.ClientSession, requests: Requests
) -> None:
    """C shares 160 tokens with A, which d holds, so isl_bounding would bypass it onto d; the
    guard (decode_busy_threshold 0.9) must veto that while B waits there for KV room. The guard
    counts all of C's 13 blocks (A's 129 or so + 13 < 0.9 x 256; with B's 128, over)."""
    router, d = await _fleet(cluster, disagg="conditional", conditional_disagg=True, decode_busy_threshold=0.9)
    c_prompt = A_PROMPT[:160] + list(range(9001, 9041))
    await _a_decoding(requests, http, router, d, False)
    assert router.path.explain(MODEL, c_prompt, text=False)["path"] == "bypass"  # d has room beside A alone
    _post(requests, http, router, B_PROMPT, False)
    await until(
        lambda: bool(d.sim.engine.waiting) and router.view.load(d.id).waiting >= 1,
        what="B waiting on d, in d's load report",
    )
    plan = router.path.explain(MODEL, c_prompt, text=False)
    assert d.sim.engine.waiting, "B still waits on d"
    assert (plan["path"], plan["outcome"]) == ("remote", "vetoed_decode_busy"), plan["reason"]


async def test_a_whole_answer_on_a_decode_engine_without_prefix_caching_counts_once(
    cluster: Cluster, http: aiohttp.ClientSession, requests: Requests
) -> None:
    """Such an engine announces no blocks, so no `prefilled` comes for a whole answer: the end of
    the prefill leg ends d's booking too, and d's reports take over (review of the fix above: it
    counted the request's blocks twice on d, booked and reported, until the answer ended)."""
    await cluster.add_worker("prefill", speedup=1.0)
    d = await cluster.add_worker("decode", speedup=1.0, num_gpu_blocks=1024, enable_prefix_caching=False)
    router = await cluster.add_ready_router(disagg="always")
    a = _post(requests, http, router, A_PROMPT, stream=False)
    await until(lambda: router.view.load(d.id).kv_used_blocks >= BLOCKS, what="d's report holding A")
    await until(lambda: router.view.load(d.id).active_blocks < 2 * BLOCKS, what="A's booking handed over")
    load = router.view.load(d.id)
    assert not a.done() and load.active_blocks - load.kv_used_blocks < BLOCKS, load
