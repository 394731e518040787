"""A NATS connection made by runtime.nats_connect with protocol.config's options, on a member that
stops answering with its TCP connection up (SIGSTOP: frozen, or cut off by a partition): it leaves
for another member within a few PING intervals, with bytes still queued for the frozen one, and
says which server it left and which it joined. nats-py's defaults (a PING every 120 s, 2 unanswered)
held it there for 4-6 minutes; its graceful close of the old socket, with bytes queued, held it
until the kernel gave up (nats-io/nats.py#671). The other side: at the shortest interval allowed, a
healthy server whose PONGs wait behind a burst of messages, read by a busy process, is kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import nats
import nats.aio.client
import pytest
from nats.aio.client import Client, Srv

from kvswitch.servers import NatsCluster, NatsServer
from protocol.config import PING_INTERVAL_S, PINGS_UNANSWERED, NatsSettings
from runtime.nats_connect import _shown, connect
from runtime.nats_flush import flush
from tests.runtime.frozen import frozen

PING_S = PING_INTERVAL_S[0]
# Noticed PINGS_UNANSWERED+1 intervals after the freeze at most, and slack for a loaded machine.
# The old defaults could not leave before 240 s.
MOVED_WITHIN_S = (PINGS_UNANSWERED + 1) * PING_S + 5.0
# A member's address, gossiped ~1 s after its route was up at worst, and slack for a loaded machine.
ADVERTISED_WITHIN_S = 10.0


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

            # What it publishes now reaches a subscriber on the healthy member. Its subscription at
            # the server first (runtime.nats_flush): nats-py's flush() PINGs ahead of the queued SUB,
            # and a PUB the server took before that SUB was lost (4 runs in 150).
            watcher = await nats.connect(healthy.url, allow_reconnect=False)
            try:
                sub = await watcher.subscribe("stale.after")
                await flush(watcher)
                await nc.publish("stale.after", b"here")
                assert (await sub.next_msg(timeout=5)).data == b"here"
            finally:
                await watcher.close()
        finally:
            await nc.close()


BURSTS, BURST, SIZE = 2, 20_000, 1024
BUSY_SLICE_S = 0.02


async def _bursts(url: str, bursts: int = BURSTS, burst: int = BURST) -> None:
    """`bursts` bursts of `burst` messages, 1 s apart (20 MB each by default), faster than a busy
    reader reads."""
    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    try:
        for i in range(bursts):
            if i:
                await asyncio.sleep(1.0)
            for _ in range(burst):
                await nc.publish("burst", b"y" * SIZE)
            await flush(nc)
    finally:
        await nc.close()


async def test_a_busy_reader_behind_a_burst_keeps_its_healthy_server(caplog: pytest.LogCaptureFixture) -> None:
    # A PONG is read behind every message the server sent before it: a process whose loop is busy
    # (20 ms slices, a router decoding reports) reads it seconds late. The shortest interval allowed
    # rests on this: at 0.5 s each burst was taken for a frozen server, the connection dropped and
    # its backlog lost.
    with NatsServer() as server:
        left: list[float] = []
        received = 0

        async def on_msg(_: object) -> None:
            nonlocal received
            received += 1

        async def disconnected() -> None:
            left.append(time.monotonic())

        async def on_error(exc: Exception) -> None:
            pass

        settings = NatsSettings(servers=[server.url], ping_interval_s=PING_INTERVAL_S[0])
        log = logging.getLogger("test.nats.busy")
        nc = await connect(log, **settings.connect_options("busy"), disconnected_cb=disconnected, error_cb=on_error)
        try:
            await nc.subscribe("burst", cb=on_msg)
            await flush(nc)  # at the server before the bursts
            with caplog.at_level(logging.INFO, logger="test.nats.busy"):
                publisher = asyncio.create_task(asyncio.to_thread(asyncio.run, _bursts(server.url)))
                deadline = time.monotonic() + 60
                while not left and (received < BURSTS * BURST or not publisher.done()) and time.monotonic() < deadline:
                    time.sleep(BUSY_SLICE_S)  # the process's own work, on the loop
                    await asyncio.sleep(0)
                await publisher
            stale = [r.getMessage() for r in caplog.records if "answered none" in r.getMessage()]
            assert (stale, left) == ([], []), "a healthy server was left"
            assert received == BURSTS * BURST
        finally:
            await nc.close()


# A backlog of 4 MB, read at most ~256 KB (a socket read of asyncio's) a slice: 4 s and more.
SLOW_PING_S, SLOW_SLICE_S, BACKLOG = 0.5, 0.25, 4000


async def test_a_reader_behind_on_a_backlog_longer_than_the_ping_limit_keeps_its_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its PONGs all wait behind the backlog, which the reader takes longer than PINGS_UNANSWERED+1
    # intervals to read (0.5 s intervals here, below the minimum, to keep the test short): the
    # messages it reads meanwhile are the server heard from. Counting PONGs only, it left its
    # healthy server mid-backlog, a busy host at 2 s alike.
    with NatsServer() as server:
        left: list[float] = []
        read_at: list[float] = []

        async def on_msg(_: object) -> None:
            read_at.append(time.monotonic())

        async def disconnected() -> None:
            left.append(time.monotonic())

        async def on_error(exc: Exception) -> None:
            pass

        options = NatsSettings(servers=[server.url]).connect_options("slow") | {"ping_interval": SLOW_PING_S}
        log = logging.getLogger("test.nats.slow")
        nc = await connect(log, **options, disconnected_cb=disconnected, error_cb=on_error)
        try:
            await nc.subscribe("burst", cb=on_msg)
            await flush(nc)
            with caplog.at_level(logging.INFO, logger="test.nats.slow"):
                publisher = asyncio.create_task(asyncio.to_thread(asyncio.run, _bursts(server.url, 1, BACKLOG)))
                deadline = time.monotonic() + 60
                while not left and len(read_at) < BACKLOG and time.monotonic() < deadline:
                    time.sleep(SLOW_SLICE_S)  # the process's own work, on the loop
                    await asyncio.sleep(0)
                await publisher
            stale = [r.getMessage() for r in caplog.records if "answered none" in r.getMessage()]
            assert (stale, left) == ([], []), "a healthy server was left"
            assert len(read_at) == BACKLOG
            # Read over more than the intervals a silent server is left after: not passed vacuously.
            assert read_at[-1] - read_at[0] > (PINGS_UNANSWERED + 1) * SLOW_PING_S
        finally:
            await nc.close()


async def test_a_server_left_is_tried_last_under_any_of_its_names(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given by name, the cluster's members advertise their addresses, which nats-py adds to the pool
    # ('127.0.0.1:P' beside 'localhost:P'): the frozen member's address is tried last as well.
    with NatsCluster(2) as cluster:
        moved, discovered = asyncio.Event(), asyncio.Event()
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        async def reconnected() -> None:
            moved.set()

        async def on_discovered() -> None:
            discovered.set()

        urls = [u.replace("127.0.0.1", "localhost") for u in cluster.urls]
        log = logging.getLogger("test.nats.names")
        nc = await connect(
            log,
            **NatsSettings(servers=urls, ping_interval_s=PING_S).connect_options("named"),
            error_cb=on_error,
            reconnected_cb=reconnected,
            discovered_server_cb=on_discovered,
        )
        try:
            # Both members' addresses in the pool before the freeze. The first INFO names the member
            # connected to; in ~1 of 40 starts the other's came ~1 s later (an async INFO), although
            # NatsCluster had seen the routes up.
            async with asyncio.timeout(ADVERTISED_WITHIN_S):
                while len(advertised := [s for s in nc._server_pool if s.discovered]) < 2:
                    discovered.clear()
                    await discovered.wait()
            assert [s.uri.hostname for s in advertised] == ["127.0.0.1"] * 2, nc._server_pool
            assert nc.connected_url is not None and nc.connected_url.hostname == "localhost"
            victim = next(n for n in cluster.nodes if n.port == nc.connected_url.port)
            healthy = next(n for n in cluster.nodes if n is not victim)
            assert victim.pid is not None
            # The unlucky draw: the frozen member by its advertised address first.
            monkeypatch.setattr(
                nats.aio.client,
                "shuffle",
                lambda pool: pool.sort(key=lambda s: not (s.uri.port == victim.port and s.discovered)),
            )
            with caplog.at_level(logging.INFO, logger="test.nats.names"), frozen(victim.pid):
                async with asyncio.timeout(MOVED_WITHIN_S):
                    await moved.wait()
                assert nc.connected_url is not None and nc.connected_url.port == healthy.port
            # Not tried again first: its connect timeout (2 s) would have been an error.
            assert not [e for e in errors if isinstance(e, TimeoutError)], errors
            said = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("NATS connection named: moved from nats://localhost:") for m in said), said
        finally:
            await nc.close()


async def test_a_server_left_is_tried_again_while_the_other_never_completes_the_connect(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Both members freeze; the one left first is continued. The other still takes TCP connections
    # (its kernel does) and never sends its INFO: put last before every try, the continued member
    # was never tried again while the other stayed frozen.
    connect_timeout = 1  # nats-py's 2 s halved: each try of a frozen member costs one
    with NatsCluster(2) as cluster:
        left, back = asyncio.Event(), asyncio.Event()

        async def on_error(exc: Exception) -> None:
            pass

        async def disconnected() -> None:
            left.set()

        async def reconnected() -> None:
            back.set()

        log = logging.getLogger("test.nats.both")
        nc = await connect(
            log,
            **NatsSettings(servers=cluster.urls, ping_interval_s=PING_S).connect_options("both"),
            error_cb=on_error,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            connect_timeout=connect_timeout,
        )
        try:
            assert nc.connected_url is not None
            first = next(n for n in cluster.nodes if n.port == nc.connected_url.port)
            other = next(n for n in cluster.nodes if n is not first)
            assert first.pid is not None and other.pid is not None
            with caplog.at_level(logging.INFO, logger="test.nats.both"), frozen(other.pid):
                with frozen(first.pid):
                    async with asyncio.timeout(MOVED_WITHIN_S):
                        await left.wait()
                    await asyncio.sleep(3 * connect_timeout)  # a few connect timeouts on the other
                # Up to a try of the other (a connect timeout), then the continued one.
                async with asyncio.timeout(connect_timeout + 5.0):
                    await back.wait()
                assert nc.connected_url is not None and nc.connected_url.port == first.port
            said = [(r.levelno, r.getMessage()) for r in caplog.records]
            assert (logging.WARNING, f"NATS connection both: back on {first.url}, which had answered no PING") in said
        finally:
            await nc.close()


@pytest.mark.parametrize(
    "url",
    ["nats://[::1]:4222", "nats://user:pass@NATS-0.Example:4222", "tls://tok@[fd00::1]:4443", "ws://h.example"],
)
def test_a_server_is_named_as_given_without_its_userinfo(url: str) -> None:
    # The left/joined WARNINGs name the server as --nats-servers does (NatsSettings.shown_servers):
    # an IPv6 address lost its brackets (nats://::1:4222) and a name its case.
    srv = Srv(Client._parse_server_uri(url))
    assert _shown(srv) == NatsSettings(servers=[url]).shown_servers()[0]
