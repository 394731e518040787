"""Two shims given each other's --kv-events / --kv-replay each read a live stream of Stored events,
so neither `no_stored` nor the credit check said anything (audit: second sends hit 39/80, every
problem gauge 0). The shim now checks that the prompts it serves are stored in the events it reads:
`other_engine`, with an ERROR naming the fix. A healthy worker under mixed traffic (requests sent to
the engine past the shim, repeats, prompts sharing prefixes) is never flagged. EventOwner alone, then
two whole shims (real nats, etcd, sims)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import pytest

from engine_sim.server import SimServer
from protocol import subjects
from tests.worker_shim.cluster import complete, connect, shim_for, sim_config, wait_for
from tests.worker_shim.test_event_health import _reported_bad
from tests.worker_shim.test_request_service import Collector, gen
from worker_shim import WorkerShim
from worker_shim.event_health import EventHealth, EventProblem
from worker_shim.event_owner import WATCH_WINDOW, EventOwner

FIX = "--kv-events / --kv-replay may be another engine's: check each shim's endpoints"


def _said(caplog: pytest.LogCaptureFixture, level: int, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == level and text in r.getMessage())


# --- EventOwner alone --------------------------------------------------------------------------------


def _owner(held: set[int], timeout_s: float = 0.05) -> tuple[EventHealth, EventOwner]:
    health = EventHealth(timeout_s=timeout_s)
    health.holds = held.__contains__
    return health, EventOwner(health)


async def test_prompts_whose_blocks_another_stream_stores_raise_other_engine_naming_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health, owner = _owner(set())
    with caplog.at_level(logging.INFO, logger="worker_shim"):
        for i in range(WATCH_WINDOW):
            owner.served(1000 + i, f"r{i}")
            health.live(stored=True)  # someone's blocks, never the prompts served
        await asyncio.sleep(0.2)
    assert EventProblem.OTHER_ENGINE in health.problems and not health.ok
    assert FIX in health.why
    assert _said(caplog, logging.ERROR, FIX) == 1
    health.live(stored=True)  # live events are no evidence against it
    assert not health.ok
    owner.close()
    health.close()


async def test_prompts_stored_in_the_stream_read_keep_the_worker() -> None:
    held: set[int] = set()
    health, owner = _owner(held)
    for i in range(3 * WATCH_WINDOW):
        owner.served(1000 + i, f"r{i}")
        health.live(stored=True)
        if i % 6:  # most are stored after they were served; a few are missed
            held.add(1000 + i)
            owner.batch()
    await asyncio.sleep(0.2)
    assert health.ok and owner.matched >= 2 * WATCH_WINDOW
    owner.close()
    health.close()


async def test_an_engine_that_stores_nothing_is_no_stored_not_other_engine() -> None:
    health, owner = _owner(set())
    for i in range(WATCH_WINDOW):
        owner.served(1000 + i, f"r{i}")
    await asyncio.sleep(0.2)
    assert EventProblem.OTHER_ENGINE not in health.problems
    owner.close()
    health.close()


async def test_other_engine_is_lifted_for_a_retest_and_logs_its_error_once_per_episode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held: set[int] = set()
    health, owner = _owner(held)
    health.retest_s = 0.3
    with caplog.at_level(logging.INFO, logger="worker_shim"):
        for episode in range(2):
            for i in range(WATCH_WINDOW):
                owner.served(100 * episode + i, f"r{episode}-{i}")
                health.live(stored=True)
            await asyncio.sleep(0.2)
            assert not health.ok
            await wait_for(lambda: health.ok, 2, "lifted for a retest")
        for i in range(WATCH_WINDOW):  # fixed: the prompts' blocks are stored
            held.add(500 + i)
            owner.served(500 + i, f"ok{i}")
        assert health.ok and not owner._episode
    assert _said(caplog, logging.ERROR, FIX) == 1
    assert _said(caplog, logging.WARNING, "other_engine lifted") == 1
    owner.close()
    health.close()


# --- two whole shims ---------------------------------------------------------------------------------


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(40, 100))] for _ in range(n)]


async def _serve_all(ns: str, nats_url: str, sends: list[tuple[WorkerShim, str, list[int]]], width: int = 4) -> None:
    nc = await connect(nats_url)
    try:
        col = Collector(nc)
        await col.start()
        gate = asyncio.Semaphore(width)

        async def one(shim: WorkerShim, rid: str, tokens: list[int]) -> None:
            assert shim.worker_id is not None
            async with gate:
                await col.send(subjects.gen(ns, "agg", shim.worker_id), gen(rid, tokens, max_tokens=2))
                assert (await col.final(rid)).error is None

        await asyncio.gather(*(one(*s) for s in sends))
    finally:
        await nc.close()


def _flagged(shim: WorkerShim) -> Callable[[], bool]:
    return lambda: EventProblem.OTHER_ENGINE in shim.events.problems


async def test_two_shims_with_swapped_event_endpoints_are_both_excluded_naming_the_fix(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit's slip: shim wa serves engine A with engine B's endpoints, wb the reverse. Each is
    flagged within a window of watched prompts, and routers are told (etcd and load reports)."""
    timeout = 0.3
    async with SimServer(sim_config()) as a, SimServer(sim_config()) as b:
        wa = shim_for(
            a, ns, nats_url, etcd_url, kv_events=b.events_endpoint, kv_replay=b.replay_endpoint,
            events_timeout_s=timeout, worker_name="wa",
        )  # fmt: skip
        wb = shim_for(
            b, ns, nats_url, etcd_url, kv_events=a.events_endpoint, kv_replay=a.replay_endpoint,
            events_timeout_s=timeout, worker_name="wb",
        )  # fmt: skip
        async with wa, wb:
            await wa.registered.wait()
            await wb.registered.wait()
            prompts = _prompts(2 * WATCH_WINDOW, seed=1)
            sends = [(wa if i % 2 else wb, f"p{i}", p) for i, p in enumerate(prompts)]
            with caplog.at_level(logging.ERROR, logger="worker_shim"):
                await _serve_all(ns, nats_url, sends)
                for shim in (wa, wb):
                    await wait_for(_flagged(shim), 4 * timeout + 2, f"{shim.config.worker_name} flagged")
                    assert FIX in shim.events.why
                    assert shim.owner.watched <= WATCH_WINDOW and shim.owner.matched <= 2
                    await _reported_bad(shim, ns, nats_url, etcd_url, within=5)
            assert _said(caplog, logging.ERROR, FIX) == 2  # one each
            assert wa.events.problems.keys() == {EventProblem.OTHER_ENGINE}  # events flow: nothing else


async def test_a_healthy_pair_under_mixed_traffic_is_not_flagged(ns: str, nats_url: str, etcd_url: str) -> None:
    """Prompts through the shims, repeats, prompts sharing a system prompt, and requests sent to each
    engine past its shim (warm-up, health checks): blocks the shim never served, prompts the index
    already holds."""
    timeout = 0.3
    async with SimServer(sim_config()) as a, SimServer(sim_config()) as b:
        wa = shim_for(a, ns, nats_url, etcd_url, events_timeout_s=timeout, worker_name="wa")
        wb = shim_for(b, ns, nats_url, etcd_url, events_timeout_s=timeout, worker_name="wb")
        async with wa, wb:
            await wa.registered.wait()
            await wb.registered.wait()
            rng = random.Random(2)
            system = [rng.randrange(10, 4000) for _ in range(48)]
            prompts = _prompts(3 * WATCH_WINDOW, seed=3)
            prompts += [system + p[:30] for p in _prompts(WATCH_WINDOW, seed=4)]
            direct = _prompts(2 * WATCH_WINDOW, seed=5)
            sends = [(wa if i % 2 else wb, f"p{i}", p) for i, p in enumerate(prompts)]
            sends += [(wb if i % 2 else wa, f"again{i}", p) for i, p in enumerate(prompts[:WATCH_WINDOW])]
            sends += [(wa if i % 2 else wb, f"was-direct{i}", p) for i, p in enumerate(direct[:WATCH_WINDOW])]
            rng.shuffle(sends)
            bypass = [complete((a if i % 2 else b).url, p) for i, p in enumerate(direct)]
            await asyncio.gather(_serve_all(ns, nats_url, sends), *bypass)
            await asyncio.sleep(2 * timeout + 0.3)
            for shim in (wa, wb):
                assert shim.events.ok, shim.events.why
                assert shim.owner.watched >= WATCH_WINDOW, shim.owner.watched  # the check ran
                assert shim.owner.matched >= shim.owner.watched - 2
