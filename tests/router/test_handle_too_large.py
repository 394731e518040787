"""A remote prefill whose decode leg NATS could not carry with its transfer handle (vLLM's names a
block id per prompt block) takes the bypass path before its prefill leg goes out; a handle larger
than its bound falls back to the bypass path after the prefill. Before, the router ran the whole
remote prefill and answered 413 "send a shorter prompt" for a prompt the bypass path serves, the
prefill engine's blocks left pinned. Against a real nats-server whose max_payload is 64 KiB."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import GenerateRequest, TransferHandle
from protocol.messages import ANNOTATION_BYPASS, HANDLE_FIELDS_BYTES, transfer_handle_bound
from router.disagg import RoutePlan
from router.dispatch import Dispatcher, Job
from router.policies import Outcome, Path
from tests.router.builders import cand, ctx, worker
from tests.router.conftest import Cluster, complete
from tests.router.test_dispatch import Behaviour, Books, Worker, answer, chunk
from tests.small_nats import SmallNats

SMALL = 64 << 10
PROMPT = [300 + i % 5000 for i in range(21_000)]  # ~63 KB of ids: the prefill leg fits, with a handle it does not


@pytest.fixture(scope="module")
def small_server() -> Iterator[str]:
    with SmallNats(SMALL) as server:
        yield server.url


@pytest.fixture
def nats_url(small_server: str) -> str:
    """Every connection of these tests (the cluster's too) on the small server."""
    return small_server


@pytest.fixture
async def small_nc(nats_url: str) -> AsyncIterator[Client]:
    nc = await nats.connect(nats_url)
    assert nc.max_payload == SMALL
    yield nc
    await nc.close()


def remote_job(tokens: list[int]) -> Job:
    c = ctx(len(tokens), [cand("d1")], [cand("p1", "prefill", kv_total_blocks=2048)])
    plan = RoutePlan(
        c, c.decode_pool[0], c.prefill_pool[0], Path.REMOTE, Outcome.REMOTE_PREFILL, "", c.decode_pool,
        c.prefill_pool, key="r1#1",
    )  # fmt: skip
    req = GenerateRequest(request_id="r1", model="m", token_ids=tokens)
    return Job(request=req, plan=plan, replan=lambda ex: None, deadline=time.monotonic() + 30, path=Path.REMOTE)


def handing_over(params: dict[str, object]) -> Behaviour:
    async def run(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        handle = TransferHandle(engine="vllm", params=params, prefill_worker="p1")
        await chunk(nc, msg, req, 0, final=True, finish_reason="length", transfer=handle)

    return run


Served = tuple[Dispatcher, Books, Worker, Worker]


async def served(small_nc: Client, ns: str, j: Job, handle: dict[str, object]) -> Served:
    """`j` run to its end with p1 handing over `handle` and d1 answering: the dispatcher, its
    bookings and the two workers (what each was asked)."""
    books = Books()
    d = Dispatcher(small_nc, ns, books)
    await d.start()
    p, w = Worker(small_nc, ns, "p1"), Worker(small_nc, ns, "d1")
    await p.serve("prefill", handing_over(handle))
    await w.serve("decode", answer)
    try:
        out = [c async for c in d.run(j)]
    finally:
        await d.stop()
    assert [t for c in out for t in c.token_ids] == [5, 6]
    return d, books, p, w


async def test_a_decode_leg_its_handle_would_take_past_the_limit_is_prefilled_locally_before_any_prefill_leg(
    small_nc: Client, ns: str
) -> None:
    j = remote_job(PROMPT)
    d, books, p, w = await served(small_nc, ns, j, {"remote_block_ids": list(range(len(PROMPT) // 16))})
    assert p.requests == [], "no prefill leg: its blocks would have been pinned for a decode leg NATS cannot carry"
    assert len(w.requests) == 1 and w.requests[0].disagg is None and ANNOTATION_BYPASS in w.requests[0].annotations
    assert (j.path, j.outcome, j.fallback) == (Path.BYPASS, Outcome.FALLBACK_HANDLE_TOO_LARGE, True)
    assert ("rebook_bypass", "r1#1") in books.log and (d.handle_fallbacks, d.fallbacks) == (1, 0)


async def test_a_prompt_whose_decode_leg_fits_with_its_handle_still_prefills_remotely(
    small_nc: Client, ns: str
) -> None:
    tokens = PROMPT[:15_000]
    j = remote_job(tokens)
    d, _, p, w = await served(small_nc, ns, j, {"remote_block_ids": list(range(len(tokens) // 16))})
    assert len(p.requests) == 1 and w.requests[0].disagg is not None
    assert (j.path, j.outcome, d.handle_fallbacks) == (Path.REMOTE, Outcome.REMOTE_PREFILL, 0)


async def test_a_handle_larger_than_its_bound_falls_back_to_a_local_prefill_not_a_413(
    small_nc: Client, ns: str
) -> None:
    tokens = PROMPT[:15_000]
    j = remote_job(tokens)
    # Ids of several KV cache groups (a hybrid model), past what the bound counts
    d, books, p, w = await served(small_nc, ns, j, {"remote_block_ids": [list(range(300, 4300))] * 2})
    assert len(p.requests) == 1, "the prefill leg went: its handle was not known to be this large"
    assert len(w.requests) == 1 and w.requests[0].disagg is None and ANNOTATION_BYPASS in w.requests[0].annotations
    assert (j.path, j.outcome, j.transfer) == (Path.BYPASS, Outcome.FALLBACK_HANDLE_TOO_LARGE, None)
    assert ("rebook_bypass", "r1#1") in books.log and d.handle_fallbacks == 1


def test_the_bound_keeps_room_for_a_vllm_handles_ids_and_its_other_fields() -> None:
    info = worker("p1", "prefill", kv_total_blocks=2048)
    assert transfer_handle_bound(info, 16_000) == HANDLE_FIELDS_BYTES + len("p1") + len("vllm") + 5 + 1000 * 3
    assert transfer_handle_bound(info, 16_001, kv_blocks=100) == HANDLE_FIELDS_BYTES + 2 + 4 + 5 + 1001 * 1
    unknown = worker("p1", "prefill", kv_total_blocks=None)  # any 32-bit id
    assert transfer_handle_bound(unknown, 16) == HANDLE_FIELDS_BYTES + 2 + 4 + 5 + 5


async def test_a_prompt_the_bypass_leg_carries_is_served_with_no_prefill_run(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The audit's case, scaled to a 64 KiB max_payload: disagg always, a prompt that fits the
    prefill leg but not the decode leg with its handle."""
    p = await cluster.add_worker("prefill", num_gpu_blocks=2048)
    d = await cluster.add_worker("decode", num_gpu_blocks=2048)
    router = await cluster.add_ready_router(disagg="always")
    status, out, headers = await complete(http, router, PROMPT, max_tokens=2)
    assert status == 200, out
    assert (headers["x-kvswitch-prefill"], out["kvswitch"]["outcome"]) == ("bypass", "fallback_handle_too_large")
    # No prefill ran (the shims' endpoint probes aside: conftest.add_worker), no blocks pinned.
    assert p.sim.engine.prefill_tokens_computed == p.shim.probe.prompt_tokens and not p.sim.engine.pins
    assert d.sim.engine.prefill_tokens_computed == len(PROMPT) + d.shim.probe.prompt_tokens
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    assert 'kvswitch_router_fallbacks_total{cause="handle_too_large"} 1.0' in text
    assert 'kvswitch_router_decisions_total{outcome="fallback_handle_too_large"} 1.0' in text
