"""The shim's NATS flush against a real nats-server: a caller cancelled while its PONG is on the
way leaves the connection reading (nats-py alone would stop its read loop at that PONG)."""

from __future__ import annotations

import asyncio
import os
import signal

import nats
from nats.aio.msg import Msg

from kvswitch.servers import NatsServer
from tests.worker_shim.cluster import wait_for
from worker_shim.nats_connect import flush


async def test_a_flush_cancelled_before_its_pong_leaves_the_connection_reading() -> None:
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
                caller = asyncio.create_task(flush(nc))
                await asyncio.sleep(0.2)
                caller.cancel()
                await asyncio.sleep(0)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            await asyncio.sleep(0.2)  # the PONG arrives
            await other.publish("flush", b"after")
            await wait_for(lambda: got == [b"after"], 3, "a message after the cancelled flush")
        finally:
            await other.close()
            await nc.close()
