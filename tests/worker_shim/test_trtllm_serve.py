"""The TensorRT-LLM adapter against stand-ins shaped as trtllm-serve's own code answers:
partly filled last blocks in `stored` events, a `/metrics` that holds its answer while the engine
iterates, and token-id legs that need `detokenize: false`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import nats
import pytest
from aiohttp import web
from nats.aio.msg import Msg

from protocol import LoadReport, SamplingParams, block_hashes, decode_msg, subjects
from protocol.config import EtcdSettings, NatsSettings
from tests.router.polling import until
from tests.worker_shim.cluster import collector, served
from tests.worker_shim.test_trtllm_adapter import CREATED, folded, removed, stored
from worker_shim import EngineLoad, Normaliser, ShimConfig, ShimStatus, WorkerShim
from worker_shim.adapters import trtllm
from worker_shim.adapters.base import EngineCold, EngineError, EngineHealth, LegRequest
from worker_shim.adapters.trtllm import TrtllmAdapter, disagg_body
from worker_shim.adapters.trtllm_events import TrtllmEventTracker
from worker_shim.load_reporter import LoadReporter

TPB = 32
# TensorRT-LLM's test_llm_kv_events_api: a 127-token prompt and 6 output tokens store 132 (the
# last token's KV is never written): storeBlocksForReuse chops them with allowPartial, 4 x 32 + 4.
USABLE = [*range(1000, 1127), *range(7, 12)]


def chopped(eid: int, parent: int | None, tokens: list[int], first_hash: int) -> dict[str, Any]:
    """A `stored` event as kvCacheManager.cpp builds it: every block, the last one partly filled."""
    blocks = [(first_hash + i, tokens[s : s + TPB]) for i, s in enumerate(range(0, len(tokens), TPB))]
    return stored(eid, parent, *blocks)


# --- stored events ending in a partly filled block -----------------------------------------------


@pytest.mark.parametrize("block_size", [TPB, None])
def test_a_stored_event_ending_in_a_partial_block_indexes_its_full_blocks(block_size: int | None) -> None:
    """The trailing partial block made the event's block size -1: the normaliser dropped the whole
    event as malformed and voided its hashes, so the next turn, stored under them, was lost too."""
    tracker = TrtllmEventTracker() if block_size is None else TrtllmEventTracker(block_size=block_size)
    norm = Normaliser(TPB)
    first = chopped(1, None, USABLE, 0x100)
    assert [len(b["tokens"]) for b in first["data"]["blocks"]] == [32, 32, 32, 32, 4]
    folded(tracker, norm, [CREATED, first])
    assert norm.canonical_hashes() == set(block_hashes(USABLE[:128], TPB))
    assert (norm.stats.malformed, tracker.malformed, tracker.partial) == (0, 0, 1)
    # The next turn matches the 4 full blocks and stores its own under the last one (0x103).
    turn2 = USABLE[:128] + list(range(2000, 2040))
    folded(tracker, norm, [chopped(2, 0x103, turn2[128:], 0x200), removed(3, 0x104)])
    assert norm.holds(block_hashes(turn2[:160], TPB)[-1]) and len(norm) == 5
    assert (norm.stats.malformed, norm.stats.unknown_parent, tracker.partial) == (0, 0, 2)


def test_an_event_of_one_partial_block_is_dropped_not_malformed() -> None:
    tracker, norm = TrtllmEventTracker(block_size=TPB), Normaliser(TPB)
    (batch,) = folded(tracker, norm, [CREATED, stored(1, None, (0x300, list(range(5))))])
    assert batch.events == [] and len(norm) == 0
    assert (tracker.malformed, norm.stats.malformed, tracker.partial) == (0, 0, 1)


@pytest.mark.parametrize("sizes", [[32, 4, 32], [32, 4, 4], [16, 16]])
def test_a_short_block_that_is_not_last_stays_malformed(sizes: list[int]) -> None:
    tracker, norm = TrtllmEventTracker(block_size=TPB), Normaliser(TPB)
    blocks = [(0x400 + i, list(range(n))) for i, n in enumerate(sizes)]
    folded(tracker, norm, [CREATED, stored(1, None, *blocks)])
    assert len(norm) == 0 and norm.stats.malformed == 1


async def test_the_shim_indexes_full_blocks_and_exports_the_partial_count(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """End to end: the block size the adapter's limits read (kvCacheStats.tokensPerBlock) decides
    what is partial, and the count is `kvswitch_shim_kv_transport_partial_total`."""
    polls = [[CREATED, chopped(1, None, USABLE, 0x100), stored(2, 0x103, (0x500, list(range(3))))]]

    async def kv_cache_events(request: web.Request) -> web.Response:
        return web.json_response(polls.pop(0) if polls else [])

    stats = [{"numActiveRequests": 0, "numQueuedRequests": 0, "kvCacheStats": {"maxNumBlocks": 512,
              "usedNumBlocks": 0, "tokensPerBlock": TPB}}]  # fmt: skip
    routes = {"/kv_cache_events": kv_cache_events, "/metrics": _json_route(stats), "/health": _json_route({})}
    async with _engine(routes) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1)
        async with WorkerShim(cfg, NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url])) as shim:
            await until(lambda: shim.status is ShimStatus.REGISTERED, 10, "registered")
            await until(lambda: shim.normaliser is not None and len(shim.normaliser) == 4, 5, "4 blocks indexed")
            assert shim.norm_stats.malformed == 0
            assert shim.normaliser is not None
            assert shim.normaliser.canonical_hashes() == set(block_hashes(USABLE[:128], TPB))
            assert "kvswitch_shim_kv_transport_partial_total 2.0" in shim.metrics_text().decode()


@pytest.mark.parametrize("stats", [[{"kvCacheStats": {"maxNumBlocks": 512}}], []], ids=["no-tokensPerBlock", "none"])
async def test_limits_give_the_tracker_the_engines_block_size_or_the_flag(stats: list[Any]) -> None:
    """No stats at all is an engine that has served nothing yet: EngineCold (the shim warms it up)."""
    async with _engine({"/metrics": _json_route(stats)}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url, block_size=16))
        await adapter.open()
        try:
            if stats:
                assert (await adapter.limits()).block_size is None
            else:
                with pytest.raises(EngineCold):
                    await adapter.limits()
            assert adapter.tracker.block_size == 16
        finally:
            await adapter.close()


# --- a /metrics that answers once 2 s pass with no iteration -------------------------------------


class _IterStats:
    """trtllm-serve's legacy `/metrics` (openai_server.py get_iteration_stats over
    `get_stats_async(2)`, executor/result.py IterationResult): each call drains the stats queue
    until 2 s pass with no new entry; a new request (`mark_undone`) makes it wait again."""

    IDLE_S = 2.0  # the wait for a new entry: under traffic, a call answers this long after it ends

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.done = True
        self.calls = 0
        self.posted = 0
        self.answered: list[int] = []  # stats per answer

    async def metrics(self, request: web.Request) -> web.Response:
        self.calls += 1
        got = []
        while not self.done:
            try:
                got.append(await asyncio.wait_for(self.queue.get(), self.IDLE_S))
            except TimeoutError:
                self.done = True
        self.answered.append(len(got))
        return web.json_response(got)

    async def traffic(self, seconds: float) -> None:
        """One iteration's stats every 20 ms, new requests arriving all along."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.done = False
            self.queue.put_nowait(
                {
                    "iter": self.posted,
                    "numActiveRequests": 3,
                    "numQueuedRequests": 1,
                    "kvCacheStats": {"maxNumBlocks": 512, "usedNumBlocks": 128, "tokensPerBlock": TPB},
                }
            )
            self.posted += 1
            await asyncio.sleep(0.02)


async def test_a_busy_engine_holding_its_metrics_is_not_reported_unhealthy(nats_url: str) -> None:
    """The load poll gave up after 2 s: every poll under traffic failed, the worker reported
    healthy=False, and each abandoned handler drained the engine's stats into a closed connection."""
    engine = _IterStats()
    health_s: list[float] = []

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    routes = {"/metrics": engine.metrics, "/health": health, "/kv_cache_events": _json_route([])}
    async with _engine(routes) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        nc = await nats.connect(nats_url)
        sent: list[LoadReport] = []

        async def on_load(msg: Msg) -> None:
            sent.append(decode_msg(msg.data, LoadReport))

        await nc.subscribe(subjects.load("ns", "w"), cb=on_load)
        reporter = LoadReporter(nc, "ns", "w", adapter, lambda: 0, 512, poll_s=0.25)
        events = asyncio.create_task(adapter.run_events(collector([]), live := asyncio.Event()))
        try:
            traffic = asyncio.create_task(engine.traffic(3.0))
            reporter.start()
            healthy = []
            while not traffic.done():
                healthy.append(reporter.healthy)
                t0 = time.monotonic()
                await adapter.health()
                health_s.append(time.monotonic() - t0)
                await asyncio.sleep(0.1)
            # The held read blocks neither: a health check behind it would wait out the traffic and
            # the engine's IDLE_S after it; a free one takes milliseconds, a loaded box's 0.53 s once.
            assert all(healthy) and max(health_s) < _IterStats.IDLE_S / 2
            assert live.is_set() and not events.done()
            # Once the load pauses the engine answers the read in flight: the newest stats arrive.
            limits = await adapter.limits()
            assert (limits.block_size, adapter.tracker.block_size) == (TPB, TPB)
            await until(lambda: reporter.report().running == 3, 5, "the newest load")
            assert reporter.healthy and reporter.report().waiting == 1
            assert engine.answered[0] == engine.posted  # one read took every stat: none drained for nobody
            # and the routers heard it so: every report sent said healthy, the newest the engine's load
            await until(lambda: bool(sent) and sent[-1].running == 3, 5, "the newest load on NATS")
            assert all(r.healthy for r in sent)
        finally:
            events.cancel()
            await reporter.stop()
            await adapter.close()
            await nc.close()


async def test_load_waits_for_an_answer_held_past_two_seconds() -> None:
    """An engine that just went quiet answers 2 s after its last iteration: past the old probe limit."""
    stat = {"numActiveRequests": 3, "numQueuedRequests": 0, "kvCacheStats": {"maxNumBlocks": 8, "usedNumBlocks": 2}}

    async def metrics(request: web.Request) -> web.Response:
        await asyncio.sleep(2.2)
        return web.json_response([stat])

    async with _engine({"/metrics": metrics}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            got = await adapter.load()
            assert (got.running, got.kv_usage) == (3, 0.25)
        finally:
            await adapter.close()


async def test_limits_past_their_wait_fail_the_session_naming_return_perf_metrics(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(trtllm, "LIMITS_WAIT_S", 0.3)
    monkeypatch.setattr(trtllm, "LOAD_WAIT_S", 0.2)
    engine = _IterStats()
    async with _engine({"/metrics": engine.metrics}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        traffic = asyncio.create_task(engine.traffic(1.0))
        try:
            with pytest.raises(EngineError) as err:
                await adapter.limits()
            assert err.value.code == 503 and "return_perf_metrics" in err.value.message
            with caplog.at_level(logging.WARNING, logger="worker_shim.adapters.trtllm"):
                held = EngineLoad(stale=True, iterating=True)  # the last load (none yet), repeated; iterations run
                assert await adapter.load() == held and await adapter.load() == held
            assert len(caplog.records) == 1 and "return_perf_metrics: true" in caplog.records[0].getMessage()
            assert engine.calls == 1  # the held read is joined, not abandoned for a new one
        finally:
            traffic.cancel()
            await adapter.close()


async def test_limits_held_stand_for_an_answer_held_past_their_wait(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A busy engine without return_perf_metrics holds /metrics while its load lasts: with limits
    held from an earlier answer (the same engine: a restart drops them), a new session takes them,
    said once. Until 2026-12-07 it failed with 503 and was retried until the load paused: any
    session restart took a loaded worker out for its busy period."""
    engine = _IterStats()
    async with _engine({"/metrics": engine.metrics}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            await engine.traffic(0.1)
            read = await adapter.limits()  # answered 2 s after the last iteration
            assert (read.block_size, read.kv_total_blocks) == (TPB, 512)
            monkeypatch.setattr(trtllm, "LOAD_WAIT_S", 0.3)  # the wait with limits held; 2.5 s upstream
            traffic = asyncio.create_task(engine.traffic(1.5))
            with caplog.at_level(logging.WARNING, logger="worker_shim.adapters.trtllm"):
                t0 = time.monotonic()
                assert await adapter.limits() == read and await adapter.limits() == read
                assert time.monotonic() - t0 < 10.0  # not LIMITS_WAIT_S (30 s), which is for limits unknown
            said = [r.getMessage() for r in caplog.records]
            assert len(said) == 1 and "takes the limits read before" in said[0], said
            await traffic
        finally:
            await adapter.close()


async def test_metrics_answering_empty_after_served_legs_is_said_once_naming_pr_13405(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A trtllm-serve with return_perf_metrics but without PR #13405 has its Prometheus collector
    drain the stats /metrics would answer: reads come back [] while requests run and end. Each was
    only a stale load, so a worker reporting its last load for good said nothing. [] from an idle
    engine, or fewer than EMPTY_SAY_READS since a read with stats, stays unsaid."""
    stats = {"numActiveRequests": 1, "numQueuedRequests": 0,
             "kvCacheStats": {"maxNumBlocks": 512, "usedNumBlocks": 8, "tokensPerBlock": TPB}}  # fmt: skip
    answers: list[list[Any]] = [[stats], [], [], [], [], [], [stats]]  # then [] for good

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(answers.pop(0) if answers else [])

    async def on_output(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
        pass

    leg = LegRequest("r", "m", [1, 2, 3, 4], SamplingParams(max_tokens=2), stream=False)
    async with _engine({"/metrics": metrics, "/v1/completions": completions}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:

            async def served_then_read(n: int) -> list[str]:
                for _ in range(n):
                    await adapter.generate(leg, on_output)
                    assert (await adapter.load()).running == 1  # the last load read, stale
                said = [r.getMessage() for r in caplog.records]
                caplog.clear()
                return said

            caplog.set_level(logging.WARNING, logger="worker_shim.adapters.trtllm")
            assert (await adapter.limits()).kv_total_blocks == 512
            assert [(await adapter.load()).stale for _ in range(3)] == [True] * 3  # idle: nothing ran
            assert await served_then_read(0) == []
            assert await served_then_read(3) == []  # [], [], then stats: no run of 3
            assert await served_then_read(2) == []
            (said,) = await served_then_read(1)
            assert "answered [] 3 times since its last answer with stats" in said and "PR #13405" in said
            assert "turn return_perf_metrics off" in said
            assert await served_then_read(2) == []  # once
        finally:
            await adapter.close()


async def _served_and_read(adapter: TrtllmAdapter, legs: int) -> None:
    async def on_output(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
        pass

    for _ in range(legs):
        await adapter.generate(LegRequest("r", "m", [1, 2, 3, 4], SamplingParams(max_tokens=2)), on_output)
        assert (await adapter.load()).stale


async def test_metrics_empty_reads_count_since_the_last_with_stats_across_idle_reads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An idle read's [] between served ones proves nothing either way (a racing collector's idle
    reads answer [] too): it neither counts nor resets, and the WARNING says "since its last answer
    with stats". Until 2026-12-07 it said "in a row" over such reads."""
    stats = {"numActiveRequests": 1, "numQueuedRequests": 0,
             "kvCacheStats": {"maxNumBlocks": 512, "usedNumBlocks": 8, "tokensPerBlock": TPB}}  # fmt: skip
    answers: list[list[Any]] = [[stats]]  # then [] for good

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(answers.pop(0) if answers else [])

    caplog.set_level(logging.WARNING, logger="worker_shim.adapters.trtllm")
    async with _engine({"/metrics": metrics, "/v1/completions": completions}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            assert (await adapter.limits()).kv_total_blocks == 512
            for _ in range(trtllm.EMPTY_SAY_READS - 1):
                await _served_and_read(adapter, 1)
                assert (await adapter.load()).stale  # idle: no leg ended since the read before
            assert caplog.records == []
            await _served_and_read(adapter, 1)
        finally:
            await adapter.close()
    (said,) = [r.getMessage() for r in caplog.records]
    assert f"answered [] {trtllm.EMPTY_SAY_READS} times since its last answer with stats" in said
    assert "PR #13405" in said


async def test_metrics_empty_from_an_engine_without_iteration_stats_names_no_pr_13405(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A trtllm-serve without enable_iter_perf_stats answers [] forever (--block-size stands in for
    its limits): no collector runs, no stats go elsewhere. Until 2026-12-07 three served legs, each
    followed by a load read, said the PR #13405 race and to turn return_perf_metrics off."""

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response([])

    caplog.set_level(logging.WARNING, logger="worker_shim.adapters.trtllm")
    async with _engine({"/metrics": metrics, "/v1/completions": completions}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url, block_size=32))
        await adapter.open()
        try:
            await _served_and_read(adapter, 2 * trtllm.EMPTY_SAY_READS)
        finally:
            await adapter.close()
    assert caplog.records == []


async def test_metrics_empty_after_a_restart_counts_only_once_the_new_engine_gave_stats(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stats read from an engine say nothing of the one a restart brings up (/health down): one
    without enable_iter_perf_stats, answering [] forever, is not taken for the PR #13405 race."""
    stats = {"numActiveRequests": 1, "numQueuedRequests": 0,
             "kvCacheStats": {"maxNumBlocks": 512, "usedNumBlocks": 8, "tokensPerBlock": TPB}}  # fmt: skip
    answers: list[list[Any]] = [[stats]]  # then [] for good

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(answers.pop(0) if answers else [])

    caplog.set_level(logging.WARNING, logger="worker_shim.adapters.trtllm")
    async with _engine({"/metrics": metrics, "/v1/completions": completions}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            assert (await adapter.limits()).kv_total_blocks == 512
            assert await adapter.health() is EngineHealth.DOWN  # no /health route: restarting
            await _served_and_read(adapter, 2 * trtllm.EMPTY_SAY_READS)
        finally:
            await adapter.close()
    assert caplog.records == []


# --- token-id legs ---------------------------------------------------------------------------------


def _choice(ids: list[int], text: str, detokenize: bool, finish: str | None) -> dict[str, Any]:
    # tensorrt_llm/serve/postprocess_handlers.py completion_(response|stream)_post_processor
    return {"index": 0, "text": text if detokenize else "", "token_ids": None if detokenize else ids,
            "logprobs": None, "finish_reason": finish, "stop_reason": None}  # fmt: skip


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    detok = body.get("detokenize", True)  # CompletionRequest.detokenize defaults to True
    if not body.get("stream"):
        choice = _choice([9906, 1917], " Hello world", detok, "length")
        usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": usage})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for ids, text, finish in (([9906], " Hello", None), ([1917], " world", "length")):
        chunk = {"id": "cmpl-1", "object": "text_completion", "choices": [_choice(ids, text, detok, finish)]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.mark.parametrize("stream", [False, True])
async def test_a_token_id_leg_asks_trtllm_serve_for_token_ids(stream: bool) -> None:
    """Without `detokenize: false` trtllm-serve returns text and no token_ids: every token-id leg
    ended in 502 engine_protocol."""
    leg = LegRequest("r", "m", [1, 2, 3, 4], SamplingParams(max_tokens=2), stream=stream)
    assert disagg_body(leg)["detokenize"] is False
    passed = LegRequest("r", "m", [1, 2], SamplingParams(), endpoint="completions", params={"prompt": "x"})
    assert "detokenize" not in disagg_body(passed)  # the client's own request is the client's

    async def on_output(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
        pass

    async with _engine({"/v1/completions": completions}) as url:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=url))
        await adapter.open()
        try:
            out = await adapter.generate(leg, on_output)
        finally:
            await adapter.close()
    assert (out.finish_reason, out.token_ids) == ("length", [9906, 1917])


# --- helpers ---------------------------------------------------------------------------------------


def _json_route(value: Any) -> Any:
    async def handle(request: web.Request) -> web.Response:
        return web.json_response(value)

    return handle


@asynccontextmanager
async def _engine(routes: dict[str, Any]) -> AsyncIterator[str]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_route("*", path, handler)
    async with served(app) as url:
        yield url
