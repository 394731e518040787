"""An unsubscribe that loses no message: every message the server delivered before it processed the
UNSUB is handed to the subscription's callback, so a request sent while a responder leaves gets
either its answer or "no responders", never silence.

nats-py 2.16's `Subscription.unsubscribe()` forgets the subscription and stops its task before the
UNSUB reaches the server: a message the server sent in between is dropped by the read loop (no
subscription by that id) and one read but not yet handed to the callback is discarded. Its requester
waits out its timeout (a router leg: three heartbeat periods). Measured with the CPU busy: a retired
worker id's probe timed out in 4 of 60 runs of test_reregistration's grace test, each a MSG dropped
for the removed subscription. `Subscription.drain()` would keep them, but its flush is nats-py's own,
whose PING can overtake the queued UNSUB (runtime.nats_flush).

In its own module, not in `runtime`'s namespace: processes without NATS (engine_sim) import runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence

from nats.aio.subscription import Subscription

from runtime.nats_flush import flush

__all__ = ["unsubscribe"]


async def unsubscribe(subs: Sequence[Subscription], timeout: float = 10) -> None:
    """Unsubscribe `subs` once the server has stopped sending to them and each message it sent
    before that went through its callback: every UNSUB first, then one flush per connection, so
    many subscriptions (a shim's worker ids at its stop) cost one barrier. A connection that cannot
    do that (down, frozen, closed meanwhile) has them forgotten all the same after `timeout` seconds
    at most for the whole: reconnecting, nats-py subscribes again to every subscription it still knows."""
    live = [sub for sub in subs if sub._conn.is_connected]  # private: each one's own connection
    try:
        # One deadline: a frozen server held a shim's stop a flush timeout per step and per worker id.
        async with asyncio.timeout(timeout):
            for sub in live:
                # Private: UNSUB while the subscription still takes what the server sends first.
                await sub._conn._send_unsubscribe(sub._id)
            for nc in {id(sub._conn): sub._conn for sub in live}.values():
                # Shielded (runtime.nats_flush): the deadline leaves no PONG future behind.
                await flush(nc, math.ceil(timeout))  # the server has processed the UNSUBs: nothing more comes
            for sub in live:
                # A connection closed meanwhile stops the callbacks with messages still queued.
                await sub._pending_queue.join()  # each message delivered before went through the callback
    finally:
        for sub in subs:
            # A second UNSUB for the same sid, which the server ignores; closed, it raises.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
