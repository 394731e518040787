"""A NATS connection made by runtime.nats_connect with protocol.config's options, on a member that
stops answering with its TCP connection up (SIGSTOP: frozen, or cut off by a partition): it leaves
for another member within a few PING intervals, with bytes still queued for the frozen one, and
says which server it left and which it joined. nats-py's defaults (a PING every 120 s, 2 unanswered)
held it there for 4-6 minutes; its graceful close of the old socket, with bytes queued, held it
until the kernel gave up (nats-io/nats.py#671)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats
import nats.aio.client
import pytest
from nats.aio.client import Client

from kvswitch.servers import NatsCluster
from protocol.config import PINGS_UNANSWERED, NatsSettings
from runtime.nats_connect import connect
from tests.runtime.frozen import frozen

PING_S = 1.0
# Noticed PINGS_UNANSWERED+1 intervals after the freeze at most, and slack for a loaded machine.
# The old defaults could not leave before 240 s.
MOVED_WITHIN_S = (PINGS_UNANSWERED + 1) * PING_S + 5.0


async def _publish_until(stop: asyncio.Event, nc: Client) -> None:
    # Stopped by an event: nats-py swallows a cancellation while a publish waits on its flusher.
    payload = b"x" * 8192
    while not stop.is_set():
        # ~16 MB/s: a frozen server's socket buffers are full within a second, and then nats-py's
        # own queue (2 MB; over it, a publish is refused)
        with contextlib.suppress(nats.errors.OutboundBufferLimitError):
            for _ in range(100):
                await nc.publish("stale.flood", payload)
        await asyncio.sleep(0.05)


async def test_a_frozen_server_is_left_for_another_with_bytes_queued_for_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with NatsCluster(2) as cluster:
        moved = asyncio.Event()
        queued_when_left: list[int] = []
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        async def disconnected() -> None:
            queued_when_left.append(nc.pending_data_size)

        async def reconnected() -> None:
            moved.set()

        settings = NatsSettings(servers=cluster.urls, ping_interval_s=PING_S)
        log = logging.getLogger("test.nats.stale")
        nc = await connect(
            log,
            **settings.connect_options("publisher"),
            error_cb=on_error,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
        )
        try:
            assert nc.connected_url is not None
            victim = next(n for n in cluster.nodes if n.port == nc.connected_url.port)
            healthy = next(n for n in cluster.nodes if n is not victim)
            assert victim.pid is not None
            # The unlucky draw of nats-py's shuffle before it reconnects: the frozen server first.
            monkeypatch.setattr(
                nats.aio.client, "shuffle", lambda pool: pool.sort(key=lambda s: s.uri.port != victim.port)
            )
            stop = asyncio.Event()
            publisher = asyncio.create_task(_publish_until(stop, nc))
            try:
                with caplog.at_level(logging.INFO, logger="test.nats.stale"), frozen(victim.pid):
                    async with asyncio.timeout(MOVED_WITHIN_S):
                        await moved.wait()
                    assert nc.connected_url is not None and nc.connected_url.port == healthy.port
            finally:
                stop.set()
                await publisher
            # Not tried again first: its connect timeout (2 s) would have been an error.
            assert not [e for e in errors if isinstance(e, TimeoutError)], errors
            # nats-py's own queue (PINGs aside) backs up only behind a socket buffer that stopped draining.
            assert queued_when_left[0] > 1_000_000, f"{queued_when_left} B queued when it left: no case"
            said = [(r.levelno, r.getMessage()) for r in caplog.records]
            left = f"NATS connection publisher: {victim.url} answered none of its last {PINGS_UNANSWERED} PINGs"
            assert any(level == logging.WARNING and m.startswith(left) for level, m in said), said
            joined = f"NATS connection publisher: moved from {victim.url}, which answered no PING, to {healthy.url}"
            assert (logging.WARNING, joined) in said, said

            # What it publishes now reaches a subscriber on the healthy member.
            watcher = await nats.connect(healthy.url, allow_reconnect=False)
            try:
                sub = await watcher.subscribe("stale.after")
                await watcher.flush()
                await nc.publish("stale.after", b"here")
                assert (await sub.next_msg(timeout=5)).data == b"here"
            finally:
                await watcher.close()
        finally:
            await nc.close()
