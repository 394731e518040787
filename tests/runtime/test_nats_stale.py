"""A NATS connection made by runtime.nats_connect with protocol.config's options, on a member that
stops answering with its TCP connection up (SIGSTOP: frozen, or cut off by a partition): it leaves
for another member within a few PING intervals, with bytes still queued for the frozen one, and
says which server it left and which it joined. nats-py's defaults (a PING every 120 s, 2 unanswered)
held it there for 4-6 minutes; its graceful close of the old socket, with bytes queued, held it
until the kernel gave up (nats-io/nats.py#671). The other side: a healthy server whose PONGs wait
behind a burst of messages, read by a busy process, is kept; a server that keeps sending but reads
nothing is not."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats
import nats.aio.client
import pytest
from nats.aio.client import Client

from kvswitch.servers import NatsCluster, NatsServer
from protocol.config import PING_INTERVAL_S, PINGS_UNANSWERED, NatsSettings
from runtime.nats_connect import _AliveWhenRead, connect
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


def test_nats_py_reads_and_counts_pings_where_runtime_nats_connect_hooks_in() -> None:
    # runtime.nats_connect takes a full chunk read for an answer by replacing the parser its reader
    # task feeds, resets the count its PING timer keeps and watches the PONGs it counts: a nats-py
    # that renamed any would leave a busy reader's healthy server again, or keep a server that
    # reads nothing, silently. Upgrading nats-py: check them all.
    read_loop = inspect.getsource(Client._read_loop)
    assert "b = await self._transport.read(DEFAULT_BUFFER_SIZE)" in read_loop
    assert "await self._ps.parse(b)" in read_loop
    ping_timer = inspect.getsource(Client._ping_interval)
    assert "self._pings_outstanding += 1" in ping_timer
    assert 'if self._pings_outstanding > self.options["max_outstanding_pings"]' in ping_timer
    assert "self._pongs_received += 1" in inspect.getsource(Client._process_pong)


BURSTS, BURST, SIZE = 2, 20_000, 1024
BUSY_SLICE_S = 0.02


async def _bursts(url: str) -> None:
    """BURSTS bursts of BURST messages, 1 s apart: 20 MB each, faster than a busy reader reads."""
    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    try:
        for i in range(BURSTS):
            if i:
                await asyncio.sleep(1.0)
            for _ in range(BURST):
                await nc.publish("burst", b"y" * SIZE)
            await nc.flush()
    finally:
        await nc.close()


async def test_a_busy_reader_behind_a_burst_keeps_its_healthy_server(caplog: pytest.LogCaptureFixture) -> None:
    # A PONG is read behind every message the server sent before it: a process whose loop is busy
    # (20 ms slices, a router decoding reports) read it seconds late. At the shortest interval
    # each burst was taken for a frozen server, the connection dropped and its backlog lost.
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
            await nc.flush()
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


async def test_a_server_left_is_tried_last_under_any_of_its_names(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given by name, the cluster's members advertise their addresses, which nats-py adds to the pool
    # ('127.0.0.1:P' beside 'localhost:P'): the frozen member's address is tried last as well.
    with NatsCluster(2) as cluster:
        moved = asyncio.Event()
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        async def reconnected() -> None:
            moved.set()

        urls = [u.replace("127.0.0.1", "localhost") for u in cluster.urls]
        log = logging.getLogger("test.nats.names")
        nc = await connect(
            log,
            **NatsSettings(servers=urls, ping_interval_s=PING_S).connect_options("named"),
            error_cb=on_error,
            reconnected_cb=reconnected,
        )
        try:
            # The routes were up: the first INFO named both members' addresses.
            assert [s.uri.hostname for s in nc._server_pool if s.discovered] == ["127.0.0.1"] * 2, nc._server_pool
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
                    await asyncio.sleep(3 * 2.0)  # a few connect timeouts (2 s) on the other
                # Up to a try of the other (2 s), then the continued one.
                async with asyncio.timeout(2.0 + 5.0):
                    await back.wait()
                assert nc.connected_url is not None and nc.connected_url.port == first.port
            said = [(r.levelno, r.getMessage()) for r in caplog.records]
            assert (logging.WARNING, f"NATS connection both: back on {first.url}, which had answered no PING") in said
        finally:
            await nc.close()


INFO = b'INFO {"server_id":"talking","version":"2.10.0","proto":1,"headers":true,"max_payload":1048576}\r\n'
# The most PING intervals without a PONG before leaving: those answered by full chunks, then the
# ordinary rule's; and slack for a loaded machine.
NO_PONG_MAX = (_AliveWhenRead.FORGIVEN_PER_UNANSWERED + 1) * PINGS_UNANSWERED + 1
LEFT_BEHIND_WITHIN_S = NO_PONG_MAX * PING_INTERVAL_S[0] + 5.0
# The PING intervals a backlog may be forgiven, in seconds.
FORGIVEN_S = _AliveWhenRead.FORGIVEN_PER_UNANSWERED * PINGS_UNANSWERED * PING_INTERVAL_S[0]


@contextlib.asynccontextmanager
async def _reading_nothing(talk: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> AsyncIterator[str]:
    """A NATS server on a free loopback port. On its first connection it takes the CONNECT, answers
    its PING, then reads nothing more (a server whose reader is stuck, a path cut one way) while
    `talk` keeps sending on it; on every later one it answers every PING. Yields its URL."""
    connections: list[tuple[asyncio.Task[Any], asyncio.StreamWriter]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = not connections
        task = asyncio.current_task()
        assert task is not None, "asyncio runs each connection's handler in a task"
        connections.append((task, writer))
        writer.write(INFO)
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
                    if first:
                        await talk(writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()
        for _, writer in connections:  # ended, not cancelled: asyncio logs a cancelled handler
            writer.transport.abort()
        await asyncio.gather(*(task for task, _ in connections))


async def _first_leaving(url: str, name: str, caplog: pytest.LogCaptureFixture) -> tuple[float, list[str]]:
    """Seconds from connecting to `url` (at the shortest PING interval) to leaving it, and the
    WARNINGs said until it joined it again; fails past LEFT_BEHIND_WITHIN_S."""
    left, back = asyncio.Event(), asyncio.Event()

    async def disconnected() -> None:
        left.set()

    async def reconnected() -> None:
        back.set()

    async def on_error(exc: Exception) -> None:
        pass

    log = logging.getLogger(f"test.nats.{name}")
    options = NatsSettings(servers=[url], ping_interval_s=PING_INTERVAL_S[0]).connect_options(name)
    with caplog.at_level(logging.WARNING, logger=log.name):
        start = time.monotonic()
        nc = await connect(log, **options, disconnected_cb=disconnected, reconnected_cb=reconnected, error_cb=on_error)
        try:
            parser = nc._ps
            assert type(parser) is _AliveWhenRead
            async with asyncio.timeout(LEFT_BEHIND_WITHIN_S):
                await left.wait()
            took = time.monotonic() - start
            async with asyncio.timeout(5.0):
                await back.wait()
            # nats-py makes its parser once, in __init__: the same one reads every server joined.
            assert nc._ps is parser
        finally:
            await nc.close()
    return took, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("noise", [b"PING\r\n", b"+OK\r\n"])
async def test_a_server_that_talks_but_reads_nothing_is_left(noise: bytes, caplog: pytest.LogCaptureFixture) -> None:
    # Its bytes are no answer: it read none of the PINGs. Taking any bytes for one kept it for
    # good, every publish lost and every request timed out, with nothing said.
    async def talk(writer: asyncio.StreamWriter) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL_S[0] / 3)
            writer.write(noise)
            await writer.drain()

    async with _reading_nothing(talk) as url:
        took, said = await _first_leaving(url, "talking", caplog)
    # The ordinary rule: PINGS_UNANSWERED+1 intervals (2 s), before any backlog's forgiveness could run out.
    assert took < FORGIVEN_S, f"left after {took:.1f} s: its bytes were taken for a backlog"
    assert any(m.startswith(f"NATS connection talking: {url} answered none of its last") for m in said), said


async def test_a_server_that_floods_but_reads_nothing_is_left_once_the_backlog_is_forgiven_no_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Full chunks, for ever: as a backlog a busy reader is behind, but never a PONG. Kept for
    # FORGIVEN_PER_UNANSWERED x PINGS_UNANSWERED intervals, then left by the ordinary rule.
    flood = b"MSG nobody 1 16384\r\n" + b"z" * 16384 + b"\r\n"  # to no subscription: dropped
    flood *= 64

    async def talk(writer: asyncio.StreamWriter) -> None:
        while True:
            writer.write(flood)
            await writer.drain()

    async with _reading_nothing(talk) as url:
        took, said = await _first_leaving(url, "flooding", caplog)
    assert took >= FORGIVEN_S, f"left after {took:.1f} s: the backlog was not taken for one"
    assert any(m.startswith(f"NATS connection flooding: {url} answered none of its last") for m in said), said
