"""A part's stop cancelled again while it waits on its task (cancel_and_wait passes the cut on, then
raises it once the task ended): as RouterService.stop is, in a cancelled start's cleanup, every
CANCEL_AGAIN_S. What came after that wait was skipped: the sender subscriptions stayed subscribed,
KvIngest's subscriptions and gap repairs ran on, and
ReplicaSync sent no last flush and kept its subscription. Each step now runs though one before it was
cut (runtime.StopSteps), and the cut is raised after the last."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import subjects
from router.block_index import BlockIndex
from router.kv_ingest import KvIngest
from router.load_view import LoadView
from router.replica_sync import ReplicaSync
from router.sender_subscriptions import SenderSubscriptions
from tests.lost_cancellation import cut_while_it_waits, runs_on


async def test_sender_subscriptions_cut_while_their_task_ends_still_unsubscribe(
    nc: Client, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost: list[str] = []

    async def follow(self: SenderSubscriptions) -> None:
        await runs_on(lost, "follow")

    async def handler(msg: Msg) -> None:
        return None

    monkeypatch.setattr(SenderSubscriptions, "_follow", follow)
    subs = SenderSubscriptions(nc, subjects.load_all(ns), partial(subjects.load, ns), handler, list, what="load report")
    await subs.start()
    held = subs._all
    assert held is not None
    unsubscribed: list[bool] = []
    real = held.unsubscribe

    async def unsubscribe(limit: int = 0) -> None:
        unsubscribed.append(True)
        await real(limit)

    monkeypatch.setattr(held, "unsubscribe", unsubscribe)
    stop = await cut_while_it_waits(subs.stop(), lost, "follow")
    assert stop.cancelled(), "the cut was not raised once the stop was done"
    assert unsubscribed == [True], "the wildcard subscription was left held"


async def test_kv_ingest_cut_at_its_barrier_still_stops_its_subscriptions_and_repairs(
    nc: Client, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ingest = KvIngest(nc, ns, BlockIndex())
    await ingest.start()
    lost: list[str] = []
    ingest._barrier = asyncio.create_task(runs_on(lost, "barrier"))
    stopped: list[str] = []
    for name, part in (("subscriptions", ingest.subscriptions), ("repairs", ingest.repairs)):
        real = part.stop

        async def stop(name: str = name, real: Callable[[], Awaitable[None]] = real) -> None:
            stopped.append(name)
            await real()

        monkeypatch.setattr(part, "stop", stop)
    task = await cut_while_it_waits(ingest.stop(), lost, "barrier")
    assert task.cancelled(), "the cut was not raised once the stop was done"
    assert stopped == ["subscriptions", "repairs"], stopped


async def test_replica_sync_cut_while_its_tasks_end_still_sends_and_unsubscribes(
    nc: Client, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RouterService.stop stops it beside KvIngest: cut at its tasks' wait, it skipped its last
    send (peers kept this router's bookings to their TTL) and left its subscription held."""
    sync = ReplicaSync(nc, ns, "ra", LoadView(), flush_ms=1.0)
    await sync.start()
    lost: list[str] = []
    sync._tasks.append(asyncio.create_task(runs_on(lost, "watch")))
    held = sync._sub
    assert held is not None
    done: list[str] = []
    real_send, real_unsubscribe = sync._send, held.unsubscribe

    async def send() -> None:
        done.append("send")
        await real_send()

    async def unsubscribe(limit: int = 0) -> None:
        done.append("unsubscribe")
        await real_unsubscribe(limit)

    monkeypatch.setattr(sync, "_send", send)
    monkeypatch.setattr(held, "unsubscribe", unsubscribe)
    task = await cut_while_it_waits(sync.stop(), lost, "watch")
    assert task.cancelled(), "the cut was not raised once the stop was done"
    assert done == ["send", "unsubscribe"], done
