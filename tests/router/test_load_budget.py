"""A load report sender past its budget: dropped before decoding (router.load_budget), its subject
unheard for a while (router.load_subscriptions); and nats-py's slow-consumer drops counted by
subscription (router.service)."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError

from protocol import subjects
from protocol.config import NatsSettings
from router.load_budget import LoadBudget
from router.load_subscriptions import LoadSubscriptions
from router.service import RouterConfig, RouterService
from tests.router.polling import until


def test_a_sender_gets_its_burst_then_its_rate() -> None:
    budget = LoadBudget(rate_per_s=10.0, burst=5.0)
    assert [budget.admit("a", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert budget.admit("b", 0.0)  # each sender its own
    assert not budget.admit("a", 0.05)  # half a report refilled
    assert budget.admit("a", 0.1) and not budget.admit("a", 0.1)
    assert budget.over == 3


def test_senders_are_bounded_by_forgetting_full_buckets() -> None:
    budget = LoadBudget(rate_per_s=10.0, burst=5.0, max_senders=2)
    assert budget.admit("a", 0.0) and budget.admit("b", 0.0)
    assert budget.admit("c", 1.0)  # a and b refilled by now: forgotten, as good as full
    assert len(budget._buckets) == 1
    for _ in range(5):
        budget.admit("c", 1.0)
    assert not budget.admit("c", 1.0)  # c's own bucket was kept


async def test_a_quarantined_sender_is_unheard_and_the_others_heard(nats_url: str, ns: str) -> None:
    nc = await nats.connect(nats_url)
    pub = await nats.connect(nats_url)
    heard: list[str] = []

    async def handler(msg: Msg) -> None:
        heard.append(msg.subject.rpartition(".")[2])

    subs = LoadSubscriptions(nc, ns, handler, lambda: ["a", "b"], quarantine_s=0.5)
    await subs.start()
    try:

        async def send_all() -> None:
            await nc.flush()  # its subscriptions at the server before anything is sent
            for sender in ("a", "b", "stranger"):
                await pub.publish(subjects.load(ns, sender), b"x")
            await pub.flush()

        await send_all()
        await until(lambda: sorted(heard) == ["a", "b", "stranger"], what="every sender heard")
        heard.clear()
        subs.quarantine("a")
        await until(lambda: "a" in subs.quarantined() and subs._all is None, what="the per-worker subscriptions")
        await send_all()
        await until(lambda: heard == ["b"], what="b alone heard")  # a quarantined; a stranger has no record
        heard.clear()
        subs.quarantine("a")  # again within its quarantine: counted once
        assert subs.quarantines == 1
        await until(lambda: not subs.quarantined() and subs._all is not None and not subs._each, what="load.* again")
        await send_all()
        await until(lambda: sorted(heard) == ["a", "b", "stranger"], what="every sender heard again")
        await asyncio.sleep(0.1)
        assert len(heard) == 3  # no subscription left over, each heard once
    finally:
        await subs.stop()
        await nc.close()
        await pub.close()


class _Sub:
    def __init__(self, subject: str) -> None:
        self.subject = subject


async def test_slow_consumer_drops_are_counted_by_subscription(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="router.service")
    router = RouterService(RouterConfig(ns="t", nats=NatsSettings(servers=["nats://127.0.0.1:1"])))
    load, main = router._nats_errors("load"), router._nats_errors("main")
    for _ in range(3):
        await load(SlowConsumerError(subject="t.load.a", reply="", sid=1, sub=_Sub("t.load.*")))  # type: ignore[arg-type]
    await main(SlowConsumerError(subject="_INBOX.x.1", reply="", sid=2, sub=_Sub("_INBOX.x.*")))  # type: ignore[arg-type]
    await main(SlowConsumerError(subject="t.router.sync", reply="", sid=3, sub=_Sub(subjects.sync("t"))))  # type: ignore[arg-type]
    assert router.slow_consumer_dropped == {"load": 3, "replies": 1, "sync": 1}
    said = [r.getMessage() for r in caplog.records if "SlowConsumerError" in r.getMessage()]
    assert len(said) == 3 and "(load)" in said[0]  # each subscription once, then counted
    text = router.metrics.render().decode()
    assert 'kvswitch_router_nats_slow_consumer_dropped_total{subscription="load"} 3.0' in text
