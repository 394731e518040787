"""A worker whose engine answers /health but fails every completion with a server error is left out
(`engine_failing`) after ENGINE_FAILING_AFTER such failures in a row, tried again by one request
after a cooldown that each failed try doubles, and readmitted when that request is served; a fleet
whose only worker fails so still sends it requests. Before (engine-fault audit of 2026-12-07) such
a worker stayed routable for good: every request it drew failed once and was retried, two such
workers gave clients errors. Unit tests on Eligibility, then end to end against real NATS and etcd."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from protocol.messages import WorkerInfo
from router.eligibility import (
    ENGINE_COOLDOWN_MAX_S,
    ENGINE_COOLDOWN_S,
    ENGINE_FAILING_AFTER,
    Eligibility,
    Exclusion,
    taking_requests,
)
from router.load_view import Liveness
from tests.router.conftest import MODEL, Cluster, complete
from tests.router.test_prefill_breaker import fails_poisoned_requests

FAULT = "500 EngineCore died"


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


# --- end to end ----------------------------------------------------------------------------------


async def test_an_engine_failing_every_request_is_left_out_tried_after_its_cooldown_and_readmitted(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("router.eligibility.ENGINE_COOLDOWN_S", 0.5)  # 10 s in service
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
    await asyncio.sleep(0.6)  # past the cooldown
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


async def test_a_fleet_whose_only_worker_fails_every_request_still_sends_it_requests(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    only = await cluster.add_worker("agg")
    fails_poisoned_requests(only, every=True)
    router = await cluster.add_ready_router()
    answers = [await complete(http, router, list(range(k * 100, k * 100 + 40)), max_tokens=2) for k in range(5)]
    listed = {st["worker"]: st["excluded"] for st in router.worker_listing()["worker_status"]}
    assert listed[only.id] == "engine_failing"
    assert router.dispatcher.legs_failed[only.id, "engine_error"] == 5  # sent each, excluded or not
    # each the engine's own error, not a 503 for want of a worker
    assert all(status >= 500 and status != 503 for status, _, _ in answers), answers
    ready, body = router.readiness()
    assert ready and any("its 1 engine_failing ones" in w for w in body["warnings"]), body["warnings"]
