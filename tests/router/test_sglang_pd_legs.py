"""A remote prefill between SGLang workers end to end over a real nats-server: the router's
dispatcher, and on each worker the shim's request service with its SGLang adapter before a fake
SGLang server (tests/worker_shim/fake_sglang.py). What the cluster harness cannot show, as its
engines are simulated vLLMs: the prefill leg's handle comes before its end, and a prefill the
engine refuses takes the bypass path on the decode worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import nats
import pytest
from aiohttp import web

from protocol import GenerateRequest, subjects
from protocol.config import RouterSettings
from router.disagg import RoutePlan
from router.dispatch import Dispatcher, Job
from router.leg import LegError
from router.policies import Outcome, Path
from runtime.nats_flush import flush
from tests.router.builders import cand, ctx
from tests.router.test_dispatch import Books, collect
from tests.worker_shim.cluster import wait_for
from tests.worker_shim.fake_sglang import TOO_LONG, FakeSglang
from worker_shim.adapters.sglang import SglangAdapter
from worker_shim.config import ShimConfig, ShimRole
from worker_shim.request_service import RequestService

HB = 0.1
DEADLINE_S = 5.0


@dataclass
class Worker:
    engine: FakeSglang
    svc: RequestService


@dataclass
class PD:
    router: Dispatcher
    books: Books
    prefill: Worker
    decode: Worker


class SlowAbort(FakeSglang):
    """Answers /abort_request after `delay`: an engine busy when the abort comes."""

    delay = 0.6  # six heartbeats

    async def _abort(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.delay)
        return await super()._abort(request)


async def _worker(
    stack: AsyncExitStack, nats_url: str, ns: str, role: ShimRole, name: str, engine: FakeSglang | None = None
) -> Worker:
    engine = engine or FakeSglang()
    url = await stack.enter_async_context(engine.serving())
    host = "10.0.0.5" if role == "prefill" else None
    config = ShimConfig(
        engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9", role=role, bootstrap_host=host
    )
    adapter = SglangAdapter(config.validate())
    await adapter.open()
    stack.push_async_callback(adapter.close)
    nc = await nats.connect(nats_url)
    stack.push_async_callback(nc.close)
    svc = RequestService(nc, adapter, lambda: None)
    stack.push_async_callback(svc.drain, 0)
    await nc.subscribe(subjects.gen(ns, role, name), cb=svc.on_generate)
    await nc.subscribe(subjects.cancel(ns, name), cb=svc.on_cancel)
    await flush(nc)
    return Worker(engine, svc)


async def _pd(stack: AsyncExitStack, nats_url: str, ns: str, **settings: Any) -> PD:
    """Prefill worker p1, decode worker w1 and a router over them; `settings`: RouterSettings fields
    besides the heartbeat."""
    prefill = await _worker(stack, nats_url, ns, "prefill", "p1")
    decode = await _worker(stack, nats_url, ns, "decode", "w1")
    nc = await nats.connect(nats_url)
    stack.push_async_callback(nc.close)
    books = Books()
    config = RouterSettings(stream_heartbeat_s=HB, **settings)
    router = Dispatcher(nc, ns, books, settings=lambda: config)
    await router.start()
    stack.push_async_callback(router.stop)
    return PD(router, books, prefill, decode)


@pytest.fixture
async def pd(nats_url: str, ns: str) -> AsyncIterator[PD]:
    async with AsyncExitStack() as stack:
        yield await _pd(stack, nats_url, ns)


def _job(tokens: int) -> Job:
    c = ctx(tokens, [cand("w1")], [cand("p1", "prefill")])
    plan = RoutePlan(
        c, c.decode_pool[0], c.prefill_pool[0], Path.REMOTE, Outcome.DECLINED_POLICY, "", c.decode_pool,
        c.prefill_pool, key="r1#1",
    )  # fmt: skip
    req = GenerateRequest(request_id="r1", model="m", token_ids=list(range(tokens)))
    return Job(request=req, plan=plan, replan=lambda _ex: None, deadline=time.monotonic() + DEADLINE_S)


async def test_a_prompt_both_engines_refuse_is_the_clients_400_at_once(pd: PD) -> None:
    """The audit's r2: SGLang refuses the prefill of a prompt past its context. The router hears
    it now (until 2026-12-07 the prefill shim answered the triple and only logged the refusal);
    the decode engine, with the same context, refuses the prompt too, on the leg with the triple
    or on the bypass leg, whichever reaches it first: its refusal is the client's, at once, and
    nothing is left waiting for KV."""
    started = time.monotonic()
    with pytest.raises(LegError) as caught:
        await collect(pd.router, _job(9000))
    err = caught.value
    assert (err.code, err.worker, err.message) == (400, "w1", TOO_LONG)
    assert time.monotonic() - started < DEADLINE_S / 2
    assert not pd.decode.engine.held and pd.decode.engine.got
    await wait_for(lambda: not pd.decode.svc.inflight and not pd.prefill.svc.inflight, 5, what="the legs to end")


async def test_a_prefill_failed_after_the_decode_leg_went_aborts_that_leg_and_takes_the_bypass(pd: PD) -> None:
    """The prefill engine fails once its decode peer has the request (its KV transfer failed).
    Until 2026-12-07 the router never heard it: the decode engine held the request for KV that
    never came, to the request's deadline or SGLang's own timeout. Now the router cancels that
    leg, so the decode engine gets its abort, and sends the bypass leg. What the decode engine
    answers to that leg is the test's: an SGLang decode server has no local prefill (docs/router.md,
    "SGLang workers")."""
    job = _job(100)
    got = asyncio.ensure_future(collect(pd.router, job))
    await wait_for(lambda: "r1" in pd.decode.engine.held and "r1" in pd.prefill.engine.held, 5, what="both legs")
    pd.prefill.engine.answer("r1", 500, {"error": {"message": "KV transfer failed"}})
    await wait_for(lambda: len(pd.decode.engine.got) == 2 and "r1" in pd.decode.engine.held, 5, what="the bypass")
    assert pd.decode.engine.aborted == ["r1"]  # the leg with the triple, aborted in its engine first
    fed, bypass = pd.decode.engine.got
    assert "bootstrap_room" in fed and "bootstrap_room" not in bypass
    pd.decode.engine.answer("r1", tokens=2)
    chunks = await asyncio.wait_for(got, 5)
    assert [t for c in chunks for t in c.token_ids] == [11, 12]
    assert (job.outcome, job.path, pd.router.fallbacks) == (Outcome.FALLBACK_PREFILL_FAILED, Path.BYPASS, 1)


async def test_a_served_remote_prefill_sends_the_decode_leg_while_the_prefill_waits_for_it(pd: PD) -> None:
    """SGLang's prefill ends once its decode peer has the request; the prefill shim's prompt stays
    queued until then."""
    job = _job(100)
    got = asyncio.ensure_future(collect(pd.router, job))
    await wait_for(lambda: "r1" in pd.decode.engine.held and "r1" in pd.prefill.engine.held, 5, what="both legs")
    room = {b["bootstrap_room"] for b in (pd.prefill.engine.got[0], pd.decode.engine.got[0])}
    assert len(room) == 1  # the decode leg carries the prefill's triple
    assert pd.prefill.svc.prefill_tokens_queued == 100
    pd.prefill.engine.answer("r1")  # its KV went
    await wait_for(lambda: pd.prefill.svc.prefill_tokens_queued == 0, 5, what="the prefill's end")
    pd.decode.engine.answer("r1", tokens=3)
    chunks = await asyncio.wait_for(got, 5)
    assert [t for c in chunks for t in c.token_ids] == [11, 12, 13]
    assert (job.outcome, job.path, pd.router.fallbacks) == (Outcome.DECLINED_POLICY, Path.REMOTE, 0)
    assert ("prefill_done", "r1#1", "p1") in pd.books.log


async def test_a_prefill_slower_than_prefill_timeout_after_its_handle_is_served(nats_url: str, ns: str) -> None:
    """The review's r3: an SGLang prefill whose handle came, then took longer than prefill_timeout_s
    (its decode peer slow to take the request). Its time is the pair's, to the request's deadline:
    until 2026-12-07 (20d8bb4) the router called it failed at prefill_timeout_s, cut the decode leg
    and sent a bypass an SGLang decode server cannot serve, and the prefill shim aborted the
    engine's prefill at that deadline too: a 504 at the client's deadline for a prefill that worked."""
    async with AsyncExitStack() as stack:
        pd = await _pd(stack, nats_url, ns, prefill_timeout_s=0.5)
        router, prefill, decode = pd.router, pd.prefill, pd.decode
        job = _job(100)
        got = asyncio.ensure_future(collect(router, job))
        await wait_for(lambda: "r1" in decode.engine.held and "r1" in prefill.engine.held, 5, what="both legs")
        await asyncio.sleep(1.0)  # twice prefill_timeout_s, heartbeats going on
        assert "r1" in prefill.engine.held and not prefill.engine.aborted and not decode.engine.aborted
        prefill.engine.answer("r1")  # its KV went
        decode.engine.answer("r1", tokens=2)
        chunks = await asyncio.wait_for(got, 5)
        assert [t for c in chunks for t in c.token_ids] == [11, 12]
        assert (job.outcome, job.path, router.fallbacks) == (Outcome.DECLINED_POLICY, Path.REMOTE, 0)
        assert len(decode.engine.got) == 1  # no bypass leg


async def test_a_cut_decode_leg_whose_engine_aborts_slowly_is_waited_for_before_the_bypass(
    nats_url: str, ns: str
) -> None:
    """The review's r1: the decode engine answers the abort of the cut leg after six heartbeats.
    Until 2026-12-07 the router waited three heartbeats after the cut, then sent the bypass, which
    the decode shim refused (409: the cut leg still in flight under the same request id), the
    client's 502. Its shim heartbeats while the engine aborts, so the router waits on."""
    async with AsyncExitStack() as stack:
        prefill = await _worker(stack, nats_url, ns, "prefill", "p1")
        decode = await _worker(stack, nats_url, ns, "decode", "w1", SlowAbort())
        nc = await nats.connect(nats_url)
        stack.push_async_callback(nc.close)
        router = Dispatcher(nc, ns, Books(), settings=lambda: RouterSettings(stream_heartbeat_s=HB))
        await router.start()
        stack.push_async_callback(router.stop)
        job = _job(100)
        got = asyncio.ensure_future(collect(router, job))
        await wait_for(lambda: "r1" in decode.engine.held and "r1" in prefill.engine.held, 5, what="both legs")
        prefill.engine.answer("r1", 500, {"error": {"message": "KV transfer failed"}})
        await wait_for(lambda: len(decode.engine.got) == 2 and "r1" in decode.engine.held, 5, what="the bypass")
        decode.engine.answer("r1", tokens=2)
        chunks = await asyncio.wait_for(got, 5)
        assert [t for c in chunks for t in c.token_ids] == [11, 12]
        assert (job.outcome, router.fallbacks) == (Outcome.FALLBACK_PREFILL_FAILED, 1)


async def test_a_prefill_whose_decode_leg_ends_first_is_judged_and_not_aborted(nats_url: str, ns: str) -> None:
    """The review's r6: a one-token answer's decode leg ends before the prefill leg's final chunk is
    read (SGLang answers the prefill once its sender sees the transfer done). Until 2026-12-07 the
    decode leg's end cancelled the watch: the prefill that fed it was never judged (a
    prefill_failing probe episode ran on) and its engine got a needless abort."""
    async with AsyncExitStack() as stack:
        prefill = await _worker(stack, nats_url, ns, "prefill", "p1")
        decode = await _worker(stack, nats_url, ns, "decode", "w1")
        nc = await nats.connect(nats_url)
        stack.push_async_callback(nc.close)
        verdicts: list[tuple[str, str | None, bool]] = []
        router = Dispatcher(
            nc, ns, Books(), settings=lambda: RouterSettings(stream_heartbeat_s=HB),
            on_prefill=lambda w, fault, whole, ago_s: verdicts.append((w, fault, whole)),
        )  # fmt: skip
        await router.start()
        stack.push_async_callback(router.stop)
        for gap in (0.0, 0.02, 0.05):
            verdicts.clear()
            got = asyncio.ensure_future(collect(router, _job(100)))
            await wait_for(lambda: "r1" in decode.engine.held and "r1" in prefill.engine.held, 5, what="both legs")
            decode.engine.answer("r1", tokens=1)
            await asyncio.sleep(gap)
            if "r1" in prefill.engine.held:
                prefill.engine.answer("r1")  # its KV went
            await asyncio.wait_for(got, 5)
            assert verdicts == [("p1", None, True)], gap
            await wait_for(lambda: not prefill.svc.inflight, 5, what="the prefill leg's end")
        assert prefill.engine.aborted == []


async def test_a_retry_after_a_decode_failure_can_use_the_same_prefill_worker(
    nats_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The review's r5: the decode leg fails before its first token (w1 is gone) and the request is
    retried on w2 with the same prefill worker. The first prefill leg, waiting for its decode peer,
    is cancelled and read to its end before the retry: until 2026-12-07 the retry's prefill leg met
    it still aborting there, was refused (409), counted as p1's failure and fell back, blaming p1."""
    async with AsyncExitStack() as stack:
        prefill = await _worker(stack, nats_url, ns, "prefill", "p1")
        w2 = await _worker(stack, nats_url, ns, "decode", "w2", SlowAbort())
        prefill.engine.__class__ = SlowAbort  # its abort takes six heartbeats too
        nc = await nats.connect(nats_url)
        stack.push_async_callback(nc.close)
        router = Dispatcher(nc, ns, Books(), settings=lambda: RouterSettings(stream_heartbeat_s=HB))
        await router.start()
        stack.push_async_callback(router.stop)
        c = ctx(100, [cand("w1"), cand("w2")], [cand("p1", "prefill")])

        def plan(decode: int) -> RoutePlan:
            d = c.decode_pool[decode]
            return RoutePlan(
                c, d, c.prefill_pool[0], Path.REMOTE, Outcome.DECLINED_POLICY, "", c.decode_pool, c.prefill_pool,
                key=f"r1#{decode + 1}",
            )  # fmt: skip

        replans = [plan(1)]
        req = GenerateRequest(request_id="r1", model="m", token_ids=list(range(100)))
        job = Job(request=req, plan=plan(0), replan=lambda _ex: replans.pop(0), deadline=time.monotonic() + DEADLINE_S)
        got = asyncio.ensure_future(collect(router, job))
        await wait_for(lambda: "r1" in w2.engine.held and "r1" in prefill.engine.held, 5, what="the retry's legs")
        assert prefill.engine.aborted == ["r1"] and len(prefill.engine.got) == 2  # the first leg ended first
        prefill.engine.answer("r1")
        w2.engine.answer("r1", tokens=2)
        chunks = await asyncio.wait_for(got, 5)
        assert [t for c in chunks for t in c.token_ids] == [11, 12]
        assert (job.path, router.retries, router.fallbacks) == (Path.REMOTE, 1, 0)
        assert not [r for r in caplog.records if "remote prefill failed" in r.getMessage()]
