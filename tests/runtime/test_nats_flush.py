"""runtime.nats_flush against a real nats-server: its PING follows every command sent before it
(nats-py's own flush overtakes queued ones), and a caller cancelled while its PONG is on the way
leaves the connection reading (nats-py alone would stop its read loop at that PONG)."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any, cast

import nats
import pytest
from nats.aio.msg import Msg
from nats.errors import FlushTimeoutError

from kvswitch.servers import NatsServer
from runtime.nats_flush import flush, write_queued
from tests.runtime.recording_proxy import recording_proxy
from tests.worker_shim.cluster import wait_for

ROOT = Path(__file__).resolve().parents[2]
# Where nats-py's own flush is awaited on purpose: inside this flush, and where it is measured.
OWN_FLUSH = {"runtime/nats_flush.py", "bench/nats_flush_race.py"}
PACKAGES = ("protocol", "runtime", "discovery", "engine_sim", "worker_shim", "router", "kvswitch", "bench", "tests")


async def test_the_flush_ping_goes_out_behind_the_subscription_it_follows() -> None:
    # The server answers a PING only after every command before it on the connection, so a PONG
    # proves the SUB registered only if the PING follows it on the wire. nats-py's flush() writes
    # its PING at once, ahead of the SUB still queued for its flusher task.
    with NatsServer() as server:
        sent = bytearray()
        proxy = await recording_proxy(server.port, sent)
        port = proxy.sockets[0].getsockname()[1]
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            for i in range(3):
                await nc.subscribe(f"barrier.{i}")
                before = len(sent)
                await flush(nc)
                wire = bytes(sent)
                sub = wire.index(f"SUB barrier.{i} ".encode())
                assert b"PING" in wire[sub:], f"no PING after the SUB of barrier.{i}: {wire[before:]!r}"
        finally:
            await nc.close()
            proxy.close()
            await proxy.wait_closed()


async def test_the_private_names_the_flush_relies_on_are_still_nats_pys() -> None:
    """runtime.nats_flush falls back to nats-py's own flush (its PING ahead of a queued SUB) if a
    release renames these: the wire test above passes on an idle connection either way, as the
    flusher task often writes the SUB first, so a rename must fail here instead."""
    with NatsServer() as server:
        nc = await nats.connect(server.url)
        try:
            assert callable(getattr(nc, "_flush_pending", None))
            assert isinstance(getattr(nc, "_pongs", None), list)
        finally:
            await nc.close()


@pytest.mark.parametrize(
    ("timeout", "stalled_s"),
    [
        (10, 0.0),  # the PONG comes while the flush still waits for it
        (1, 1.5),  # the flush times out first, its caller gone: nobody else takes its future out
    ],
)
async def test_a_flush_cancelled_before_its_pong_leaves_the_connection_reading(timeout: int, stalled_s: float) -> None:
    with NatsServer() as server:
        assert server.proc is not None
        nc, other = await nats.connect(server.url), await nats.connect(server.url)
        try:
            got: list[bytes] = []

            async def on(msg: Msg) -> None:
                got.append(msg.data)

            await nc.subscribe("flush", cb=on)
            await flush(nc)
            os.kill(server.proc.pid, signal.SIGSTOP)  # the PONG cannot come before the cancel
            try:
                caller = asyncio.create_task(flush(nc, timeout=timeout))
                await asyncio.sleep(0.2)
                caller.cancel()
                await asyncio.sleep(stalled_s)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            await asyncio.sleep(0.3)  # the PONG arrives
            await other.publish("flush", b"after")
            await wait_for(lambda: got == [b"after"], 3, "a message after the cancelled flush")
        finally:
            await other.close()
            await nc.close()


def test_nats_pys_own_flush_is_awaited_only_where_it_is_measured() -> None:
    """Every other awaited `.flush()` (all on NATS connections) is this one: nats-py's, as the
    barrier after a subscribe(), lost test_nats_stale's publish from another connection about once
    in 50 runs (2026-12-06), and a test or a tool written from it would copy it."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for top in PACKAGES
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in OWN_FLUSH
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Await)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "flush"
    ]
    assert not found, f"await runtime.nats_flush.flush(nc) there, not nc.flush(): {found}"


async def test_a_write_that_swallows_its_timeouts_cancellation_is_a_flush_timeout() -> None:
    """nats-py's _flush_pending swallows the cancellation wait_for's timeout sends it and returns:
    write_queued returned as if written (review of 080ad89)."""

    class Hung:
        async def _flush_pending(self, force_flush: bool = False) -> None:
            with contextlib.suppress(asyncio.CancelledError):  # as nats-py 2.16 does
                await asyncio.Event().wait()

    with pytest.raises(FlushTimeoutError):
        await write_queued(cast(Any, Hung()), timeout=0.2)

    class Quick:
        async def _flush_pending(self, force_flush: bool = False) -> None:
            return None

    await write_queued(cast(Any, Quick()), timeout=0.2)
