"""A NATS flush that is a barrier: when it returns, the server has processed every command this
connection sent before it (subscriptions above all), and neither a cancelled caller nor a timeout
can turn it against the connection.

nats-py 2.16 gets both wrong:
- `Client.flush()` writes its PING straight to the socket while commands sent before it (a SUB, a
  PUB) still wait in the queue its flusher task writes from. The PONG can come back before the
  server has seen them: measured here, with the CPU busy, 23 to 34 of 500 messages published by
  another connection right after `subscribe(); flush()` were never delivered (0 of 500 with the
  queue written first). A shim's "subscribed, now I can be routed to" was therefore not true.
- An abandoned flush leaves its future in the PONG queue, and the PONG, when it comes, raises in
  the connection's read loop, which stops: nothing more is read until the server drops the
  connection.

In its own module, not in `runtime`'s namespace: processes without NATS (engine_sim) import runtime.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.errors import FlushTimeoutError

__all__ = ["flush", "nats_answers", "write_queued"]


async def flush(nc: Client, timeout: int = 10) -> None:
    """Return once the server has processed everything sent on `nc` before this call. Shielded,
    the flush outlives a cancelled caller; one that times out has its future taken out of the PONG
    queue. FlushTimeoutError after about `timeout` seconds (twice that at worst)."""
    flushing = asyncio.ensure_future(_flush(nc, timeout))
    # A cancelled caller leaves its outcome to nobody: retrieved here, not logged as never retrieved.
    flushing.add_done_callback(lambda t: t.cancelled() or t.exception())
    await asyncio.shield(flushing)


async def nats_answers(nc: Client, timeout_s: int) -> bool:
    """Whether `nc`'s server answers a PING within `timeout_s`: a hung one (stopped, or the network
    to it dropping packets) leaves the connection up until nats-py's own PINGs go unanswered. A
    connection down or reconnecting is no answer: nats-py's flush returns at once then, with no
    round trip (a killed NATS, or a hung one once its PINGs dropped the connection, read as live)."""
    if not nc.is_connected:
        return False
    try:
        await flush(nc, timeout_s)
    except Exception:  # timed out, or the connection is down or closed: no answer either way
        return False
    return True


async def write_queued(nc: Client, timeout: float = 10) -> None:
    """Return once the commands queued on `nc` before this call are written to its socket: the
    write half of `flush`, without waiting for the server's PONG, which comes behind whatever the
    server sends this connection first (a flood's backlog). Shielded as `flush` is (nats-py's
    write swallows a cancellation). FlushTimeoutError after about `timeout` seconds."""
    writing = asyncio.ensure_future(_write_queued(nc, timeout))
    writing.add_done_callback(lambda t: t.cancelled() or t.exception())
    await asyncio.shield(writing)


async def _write_queued(nc: Client, timeout: float) -> None:
    # Private: write the queued commands and wait until they are on the socket. Without it (a
    # renamed method) nats-py's flusher task writes them soon, and a flush's PING may overtake them.
    write = getattr(nc, "_flush_pending", None)
    if write is not None:
        # wait_for cancels it at the timeout, and nats-py's write swallows the cancellation and
        # returns: the deadline, not an exception, says it ran out.
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            await asyncio.wait_for(write(force_flush=True), timeout)
        except TimeoutError:
            raise FlushTimeoutError from None
        if asyncio.get_running_loop().time() >= deadline:
            raise FlushTimeoutError


async def _flush(nc: Client, timeout: int) -> None:
    """The flush itself, shielded. A timeout takes its future out of the PONG queue here, in the
    shielded task, so that it is done whether or not the caller still waits (done in the caller,
    a caller cancelled before the timeout left it there)."""
    try:
        await _write_queued(nc, timeout)  # so the PING goes out behind them
        await nc.flush(timeout)
    except FlushTimeoutError:
        pongs = getattr(nc, "_pongs", None)  # private: no-op should a nats-py release rename it
        if isinstance(pongs, list):
            pongs[:] = [f for f in pongs if not f.cancelled()]
        raise
