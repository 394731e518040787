"""A router whose --nats-servers is not its shims' NATS says so (router.unheard): it reads their
records from etcd and hears nothing of them over NATS. Before (ops review of 2026-12-06), each
worker read `bootstrapping` with its kvstate failures counted, the gap repair's ERROR said to see
the shim's log, a clean one, and no message named --nats-servers."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

import aiohttp
import pytest

from kvswitch.servers import NatsServer
from router import unheard
from router.fleet_news import CHECK_S
from router.gap_repair import FailureKind
from router.unheard import UNHEARD_S, Unheard
from tests.router.conftest import Cluster
from tests.router.polling import until


@dataclass
class Fleet:
    """What an Unheard is told of each worker, and its clock."""

    now: float = 0.0
    heard: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)  # some subscriber answers or times out: not no responders

    def unheard(self) -> Unheard:
        return Unheard(
            ["nats://10.0.0.9:4222"],
            heard=lambda w: w in self.heard,
            nobody_subscribes=lambda w: w not in self.answered,
            clock=lambda: self.now,
        )


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    out = [r.getMessage() for r in caplog.records if r.name == "router.unheard"]
    caplog.clear()
    return out


def test_a_worker_unheard_past_the_grace_is_said_once_and_a_young_one_is_not(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.unheard")
    fleet = Fleet()
    watch = fleet.unheard()
    watch.added("w1")
    fleet.now = UNHEARD_S - 0.1  # a shim starting, or a router just started: its record is young
    watch.check(["w1"])
    assert said(caplog) == [] and watch.problem(["w1"]) is None
    fleet.now = UNHEARD_S
    watch.check(["w1"])
    (line,) = said(caplog)
    assert "worker w1 has been registered in etcd for 10 s" in line and "nats://10.0.0.9:4222" in line, line
    assert "--nats-servers" in line
    problem = watch.problem(["w1"])
    assert problem is not None and "this router's --nats-servers may not be the shims' NATS" in problem, problem
    assert "10.0.0.9" not in problem and "its log names the URLs" in problem, problem  # /ready carries no key
    fleet.now += 60
    watch.check(["w1"])
    assert said(caplog) == []  # once, until it is heard
    fleet.heard.add("w1")
    watch.check(["w1"])
    assert said(caplog) == [] and watch.problem(["w1"]) is None


def test_what_is_heard_or_answered_or_registered_anew_is_not_unheard(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.unheard")
    fleet = Fleet(heard={"reports"}, answered={"times_out"})
    watch = fleet.unheard()
    for w in ("reports", "times_out", "old", "silent"):
        watch.added(w)
    fleet.now = 2 * UNHEARD_S
    watch.removed("old")
    watch.added("old")  # registered anew: young again
    watch.check(["reports", "times_out", "old", "silent"])
    assert [line.split()[1] for line in said(caplog)] == ["silent"]
    # /ready's problem only when it is every worker: one heard is this router's NATS working
    assert watch.problem(["reports", "silent"]) is None and watch.problem([]) is None
    fleet.now = 3 * UNHEARD_S
    problem = watch.problem(["old", "silent"])
    assert problem is not None and problem.startswith("none of the 2 workers this router routes has been heard")


@pytest.fixture
async def elsewhere(cluster: Cluster, own_nats: NatsServer) -> Cluster:
    """The cluster's etcd and namespace with a nats-server its shims are not on."""
    return Cluster(cluster.ns, own_nats.url, cluster.etcd_url)


async def test_a_router_on_another_nats_than_its_shims_names_its_nats_servers(
    cluster: Cluster,
    elsewhere: Cluster,
    own_nats: NatsServer,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(unheard, "UNHEARD_S", 3600.0)  # every record young, first
    worker = await cluster.add_worker("agg")
    try:
        right = await cluster.add_ready_router(disagg="never")
        wrong = await elsewhere.add_router(disagg="never")
        await until(
            lambda: (
                wrong.ingest.repairs.last_failure(worker.id) is FailureKind.NO_RESPONDERS
                and wrong.ingest.repairs.failures(worker.id) >= 3
            ),
            what="kvstate requests of the wrong router unanswered",
        )
        await until(lambda: wrong.fleet_news.excluded != {}, what="a fleet check of the wrong router")
        assert [r for r in caplog.records if r.name == "router.unheard"] == []  # young: nothing said
        assert not [p for p in wrong.readiness()[1]["problems"] if "--nats-servers" in p]
        repair = [r.getMessage() for r in caplog.records if "cannot be repaired" in r.getMessage()]
        assert repair and all("on this router's NATS" in m and "shim's log" not in m for m in repair), repair

        monkeypatch.setattr(unheard, "UNHEARD_S", 1.0)
        await until(
            lambda: any("--nats-servers" in p for p in wrong.readiness()[1]["problems"]),
            what="the wrong router's /ready naming --nats-servers",
        )
        async with http.get(wrong.url + "/ready") as r:
            assert r.status == 503
            text = await r.text()
        problems = json.loads(text)["problems"]
        (problem,) = [p for p in problems if "--nats-servers" in p]
        assert "this router's --nats-servers may not be the shims' NATS (its log names the URLs)" in problem, problem
        assert own_nats.url.split("://")[-1] not in text, text  # /ready carries no key: the URLs are the log's
        assert problem.startswith("the one worker this router routes has not been heard over NATS"), problem
        await until(lambda: any(r.name == "router.unheard" for r in caplog.records), what="the wrong router's WARNING")
        await asyncio.sleep(3 * CHECK_S)  # more checks of both routers: nothing more is said
        (line,) = [r for r in caplog.records if r.name == "router.unheard"]
        assert line.levelname == "WARNING" and f"worker {worker.id} has been registered" in line.getMessage()
        assert f"on this router's NATS ({own_nats.url})" in line.getMessage(), line.getMessage()
        assert right.ready and not [p for p in right.readiness()[1]["problems"] if "--nats-servers" in p]
    finally:
        await elsewhere.close()
