"""An SGLang prefill leg through the request service, against a fake SGLang server over a real
nats-server: the transfer handle first and the engine's own outcome last, the prompt queued until
the engine is done, a cancel that aborts the engine's request, drain, and a router that asks for
no early handle (of before 2026-12-07)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nats
import pytest

from protocol import CancelRequest, encode_msg, subjects
from protocol.config import EtcdSettings, NatsSettings
from runtime.nats_flush import flush
from tests.worker_shim.cluster import wait_for
from tests.worker_shim.fake_sglang import TOO_LONG, FakeSglang
from tests.worker_shim.test_request_service import Collector, gen
from worker_shim.adapters.sglang import SglangAdapter, load_from_metrics
from worker_shim.config import ShimConfig
from worker_shim.request_service import RequestService
from worker_shim.shim import WorkerShim

PROMPT = list(range(100))


@dataclass
class Prefill:
    engine: FakeSglang
    svc: RequestService
    col: Collector
    subject: str
    cancels: str


@pytest.fixture
async def prefill(nats_url: str, ns: str) -> AsyncIterator[Prefill]:
    """A prefill shim's request service on worker p1, its engine a FakeSglang."""
    engine = FakeSglang()
    async with engine.serving() as url:
        config = ShimConfig(
            engine="sglang",
            model="m",
            engine_url=url,
            kv_events="tcp://127.0.0.1:9",
            role="prefill",
            bootstrap_host="10.0.0.5",
        )
        adapter = SglangAdapter(config.validate())
        await adapter.open()
        shim_nc, router_nc = await nats.connect(nats_url), await nats.connect(nats_url)
        svc = RequestService(shim_nc, adapter, lambda: None)
        subject, cancels = subjects.gen(ns, "prefill", "p1"), subjects.cancel(ns, "p1")
        await shim_nc.subscribe(subject, cb=svc.on_generate)
        await shim_nc.subscribe(cancels, cb=svc.on_cancel)
        await flush(shim_nc)
        col = Collector(router_nc)
        await col.start()
        try:
            yield Prefill(engine, svc, col, subject, cancels)
        finally:
            await svc.drain(0)
            await adapter.close()
            await shim_nc.close()
            await router_nc.close()


async def _held(p: Prefill, *rids: str) -> None:
    await wait_for(lambda: all(r in p.engine.held for r in rids), 5, what=f"the engine to hold {rids}")


@pytest.mark.parametrize(
    ("answer", "final"),
    [
        ({}, {"finish_reason": "length", "error": None}),
        ({"status": 500, "body": {"error": {"message": "KV transfer failed"}}}, {"error": (500, "engine_error")}),
    ],
    ids=["served", "failed"],
)
async def test_the_handle_comes_first_and_the_engines_outcome_last(
    prefill: Prefill, answer: dict[str, Any], final: dict[str, Any]
) -> None:
    """Until 2026-12-07 the leg ended with the handle at once and the engine's outcome was only
    logged: no router ever heard that a prefill failed, and its prompt left the worker's queue
    while the engine still held it."""
    p = prefill
    await p.col.send(p.subject, gen("r1", PROMPT, early_transfer=True))
    await _held(p, "r1")
    await wait_for(lambda: bool(p.col.chunks["r1"]), 5, what="the handle")
    first = p.col.chunks["r1"][0]
    assert not first.final and first.transfer is not None
    assert first.transfer.params["bootstrap_host"] == "10.0.0.5"
    assert p.engine.got[0]["bootstrap_room"] == first.transfer.params["bootstrap_room"]
    assert p.svc.prefill_tokens_queued == len(PROMPT) and "r1" in p.svc.inflight  # not prefilled yet
    p.engine.answer("r1", **answer)
    last = await p.col.final("r1", 5)
    if final["error"] is None:
        assert last.error is None and last.finish_reason == final["finish_reason"]
        assert last.transfer == first.transfer and last.usage is not None and last.usage.prompt_tokens == len(PROMPT)
    else:
        assert last.error is not None and (last.error.code, last.error.kind) == final["error"]
    assert p.svc.prefill_tokens_queued == 0 and not p.svc.inflight


async def test_a_prompt_the_engine_refuses_ends_the_leg_with_its_refusal_after_the_handle(prefill: Prefill) -> None:
    p = prefill
    await p.col.send(p.subject, gen("r1", list(range(9000)), early_transfer=True))
    last = await p.col.final("r1", 5)
    chunks = p.col.chunks["r1"]
    assert chunks[0].transfer is not None and not chunks[0].final
    assert last.error is not None and (last.error.code, last.error.kind, last.error.message) == (
        400,
        "engine_rejected",
        TOO_LONG,
    )


async def test_a_cancel_aborts_the_engines_prefill(prefill: Prefill) -> None:
    """The router cancels a prefill leg it gave up on (its time, a client gone): until 2026-12-07
    the leg had ended already, and the engine's request waited on for its decode peer."""
    p = prefill
    await p.col.send(p.subject, gen("r1", PROMPT, early_transfer=True))
    await _held(p, "r1")
    await p.col.nc.publish(p.cancels, encode_msg(CancelRequest(request_id="r1")))
    last = await p.col.final("r1", 5)
    assert last.finish_reason == "abort" and p.engine.aborted == ["r1"]
    assert p.svc.prefill_tokens_queued == 0


async def test_a_router_that_asks_no_early_handle_gets_it_at_once_and_the_prompt_stays_queued(
    prefill: Prefill, caplog: pytest.LogCaptureFixture
) -> None:
    """A router of before 2026-12-07 reads the handle from the final chunk only: it comes at once as
    before (it waits for that chunk before it sends the decode leg the engine waits for), and
    the leg runs on, its prompt queued, until the engine is done; a failure then is logged."""
    p = prefill
    caplog.set_level(logging.WARNING, logger="worker_shim.request_service")
    await p.col.send(p.subject, gen("r1", PROMPT))
    first = await p.col.final("r1", 5)
    assert first.transfer is not None and first.error is None and len(p.col.chunks["r1"]) == 1
    await _held(p, "r1")
    assert p.svc.prefill_tokens_queued == len(PROMPT) and "r1" in p.svc.inflight
    p.engine.answer("r1", 500, {"error": {"message": "KV transfer failed"}})
    await wait_for(lambda: not p.svc.inflight, 5, what="the leg to end with its engine")
    assert p.svc.prefill_tokens_queued == 0
    said = [r.getMessage() for r in caplog.records if "early_transfer" in r.getMessage()]
    assert len(said) == 1 and "KV transfer failed" in said[0], said


async def test_drain_waits_for_the_engines_prefills_within_its_grace(
    prefill: Prefill, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 drain saw no SGLang prefill (each leg had ended with its handle) and the
    shim closed its session under them: cut, never aborted. Its end is said (the shim's log ended
    at "draining N legs")."""
    p = prefill
    caplog.set_level(logging.INFO, logger="worker_shim.request_service")
    for rid in ("r1", "r2"):
        await p.col.send(p.subject, gen(rid, PROMPT, early_transfer=True))
    await _held(p, "r1", "r2")
    drain = asyncio.ensure_future(p.svc.drain(10))
    await asyncio.sleep(0.2)
    assert not drain.done()
    for rid in ("r1", "r2"):
        p.engine.answer(rid)
    assert await asyncio.wait_for(drain, 5) == (2, 0)  # finished, cut
    assert p.engine.aborted == []
    assert [(await p.col.final(rid)).finish_reason for rid in ("r1", "r2")] == ["length", "length"]
    said = [r.getMessage() for r in caplog.records if "drain" in r.getMessage()]
    assert said[0] == "draining 2 legs, up to 10s (--drain-grace-s)", said
    assert len(said) == 2 and said[1].startswith("drained: the 2 legs finished in "), said


async def test_drain_past_its_grace_aborts_the_engines_prefills(prefill: Prefill) -> None:
    p = prefill
    for rid in ("r1", "r2"):
        await p.col.send(p.subject, gen(rid, PROMPT, early_transfer=True))
    await _held(p, "r1", "r2")
    await asyncio.wait_for(p.svc.drain(0.2), 5)
    assert sorted(p.engine.aborted) == ["r1", "r2"]  # sent on the open session, before any close
    for rid in ("r1", "r2"):
        last = await p.col.final(rid)
        assert last.error is not None and last.error.kind == "shutdown"


async def test_drain_says_what_it_waits_for_and_what_it_cuts_and_counts_the_cut(
    prefill: Prefill, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 the legs drain cut at --drain-grace-s ended without a word in the shim's
    log (review: its clients got 502s, its log said "SIGTERM: draining" only)."""
    p = prefill
    caplog.set_level(logging.INFO, logger="worker_shim.request_service")
    for rid in ("r1", "r2", "r3"):
        await p.col.send(p.subject, gen(rid, PROMPT, early_transfer=True))
    await _held(p, "r1", "r2", "r3")
    p.engine.answer("r3")
    await p.col.final("r3", 5)
    drain = asyncio.ensure_future(p.svc.drain(1.0))
    await asyncio.sleep(0.2)
    p.engine.answer("r2")  # ends within the grace: waited for, not cut
    assert await asyncio.wait_for(drain, 5) == (1, 1)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "drain" in r.getMessage()]
    assert said == [
        ("INFO", "draining 2 legs, up to 1s (--drain-grace-s)"),
        (
            "WARNING",
            "1 legs still running after the 1s drain (--drain-grace-s): ended with 503 shutdown "
            '(kvswitch_shim_requests_total{outcome="shutdown"}); 1 finished within it',
        ),
    ], said
    assert (await p.col.final("r2")).error is None
    cut = await p.col.final("r1")
    assert cut.error is not None and cut.error.kind == "shutdown"
    assert p.svc.outcomes[("prefill", "shutdown")] == 1


async def test_an_old_routers_prefill_runs_past_its_legs_deadline_once_its_handle_went(prefill: Prefill) -> None:
    """The review's r3 with a router of before 2026-12-07: its prefill leg's deadline is its prefill
    timeout, but once the handle went the engine waits on the decode leg, whose deadline is the
    request's. Until then (20d8bb4) the shim aborted the engine's prefill at the leg's deadline, and
    the decode engine waited for KV that never came."""
    p = prefill
    await p.col.send(p.subject, gen("r1", PROMPT, deadline=time.time() + 0.5))
    assert (await p.col.final("r1", 5)).transfer is not None
    await _held(p, "r1")
    await asyncio.sleep(1.0)  # past the leg's deadline
    assert "r1" in p.engine.held and not p.engine.aborted and "r1" in p.svc.inflight
    p.engine.answer("r1")
    await wait_for(lambda: not p.svc.inflight, 5, what="the leg to end with its engine")


_WAITING_FOR_PEERS = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 0
sglang:num_queue_reqs{model_name="m"} 0
sglang:token_usage{model_name="m"} 0.0
sglang:num_prefill_bootstrap_queue_reqs{model_name="m"} 2
"""


def _watchdog(svc: RequestService, stall_limit_s: float) -> WorkerShim:
    """A shim, never started, whose stall watchdog looks at `svc` and its adapter."""
    cfg = ShimConfig(
        engine="sglang",
        model="m",
        role="prefill",
        bootstrap_host="10.0.0.5",
        kv_events="tcp://127.0.0.1:9",
        stall_limit_s=stall_limit_s,
    )
    shim = WorkerShim(cfg, NatsSettings(servers=["nats://127.0.0.1:1"]), EtcdSettings(endpoints=["x"]))
    shim.requests, shim.adapter = svc, svc.adapter
    return shim


async def test_a_prefill_engine_waiting_for_its_decode_peers_is_not_taken_for_hung(prefill: Prefill) -> None:
    """The review's r4: two prefill legs whose handles went wait for their decode peers, the engine
    healthy, its /metrics answering, its bootstrap queue holding them. Until 2026-12-07 the stall
    watchdog judged them (and the bootstrap queue) as the engine's work, saw no step, and took the
    engine for hung after the stall limit: its legs ended and the worker deregistered."""
    p = prefill
    for rid in ("a", "b"):
        await p.col.send(p.subject, gen(rid, PROMPT, early_transfer=True, heartbeat_s=0.1))
    await _held(p, "a", "b")
    dog = _watchdog(p.svc, stall_limit_s=0.5)
    started = time.monotonic()
    while time.monotonic() - started < 1.5:  # three stall limits of fresh readings: no time limit on a peer
        dog._engine_load = load_from_metrics(_WAITING_FOR_PEERS, 1000, 1000)
        dog._engine_load_at = time.monotonic()
        assert dog._hung(time.monotonic()) is None
        await asyncio.sleep(0.1)
    p.engine.answer("a")  # its peer came: the engine answers, and the leg is judged as any other work
    await wait_for(lambda: "a" not in p.svc.inflight and "a" not in p.svc.adapter.waiting_peer, 5, what="a's end")
    assert "b" in p.svc.adapter.waiting_peer
