"""A task that runs for its owner's life says at once when it crashes, not at the owner's stop(); a
NATS handler that raises is named with its traceback, and NATS is not blamed."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats
import pytest

from runtime import TickErrors, background, ended, guarded
from runtime.nats_flush import flush


async def test_a_crash_is_an_error_at_once_with_its_traceback_and_what_stops(caplog: pytest.LogCaptureFixture) -> None:
    async def loop() -> None:
        await asyncio.sleep(0)
        raise ValueError("cannot convert float NaN to integer")

    with caplog.at_level(logging.ERROR, logger="runtime"):
        task = background(loop(), "load-w1", "no load report is sent until the next session")
        await asyncio.wait({task})
        await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
    (said,) = [r for r in caplog.records if r.name == "runtime"]
    assert said.getMessage() == "task load-w1 crashed: no load report is sent until the next session"
    assert said.exc_info is not None and isinstance(said.exc_info[1], ValueError)


async def test_a_cancelled_or_finished_task_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def done() -> None:
        return None

    with caplog.at_level(logging.DEBUG, logger="runtime"):
        stopped = background(forever(), "a", "a")
        finished = background(done(), "b", "b")
        await asyncio.sleep(0)
        stopped.cancel()
        await asyncio.wait({stopped, finished})
        await asyncio.sleep(0)
    assert [r for r in caplog.records if r.name == "runtime"] == []


async def test_ended_says_which_task_no_longer_runs_and_what_that_stops() -> None:
    async def crash() -> None:
        raise ValueError("a bug")

    async def done() -> None:
        return None

    async def forever() -> None:
        await asyncio.Event().wait()

    crashed, returned, running = (
        background(crash(), "sync-flush", "peers get no booking"),
        background(done(), "sync-expire", "stale bookings stay"),
        background(forever(), "loop-watch", "stalls count"),
    )
    await asyncio.wait({crashed, returned})
    assert ended(crashed) == "task sync-flush crashed (ValueError: a bug): peers get no booking"
    assert ended(returned) == "task sync-expire ended: stale bookings stay"
    assert ended(running) is None and ended(None) is None
    running.cancel()
    await asyncio.wait({running})
    assert ended(running) is None  # its owner stopped it


def test_tick_errors_say_the_first_then_once_a_while_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    errors = TickErrors(logging.getLogger("t"), "a flush", every_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="t"):
        for t in (0.0, 1.0, 2.0, 40.0):
            now[0] = t
            errors(RuntimeError(f"at {t}"))
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "a flush failed; going on with its next round",
        "a flush failed (2 more in 40s); going on with its next round",
    ]
    assert errors.count == 4 and all(r.exc_info is not None for r in caplog.records)


def test_tick_errors_per_kind_say_a_new_kind_at_once(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    errors = TickErrors(logging.getLogger("t"), "a check", every_s=60.0, per_kind=True, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="t"):
        for t, exc in ((0.0, RuntimeError("a")), (1.0, RuntimeError("b")), (2.0, KeyError("c")), (3.0, KeyError("d"))):
            now[0] = t
            errors(exc)
    said = [(r.getMessage(), type(r.exc_info[1]).__name__ if r.exc_info else None) for r in caplog.records]
    assert said == [
        ("a check failed; going on with its next round", "RuntimeError"),
        ("a check failed; going on with its next round", "KeyError"),  # within the minute, a new kind
    ]
    assert errors.count == 4


async def test_a_handler_that_raises_is_logged_as_its_own_and_the_next_message_is_handled(
    nats_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    blamed: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        blamed.append(exc)

    nc = await nats.connect(nats_url, error_cb=on_error)
    seen: list[bytes] = []
    both = asyncio.Event()

    async def handler(msg: Any) -> None:
        if msg.data == b"bad":
            raise KeyError("worker")
        seen.append(msg.data)
        if len(seen) == 2:
            both.set()

    try:
        with caplog.at_level(logging.ERROR, logger="runtime"):
            await nc.subscribe(f"{ns}.x", cb=guarded(handler, "the load report handler"))
            for data in (b"bad", b"good", b"bad", b"also good"):
                await nc.publish(f"{ns}.x", data)
            await flush(nc)
            await asyncio.wait_for(both.wait(), 5)
    finally:
        await nc.close()
    assert seen == [b"good", b"also good"] and blamed == []  # NATS is not blamed
    (said,) = [r for r in caplog.records if r.name == "runtime"]  # the second held back (30 s)
    assert said.getMessage() == f"the load report handler failed on a message of {ns}.x"
    assert said.exc_info is not None and isinstance(said.exc_info[1], KeyError)
