"""The credit check: the rule on hand-made readings, then a shim against a sim, where the engine
reuses exactly what the shim predicted, and reuses nothing of what a router that renders chat
differently from the engine was promised."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from nats.aio.msg import Msg

from engine_sim.server import SimServer
from protocol import GenerateRequest, LoadReport, decode_msg, subjects
from protocol.messages import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from tests.worker_shim.cluster import BLOCK, connect, shim_for, sim_config, wait_for
from tests.worker_shim.test_request_service import Collector, agg_shim, gen
from worker_shim import WorkerShim
from worker_shim.credit_check import CreditCheck

# --- the rule -------------------------------------------------------------------------------------


def check(**kw: float) -> CreditCheck:
    return CreditCheck("engine-a", min_legs=int(kw.pop("min_legs", 2)), min_tokens=int(kw.pop("min_tokens", 100)), **kw)


def leg(c: CreditCheck, at: float, predicted: int, dispatched: float | None = None) -> None:
    """A leg scheduled at `at`, dispatched just before unless said."""
    c.scheduled(at - 0.05 if dispatched is None else dispatched, at, predicted)


def read(c: CreditCheck, asked: float, reused: int | None) -> None:
    c.reading(asked, asked + 0.01, reused)


def test_a_window_is_judged_once_it_holds_enough_legs_and_tokens() -> None:
    c = check()
    read(c, 0.0, 1000)  # the base
    leg(c, 1.0, 60)
    read(c, 2.0, 1060)
    assert c.windows == 0, "one leg is not enough"
    leg(c, 3.0, 60)
    read(c, 4.0, 1120)
    assert (c.windows, c.ratio, c.predicted_total, c.reused_total) == (1, 1.0, 120, 120)
    assert not c.short


def test_a_shortfall_is_warned_once_and_its_recovery_said(caplog: pytest.LogCaptureFixture) -> None:
    c = check()
    read(c, 0.0, 0)
    with caplog.at_level(logging.INFO, logger="worker_shim.credit_check"):
        for i in range(3):  # three windows, each 200 tokens promised and 40 reused
            leg(c, 10.0 * i + 1, 100)
            leg(c, 10.0 * i + 2, 100)
            read(c, 10.0 * i + 5, 40 * (i + 1))
        assert c.short and c.ratio == pytest.approx(0.2)
        assert (c.windows, c.short_windows) == (3, 3) and c.lowest == pytest.approx(0.2)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "engine-a reused 40 of the 200" in warned[0]
        leg(c, 31.0, 100)
        leg(c, 32.0, 100)
        read(c, 35.0, 120 + 170)  # 0.85: at or over `recover`
        assert not c.short
        assert any(r.levelno == logging.INFO and "again" in r.getMessage() for r in caplog.records)


def test_between_low_and_recover_the_state_holds() -> None:
    c = check()
    read(c, 0.0, 0)
    for t, reused, short in ((1.0, 120, False), (3.0, 200, True), (5.0, 340, True)):  # 0.6, 0.4, 0.7
        leg(c, t, 100)
        leg(c, t + 0.5, 100)
        read(c, t + 1.0, reused)
        assert c.short is short


def test_a_leg_scheduled_while_a_reading_was_out_waits_for_the_next_one() -> None:
    c = check()
    read(c, 0.0, 0)
    leg(c, 1.0, 100)
    leg(c, 2.005, 100)  # after the reading asked at 2.0, before it came back: maybe not in it
    read(c, 2.0, 100)
    assert c.windows == 0
    leg(c, 2.5, 100)
    read(c, 3.0, 300)
    assert (c.windows, c.predicted_total, c.reused_total) == (1, 300, 300)


def test_a_leg_dispatched_before_its_window_began_is_left_out() -> None:
    """Its reuse was counted when the engine scheduled it, which may be before the window: a
    long prefill, or a wait in the engine's queue."""
    c = check(min_legs=1, min_tokens=1)
    read(c, 0.0, 5000)
    leg(c, 1.0, 100)
    read(c, 2.0, 5100)  # the base for the next window
    leg(c, 3.0, 4000, dispatched=1.5)  # its 4,000 were reused at 1.8, before the base
    leg(c, 3.5, 100)
    read(c, 4.0, 5200)
    assert (c.windows, c.predicted_total, c.reused_total, c.short) == (2, 200, 200, False)


def test_legs_before_the_first_reading_are_not_judged_against_it() -> None:
    c = check(min_legs=1, min_tokens=1)
    leg(c, 0.5, 500)  # its reuse is in the base reading already
    read(c, 1.0, 500)
    leg(c, 1.5, 100)
    read(c, 2.0, 600)
    assert (c.ratio, c.predicted_total) == (1.0, 100)


def test_a_counter_that_goes_down_or_a_failed_poll_starts_over() -> None:
    c = check(min_legs=1, min_tokens=1)
    read(c, 0.0, 10_000)
    leg(c, 1.0, 100)
    read(c, 2.0, 50)  # the engine restarted: no window across it
    assert c.windows == 0
    leg(c, 3.0, 100)
    c.lost()
    read(c, 4.0, 60)  # a new base, not a window judged against 50
    assert c.windows == 0
    leg(c, 5.0, 100)
    read(c, 6.0, 160)
    assert (c.windows, c.ratio) == (1, 1.0)


def test_an_engine_that_does_not_count_reuse_is_never_judged() -> None:
    c = check(min_legs=1, min_tokens=1)
    for t in range(10):
        leg(c, t + 0.5, 100)
        read(c, t + 1.0, None)
    assert (c.windows, c.short) == (0, False)


# --- a shim against a sim -----------------------------------------------------------------------

PROMPT = list(range(300, 300 + 4 * BLOCK))  # four full blocks: vLLM reuses three when it repeats


async def served(col: Collector, subject: str, req: GenerateRequest) -> None:
    await col.send(subject, req)
    assert (await col.final(req.request_id)).error is None
    await asyncio.sleep(0.35)  # past the next load poll, so each leg's window holds its reuse


@asynccontextmanager
async def warm_shim(ns: str, nats_url: str, etcd_url: str) -> AsyncIterator[tuple[WorkerShim, Collector, str]]:
    """A shim beside a sim whose cache holds PROMPT, judging every window that holds a leg (so a
    test needs few requests); with a Collector and the shim's agg subject."""
    async with SimServer(sim_config()) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        shim.credit.min_legs = shim.credit.min_tokens = 1
        subject = subjects.gen(ns, "agg", shim.worker_id)
        await served(col, subject, gen("first", PROMPT))
        await wait_for(lambda: shim._cached_prompt_tokens(PROMPT) == len(PROMPT), what="the prompt indexed")
        yield shim, col, subject


async def test_the_engine_reuses_exactly_what_the_shim_predicted(ns: str, nats_url: str, etcd_url: str) -> None:
    async with warm_shim(ns, nats_url, etcd_url) as (shim, col, subject):
        for i in range(3):
            await served(col, subject, gen(f"again-{i}", PROMPT))  # 64 held, 48 reused
            await served(col, subject, gen(f"longer-{i}", PROMPT + [7] * (i + 1)))  # 64 held and reused
        await wait_for(lambda: shim.credit.predicted_total == 3 * 48 + 3 * 64, what="every leg judged")
        assert shim.credit.reused_total == shim.credit.predicted_total
        assert not shim.credit.short


async def test_legs_asking_for_prompt_logprobs_are_not_promised_a_hit(ns: str, nats_url: str, etcd_url: str) -> None:
    async with warm_shim(ns, nats_url, etcd_url) as (shim, col, subject):
        logprobs = [
            {"model": "sim-llama", "max_tokens": 2, "prompt_logprobs": 1},
            {"model": "sim-llama", "max_tokens": 2, "echo": True, "logprobs": 1},
        ]
        for i, params in enumerate(logprobs * 2):
            req = GenerateRequest(
                request_id=f"lp-{i}",
                model="sim-llama",
                token_ids=PROMPT,
                stream=False,  # vLLM refuses prompt logprobs on a stream
                endpoint=ENDPOINT_COMPLETIONS,
                params=params,
            )
            await served(col, subject, req)  # the engine reads no cache for these
        await served(col, subject, gen("plain", PROMPT))
        await wait_for(lambda: shim.credit.windows >= 1, what="the plain leg judged")
        assert (shim.credit.predicted_total, shim.credit.reused_total, shim.credit.short) == (48, 48, False)


async def test_a_router_that_renders_chat_differently_is_caught_then_cleared(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The router hashed `token_ids` (a cached prompt); the engine renders the messages into
    another prompt and reuses none of it: the credit routers give this worker is wrong."""
    async with warm_shim(ns, nats_url, etcd_url) as (shim, col, subject):
        assert shim.worker_id is not None
        reported: list[bool] = []  # each LoadReport's prefix_credit_short, as routers get them

        async def on_load(msg: Msg) -> None:
            reported.append(decode_msg(msg.data, LoadReport).prefix_credit_short)

        await col.nc.subscribe(subjects.load(ns, shim.worker_id), cb=on_load)
        with caplog.at_level(logging.INFO, logger="worker_shim.credit_check"):
            for i in range(3):
                params = {"model": "sim-llama", "max_tokens": 2, "messages": [{"role": "user", "content": f"hi {i}"}]}
                req = GenerateRequest(
                    request_id=f"chat-{i}",
                    model="sim-llama",
                    token_ids=[*PROMPT, 9],
                    endpoint=ENDPOINT_CHAT,
                    params=params,
                )
                await served(col, subject, req)
            await wait_for(lambda: shim.credit.short, what="the shortfall")
            assert shim.credit.ratio == 0.0
            await wait_for(lambda: reported[-1:] == [True], what="a load report saying so")
            async with aiohttp.ClientSession() as http:
                async with http.get(shim.http.url + "/metrics") as r:
                    assert "kvswitch_shim_prefix_credit_short 1.0" in await r.text()
                async with http.get(shim.http.url + "/health") as r:
                    assert (await r.json())["prefix_credit_short"] is True
            for i in range(2):
                await served(col, subject, gen(f"honest-{i}", [*PROMPT, 9]))
            await wait_for(lambda: not shim.credit.short, what="the recovery")
            await wait_for(lambda: reported[-1:] == [False], what="a load report saying so")
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and shim.config.engine_url in warned[0] and "tokenizes" in warned[0]


async def test_a_decode_workers_pulled_prompts_do_not_hide_a_shortfall(ns: str, nats_url: str, etcd_url: str) -> None:
    """On a P/D decode engine vLLM counts each pulled prompt as a connector hit ("p2p"). Counted as
    reuse, two pulls of 64 tokens would cover the 64 a mis-rendered chat leg was promised and
    reused none of; left out, the shortfall shows."""
    async with (
        SimServer(sim_config(role="prefill")) as psim,
        SimServer(sim_config(role="decode")) as dsim,
        shim_for(psim, ns, nats_url, etcd_url, role="prefill") as pshim,
        shim_for(dsim, ns, nats_url, etcd_url, role="decode") as dshim,
    ):
        await pshim.registered.wait()
        await dshim.registered.wait()
        assert pshim.worker_id is not None and dshim.worker_id is not None
        dshim.credit.min_legs = dshim.credit.min_tokens = 1
        decode = subjects.gen(ns, "decode", dshim.worker_id)
        nc = await connect(nats_url)
        try:
            col = Collector(nc)
            await col.start()
            await served(col, decode, gen("warm", PROMPT))  # no handle: a local prefill
            await wait_for(lambda: dshim._cached_prompt_tokens(PROMPT) == len(PROMPT), what="the prompt indexed")
            await served(col, decode, gen("again", PROMPT))  # promised 48, reused 48: a window judged
            await wait_for(lambda: dshim.credit.windows >= 1, what="the honest leg's window")
            for i in range(2):
                fresh = list(range(5000 + 100 * i, 5000 + 100 * i + 4 * BLOCK))
                await col.send(subjects.gen(ns, "prefill", pshim.worker_id), gen(f"pd-{i}", fresh, max_tokens=1))
                pre = await col.final(f"pd-{i}")
                assert pre.transfer is not None
                col.finals.pop(f"pd-{i}")
                await col.send(decode, gen(f"pd-{i}", fresh, max_tokens=2, disagg=pre.transfer))
                assert (await col.final(f"pd-{i}")).error is None
            params = {"model": "sim-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            chat = GenerateRequest(
                request_id="chat", model="sim-llama", token_ids=[*PROMPT, 9], endpoint=ENDPOINT_CHAT, params=params
            )
            await served(col, decode, chat)
            await wait_for(lambda: dshim.credit.windows >= 2, what="the chat leg's window")
            assert dsim.engine.stats.external_prefix_cache_hits == 2 * 4 * BLOCK  # vLLM's count of the pulls
            assert (dshim.credit.ratio, dshim.credit.short) == (0.0, True)
        finally:
            await nc.close()
