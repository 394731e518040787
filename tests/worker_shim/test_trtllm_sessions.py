"""The TensorRT-LLM adapter across a shim's sessions, against stand-ins shaped as trtllm-serve
answers (tensorrt_llm/executor/executor.py, serve/openai_server.py): an engine that has served
nothing yet, limits an idle engine hands out once, an events poll held while events keep coming,
a load read that repeats the last one, and a poll answer that is no JSON."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import nats
import pytest
from aiohttp import web
from nats.aio.msg import Msg

from protocol import GenerateRequest, LoadReport, SamplingParams, block_hashes, decode_msg, subjects
from protocol.config import EtcdSettings, NatsSettings
from tests.router.polling import until
from tests.worker_shim.cluster import collector
from tests.worker_shim.test_request_service import Collector
from tests.worker_shim.test_trtllm_adapter import CREATED, stored
from tests.worker_shim.test_trtllm_serve import TPB, USABLE, _engine, chopped
from worker_shim import Normaliser, ShimConfig, ShimStatus, WorkerShim
from worker_shim.adapters import trtllm
from worker_shim.adapters.base import EngineCold, EngineError, EngineHealth
from worker_shim.adapters.trtllm import TrtllmAdapter
from worker_shim.engine_events import EngineBatch, EngineRestarted, EngineStored

STATS = {"numActiveRequests": 0, "numQueuedRequests": 0,
         "kvCacheStats": {"maxNumBlocks": 512, "usedNumBlocks": 0, "tokensPerBlock": TPB}}  # fmt: skip


def _settings(nats_url: str, etcd_url: str) -> tuple[NatsSettings, EtcdSettings]:
    return NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url])


async def _ok(request: web.Request) -> web.Response:
    return web.Response()


def _completion(token_ids: list[int]) -> dict[str, Any]:
    """A non-streamed /v1/completions answer with `detokenize: false`."""
    choice = {"index": 0, "text": "", "token_ids": token_ids, "finish_reason": "length"}
    usage = {"prompt_tokens": 1, "completion_tokens": len(token_ids), "total_tokens": 1 + len(token_ids)}
    return {"choices": [choice], "usage": usage}


# --- an engine that has served nothing yet ---------------------------------------------------------


@dataclass
class _Fresh:
    """A trtllm-serve that has run no request: `aget_stats` is empty_async_iterable() (/metrics
    answers []) and `aget_kv_events` asserts, which get_kv_cache_events does not catch (FastAPI: a
    500), until its first generate_async. `stats_first`: its /metrics answers at once, as an engine
    restarted under limits the shim held would look."""

    stats_first: bool = False
    generated: int = 0

    async def metrics(self, request: web.Request) -> web.Response:
        return web.json_response([STATS] if self.generated or self.stats_first else [])

    async def events(self, request: web.Request) -> web.Response:
        if not self.generated:
            return web.Response(status=500, text="Internal Server Error")
        return web.json_response([])

    async def completions(self, request: web.Request) -> web.Response:
        self.generated += 1
        return web.json_response(_completion([7]))

    def routes(self) -> dict[str, Any]:
        return {"/metrics": self.metrics, "/kv_cache_events": self.events, "/health": _ok,
                "/v1/completions": self.completions}  # fmt: skip


def _scripted(reads: list[list[Any]], health: dict[str, int], polls: list[list[Any]]) -> dict[str, Any]:
    """An engine's /metrics, /health and /kv_cache_events, answered from `reads`, `health` and `polls`
    as the test changes them (an empty list answers [])."""

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(reads.pop(0) if reads else [])

    async def health_route(request: web.Request) -> web.Response:
        return web.Response(status=health["status"])

    async def kv_cache_events(request: web.Request) -> web.Response:
        return web.json_response(polls.pop(0) if polls else [])

    return {"/metrics": metrics, "/health": health_route, "/kv_cache_events": kv_cache_events}


@pytest.mark.parametrize(
    ("block_size", "stats_first"), [(None, False), (TPB, False), (None, True)], ids=["no-flag", "block-size", "events"]
)
async def test_an_engine_that_has_served_nothing_gets_one_request_and_the_worker_registers(
    ns: str, nats_url: str, etcd_url: str, block_size: int | None, stats_first: bool
) -> None:
    """Until 2026-12-07 a fresh trtllm-serve never got a worker: without --block-size its [] ended the
    shim ("give --block-size"); with it, or with its stats there, the event stream's 500 failed every
    session before registration, and the engine saw no request ever."""
    engine = _Fresh(stats_first)
    async with _engine(engine.routes()) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1,
                         block_size=block_size)  # fmt: skip
        async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
            await until(lambda: shim.status in (ShimStatus.REGISTERED, ShimStatus.FAILED), 10, "registered")
            assert shim.status is ShimStatus.REGISTERED, shim.failure
            assert (engine.generated, shim.probe.alive, shim.session_failures) == (1, 1, 0)
            assert shim.limits.block_size == TPB
            # The events poll answers at once here: the lag stays small, on /health and /metrics.
            lag = shim.health_report()[1]["events_lag_s"]
            assert lag is not None and 0 <= lag < 1
            assert "kvswitch_shim_kv_events_poll_lag_seconds " in shim.metrics_text().decode()


async def test_with_no_endpoint_probe_a_fresh_engine_gets_no_request_and_the_session_says_why(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _Fresh()
    async with _engine(engine.routes()) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1,
                         no_endpoint_probe=True)  # fmt: skip
        with caplog.at_level(logging.ERROR, logger="worker_shim.shim"):
            async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
                await until(lambda: shim.session_failures >= 1, 10, "a failed session")
                assert shim.status is ShimStatus.WAITING_ENGINE and engine.generated == 0  # retried, not ended
        said = [r.getMessage() for r in caplog.records]
        assert any("--no-endpoint-probe sends it no one-token request" in m for m in said), said


@pytest.mark.parametrize("block_size", [TPB, None], ids=["block-size", "no-flag"])
async def test_an_engine_with_no_stats_after_its_warm_up_takes_the_flags_or_is_retried(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, block_size: int | None
) -> None:
    """A trtllm-serve without enable_iter_perf_stats answers [] for good: --block-size stands in
    (one WARNING), as before 2026-12-07; without it the session fails and is retried, no startup
    error (the stats of one with them may only lag its first answer)."""
    engine = _Fresh()

    async def no_stats(request: web.Request) -> web.Response:
        return web.json_response([])

    async with _engine({**engine.routes(), "/metrics": no_stats}) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1,
                         block_size=block_size)  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="worker_shim.shim"):
            async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
                if block_size is None:
                    await until(lambda: shim.session_failures >= 2, 10, "failed sessions")
                    assert shim.status is ShimStatus.WAITING_ENGINE and shim.failure is None
                    return
                await until(lambda: shim.serving, 10, "registered")
                assert (shim.limits.block_size, engine.generated, shim.session_failures) == (TPB, 1, 0)
        said = [r.getMessage() for r in caplog.records if "the flags stand in" in r.getMessage()]
        assert len(said) == 1 and "enable_iter_perf_stats" in said[0], said


async def test_an_event_stream_still_failing_after_the_warm_up_fails_the_session_once_per_request(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A 500 that a served request does not cure is no cold engine: the session fails (an ERROR,
    counted, retried after a wait that doubles), one one-token request each, never a tight loop."""
    engine = _Fresh(stats_first=True)

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="Internal Server Error")

    async with _engine({**engine.routes(), "/kv_cache_events": broken}) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1)
        with caplog.at_level(logging.ERROR, logger="worker_shim.shim"):
            async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
                await until(lambda: shim.session_failures >= 3, 10, "three failed sessions")
                assert shim.status is ShimStatus.WAITING_ENGINE and shim.registration_count == 0
                assert engine.generated in (shim.session_failures, shim.session_failures + 1)
        said = [r.getMessage() for r in caplog.records]
        assert any("still so after it served one" in m for m in said), said


async def test_a_stop_during_the_warm_up_ends_it_at_once_and_is_no_failed_session(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The one-token request may take up to --stall-limit-s: a stop cancels it (its connection
    closed), and the session that was starting ends without an ERROR."""
    engine = _Fresh()
    arrived, release = asyncio.Event(), asyncio.Event()

    async def stuck(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()  # the stand-in's handler outlives the shim's closed connection
        return web.Response()

    async with _engine({**engine.routes(), "/v1/completions": stuck}) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1,
                         stall_limit_s=60.0)  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="worker_shim.shim"):
            shim = WorkerShim(cfg, *_settings(nats_url, etcd_url))
            await shim.start()
            await asyncio.wait_for(arrived.wait(), 10)
            t0 = time.monotonic()
            await shim.stop()
            release.set()
        assert time.monotonic() - t0 < 3 and shim.status is ShimStatus.STOPPED and shim.session_failures == 0
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_limits_read_hold_for_an_idle_engines_empty_answers_until_it_may_have_restarted() -> None:
    """trtllm-serve hands each iteration's stats out once: after the first read an idle engine
    answers []. Until 2026-12-07 that was "no limits": a second session (any NATS blip) ended the
    shim asking for --block-size. Held, they are dropped when /health says down or the events
    start over (a restart), where the next engine may have others."""
    reads: list[list[Any]] = []
    health = {"status": 200}

    polls = [[CREATED, stored(1, None, (11, [1] * TPB))], [CREATED]]
    routes = _scripted(reads, health, polls)
    async with _engine(routes) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            reads.append([STATS])
            assert (await adapter.limits()).block_size == TPB
            assert (await adapter.limits()).block_size == TPB  # [] now: the limits read stand
            health["status"] = 503
            assert await adapter.health() is EngineHealth.DOWN
            with pytest.raises(EngineCold):  # it may be back as another engine
                await adapter.limits()
            reads.append([STATS])
            assert (await adapter.limits()).block_size == TPB
            got: list[EngineBatch] = []
            task = asyncio.create_task(adapter.run_events(collector(got), asyncio.Event()))
            with pytest.raises(EngineRestarted):  # the engine's start shown again (event 0)
                await asyncio.wait_for(task, 5)
            assert adapter.tracker.restarts == 1
            with pytest.raises(EngineCold):
                await adapter.limits()
        finally:
            await adapter.close()


async def test_an_engine_restarted_cold_with_other_limits_registers_with_its_own(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine behind the URL is replaced, unseen by /health, by one with another block size
    that has served nothing (its /metrics answers [], so the held limits stood): its events' 500
    shows a fresh engine, whose limits are read after the warm-up, before registering. Until
    2026-12-07 the worker registered with the old ones, and every event was dropped ("block_size
    ... differs")."""
    old = _Fresh(stats_first=True)
    new = _Restarted()
    engine: dict[str, Any] = {"now": old, "proxy_page": False}

    async def route(name: str, request: web.Request) -> web.StreamResponse:
        if name == "events" and engine["proxy_page"]:  # the session ends on a 502, no transport error
            engine["proxy_page"], engine["now"] = False, new  # ... as the engine is replaced
            return web.Response(status=502, text="Bad Gateway")
        answer: web.StreamResponse = await getattr(engine["now"], name)(request)
        return answer

    paths = {"/metrics": "metrics", "/kv_cache_events": "events", "/v1/completions": "completions"}
    routes = {path: functools.partial(route, name) for path, name in paths.items()}
    async with _engine({**routes, "/health": _ok}) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1)
        with caplog.at_level(logging.INFO, logger="worker_shim.shim"):
            async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
                await until(lambda: shim.serving, 10, "registered on the first engine")
                assert (shim.limits.block_size, shim.registration_count) == (TPB, 1)
                engine["proxy_page"] = True
                await until(lambda: shim.registration_count == 2 and shim.serving, 10, "registered again")
                assert (shim.limits.block_size, shim.limits.kv_total_blocks) == (2 * TPB, 1024)
                assert new.generated == 1
        assert any("a fresh one with other limits" in r.getMessage() for r in caplog.records)


class _Restarted(_Fresh):
    """A fresh engine with twice the block size and 1,024 blocks."""

    async def metrics(self, request: web.Request) -> web.Response:
        kv = {"maxNumBlocks": 1024, "usedNumBlocks": 0, "tokensPerBlock": 2 * TPB}
        return web.json_response([{**STATS, "kvCacheStats": kv}] if self.generated else [])


async def test_a_restart_only_the_event_ids_show_ends_the_session_and_the_next_takes_its_limits(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """trtllm-serve restarted between two health checks with twice the block size: its event ids
    start over at 0. Until 2026-12-08 the stream was reset and the session kept its worker id and
    the old limits (every Stored of the new size dropped); now the session ends, the worker
    registers anew with the new engine's limits, and the new run's events are indexed: those the
    poll that showed the restart drained first (no replay: until 2026-12-08 they were dropped, the
    state stayed partial and their children had an unknown parent), then the next poll's."""
    engine = {"new": False}
    polls: list[list[Any]] = [[CREATED, stored(1, None, (11, [1] * TPB))]]
    new_kv = {"maxNumBlocks": 1024, "usedNumBlocks": 0, "tokensPerBlock": 2 * TPB}

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response([{**STATS, "kvCacheStats": new_kv}] if engine["new"] else [STATS])

    async def events(request: web.Request) -> web.Response:
        return web.json_response(polls.pop(0) if polls else [])

    async def completions(request: web.Request) -> web.Response:
        return web.json_response(_completion([7]))

    routes = {"/metrics": metrics, "/kv_cache_events": events, "/health": _ok, "/v1/completions": completions}
    async with _engine(routes) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1)
        with caplog.at_level(logging.WARNING, logger="worker_shim.shim"):
            async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
                await until(lambda: shim.serving, 10, "registered")
                assert (shim.limits.block_size, shim.registration_count) == (TPB, 1)
                engine["new"] = True
                created = {**CREATED, "data": {"type": "created", "num_blocks_per_cache_level": [1024, 0]}}
                a, b, c = [2] * 2 * TPB, [4] * 2 * TPB, [3] * 2 * TPB
                polls.append([created, stored(1, None, (21, a)), stored(2, 21, (23, b))])
                await until(lambda: shim.registration_count == 2 and shim.serving, 10, "registered anew")
                assert (shim.limits.block_size, shim.limits.kv_total_blocks) == (2 * TPB, 1024)
                polls.append([stored(3, 23, (22, c))])  # a child of the restart poll's blocks
                norm = shim.normaliser
                assert norm is not None and isinstance(shim.adapter, TrtllmAdapter)
                await until(lambda: len(norm.canonical_hashes()) == 3, 5, "the new run's blocks")
                assert norm.canonical_hashes() == set(block_hashes([*a, *b, *c], 2 * TPB))
                assert norm.exact and norm.stats.unknown_parent == 0  # complete: the engine's start seen
                assert (shim.registration_count, shim.adapter.tracker.restarts) == (2, 1)
        said = [r.getMessage() for r in caplog.records]
        assert any("its KV event ids went back from 1 to 0" in m for m in said), said


@pytest.mark.parametrize("health_saw", [True, False], ids=["health-saw-it", "unseen"])
async def test_a_streams_first_poll_from_zero_is_a_restart_only_against_limits_held(health_saw: bool) -> None:
    """Event ids are compared with the run of the engine whose limits the session took. After
    /health said down the limits are read anew from the engine back at the URL: its ids from 0 are
    its own start, no second restart of a session that ended already. Held (a restart between
    sessions, unseen), they are the old engine's: ids that went back end the new stream, before any
    of the new run is delivered."""
    reads: list[list[Any]] = [[STATS]]
    health = {"status": 200}
    polls: list[list[Any]] = [[CREATED, stored(1, None, (11, [1] * TPB))]]

    routes = _scripted(reads, health, polls)
    async with _engine(routes) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            assert (await adapter.limits()).block_size == TPB
            first = asyncio.create_task(adapter.run_events(collector([]), asyncio.Event()))
            await until(lambda: not polls and adapter.tracker.last_id == 1, 5, "the first run's events")
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            if health_saw:
                health["status"] = 503
                assert await adapter.health() is EngineHealth.DOWN
                health["status"] = 200
                reads.append([STATS])
            assert (await adapter.limits()).block_size == TPB  # read anew, or held
            polls.append([CREATED, stored(1, None, (21, [2] * TPB))])
            got: list[EngineBatch] = []
            task = asyncio.create_task(adapter.run_events(collector(got), asyncio.Event()))
            if health_saw:
                await until(lambda: len(got) == 2, 5, "the new run's first batch")
                task.cancel()
                assert (got[1].reset, got[1].complete, len(got[1].events)) == (True, True, 1)
                assert adapter.tracker.restarts == 0
            else:
                with pytest.raises(EngineRestarted, match="went back from 1 to 0"):
                    await asyncio.wait_for(task, 5)
                assert got == [EngineBatch(reset=True, complete=False)] and adapter.tracker.restarts == 1
        finally:
            await adapter.close()


async def test_a_metrics_read_hung_with_a_gone_engine_is_given_up_when_health_says_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A /metrics read hung on an engine whose host went away silently (no FIN, no RST, no read
    deadline) stayed the adapter's read in flight after /health said down: until 2026-12-08 every
    later limits() failed with the "held its answer ... set return_perf_metrics" 503 and load()
    reported the last load, iterating (progress to the stall watchdog), until close(). A load()
    waiting on it when health says down fails, not left waiting on a gone engine."""
    monkeypatch.setattr(trtllm, "LIMITS_WAIT_S", 0.5)
    monkeypatch.setattr(trtllm, "LOAD_WAIT_S", 0.2)
    calls = {"metrics": 0}
    health = {"status": 200}
    never = asyncio.Event()

    async def metrics(request: web.Request) -> web.Response:
        calls["metrics"] += 1
        if calls["metrics"] in (2, 5):
            await never.wait()  # the engine's host gone mid-answer
        return web.json_response([STATS])

    async def health_route(request: web.Request) -> web.Response:
        return web.Response(status=health["status"])

    async def down_and_up() -> None:
        health["status"] = 503
        assert await adapter.health() is EngineHealth.DOWN
        health["status"] = 200

    async with _engine({"/metrics": metrics, "/health": health_route}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            assert (await adapter.limits()).block_size == TPB
            assert (await adapter.load()).stale  # the read hangs
            await down_and_up()
            assert (await adapter.limits()).block_size == TPB  # read anew from the engine back
            assert not (await adapter.load()).stale and calls["metrics"] == 4
            monkeypatch.setattr(trtllm, "LOAD_WAIT_S", 30.0)
            waiting = asyncio.create_task(adapter.load())
            await until(lambda: calls["metrics"] == 5, 5, "the next read hung")
            await down_and_up()
            with pytest.raises(EngineError) as err:
                await asyncio.wait_for(waiting, 5)
            assert err.value.code == 503 and "during the read" in err.value.message
        finally:
            never.set()
            await adapter.close()


@pytest.mark.parametrize("went_down", [False, True], ids=["next-session", "engine-down-between"])
async def test_the_new_runs_events_the_restart_poll_drained_open_the_next_session(went_down: bool) -> None:
    """The poll whose ids went back drained the new run's first events (trtllm-serve has no replay):
    the next session folds them first, with its limits, from a complete reset, and a block stored
    under them later is indexed. Until 2026-12-08 they were dropped with the ended session: its
    successor stayed partial and the child had an unknown parent. An engine /health saw go down
    between the sessions may be another: that run's events are not delivered."""
    reads: list[list[Any]] = [[STATS]]
    health = {"status": 200}
    polls: list[list[Any]] = [[CREATED, stored(1, None, (11, [1] * TPB))]]

    a, b, c = [2] * TPB, [3] * TPB, [4] * TPB
    routes = _scripted(reads, health, polls)
    async with _engine(routes) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            await adapter.limits()
            first = asyncio.create_task(adapter.run_events(collector([]), asyncio.Event()))
            await until(lambda: adapter.tracker.last_id == 1, 5, "the first run's events")
            polls.append([stored(2, 11, (12, [5] * TPB)), CREATED, stored(1, None, (21, a)), stored(2, 21, (22, b))])
            with pytest.raises(EngineRestarted, match="went back from 2 to 0"):
                await asyncio.wait_for(first, 5)
            if went_down:
                health["status"] = 503
                assert await adapter.health() is EngineHealth.DOWN
                health["status"] = 200
                polls.append([CREATED, stored(1, None, (31, c))])  # the engine back at the URL
            else:
                polls.append([stored(3, 22, (23, c))])  # a child of the restart poll's blocks
            reads.append([STATS])
            await adapter.limits()
            got: list[EngineBatch] = []
            task = asyncio.create_task(adapter.run_events(collector(got), asyncio.Event()))
            await until(lambda: not polls and adapter.tracker.last_id == (1 if went_down else 3), 5, "the next poll")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await adapter.close()
    norm = Normaliser(TPB)
    for batch in got:
        if batch.reset:
            norm.reset(exact=batch.complete)
        norm.apply(batch.events)
    want = block_hashes(c, TPB) if went_down else block_hashes([*a, *b, *c], TPB)
    assert norm.canonical_hashes() == set(want) and norm.exact and norm.stats.unknown_parent == 0
    assert (adapter.tracker.restarts, adapter.tracker.ignored, adapter.tracker.partial) == (1, 0, 0)


@pytest.mark.parametrize("run3", ["answers", "fresh"])
async def test_another_engine_taking_the_url_after_a_restart_starts_the_next_session_afresh(run3: str) -> None:
    """A restart's held-over run (run 2) opens the next session, but another engine (run 3) took the
    URL meanwhile, /health never down: its first poll's ids go back right after them. Until
    2026-12-08 the held-over events set `live` and `answered`, and that step back was a second
    EngineRestarted (run 2's blocks published as exact, the session ended, restarts counted twice);
    a fresh run 3's 500 was a plain EngineError, not EngineCold. Now it is a reset, complete from
    run 3's created event 0, the session's state run 3's."""
    reads: list[list[Any]] = [[STATS]]
    polls: list[list[Any] | None] = [[CREATED, stored(1, None, (11, [1] * TPB))]]  # None: a 500

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(reads.pop(0) if reads else [])

    async def kv_cache_events(request: web.Request) -> web.Response:
        answer = polls.pop(0) if polls else []
        return web.Response(status=500) if answer is None else web.json_response(answer)

    a, b, c = [2] * TPB, [3] * TPB, [4] * TPB
    routes = {"/metrics": metrics, "/health": _ok, "/kv_cache_events": kv_cache_events}
    async with _engine(routes) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            await adapter.limits()
            first = asyncio.create_task(adapter.run_events(collector([]), asyncio.Event()))
            await until(lambda: adapter.tracker.last_id == 1, 5, "run 1's events")
            polls.append([stored(2, 11, (12, [5] * TPB)), CREATED, stored(1, None, (21, a)), stored(2, 21, (22, b))])
            with pytest.raises(EngineRestarted, match="went back from 2 to 0"):
                await asyncio.wait_for(first, 5)
            assert await adapter.health() is EngineHealth.UP  # never down: the run held over is kept
            polls.append([CREATED, stored(1, None, (31, c))] if run3 == "answers" else None)
            reads.append([STATS])
            await adapter.limits()
            got: list[EngineBatch] = []
            live = asyncio.Event()
            task = asyncio.create_task(adapter.run_events(collector(got), live))
            if run3 == "fresh":
                with pytest.raises(EngineCold):
                    await asyncio.wait_for(task, 5)
                assert not live.is_set()
                return
            await until(lambda: task.done() or (live.is_set() and adapter.tracker.last_id == 1), 5, "run 3's events")
            assert not task.done(), task.exception()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await adapter.close()
    norm = Normaliser(TPB)
    for batch in got:
        if batch.reset:
            norm.reset(exact=batch.complete)
        norm.apply(batch.events)
    assert norm.canonical_hashes() == set(block_hashes(c, TPB)) and norm.exact
    # runs 1→2 and 2→3: two restarts the stream showed, only the first ending a session (until
    # later on 2026-12-08 the second was counted nowhere)
    assert adapter.tracker.restarts == 2


@pytest.mark.parametrize("end", ["proxy-503", "stop"])
async def test_a_session_ended_before_the_engine_answered_hands_the_held_over_run_on(end: str) -> None:
    """A restart's held-over run opens the next session, which ends before the engine answers its
    first poll (a proxy's 503; a stop, as LIVE_TIMEOUT_S makes): the session after starts with that
    run again, complete, and a block stored under it is indexed. Until 2026-12-08 the run was lost
    with the session: the next one stayed partial and the child had an unknown parent."""
    reads: list[list[Any]] = [[STATS]]
    polls: list[list[Any] | int] = [[CREATED, stored(1, None, (11, [1] * TPB))]]  # an int: that status
    hold = asyncio.Event()
    held: list[bool] = []

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(reads.pop(0) if reads else [])

    async def kv_cache_events(request: web.Request) -> web.Response:
        if end == "stop" and len(held) == 1:
            held.append(True)
            await hold.wait()  # the engine holds this session's first poll until the stop
            return web.json_response([])  # to no one
        answer = polls.pop(0) if polls else []
        return web.Response(status=answer) if isinstance(answer, int) else web.json_response(answer)

    a, b, c = [2] * TPB, [3] * TPB, [4] * TPB
    routes = {"/metrics": metrics, "/health": _ok, "/kv_cache_events": kv_cache_events}
    async with _engine(routes) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            await adapter.limits()
            first = asyncio.create_task(adapter.run_events(collector([]), asyncio.Event()))
            await until(lambda: adapter.tracker.last_id == 1, 5, "run 1's events")
            polls.append([stored(2, 11, (12, [5] * TPB)), CREATED, stored(1, None, (21, a)), stored(2, 21, (22, b))])
            with pytest.raises(EngineRestarted, match="went back from 2 to 0"):
                await asyncio.wait_for(first, 5)
            reads.append([STATS])
            await adapter.limits()
            live = asyncio.Event()
            second = asyncio.create_task(adapter.run_events(collector([]), live))
            if end == "proxy-503":
                polls.append(503)
                with pytest.raises(EngineError) as err:
                    await asyncio.wait_for(second, 5)
                assert err.value.code == 503
            else:
                held.append(True)
                await until(lambda: len(held) == 2, 5, "the second session's first poll")
                second.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await second
                hold.set()
            assert not live.is_set()
            polls.append([stored(3, 22, (23, c))])  # a child of the held-over run's blocks
            got: list[EngineBatch] = []
            third = asyncio.create_task(adapter.run_events(collector(got), asyncio.Event()))
            await until(lambda: adapter.tracker.last_id == 3, 5, "the third session's poll")
            third.cancel()
            with pytest.raises(asyncio.CancelledError):
                await third
        finally:
            hold.set()
            await adapter.close()
    norm = Normaliser(TPB)
    for batch in got:
        if batch.reset:
            norm.reset(exact=batch.complete)
        norm.apply(batch.events)
    assert norm.canonical_hashes() == set(block_hashes([*a, *b, *c], TPB))
    assert norm.exact and norm.stats.unknown_parent == 0
    assert (adapter.tracker.restarts, adapter.tracker.partial) == (1, 0)


async def test_held_limits_go_with_a_fresh_engines_500_and_an_engine_gone() -> None:
    """An events poll answered 500 (a fresh engine's stream) or failing on the transport (the
    engine gone) drops the limits held: the engine next behind the URL may have others."""
    polls: list[Any] = []

    async def kv_cache_events(request: web.Request) -> web.StreamResponse:
        poll = polls.pop(0) if polls else []
        if poll == "500":
            return web.Response(status=500, text="Internal Server Error")
        if poll == "cut":
            assert request.transport is not None
            request.transport.close()  # the engine's process gone mid-answer
        return web.json_response(poll)

    reads: list[Any] = []

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(reads.pop(0) if reads else [])

    async with _engine({"/metrics": metrics, "/kv_cache_events": kv_cache_events}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            for failure, raised in (("500", EngineCold), ("cut", EngineError)):
                reads.append([STATS])
                assert (await adapter.limits()).block_size == TPB
                assert (await adapter.limits()).block_size == TPB  # [] now: held
                polls.append(failure)
                with pytest.raises(raised):
                    await adapter.run_events(collector([]), asyncio.Event())
                with pytest.raises(EngineCold):  # dropped: [] is no limits now
                    await adapter.limits()
        finally:
            await adapter.close()


# --- an events poll the engine holds while events keep coming -------------------------------------


def test_the_events_poll_has_no_read_deadline() -> None:
    """trtllm-serve's get_kv_cache_events_async(2) answers once 2 s pass with no new event: under
    steady load, not while it lasts. A 30 s read deadline (until 2026-12-07) gave up such a poll,
    lost the events the engine had handed over for it, and ended the session: the worker
    re-registered every 30 s (an audit: 300 events handed over, 0 received). Liveness is the
    health probe's to judge."""
    timeout = trtllm.EVENTS_TIMEOUT
    assert (timeout.total, timeout.sock_read) == (None, None)


class _HeldEvents:
    """get_kv_cache_events_async(`quiet_s`): a poll answers once `quiet_s` pass with no new event."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.handed = 0
        self.eid = 0

    async def events(self, request: web.Request) -> web.Response:
        got = []
        while True:
            try:
                got.append(await asyncio.wait_for(self.queue.get(), self.quiet_s))
            except TimeoutError:
                break
        self.handed += len(got)
        return web.json_response(got)

    async def traffic(self, seconds: float) -> None:
        """A stored event every 50 ms."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.eid += 1
            self.queue.put_nowait(stored(self.eid, None, (1000 + self.eid, [self.eid] * TPB)))
            await asyncio.sleep(0.05)


async def test_a_poll_held_under_steady_events_is_kept_said_once_and_its_lag_shown(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(trtllm, "EVENTS_HELD_SAY_S", 0.4)
    engine = _HeldEvents(quiet_s=0.3)
    engine.queue.put_nowait(CREATED)
    async with _engine({"/kv_cache_events": engine.events}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url, block_size=TPB))
        await adapter.open()
        got: list[EngineBatch] = []
        task = asyncio.create_task(adapter.run_events(collector(got), live := asyncio.Event()))
        try:
            with caplog.at_level(logging.WARNING, logger="worker_shim.adapters.trtllm"):
                for _ in range(2):  # two bursts, each poll held while it lasts
                    burst = asyncio.create_task(engine.traffic(1.0))
                    await asyncio.sleep(0.8)
                    lag = adapter.events_lag_s()
                    assert lag is not None and lag > 0.6  # the poll in flight since the burst began
                    await burst
                    await until(lambda: engine.queue.empty() and (adapter.events_lag_s() or 9) < 0.3, 5, "answered")
            assert live.is_set() and not task.done()
            received = sum(1 for b in got for e in b.events if isinstance(e, EngineStored))
            assert received == engine.handed - 1 == engine.eid  # every event handed over (less CREATED)
            said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(said) == 1 and "cannot give a current index" in said[0]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await adapter.close()
    assert adapter.events_lag_s() is None  # no poll runs


# --- a load read that repeats the last one ----------------------------------------------------------


class _Buffered:
    """trtllm-serve with return_perf_metrics and enable_iter_perf_stats (PR #13405): /metrics
    answers at once from a buffer its collector refills only once a request finishes, so from idle a
    long request reads [] until it ends. `legacy`: get_stats_async(2), held while iterations run.
    One non-streamed request runs `run_s`."""

    def __init__(self, run_s: float, legacy: bool) -> None:
        self.run_s = run_s
        self.legacy = legacy
        self.running = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.reads = [[STATS]]  # the idle engine's last iteration, then nothing until a completion

    async def metrics(self, request: web.Request) -> web.Response:
        if self.legacy:
            await self.idle.wait()
        return web.json_response(self.reads.pop(0) if self.reads else [])

    async def completions(self, request: web.Request) -> web.Response:
        self.running += 1
        self.idle.clear()
        await asyncio.sleep(self.run_s)  # decoding: iterations run, none of them finished yet
        self.running -= 1
        self.idle.set()
        return web.json_response(_completion(list(range(64))))

    def routes(self) -> dict[str, Any]:
        kv = iter([[CREATED]])

        async def kv_cache_events(request: web.Request) -> web.Response:
            return web.json_response(next(kv, []))

        return {"/metrics": self.metrics, "/kv_cache_events": kv_cache_events, "/health": _ok,
                "/v1/completions": self.completions}  # fmt: skip


@pytest.mark.parametrize("legacy", [False, True], ids=["buffered", "legacy"])
async def test_a_long_non_streamed_request_from_idle_is_no_hang_and_its_worker_reads_busy(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, legacy: bool
) -> None:
    """Until 2026-12-07 TensorRT-LLM's [] (or a held /metrics) repeated the idle load as fresh:
    the stall watchdog saw no progress and ended the request as hung after --stall-limit-s (the
    worker deregistered), and the load reports told routers the busy worker was idle."""
    engine = _Buffered(run_s=3.5, legacy=legacy)
    nc = await nats.connect(nats_url)
    reports: list[LoadReport] = []
    async with _engine(engine.routes()) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1,
                         stall_limit_s=1.5, load_period_s=0.2)  # fmt: skip
        with caplog.at_level(logging.INFO):
            async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
                await until(lambda: shim.worker_id is not None and shim.serving, 10, "registered")
                worker = shim.worker_id
                assert worker is not None

                async def on_load(msg: Msg) -> None:
                    reports.append(decode_msg(msg.data, LoadReport))

                await nc.subscribe(subjects.load(ns, worker), cb=on_load)
                col = Collector(nc)
                await col.start()
                req = GenerateRequest(request_id="long", model="m", token_ids=list(range(1, 100)),
                                      sampling=SamplingParams(max_tokens=64), stream=False)  # fmt: skip
                await col.send(subjects.gen(ns, "agg", worker), req)
                await until(lambda: engine.running == 1, 5, "the request on the engine")
                await asyncio.sleep(1.0)
                during = reports[-1]
                final = await col.final("long", timeout=10)
                assert final.error is None and final.finish_reason == "length"
                assert (shim.worker_id, shim.registration_count, shim.serving) == (worker, 1, True)
                assert during.running == 1  # the shim's own leg, under the repeated idle figures
    await nc.close()
    assert not [r.getMessage() for r in caplog.records if "no progress" in r.getMessage()]


# --- a hung engine ---------------------------------------------------------------------------------


class _Streamer:
    """trtllm-serve streaming one leg: three tokens, then `hang` (its executor runs no iteration
    again: /metrics, get_stats_async(QUIET), answers [] after QUIET with no iteration, /health says
    its process is alive) or, `legacy` and busy with other work for `pause_s`, no token for this leg
    while iterations run (get_stats_async holds /metrics), then the rest."""

    QUIET = 0.3  # get_stats_async's 2 s, shortened

    def __init__(self, *, hang: bool, pause_s: float = 0.0) -> None:
        self.hang, self.pause_s = hang, pause_s
        self.paused = asyncio.Event()
        self.gone = asyncio.Event()  # the test is over: a hung handler returns, so the stand-in stops
        self.idle = asyncio.Event()  # cleared while iterations run
        self.idle.set()
        self.reads = [[STATS]]

    async def metrics(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.QUIET)
        await self.idle.wait()  # held until QUIET passes with no iteration
        return web.json_response(self.reads.pop(0) if self.reads else [])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def token(t: int, finish: str | None = None) -> None:
            choice = {"index": 0, "text": "", "token_ids": [t], "finish_reason": finish}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())

        for t in (5, 6, 7):
            await token(t)
        self.paused.set()
        if self.hang:
            await self.gone.wait()
            return resp
        self.idle.clear()
        await asyncio.sleep(self.pause_s)
        self.idle.set()
        await token(8, "length")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def routes(self) -> dict[str, Any]:
        kv = iter([[CREATED]])

        async def kv_cache_events(request: web.Request) -> web.Response:
            await asyncio.sleep(self.QUIET)
            return web.json_response(next(kv, []))

        return {"/metrics": self.metrics, "/kv_cache_events": kv_cache_events, "/health": _ok,
                "/v1/completions": self.completions}  # fmt: skip


async def _stream_one(
    engine: _Streamer, ns: str, nats_url: str, etcd_url: str, within_s: float
) -> tuple[float, Any, bool]:
    """Stream one leg through a shim on `engine` (stall limit 1.5 s): (seconds from the engine's
    pause to the leg's end, the final chunk, whether the worker is still registered as it was)."""
    nc = await nats.connect(nats_url)
    try:
        async with _engine(engine.routes()) as url:
            cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1,
                             stall_limit_s=1.5, load_period_s=0.2)  # fmt: skip
            try:
                async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
                    await until(lambda: shim.serving, 10, "registered")
                    worker = shim.worker_id
                    assert worker is not None
                    col = Collector(nc)
                    await col.start()
                    req = GenerateRequest(request_id="s", model="m", token_ids=list(range(1, 100)),
                                          sampling=SamplingParams(max_tokens=4), stream=True)  # fmt: skip
                    await col.send(subjects.gen(ns, "agg", worker), req)
                    await asyncio.wait_for(engine.paused.wait(), 5)
                    t0 = time.monotonic()
                    final = await col.final("s", timeout=within_s)
                    took = time.monotonic() - t0
                    return took, final, (shim.worker_id, shim.registration_count, shim.serving) == (worker, 1, True)
            finally:
                engine.gone.set()
    finally:
        await nc.close()


async def test_a_hung_engine_whose_metrics_answer_empty_is_caught_by_its_streamed_legs(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung executor runs no iteration: every /metrics answer is [] (stale), and trtllm-serve's
    /health says only that its process is alive. Until 2026-12-07 stale readings left progress
    unknown, so the stall watchdog never judged: the leg hung until its deadline (600 s). A leg that
    has streamed output tells progress itself."""
    with caplog.at_level(logging.ERROR, logger="worker_shim.shim"):
        took, final, _ = await _stream_one(_Streamer(hang=True), ns, nats_url, etcd_url, within_s=8)
    assert final.error is not None and final.error.kind == "engine_unavailable", final
    assert took < 6, took  # the stall limit (1.5 s), a few readings late at most
    assert any("no progress" in r.getMessage() for r in caplog.records)


async def test_a_streamed_leg_waiting_while_a_held_metrics_shows_iterations_is_no_hang(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without return_perf_metrics trtllm-serve holds /metrics while iterations run: a held answer
    is the engine working, so a streamed leg that waits past the stall limit (others' work) is not
    ended as hung."""
    monkeypatch.setattr(trtllm, "LOAD_WAIT_S", 0.5)  # 2.5 s upstream: under the stall limit here
    with caplog.at_level(logging.INFO):
        _, final, same_worker = await _stream_one(_Streamer(hang=False, pause_s=4.0), ns, nats_url, etcd_url, 10)
    assert final.error is None and final.finish_reason == "length", final
    assert same_worker
    assert not [r.getMessage() for r in caplog.records if "no progress" in r.getMessage()]


# --- a poll answer that is no JSON ---------------------------------------------------------------


async def test_one_poll_answered_with_a_proxys_page_is_a_counted_gap_not_a_new_worker(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """Until 2026-12-07 one such answer ended the event stream, so the session: the worker
    re-registered under a new id, kv_events_malformed_total and session_failures_total at 0."""
    bad = {"left": 0}
    polls = [[CREATED, chopped(1, None, USABLE, 0x100)]]

    async def kv_cache_events(request: web.Request) -> web.Response:
        if bad["left"]:
            bad["left"] -= 1
            return web.Response(body=b"<html>502 Bad Gateway</html>", content_type="text/html")
        return web.json_response(polls.pop(0) if polls else [])

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response([STATS])

    routes = {"/kv_cache_events": kv_cache_events, "/metrics": metrics, "/health": _ok}
    async with _engine(routes) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1)
        async with WorkerShim(cfg, *_settings(nats_url, etcd_url)) as shim:
            await until(lambda: shim.serving and len(shim.canonical_hashes()) == 4, 10, "the stored blocks indexed")
            worker = shim.worker_id
            bad["left"] = 1
            await until(lambda: bad["left"] == 0, 5, "the page served")
            await until(lambda: not shim.canonical_hashes(), 5, "the state reset")
            await asyncio.sleep(0.5)  # polls go on
            text = shim.metrics_text().decode()
            assert (shim.worker_id, shim.registration_count, shim.session_failures) == (worker, 1, 0)
            assert shim.serving and "kvswitch_shim_kv_events_malformed_total 1.0" in text
