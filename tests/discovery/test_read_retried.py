"""`read_retried`, the one retry of a read from etcd through an outage: the watch's read of its
prefix and the shim's first read of the routers' prefix each had their own (review of 2026-12-07),
with their own constant and their own words for it."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from discovery import DiscoveryError
from discovery.watch import READ_RETRY_MAX_S, ReadHealth, read_retried


def _unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="boom")


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays read_retried waits, none of them waited."""
    delays: list[float] = []
    sleep = asyncio.sleep

    async def recorded(delay: float) -> None:
        delays.append(delay)
        await sleep(0)

    monkeypatch.setattr("discovery.watch.asyncio.sleep", recorded)
    return delays


async def test_a_discovery_error_is_said_once_by_the_calls_error_with_what_to_do_then_once_it_works(
    slept: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    failures: list[BaseException] = []

    async def read() -> bool:
        if len(failures) < 4:
            try:
                raise _unavailable()
            except grpc.aio.AioRpcError as exc:
                raise DiscoveryError("reading /t/routers/ failed: UNAVAILABLE: boom") from exc
        return True

    health = ReadHealth()
    caplog.set_level(logging.INFO, logger="discovery.watch")
    got = await read_retried(
        read, "watch /t/routers/", errors=(DiscoveryError,), advise=True, failed=failures.append, health=health
    )
    assert got is True and len(failures) == 4
    assert slept == [0.5, 1.0, 1.0, 1.0] and READ_RETRY_MAX_S == 1.0
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == (
        "watch /t/routers/: reading it failed (UNAVAILABLE: boom: check --etcd-endpoints and the server); "
        "retrying, said again once it works"
    ), said
    assert len(said) == 2 and said[1].startswith("watch /t/routers/: reading it works again, after "), said
    assert health.since is None and health.why == ""


async def test_without_advice_the_words_are_the_calls_alone_and_another_error_is_raised(
    slept: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    tries = 0

    async def read() -> int:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise _unavailable()
        raise KeyError("a bug, not an outage")

    caplog.set_level(logging.INFO, logger="discovery.watch")
    with pytest.raises(KeyError):
        await read_retried(read, "watch /p/", errors=(grpc.aio.AioRpcError,), first_s=2.0)
    assert tries == 2 and slept == [2.0]
    said = [r.getMessage() for r in caplog.records]
    assert said == ["watch /p/: reading it failed (UNAVAILABLE: boom); retrying, said again once it works"], said
