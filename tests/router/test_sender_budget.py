"""A load report sender past its budget: dropped before decoding (router.sender_budget), its subject
unheard for a while (router.sender_subscriptions); and nats-py's slow-consumer drops counted by
subscription (router.service)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import time
import urllib.request
from functools import partial
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError

import runtime
from kvswitch.servers import NatsServer
from protocol import LoadReport, encode_msg, subjects
from protocol.config import NatsSettings
from protocol.errors import ConfigError
from router.sender_budget import KvBudget, SenderBudget
from router.sender_subscriptions import SenderSubscriptions
from router.service import RouterConfig, RouterService
from runtime.nats_flush import flush
from tests.lost_cancellation import ends_within, never_answers
from tests.router.conftest import Cluster
from tests.router.polling import until
from tests.runtime.recording_proxy import recording_proxy


def test_a_sender_gets_its_burst_then_its_rate() -> None:
    budget = SenderBudget(rate_per_s=10.0, burst=5.0)
    assert [budget.admit("a", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert budget.admit("b", 0.0)  # each sender its own
    assert not budget.admit("a", 0.05)  # half a report refilled
    assert budget.admit("a", 0.1) and not budget.admit("a", 0.1)
    assert budget.over == 3


def test_senders_are_bounded_by_forgetting_full_buckets() -> None:
    budget = SenderBudget(rate_per_s=10.0, burst=5.0, max_senders=2)
    assert budget.admit("a", 0.0) and budget.admit("b", 0.0)
    assert budget.admit("c", 1.0)  # a and b refilled by now: forgotten, as good as full
    assert len(budget._buckets) == 1
    for _ in range(5):
        budget.admit("c", 1.0)
    assert not budget.admit("c", 1.0)  # c's own bucket was kept


def test_a_sender_is_bounded_in_bytes_too() -> None:
    budget = SenderBudget(100.0, 100.0, bytes_per_s=1000.0, bytes_burst=3000.0)
    assert budget.admit("a", 0.0, 2000) and budget.admit("a", 0.0, 1000)
    assert not budget.admit("a", 0.0, 1)  # messages left, bytes not
    assert budget.admit("b", 0.0, 3000)  # each sender its own
    assert not budget.admit("a", 0.5, 600) and budget.admit("a", 0.6, 600)  # refilled at 1000 a second
    assert budget.over == 2


def test_a_budget_without_bytes_counts_messages_alone() -> None:
    budget = SenderBudget(10.0, 2.0)
    assert budget.admit("a", 0.0, 1 << 40) and budget.admit("a", 0.0, 1 << 40)
    assert not budget.admit("a", 0.0, 0)


def test_the_kv_budget_lets_an_honest_busy_shim_through() -> None:
    """A shim seals a batch every 5 ms at the most (worker_shim.kv_publisher), sooner only when 256
    events or 20,000 hashes are pending: a second of full 20,000-hash batches (160 KB packed) at 25
    a second (500,000 hashes, 20 times a busy engine's), 600 small ones after a 3 s stall read at
    once, then 200 a second for a minute."""
    budget = KvBudget().budget()
    now = 0.0
    for _ in range(25):
        now += 0.04
        assert budget.admit("w", now, 20_000 * 8 + 200)
    stalled = [budget.admit("w", now + 3.0, 300) for _ in range(600)]  # 3 s of them queued, then read
    assert all(stalled)
    now += 3.0
    for _ in range(200 * 60):
        now += 0.005
        assert budget.admit("w", now, 300)
    assert budget.over == 0


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("batches_per_s", 100.0, "[500, 1e+06]"),
        ("batches_per_s", 400.0, "[500, 1e+06]"),  # under a shim's pace (protocol.kv_budget)
        ("batches_per_s", math.nan, "[500, 1e+06]"),
        ("batch_burst", 500.0, "[1000, 1e+07]"),
        ("mib_per_s", 0.5, "[2, 4096]"),
        ("mib_per_s", 1.5, "[2, 4096]"),  # under a shim's pace: its registration snapshot would be dropped
        ("mib_burst", 2.0, "[4, 40960]"),
    ],
)
def test_a_kv_budget_out_of_range_names_its_flag_and_range(field: str, value: float, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(KvBudget(), **{field: value}).validate()
    assert f"--kv-budget-{field.replace('_', '-')}" in str(err.value) and allowed in str(err.value)


async def test_a_quarantined_sender_is_unheard_and_the_others_heard(nats_url: str, ns: str) -> None:
    nc = await nats.connect(nats_url)
    pub = await nats.connect(nats_url)
    heard: list[str] = []

    async def handler(msg: Msg) -> None:
        heard.append(msg.subject.rpartition(".")[2])

    subs = SenderSubscriptions(
        nc,
        subjects.load_all(ns),
        partial(subjects.load, ns),
        handler,
        lambda: ["a", "b"],
        what="load report",
        quarantine_s=0.5,
    )
    await subs.start()
    try:

        async def send_all() -> None:
            await flush(nc)  # its subscriptions at the server before anything is sent
            for sender in ("a", "b", "stranger"):
                await pub.publish(subjects.load(ns, sender), b"x")
            await flush(pub)

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


async def test_a_sender_flooding_again_after_its_quarantine_lapses_is_quarantined_twice_as_long(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review of 2026-12-07: each quarantine's start and lapse stalled both replicas (~1.3 s of
    probes, a burst let through at each lapse every 15 s). Flooding again within as long as its last
    quarantine after it lapsed doubles it, up to 8 times, said once a doubling; quiet that long, it
    starts again from the first length."""
    nc = await nats.connect(nats_url)
    now = [0.0]

    async def handler(msg: Msg) -> None:
        return None

    subs = SenderSubscriptions(
        nc, "t.kv.*", lambda w: f"t.kv.{w}", handler, list, what="KV event", quarantine_s=15.0, clock=lambda: now[0]
    )
    await subs.start()

    async def lapse(after: float) -> None:
        now[0] += after
        subs.reconnected()  # wakes its task, which reads the clock: the quarantine lapsed
        await until(lambda: subs._all is not None and not subs.quarantined(), what="the wildcard again")

    lengths: list[float | None] = []
    try:
        with caplog.at_level(logging.WARNING, logger="router.sender_subscriptions"):
            for _ in range(6):  # each time it floods again 1 s after the lapse
                assert subs.quarantine("f")
                lengths.append(subs.quarantined_for("f"))
                assert not subs.quarantine("f")  # within it: once
                await until(lambda: subs._all is None, what="the per-worker subscriptions")
                await lapse(subs.quarantined_for("f") or 0.0)
                now[0] += 1.0
        assert lengths == [15.0, 30.0, 60.0, 120.0, 120.0, 120.0]
        said = [r.getMessage() for r in caplog.records if "floods again" in r.getMessage()]
        assert len(said) == 3 and "KV event sender f" in said[0] and "unheard for 30 s now" in said[0], said
        now[0] += 120.0  # quiet as long as its last quarantine: forgiven
        assert subs.quarantine("f") and subs.quarantined_for("f") == 15.0
        assert subs.quarantine("g") and subs.quarantined_for("g") == 15.0  # each sender its own
        assert subs.quarantines == 8
    finally:
        await subs.stop()
        await nc.close()


async def test_no_message_of_a_worker_heard_throughout_is_lost_as_the_subscriptions_switch(
    nats_url: str, ns: str
) -> None:
    """Review of 2026-12-07: each switch between the wildcard and the per-worker subscriptions lost
    0 to 3 of an honest worker's messages (nats-py's `unsubscribe()` drops what is queued or in
    flight for the subscription it removes). Here the honest worker's handler is slow, so a backlog
    is queued at every switch, and it publishes on throughout: every numbered message is handled."""
    nc = await nats.connect(nats_url)
    pub = await nats.connect(nats_url)
    seen: list[int] = []

    async def handler(msg: Msg) -> None:
        if msg.subject == subjects.kv(ns, "h"):
            seen.append(int(msg.data))
            await asyncio.sleep(0.002)  # a backlog builds behind it

    subs = SenderSubscriptions(
        nc,
        subjects.kv_all(ns),
        partial(subjects.kv, ns),
        handler,
        lambda: ["h", "f"],
        what="KV event",
        quarantine_s=0.3,
    )
    await subs.start()
    sent = 0
    try:
        await flush(nc)
        for _ in range(3):  # wildcard -> per worker -> wildcard, three times
            switches = subs.quarantines
            for _ in range(100):
                sent += 1
                await pub.publish(subjects.kv(ns, "h"), str(sent).encode())
            await flush(pub)
            subs.quarantine("f")
            while subs.quarantines == switches or subs.quarantined() or subs._all is None:
                sent += 1
                await pub.publish(subjects.kv(ns, "h"), str(sent).encode())
                await flush(pub)
                await asyncio.sleep(0.003)
        await until(lambda: len(set(seen)) >= sent, timeout=10.0, what="every honest message handled")
    finally:
        await subs.stop()
        await nc.close()
        await pub.close()
    assert sorted(set(seen)) == list(range(1, sent + 1))


async def test_no_message_of_a_worker_publishing_as_the_subscriptions_switch_is_lost(nats_url: str, ns: str) -> None:
    """nats-server matches a message against the subscriptions, then delivers it to each one not
    closed meanwhile: with a switch's UNSUB sent right behind its SUB, a message matched before the
    one and delivered after the other went to neither (some lost in 5 of 12 runs, 6 of 20 with the
    CPU busy). Here h publishes a burst on each of eight connections as each switch begins, which
    the server works through as the switch's SUB and UNSUB come: every numbered message is handled."""
    nc = await nats.connect(nats_url)
    pubs = [await nats.connect(nats_url) for _ in range(8)]
    seen: set[int] = set()
    now = [0.0]

    async def handler(msg: Msg) -> None:
        if msg.subject == subjects.kv(ns, "h"):
            seen.add(int(msg.data))

    subs = SenderSubscriptions(
        nc,
        subjects.kv_all(ns),
        partial(subjects.kv, ns),
        handler,
        lambda: ["h", "f"],
        what="KV event",
        quarantine_s=1.0,
        clock=lambda: now[0],
    )
    await subs.start()
    sent = 0

    async def burst() -> None:
        nonlocal sent
        for pub in pubs:
            for _ in range(250):
                sent += 1
                await pub.publish(subjects.kv(ns, "h"), str(sent).encode())
        # Written out; while the PONGs are awaited, the switch begins.
        await asyncio.gather(*(flush(pub) for pub in pubs))

    try:
        await flush(nc)
        for _ in range(5):  # wildcard -> per worker -> wildcard
            assert subs.quarantine("f")
            await burst()
            await until(lambda: subs._all is None, what="the per-worker subscriptions")
            now[0] += 100.0
            subs.reconnected()  # wakes its task, which reads the clock: the quarantine lapsed
            await burst()
            await until(lambda: subs._all is not None and not subs.quarantined(), what="the wildcard again")
        assert await subs.caught_up(10.0)  # the flushes returned: the server sent nc all of it before
    finally:
        await subs.stop()
        await nc.close()
        for pub in pubs:
            await pub.close()
    assert set(range(1, sent + 1)) - seen == set()


async def test_a_quarantine_unsubscribes_without_waiting_for_what_the_server_sends_first(
    nats_server: NatsServer, ns: str
) -> None:
    """The server's PONG comes behind everything it sends the connection first: a switch that awaited
    one before its UNSUB heard a flood until the router had read its whole backlog (0.2-0.7 s and
    144k-264k messages of 100 B after quarantine(), review of 2026-12-07). Here the router reads
    nothing more once the quarantine begins: the wildcard's UNSUB goes out all the same, behind the
    per-worker SUBs."""
    sent = bytearray()
    replies = asyncio.Event()
    replies.set()
    proxy = await recording_proxy(nats_server.port, sent, replies)
    nc = await nats.connect(f"nats://127.0.0.1:{proxy.sockets[0].getsockname()[1]}")

    async def handler(msg: Msg) -> None:
        pass

    subs = SenderSubscriptions(
        nc, subjects.kv_all(ns), partial(subjects.kv, ns), handler, lambda: ["h", "f"], what="KV event"
    )
    await subs.start()
    try:
        await flush(nc)
        assert subs._all is not None
        unsub = re.compile(rb"UNSUB %d[ \r]" % subs._all._id)
        replies.clear()  # a backlog ahead of any PONG
        assert subs.quarantine("f")
        # Well inside the 10 s after which a switch awaiting the PONG gave up on it and went on.
        await until(lambda: unsub.search(sent) is not None, timeout=5.0, what="the wildcard's UNSUB on the wire")
        wire = bytes(sent)
        unsubscribed = unsub.search(wire)
        assert unsubscribed is not None and wire.index(f"SUB {subjects.kv(ns, 'h')} ".encode()) < unsubscribed.start()
        assert f"SUB {subjects.kv(ns, 'f')} ".encode() not in wire
    finally:
        replies.set()
        await subs.stop()
        await nc.close()
        proxy.close()
        await proxy.wait_closed()


@pytest.mark.parametrize("switching", [False, True])
async def test_caught_up_returns_once_what_was_sent_before_went_through_the_handler(
    nats_url: str, ns: str, switching: bool
) -> None:
    """The barrier a report ahead of the KV index waits for before it judges batches lost
    (router.kv_ingest): what nats-server sent before, on its way or queued behind a slow handler,
    handled first, and a subscription dropped meanwhile (a quarantine's switch) has its queue handled."""
    nc = await nats.connect(nats_url)
    pub = await nats.connect(nats_url)
    seen: list[int] = []

    async def handler(msg: Msg) -> None:
        seen.append(int(msg.data))
        await asyncio.sleep(0.002)  # a backlog builds behind it

    subs = SenderSubscriptions(
        nc, subjects.kv_all(ns), partial(subjects.kv, ns), handler, lambda: ["h", "f"], what="KV event"
    )
    await subs.start()
    try:
        await flush(nc)
        for i in range(300):
            await pub.publish(subjects.kv(ns, "h"), str(i).encode())
        await flush(pub)  # all of it at the server, sent on to nc
        barrier = asyncio.create_task(subs.caught_up(10.0))
        if switching:
            subs.quarantine("f")  # the wildcard dropped for h's own subscription while the barrier waits
        assert await barrier
        assert seen == list(range(300))
        for i in range(300, 400):  # and again, on whichever subscriptions hear h now
            await pub.publish(subjects.kv(ns, "h"), str(i).encode())
        await flush(pub)
        assert await subs.caught_up(10.0)
        assert set(seen) == set(range(400))
    finally:
        await subs.stop()
        await nc.close()
        await pub.close()


async def test_slow_consumer_drops_are_counted_by_subscription(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="router.service")
    router = RouterService(RouterConfig(ns="t", nats=NatsSettings(servers=["nats://127.0.0.1:1"])))
    load, main = router._nats_errors("load"), router._nats_errors("main")
    for _ in range(3):
        await load(SlowConsumerError(subject="t.load.a", reply="", sid=1, sub=_Sub("t.load.*")))  # type: ignore[arg-type]
    await main(SlowConsumerError(subject="_INBOX.x.1", reply="", sid=2, sub=_Sub("_INBOX.x.*")))  # type: ignore[arg-type]
    await main(SlowConsumerError(subject="t.router.sync", reply="", sid=3, sub=_Sub(subjects.sync("t"))))  # type: ignore[arg-type]
    # a worker's own subscription, while a sender is quarantined, is load too (it was `other`)
    await load(SlowConsumerError(subject="t.load.b", reply="", sid=4, sub=_Sub(subjects.load("t", "b"))))  # type: ignore[arg-type]
    kvstate = router._nats_errors("kvstate")  # gap repair's replies, on a connection of their own
    await kvstate(SlowConsumerError(subject="_INBOX.y.1", reply="", sid=5, sub=_Sub("_INBOX.y.*")))  # type: ignore[arg-type]
    assert router.slow_consumer_dropped == {"load": 4, "replies": 1, "sync": 1, "kvstate": 1}
    said = [r.getMessage() for r in caplog.records if "SlowConsumerError" in r.getMessage()]
    assert len(said) == 4 and "(load)" in said[0]  # each subscription once, then counted
    text = router.metrics.render().decode()
    assert 'kvswitch_router_nats_slow_consumer_dropped_total{subscription="load"} 4.0' in text


def _server_subjects(server: NatsServer, name: str) -> list[str]:
    """The subjects nats-server holds subscribed for the client connection named `name`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/connz?subs=1") as r:
        conns = json.load(r)["connections"]
    return sorted(s for c in conns if c.get("name") == name for s in c.get("subscriptions_list", []))


async def test_a_subscription_made_and_dropped_while_nats_is_down_is_not_left_at_the_server(
    own_nats: NatsServer, ns: str
) -> None:
    """nats-py queues a SUB made while it reconnects and sends it once back, while an unsubscribe
    meanwhile only forgets it on the client's side (review of 2026-12-06): a worker that came and
    went during the outage, its quarantine over, left `{ns}.load.d` at the server beside
    `{ns}.load.*`, heard twice and out of the quarantine's reach. No change is made while the
    connection is down; once it is back, the changes held are made."""
    subs: SenderSubscriptions | None = None

    async def back() -> None:
        assert subs is not None
        subs.reconnected()

    nc = await nats.connect(
        own_nats.url, name="load", reconnect_time_wait=0.2, max_reconnect_attempts=-1, reconnected_cb=back
    )
    heard: list[str] = []

    async def handler(msg: Msg) -> None:
        heard.append(msg.subject.rpartition(".")[2])

    workers = ["a", "b", "c"]
    subs = SenderSubscriptions(
        nc,
        subjects.load_all(ns),
        partial(subjects.load, ns),
        handler,
        lambda: list(workers),
        what="load report",
        quarantine_s=1.0,
    )
    await subs.start()
    try:
        subs.quarantine("a")
        await until(lambda: subs._all is None and sorted(subs._each) == ["b", "c"], what="the per-worker subscriptions")
        await flush(nc)
        assert _server_subjects(own_nats, "load") == [subjects.load(ns, "b"), subjects.load(ns, "c")]
        own_nats.kill()
        await until(lambda: not nc.is_connected, what="the connection down")
        workers.append("d")  # registers during the outage,
        subs.workers_changed()
        await asyncio.sleep(0.2)
        workers.remove("d")  # and leaves
        subs.workers_changed()
        await until(lambda: not subs.quarantined(), what="the quarantine over during the outage")
        await asyncio.sleep(0.2)
        own_nats.launch()
        await asyncio.to_thread(own_nats.wait_healthy)
        await until(lambda: nc.is_connected and subs._all is not None and not subs._each, what="load.* again")
        await flush(nc)
        assert _server_subjects(own_nats, "load") == [subjects.load_all(ns)]
        async with await nats.connect(own_nats.url) as pub:
            for sender in ("a", "b", "d"):
                await pub.publish(subjects.load(ns, sender), b"x")
        await until(lambda: len(heard) >= 3, what="the reports")
        await asyncio.sleep(0.1)
        assert sorted(heard) == ["a", "b", "d"]  # each once
    finally:
        await subs.stop()
        await nc.close()


async def _flood(nc: Client, ns: str, worker: str, n: int = 400) -> None:
    """Past any budget: the worker's own valid report, over and over."""
    for _ in range(n):
        report = LoadReport(worker=worker, ts=time.time(), period_s=0.5, kv_total_blocks=512)
        await nc.publish(subjects.load(ns, worker), encode_msg(report))
    await flush(nc)


async def test_during_a_quarantine_every_registered_worker_is_heard_and_the_quarantined_one_says_why(
    cluster: Cluster, nc: Client
) -> None:
    """A worker left out of routing (here its max_model_len not its model's) is still registered,
    and its reports (its KV digest among them) are taken: during a quarantine only the routed
    workers' subjects were heard, so its reports were dropped (review of 2026-12-06). And the
    quarantined worker's exclusion on /debug/workers says why it is silent, not only since when."""
    flooded = await cluster.add_worker("agg")
    await cluster.add_worker("agg")
    odd = await cluster.add_worker("agg", max_model_len=4096)
    router = await cluster.add_router(disagg="never")
    await until(lambda: router.ready and len(router.registry) == 3, what="the router ready with three workers")
    assert odd.id not in {info.worker for info in router.registry.workers()}  # not routed
    await until(lambda: router.view.liveness(odd.id) is not None, what="the unrouted worker heard")
    await _flood(nc, cluster.ns, flooded.id)
    await until(lambda: flooded.id in router._load_subs.quarantined(), what="the quarantine")  # type: ignore[union-attr]
    await asyncio.sleep(2.0)  # its shim reports every 0.5 s

    def status(worker: str) -> dict[str, Any]:
        return next(s for s in router.worker_listing()["worker_status"] if s["worker"] == worker)

    why = status(flooded.id)["why"]
    assert why.startswith("last load report") and "its reports are quarantined for" in why, why
    live = router.view.liveness(odd.id)
    assert live is not None and live.age_s < 1.5, live  # heard on through the quarantine


async def test_a_quarantine_that_ends_while_the_routers_nats_is_down_ends_once_it_is_back(
    etcd_url: str, ns: str, own_nats: NatsServer
) -> None:
    """No change to the load subscriptions is made while their connection is down (see above); the
    router's reconnected callback makes them once it is back, so the quarantined worker is heard
    again and not left out until some worker comes or goes."""
    cluster = Cluster(ns, own_nats.url, etcd_url)
    try:
        flooded = await cluster.add_worker("agg")
        await cluster.add_worker("agg")
        router = await cluster.add_ready_router(disagg="never")
        subs = router._load_subs
        assert subs is not None
        subs.quarantine_s = 1.0
        async with await nats.connect(own_nats.url) as pub:
            await _flood(pub, ns, flooded.id)
        await until(lambda: subs._all is None, what="the per-worker subscriptions")
        own_nats.kill()
        await until(lambda: not router._load_nc.is_connected, what="the load connection down")  # type: ignore[union-attr]
        await until(lambda: not subs.quarantined(), what="the quarantine over during the outage")
        own_nats.launch()
        await asyncio.to_thread(own_nats.wait_healthy)
        await until(lambda: subs._all is not None and not subs._each, what="load.* heard again")
        await until(lambda: (live := router.view.liveness(flooded.id)) is not None and live.age_s < 0.6, what="heard")
    finally:
        await cluster.close()


async def test_a_stop_ends_a_task_that_lost_its_cancellation(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop that cancels its task once and waits waited for good on one whose cancellation was
    lost below it (a NATS call that swallowed it). It is now cancelled again until it ends."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.2)  # 10 s in service
    nc = await nats.connect(nats_url)

    async def handler(msg: Msg) -> None:
        return None

    subs = SenderSubscriptions(nc, "t.kv.*", lambda w: f"t.kv.{w}", handler, list, what="KV event")
    await subs.start()
    lost: list[str] = []
    try:
        subs._settle = lambda: never_answers(lost, "subscribe")  # type: ignore[method-assign]
        subs.reconnected()  # its next change now
        await asyncio.sleep(0.1)
        assert await ends_within(subs.stop(), 5), "stop() still waits on its task"
        assert lost == ["subscribe"]
    finally:
        await nc.close()
