"""Two shims given each other's --kv-events / --kv-replay each read a live stream of Stored events, so
neither `no_stored` nor the credit check said anything (audit: second sends hit 39/80, every problem
gauge 0). The shim now looks for positive evidence (worker_shim.event_owner): its own prompts' blocks
missing from the events read AND other prompts' blocks stored in them. Then an ERROR naming the fix,
a Cleared and none of those events published, `events_foreign` reported; `events_ok` stays true, so
the worker stays routable. The reverted first attempt's false positives are must-not-flag cases: a
shim restarted beside a warm engine without a replay endpoint or with a wrapped replay buffer, a
model with no full-attention group, eviction pressure, a healthy pair with requests sent past it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from engine_sim.config import LOOPBACK_PUB_ENDPOINT, KVEventsConfig
from engine_sim.server import SimServer
from protocol import Cleared, LoadReport, Usage, decode_msg, subjects
from protocol.hashing import block_hashes
from tests.worker_shim.cluster import complete, connect, shim_for, sim_config, wait_for
from tests.worker_shim.test_rebuild_guard import _shim
from tests.worker_shim.test_request_service import Collector, gen
from worker_shim import EngineBatch, EngineStored, Normaliser, WorkerShim
from worker_shim.engine_events import WINDOW as WINDOW_KIND
from worker_shim.event_health import EventProblem
from worker_shim.event_owner import FIX, FOREIGN_MIN, WINDOW, EventOwner
from worker_shim.kv_publisher import KvPublisher

B = 16


def _said(caplog: pytest.LogCaptureFixture, level: int, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == level and text in r.getMessage())


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(40, 100))] for _ in range(n)]


# --- EventOwner alone --------------------------------------------------------------------------------


async def test_own_prompts_unstored_while_others_are_stored_is_foreign_naming_the_fix_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = EventOwner(timeout_s=0.02)
    changes: list[bool] = []
    owner.on_change = lambda: changes.append(owner.foreign)
    rng = random.Random(1)
    with caplog.at_level(logging.INFO, logger="worker_shim"):
        for _ in range(WINDOW):
            mine = [rng.getrandbits(63) for _ in range(4)]
            owner.dispatched(mine, 0)
            owner.stored([rng.getrandbits(63) for _ in range(4)])  # the other engine's prompt
            owner.batch()
            owner.served(mine[-1])
        await wait_for(lambda: owner.foreign, 1, "flagged")
        assert FIX in owner.why and changes == [True]
        assert _said(caplog, logging.ERROR, FIX) == 1
        for _ in range(WINDOW):  # its own prompts' blocks are seen again (fixed)
            mine = [rng.getrandbits(63) for _ in range(4)]
            owner.dispatched(mine, 0)
            owner.stored(mine)
            owner.batch()
            owner.served(mine[-1])
        assert not owner.foreign and changes == [True, False]
        assert _said(caplog, logging.WARNING, "other_engine lifted") == 1
    owner.close()


async def test_missing_blocks_alone_or_foreign_blocks_alone_are_no_verdict() -> None:
    rng = random.Random(2)
    missing = EventOwner(timeout_s=0.02)  # a restart beside a warm engine: cached prompts store nothing
    past = EventOwner(timeout_s=0.02)  # requests sent to the engine past the shim: its own are stored too
    for _ in range(3 * WINDOW):
        mine = [rng.getrandbits(63) for _ in range(4)]
        for owner in (missing, past):
            owner.dispatched(mine, 0)
        past.stored([rng.getrandbits(63) for _ in range(4 * FOREIGN_MIN)])
        past.stored(mine)
        for owner in (missing, past):
            owner.batch()
            owner.served(mine[-1])
    await asyncio.sleep(0.1)
    assert missing.watched == past.watched == 3 * WINDOW
    assert missing.matched == 0 and not missing.foreign and missing.foreign_blocks == 0
    assert past.matched == 3 * WINDOW and not past.foreign
    missing.close()
    past.close()


async def test_a_window_only_model_publishes_no_chain_and_is_not_judged() -> None:
    """The audit's reproduction: every KV group a sliding window (no full-attention chain published)."""
    shim = _shim()
    shim.limits = dataclasses.replace(shim.limits, block_size=B)
    shim.events.timeout_s = shim.owner.timeout_s = 0.05
    shim.normaliser = Normaliser(B, stats=shim.norm_stats)
    shim.requests = SimpleNamespace(inflight={})  # type: ignore[assignment]
    rng = random.Random(1)
    for i in range(2 * WINDOW):
        tokens = [rng.randrange(10, 4000) for _ in range(70)]
        n = len(tokens) // B
        assert shim._dispatched_prompt(tokens, "") == 0
        hashes = [rng.getrandbits(63) for _ in range(n)]
        ev = EngineStored(
            hashes=hashes, parent=None, token_ids=tokens[: n * B], block_size=B, group=0, kind=WINDOW_KIND, window=64
        )
        await shim._sink(EngineBatch(events=[ev], live=True))
        other = [rng.randrange(10, 4000) for _ in range(n * B)]  # someone else's prompt, window too
        ev = EngineStored(
            hashes=[rng.getrandbits(63) for _ in range(n)], parent=None, token_ids=other, block_size=B,
            group=0, kind=WINDOW_KIND, window=64,
        )  # fmt: skip
        await shim._sink(EngineBatch(events=[ev], live=True))
        shim._on_served(f"r{i}", tokens, "", Usage(prompt_tokens=len(tokens), completion_tokens=2))
    await asyncio.sleep(2 * shim.owner.timeout_s + 0.2)
    assert shim.owner.watched == 2 * WINDOW and shim.owner.foreign_blocks == 0
    assert not shim.owner.foreign and shim.events.ok
    shim.owner.close()
    shim.events.close()


# --- whole shims (real nats, etcd, sims) ------------------------------------------------------------


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


def _foreign(shim: WorkerShim) -> Callable[[], bool]:
    return lambda: shim.owner.foreign


def _unpublished(publisher: KvPublisher) -> Callable[[], bool]:
    return lambda: publisher.digest().blocks == 0


async def _foreign_report(shim: WorkerShim, ns: str, nats_url: str, within: float) -> LoadReport:
    assert shim.worker_id is not None
    nc = await connect(nats_url)
    reports: list[LoadReport] = []

    async def on(msg: Any) -> None:
        reports.append(decode_msg(msg.data, LoadReport))

    await nc.subscribe(subjects.load(shim.config.namespace, shim.worker_id), cb=on)
    try:
        await wait_for(lambda: any(r.events_foreign for r in reports), within, "events_foreign reported")
        return next(r for r in reports if r.events_foreign)
    finally:
        await nc.close()


async def test_two_shims_with_swapped_event_endpoints_are_foreign_unpublished_and_still_serve(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit's slip: shim wa serves engine A with engine B's endpoints, wb the reverse."""
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
            prompts = _prompts(4 * WINDOW, seed=1)
            sends = [(wa if i % 2 else wb, f"p{i}", p) for i, p in enumerate(prompts)]
            with caplog.at_level(logging.ERROR, logger="worker_shim"):
                await _serve_all(ns, nats_url, sends)
                for shim in (wa, wb):
                    await wait_for(_foreign(shim), 4 * timeout + 2, f"{shim.config.worker_name} flagged")
                    assert FIX in shim.owner.why
                    report = await _foreign_report(shim, ns, nats_url, within=5)
                    assert report.events_ok  # not excluded: routed by load
                    publisher = shim.publisher
                    assert publisher is not None
                    await wait_for(_unpublished(publisher), 2, "routers told to hold nothing")
            assert _said(caplog, logging.ERROR, FIX) == 2  # one each
            for shim in (wa, wb):
                assert shim.events.ok and not shim.events.problems, shim.events.why
                ok, body = shim.health_report()
                assert ok and body["events_foreign"] and FIX in body["events_foreign_why"] and body["events_ok"]
                assert "kvswitch_shim_events_foreign 1.0" in shim.metrics_text().decode()
            # More traffic: still served, still nothing of the other engine published.
            more = [(wa if i % 2 else wb, f"q{i}", p) for i, p in enumerate(_prompts(WINDOW, seed=9))]
            await _serve_all(ns, nats_url, more)
            await asyncio.sleep(0.3)
            for shim in (wa, wb):
                assert shim.publisher is not None and shim.publisher.digest().blocks == 0
                assert len(shim.canonical_hashes()) > 0  # it still folds them (to see its own again)
            assert _said(caplog, logging.ERROR, FIX) == 2  # once per episode


@pytest.mark.parametrize("replay", ["none", "wrapped"])
async def test_a_shim_restarted_beside_a_warm_engine_is_not_foreign(
    replay: str, ns: str, nats_url: str, etcd_url: str
) -> None:
    """The audit's case 1: the engine serves old prompts from a cache the new shim's index misses (no
    replay endpoint, vLLM's default; or a replay buffer wrapped), its usage silent on cached tokens
    (vLLM's default): they store nothing, and new prompts are stored. Requests sent past the shim too."""
    endpoint = LOOPBACK_PUB_ENDPOINT.rsplit(":", 1)[0] + ":0"
    wrapped: dict[str, Any] = {"replay_endpoint": "tcp://127.0.0.1:0", "buffer_steps": 4}
    ev = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoint,
        **({"replay_endpoint": None} if replay == "none" else wrapped),
    )
    async with SimServer(sim_config(kv_events=ev)) as a:
        old = _prompts(4 * WINDOW, seed=7)
        for p in old:  # served before this shim started (a previous shim, the same engine)
            await complete(a.url, p)
        kw: dict[str, Any] = {"kv_replay": None} if replay == "none" else {}
        w = shim_for(a, ns, nats_url, etcd_url, events_timeout_s=0.3, worker_name="wa", **kw)
        async with w:
            await w.registered.wait()
            new = _prompts(WINDOW, seed=8)
            sends: list[tuple[WorkerShim, str, list[int]]] = []
            for i, p in enumerate(old):
                sends.append((w, f"old{i}", p))
                if i % 4 == 3:
                    sends.append((w, f"new{i}", new[i // 4]))
            past = [complete(a.url, p) for p in _prompts(2 * WINDOW, seed=11)]
            await asyncio.gather(_serve_all(ns, nats_url, sends, width=1), *past)
            await asyncio.sleep(1.0)
            assert w.owner.watched >= 2 * WINDOW  # the check ran
            assert not w.owner.foreign, (w.owner.matched, w.owner.own_blocks, w.owner.foreign_blocks)
            assert w.publisher is not None and w.publisher.digest().blocks > 0


async def test_eviction_pressure_is_not_foreign(ns: str, nats_url: str, etcd_url: str) -> None:
    """Blocks stored and evicted before their prompt is served still count as stored."""
    async with SimServer(sim_config(num_gpu_blocks=24)) as a:
        w = shim_for(a, ns, nats_url, etcd_url, events_timeout_s=0.3, worker_name="wa")
        async with w:
            await w.registered.wait()
            sends = [(w, f"p{i}", p) for i, p in enumerate(_prompts(5 * WINDOW, seed=9))]
            await _serve_all(ns, nats_url, sends, width=4)
            await asyncio.sleep(1.0)
            assert w.owner.watched >= WINDOW and not w.owner.foreign


async def test_a_healthy_pair_under_mixed_traffic_is_not_foreign(ns: str, nats_url: str, etcd_url: str) -> None:
    """Prompts through the shims, repeats, prompts sharing a system prompt, and requests sent to each
    engine past its shim (warm-up, health checks): blocks the shim never dispatched, in plenty."""
    timeout = 0.3
    async with SimServer(sim_config()) as a, SimServer(sim_config()) as b:
        wa = shim_for(a, ns, nats_url, etcd_url, events_timeout_s=timeout, worker_name="wa")
        wb = shim_for(b, ns, nats_url, etcd_url, events_timeout_s=timeout, worker_name="wb")
        async with wa, wb:
            await wa.registered.wait()
            await wb.registered.wait()
            rng = random.Random(2)
            system = [rng.randrange(10, 4000) for _ in range(48)]
            prompts = _prompts(3 * WINDOW, seed=3)
            prompts += [system + p[:30] for p in _prompts(WINDOW, seed=4)]
            direct = _prompts(4 * WINDOW, seed=5)
            sends = [(wa if i % 2 else wb, f"p{i}", p) for i, p in enumerate(prompts)]
            sends += [(wb if i % 2 else wa, f"again{i}", p) for i, p in enumerate(prompts[:WINDOW])]
            sends += [(wa if i % 2 else wb, f"was-direct{i}", p) for i, p in enumerate(direct[:WINDOW])]
            rng.shuffle(sends)
            bypass = [complete((a if i % 2 else b).url, p) for i, p in enumerate(direct)]
            await asyncio.gather(_serve_all(ns, nats_url, sends), *bypass)
            await asyncio.sleep(2 * timeout + 0.3)
            for shim in (wa, wb):
                o = shim.owner
                assert o.watched >= WINDOW and o.foreign_blocks >= FOREIGN_MIN, (o.watched, o.foreign_blocks)
                assert not o.foreign and o.matched >= o.watched - 2, (o.watched, o.matched)


def test_the_tokens_hashed_at_dispatch_are_the_prompts_blocks() -> None:
    shim = _shim()
    shim.limits = dataclasses.replace(shim.limits, block_size=B)
    shim.normaliser = Normaliser(B, stats=shim.norm_stats)
    tokens = list(range(100, 170))
    assert shim._dispatched_prompt(tokens, "s") == 0
    shim.owner.stored(block_hashes(tokens, B, salt="s"))  # its engine's Stored of it
    assert (shim.owner.own_blocks, shim.owner.foreign_blocks) == (len(tokens) // B, 0)


async def test_the_verdict_withdraws_the_published_set_and_its_lift_republishes_it() -> None:
    shim = _shim()
    shim.limits = dataclasses.replace(shim.limits, block_size=B)
    shim.normaliser = norm = Normaliser(B, stats=shim.norm_stats)
    tokens = list(range(100, 100 + 4 * B))
    await shim._sink(
        EngineBatch(events=[EngineStored(hashes=[1, 2, 3, 4], parent=None, token_ids=tokens, block_size=B)])
    )
    sent: list[list[Any]] = []
    shim._presence = SimpleNamespace(publisher=SimpleNamespace(add=sent.append), reporter=None)  # type: ignore[assignment]
    shim.events.problems[EventProblem.NO_STORED] = "no Stored"  # raised before the verdict: it would exclude
    shim.owner.foreign = True
    shim._on_owner_change()
    assert sent == [[Cleared()]] and shim.events.ok
    more = list(range(500, 500 + B))
    await shim._sink(EngineBatch(events=[EngineStored(hashes=[9], parent=None, token_ids=more, block_size=B)]))
    assert len(sent) == 1 and len(norm) == 5  # folded, not published
    shim.owner.foreign = False
    shim._on_owner_change()
    assert sent[1] == [Cleared(), *norm.snapshot()] and len(sent[1]) == 6
    shim.owner.close()
    shim.events.close()
