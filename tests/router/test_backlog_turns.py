"""A backlog on one of the router's NATS subscriptions is folded a slice at a time: nats-py runs the
callbacks of what it has queued back to back, and a callback that never awaits held the loop for
all of it (1,000 workers' load reports: 0.2-0.3 s at a time; scale audit of 2026-12-06)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from router.service import RouterService
from runtime.turns import Turns
from tests.router.conftest import Cluster

BACKLOG = 200


def _callbacks(router: RouterService) -> dict[str, tuple[Any, Callable[[Any], Awaitable[None]], str]]:
    """(the object whose Turns paces it, the callback, a subject it reads) per subscription."""
    sync = router._sync
    assert sync is not None
    return {
        "load": (router, router._on_load, "kvswitch.load.w1"),
        "kv": (router.ingest, router.ingest._on_msg, "kvswitch.kv.w1"),
        "sync": (sync, sync._on_msg, "kvswitch.sync"),
    }


@pytest.mark.parametrize("which", ["load", "kv", "sync"])
async def test_a_backlog_gives_the_loop_turns(cluster: Cluster, which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    owner, callback, subject = _callbacks(router)[which]
    for name in ("_load_turns", "_turns"):  # a turn after every message: counted, not timed
        monkeypatch.setattr(owner, name, Turns(0.0), raising=False)
    turns = 0
    done = False

    async def ticker() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = turns
    for i in range(BACKLOG):  # as nats-py's subscription task runs a queued backlog
        await callback(SimpleNamespace(subject=subject, data=b"not msgpack %d" % i, reply=""))
    seen = turns - before
    done = True
    await task
    assert seen >= BACKLOG // 2, f"the loop ran {seen} times while {BACKLOG} messages were folded"
