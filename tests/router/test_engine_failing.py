"""A worker whose engine answers /health but fails every completion with a server error is left out
(`engine_failing`) after ENGINE_FAILING_AFTER such failures in a row, tried again by one request
after a cooldown that each failed try doubles, and readmitted when that request is served; a fleet
whose only worker left out so still sends it requests. Before (engine-fault audit of 2026-12-07) such
a worker stayed routable for good: every request it drew failed once and was retried, two such
workers gave clients errors. A server error counts against its worker only once the request's retry
generates output on another: one the request itself causes fails there too and costs neither worker
anything (review of 1f3b368: three such requests left out a healthy worker, six the whole fleet).
Unit tests on Eligibility, then on the Dispatcher, then end to end against real NATS and etcd."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import GenerateRequest, block_hashes
from protocol.config import RouterSettings
from protocol.messages import ErrorInfo, WorkerInfo
from router.dispatch import Dispatcher
from router.eligibility import (
    ENGINE_COOLDOWN_MAX_S,
    ENGINE_COOLDOWN_S,
    ENGINE_FAILING_AFTER,
    Eligibility,
    Exclusion,
    taking_requests,
)
from router.leg import LegError
from router.load_view import Liveness
from router.service import RouterService
from tests.router.conftest import BLOCK, MODEL, Cluster, Worker, complete
from tests.router.polling import until
from tests.router.test_dispatch import HB, Books, answer, chunk, collect, heartbeats_then_answer, job, transfer
from tests.router.test_dispatch import Worker as FakeWorker
from tests.router.test_prefill_breaker import fails_poisoned_requests
from worker_shim.adapters.base import EngineError

FAULT = "500 EngineCore died"
POISON_LAST = 4242  # a prompt's last token standing for "this request's grammar does not compile"


class World:
    def __init__(self) -> None:
        self.now = 1000.0
        self.elig = Eligibility(
            clock=lambda: self.now,
            sync_state=lambda worker: None,
            liveness=lambda worker: Liveness(0.0, 0.5, True, True),
            tokenizer=None,
        )
        self.info = WorkerInfo(worker="a1", model=MODEL, role="agg", engine="vllm", block_size=16)
        self.elig.added("a1")

    def exclusion(self) -> Exclusion | None:
        return self.elig.statuses([self.info])[0].exclusion


def test_a_worker_whose_engine_fails_every_request_is_left_out_then_tried_again_with_a_doubling_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = World()
    with caplog.at_level(logging.INFO, logger="router.eligibility"):
        for _ in range(ENGINE_FAILING_AFTER - 1):
            w.elig.engine_leg("a1", FAULT)
        w.elig.engine_leg("a1", None)  # one served between: the count starts again
        for _ in range(ENGINE_FAILING_AFTER - 1):
            w.elig.engine_leg("a1", FAULT)
        assert w.exclusion() is None
        w.elig.engine_leg("a1", FAULT)
        status = w.elig.statuses([w.info])[0]
        assert status.exclusion is Exclusion.ENGINE_FAILING and status.soft and FAULT in status.detail
        assert taking_requests([status]) == 1  # the only worker of its model: it still serves
        w.now += ENGINE_COOLDOWN_S - 0.1
        w.elig.engine_leg("a1", None)  # one planned before: says nothing
        assert w.exclusion() is Exclusion.ENGINE_FAILING
        w.now += 0.1
        assert w.exclusion() is None  # the next request planned there is the trial
        w.elig.engine_probe("a1", 5.0)
        assert w.exclusion() is Exclusion.ENGINE_FAILING  # one trial, the others keep away
        w.elig.engine_leg("a1", FAULT)  # the trial failed: twice the wait
        w.now += 2 * ENGINE_COOLDOWN_S - 0.1
        assert w.exclusion() is Exclusion.ENGINE_FAILING
        w.now += 0.1
        assert w.exclusion() is None
        w.elig.engine_probe("a1", 5.0)
        w.elig.engine_leg("a1", None)  # the trial was served: readmitted
        assert w.exclusion() is None
        w.elig.engine_leg("a1", FAULT)  # a new count, not the old episode
        assert w.exclusion() is None
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO]  # one episode, however long
    began, ended = said[0][1], said[1][1]
    assert "worker a1" in began and f"failed {ENGINE_FAILING_AFTER} requests" in began and FAULT in began
    assert f"{ENGINE_COOLDOWN_S:g}s" in began and "a1 serves requests again" in ended


def test_the_wait_doubles_up_to_its_cap() -> None:
    w = World()
    for _ in range(ENGINE_FAILING_AFTER):
        w.elig.engine_leg("a1", FAULT)
    wait = ENGINE_COOLDOWN_S
    for _ in range(12):  # every trial fails
        w.now += wait
        assert w.exclusion() is None
        w.elig.engine_probe("a1", 5.0)
        w.elig.engine_leg("a1", FAULT)
        wait = min(2 * wait, ENGINE_COOLDOWN_MAX_S)
    w.now += ENGINE_COOLDOWN_MAX_S - 0.1
    assert w.exclusion() is Exclusion.ENGINE_FAILING
    w.now += 0.1
    assert w.exclusion() is None


def test_a_worker_that_leaves_takes_its_engine_episode_with_it() -> None:
    w = World()
    for _ in range(ENGINE_FAILING_AFTER):
        w.elig.engine_leg("a1", FAULT)
    w.elig.removed("a1")
    w.elig.added("a1")
    assert w.exclusion() is None


def test_a_failure_reported_late_is_not_the_trials() -> None:
    """Module-read audit of 2026-12-07: an engine's 5xx is reported only once the request's retry gave
    output, maybe past the cooldown. Any failure reported then was the trial's: an old one doubled the
    wait and dropped the trial under way, whose success then readmitted nothing. Now a failure of a
    leg from before the trial leaves its verdict standing, and one outside a trial restarts the wait
    at its length."""
    w = World()
    for _ in range(ENGINE_FAILING_AFTER):
        w.elig.engine_leg("a1", FAULT)
    w.now += ENGINE_COOLDOWN_S + 1.0
    w.elig.engine_probe("a1", 30.0)  # the trial
    w.now += 0.5
    w.elig.engine_leg("a1", FAULT, ago_s=ENGINE_COOLDOWN_S + 2.0)  # a leg of before the episode's last failure
    w.elig.engine_leg("a1", FAULT, ago_s=2.0)  # one within the cooldown, planned before the trial
    assert w.exclusion() is Exclusion.ENGINE_FAILING  # the trial still holds it
    w.elig.engine_leg("a1", None)  # the trial was served: readmitted
    assert w.exclusion() is None

    for _ in range(ENGINE_FAILING_AFTER):
        w.elig.engine_leg("a1", FAULT)
    w.now += ENGINE_COOLDOWN_S + 1.0
    w.elig.engine_leg("a1", FAULT, ago_s=0.5)  # past the cooldown, before any trial: not one
    w.now += ENGINE_COOLDOWN_S - 0.5 - 0.1
    assert w.exclusion() is Exclusion.ENGINE_FAILING
    w.now += 0.1
    assert w.exclusion() is None  # its length from that failure, not twice it


# --- Dispatcher --------------------------------------------------------------------------------


def fail_with(code: int, kind: str, message: str = "Internal server error"):  # type: ignore[no-untyped-def]
    async def run(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, final=True, error=ErrorInfo(code=code, kind=kind, message=message))

    return run


class Reports:
    """A Dispatcher recording what it reports of engines."""

    def __init__(self, nc: Client, ns: str) -> None:
        self.engine: list[tuple[str, str | None]] = []
        self.ago: list[float] = []  # ... each one's age (ago_s)
        self.prefill: list[tuple[str, str | None]] = []
        self.prefill_ago: list[float] = []  # ... each one's age (ago_s)
        self.pulls: list[tuple[str, str, bool]] = []
        self.gone: set[str] = set()  # workers whose keys went
        self.dispatcher = Dispatcher(
            nc, ns, Books(), settings=lambda: RouterSettings(stream_heartbeat_s=HB),
            on_engine=self._on_engine,
            on_prefill=self._on_prefill,
            on_transfer=lambda decode, prefill, ok: self.pulls.append((decode, prefill, ok)),
            registered=lambda worker: worker not in self.gone,
        )  # fmt: skip

    def _on_engine(self, worker: str, fault: str | None, ago_s: float) -> None:
        self.engine.append((worker, fault))
        self.ago.append(ago_s)

    def _on_prefill(self, worker: str, fault: str | None, serves_whole: bool, ago_s: float) -> None:
        self.prefill.append((worker, fault))
        self.prefill_ago.append(ago_s)

    def faults(self) -> list[tuple[str, str | None]]:
        return [(worker, fault) for worker, fault in self.engine if fault is not None]


@pytest.fixture
async def reports(nc: Client, ns: str) -> AsyncIterator[Reports]:
    r = Reports(nc, ns)
    await r.dispatcher.start()
    yield r
    await r.dispatcher.stop()


async def test_a_server_error_counts_against_its_worker_once_the_retry_elsewhere_generates_output(
    nc: Client, ns: str, reports: Reports
) -> None:
    await FakeWorker(nc, ns, "w1").serve("decode", fail_with(500, "engine_error"))
    await FakeWorker(nc, ns, "w2").serve("decode", answer)
    chunks = await collect(reports.dispatcher, job("w1", replans=[job("w2").plan]))
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert reports.faults() == [("w1", "500 Internal server error")] and ("w2", None) in reports.engine
    assert reports.dispatcher.legs_failed == {("w1", "engine_error"): 1}


async def test_a_server_error_is_reported_with_its_own_time(nc: Client, ns: str, reports: Reports) -> None:
    """Judged once the retry gave output, it is no failure of a trial begun meanwhile (router.failing_workers)."""
    await FakeWorker(nc, ns, "w1").serve("decode", fail_with(500, "engine_error"))
    # its first token 3 heartbeats on, heartbeats meanwhile: a bare sleep of 2 within the leg's
    # silence of 3 ran past it on a loaded box (a full run's worker_silent)
    await FakeWorker(nc, ns, "w2").serve("decode", heartbeats_then_answer(3 * HB))
    await collect(reports.dispatcher, job("w1", replans=[job("w2").plan]))
    assert reports.engine == [("w2", None), ("w1", "500 Internal server error")]
    assert reports.ago[0] == 0.0 and reports.ago[1] >= 3 * HB


async def test_a_server_error_the_retry_meets_too_is_the_requests_and_counts_against_neither_worker(
    nc: Client, ns: str, reports: Reports
) -> None:
    """vLLM 0.32 answers a request whose grammar fails to compile with a generic 500, alike on every
    engine. Before, each of its two legs counted against its worker: three such requests left out a
    healthy worker (its cached prefixes lost to every request after), six the whole fleet."""
    for name in ("w1", "w2"):
        await FakeWorker(nc, ns, name).serve("decode", fail_with(500, "engine_error"))
    with pytest.raises(LegError) as err:
        await collect(reports.dispatcher, job("w1", replans=[job("w2").plan]))
    assert (err.value.worker, err.value.code) == ("w2", 500)
    assert reports.faults() == []
    assert reports.dispatcher.legs_failed == {("w1", "engine_error"): 1, ("w2", "engine_error"): 1}


async def test_a_server_error_with_no_retry_says_nothing_of_its_worker(nc: Client, ns: str, reports: Reports) -> None:
    """A lone worker (or no time left for a retry): nothing shows whether its engine or the request failed."""
    await FakeWorker(nc, ns, "w1").serve("decode", fail_with(500, "engine_error"))
    with pytest.raises(LegError):
        await collect(reports.dispatcher, job("w1"))
    assert reports.faults() == [] and reports.dispatcher.legs_failed == {("w1", "engine_error"): 1}


async def test_a_server_error_held_for_the_retry_is_not_reported_once_its_worker_left(
    nc: Client, ns: str, reports: Reports
) -> None:
    """Before (review of 84a1cd2), it was reported when the retry served: engine_failing kept a
    streak for a name whose state had gone with it, so one back under that name started with it."""
    await FakeWorker(nc, ns, "w1").serve("decode", fail_with(500, "engine_error"))

    async def w1_leaves_then_answer(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        reports.gone.add("w1")  # its key goes while the retry prefills
        await answer(nc, msg, req)

    await FakeWorker(nc, ns, "w2").serve("decode", w1_leaves_then_answer)
    chunks = await collect(reports.dispatcher, job("w1", replans=[job("w2").plan]))
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert reports.dispatcher.legs_failed == {("w1", "engine_error"): 1} and reports.faults() == []


async def test_a_prefill_server_error_is_put_down_to_the_latest_prefill_leg_only(
    nc: Client, ns: str, reports: Reports
) -> None:
    """Both attempts' prefill legs fail with a 5xx, the retry's fallback serves: only the retry's
    prefill worker is reported, as before 84a1cd2 (which reported both, p1 left out for a 5xx the
    request also met on p2)."""
    for name in ("p1", "p2"):
        await FakeWorker(nc, ns, name).serve("prefill", fail_with(500, "engine_error"))
    await FakeWorker(nc, ns, "d1").serve("decode", fail_with(429, "engine_rejected", "busy"))
    await FakeWorker(nc, ns, "d2").serve("decode", answer)
    chunks = await collect(reports.dispatcher, job("d1", prefill="p1", replans=[job("d2", prefill="p2").plan]))
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert [w for w, fault in reports.prefill if fault is not None] == ["p2"]
    assert reports.faults() == []


async def test_a_prefill_server_error_is_reported_with_its_own_time(nc: Client, ns: str, reports: Reports) -> None:
    """Review of 5536a0b: a prefill leg's 5xx, judged once the fallback gave output, came with no age,
    so one from a leg sent before a prefill_failing probe was the probe's (router.failing_workers)."""
    await FakeWorker(nc, ns, "p1").serve("prefill", fail_with(500, "engine_error"))

    async def slow_first_token(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await asyncio.sleep(2 * HB)  # within the leg's silence of three heartbeats
        await answer(nc, msg, req)

    await FakeWorker(nc, ns, "d1").serve("decode", slow_first_token)
    chunks = await collect(reports.dispatcher, job("d1", prefill="p1"))
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert [(w, fault is not None) for w, fault in reports.prefill] == [("p1", True)]
    assert reports.prefill_ago[0] >= 2 * HB


@pytest.mark.parametrize(
    ("code", "kind", "counted"),
    [(429, "engine_rejected", "engine_busy"), (503, "engine_unavailable", "engine_unavailable")],
)
async def test_a_decode_leg_fed_by_a_transfer_that_fails_otherwise_than_its_pull_is_counted(
    nc: Client, ns: str, reports: Reports, code: int, kind: str, counted: str
) -> None:
    """Before, every failure of a decode leg carrying a transfer handle went uncounted in
    kvswitch_router_worker_legs_failed_total, not only its failed KV pull."""
    await FakeWorker(nc, ns, "p1").serve("prefill", transfer)
    decode = FakeWorker(nc, ns, "d1")
    await decode.serve("decode", fail_with(code, kind, "engine turned it away"))
    with pytest.raises(LegError):
        await collect(reports.dispatcher, job("d1", prefill="p1"))
    assert decode.requests[0].disagg is not None  # the leg carried the handle
    assert reports.dispatcher.legs_failed == {("d1", counted): 1} and reports.faults() == []


async def test_a_failed_kv_pull_is_neither_counted_nor_a_server_error_of_its_decode_worker(
    nc: Client, ns: str, reports: Reports
) -> None:
    """The pair's (router.transfer_health): the pull judged failed, its decode leg raised with no
    time left for the local prefill."""
    await FakeWorker(nc, ns, "p1").serve("prefill", transfer)
    j = job("d1", prefill="p1")

    async def stall_then_pull_fails(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        j.deadline = time.monotonic() - 2.0  # no time for the fallback's leg
        await chunk(
            nc, msg, req, 0, final=True, error=ErrorInfo(code=500, kind="engine_error", message="KV load failed")
        )

    await FakeWorker(nc, ns, "d1").serve("decode", stall_then_pull_fails)
    with pytest.raises(LegError):
        await collect(reports.dispatcher, j)
    assert reports.pulls == [("d1", "p1", False)]
    assert reports.dispatcher.legs_failed == {} and reports.faults() == []


# --- end to end ----------------------------------------------------------------------------------


async def test_an_engine_failing_every_request_is_left_out_tried_after_its_cooldown_and_readmitted(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10 s in service; 2 s here, past the 8 requests sent within it on a loaded box (0.5 s was not)
    monkeypatch.setattr("router.eligibility.ENGINE_COOLDOWN_S", 2.0)
    bad = await cluster.add_worker("agg")
    generate = bad.shim.adapter.generate
    fails_poisoned_requests(bad, every=True)
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router()

    def failed() -> int:
        return router.dispatcher.legs_failed[bad.id, "engine_error"]

    n = 0
    while failed() < ENGINE_FAILING_AFTER:
        n += 1
        assert n <= 60, "the failing worker drew no request"
        status, _, _ = await complete(http, router, list(range(n * 100, n * 100 + 40)), max_tokens=2)
        assert status == 200  # retried on the healthy worker
    listed = {st["worker"]: st for st in router.worker_listing()["worker_status"]}
    assert listed[bad.id]["excluded"] == "engine_failing" and "Internal server error" in listed[bad.id]["why"]
    retries = router.dispatcher.retries
    for k in range(8):  # within its cooldown: none goes there, none is retried
        status, _, headers = await complete(http, router, list(range(9000 + k * 100, 9040 + k * 100)), max_tokens=2)
        assert status == 200 and headers["x-kvswitch-decode-worker"] != bad.id
    assert failed() == ENGINE_FAILING_AFTER and router.dispatcher.retries == retries
    bad.shim.adapter.generate = generate  # type: ignore[method-assign]  # the engine is fixed
    served = bad.requests_served
    await asyncio.sleep(2.1)  # past the cooldown
    n = 0
    while bad.requests_served == served:  # past the cooldown, a request tries it again
        n += 1
        assert n <= 60, "no request tried the worker again"
        status, _, _ = await complete(http, router, list(range(20000 + n * 100, 20040 + n * 100)), max_tokens=2)
        assert status == 200
    listed = {st["worker"]: st for st in router.worker_listing()["worker_status"]}
    assert listed[bad.id]["excluded"] is None
    scraped = router.metrics.render().decode()
    assert f'kvswitch_router_worker_legs_failed_total{{kind="engine_error",worker="{bad.id}"}} 3.0' in scraped


async def _left_out_beside(cluster: Cluster, http: aiohttp.ClientSession) -> tuple[Worker, Worker, RouterService]:
    """A worker whose engine fails every request, left out after its requests were retried on a healthy one."""
    bad = await cluster.add_worker("agg")
    fails_poisoned_requests(bad, every=True)
    good = await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    n = 0
    while router.dispatcher.legs_failed[bad.id, "engine_error"] < ENGINE_FAILING_AFTER:
        n += 1
        assert n <= 60, "the failing worker drew no request"
        status, _, _ = await complete(http, router, list(range(n * 100, n * 100 + 40)), max_tokens=2)
        assert status == 200
    listed = {st["worker"]: st["excluded"] for st in router.worker_listing()["worker_status"]}
    assert listed[bad.id] == "engine_failing"
    return bad, good, router


async def test_a_fleet_whose_only_worker_left_out_as_engine_failing_still_sends_it_requests(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    bad, good, router = await _left_out_beside(cluster, http)
    good_id = good.id
    await good.shim.stop()  # its key goes: the failing worker is its model's only one
    cluster.workers.remove(good)
    await good.sim.stop()
    await until(lambda: router.registry.get(good_id) is None, what="the healthy worker's key to go")
    before = router.dispatcher.legs_failed[bad.id, "engine_error"]
    answers = [await complete(http, router, list(range(k * 100, k * 100 + 40)), max_tokens=2) for k in range(5)]
    listed = {st["worker"]: st["excluded"] for st in router.worker_listing()["worker_status"]}
    assert listed[bad.id] == "engine_failing"
    assert router.dispatcher.legs_failed[bad.id, "engine_error"] == before + 5  # sent each, excluded or not
    # each the engine's own error, not a 503 for want of a worker
    assert all(status >= 500 and status != 503 for status, _, _ in answers), answers
    ready, body = router.readiness()
    assert ready and any("its 1 engine_failing ones" in w for w in body["warnings"]), body["warnings"]


async def test_a_lone_worker_whose_requests_all_fail_is_not_left_out(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """With no other worker to retry on, nothing shows whether its engine or the requests failed
    (vLLM 0.32's 500 for a grammar that fails to compile): counted, not left out, /ready silent."""
    only = await cluster.add_worker("agg")
    fails_poisoned_requests(only, every=True)
    router = await cluster.add_ready_router()
    answers = [await complete(http, router, list(range(k * 100, k * 100 + 40)), max_tokens=2) for k in range(5)]
    assert all(status >= 500 and status != 503 for status, _, _ in answers), answers
    listed = {st["worker"]: st["excluded"] for st in router.worker_listing()["worker_status"]}
    assert listed[only.id] is None
    assert router.dispatcher.legs_failed[only.id, "engine_error"] == 5
    ready, body = router.readiness()
    assert ready and body["warnings"] == []


def poisons_last_token(worker: Worker) -> None:
    """The engine fails, with vLLM's generic 500, a request whose prompt ends in POISON_LAST (as it
    fails one whose grammar does not compile), and serves the rest."""
    adapter = worker.shim.adapter
    generate = adapter.generate

    async def patched(leg, on_output):  # type: ignore[no-untyped-def]
        if leg.token_ids and leg.token_ids[-1] == POISON_LAST:
            raise EngineError(500, "engine_error", "Internal server error")
        return await generate(leg, on_output)

    adapter.generate = patched  # type: ignore[method-assign]


async def test_a_clients_requests_that_fail_on_every_engine_leave_no_worker_out(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Review of 1f3b368: three such requests sharing a warm prefix left its worker out as
    engine_failing, and the next sound request lost the prefix; six left out the whole fleet, /ready
    warning of a build its engines share."""
    workers = [await cluster.add_worker("agg") for _ in range(3)]
    for w in workers:
        poisons_last_token(w)
    router = await cluster.add_ready_router()
    prefix = list(range(1000, 1064))  # a shared system prompt, 4 blocks
    status, _, headers = await complete(http, router, [*prefix, 7], max_tokens=2)
    assert status == 200
    warm = headers["x-kvswitch-decode-worker"]
    hashes = block_hashes(prefix, BLOCK)
    await until(lambda: router.index.find_matches(hashes).get(warm, 0) == len(hashes), what="kv events")
    for k in range(3):
        status, _, headers = await complete(http, router, [*prefix, k + 1, POISON_LAST], max_tokens=2)
        assert status == 502  # the engine's server error
    assert router.dispatcher.legs_failed[warm, "engine_error"] == 3  # each tried the warm worker first
    status, _, headers = await complete(http, router, [*prefix, 9], max_tokens=2)
    assert status == 200 and headers["x-kvswitch-decode-worker"] == warm
    for k in range(3, 6):
        status, _, _ = await complete(http, router, [*range(5000 + k * 100, 5040 + k * 100), POISON_LAST], max_tokens=2)
        assert status == 502  # the engine's server error
    assert sum(router.dispatcher.legs_failed.values()) == 12  # each request's two legs
    listed = {st["worker"]: st["excluded"] for st in router.worker_listing()["worker_status"]}
    assert listed == {w.id: None for w in workers}
    ready, body = router.readiness()
    assert ready and body["warnings"] == []
