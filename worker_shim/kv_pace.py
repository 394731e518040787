"""The pace of a shim's KV batches on `{ns}.kv.{worker}`: token buckets of batches and bytes at
half the budget a router gives a sender by default (protocol.kv_budget), so that no bulk send of
the shim reads as a flood there. Two sends are bulk: a registration's snapshot (`Cleared` and the
whole cache: a warm worker of 450k blocks in short branches is ~13 MiB) and the ring of batches
(at most RING_SIZE batches and RING_BYTES) held through a NATS stall, sent once NATS takes them again. Unpaced, a router
read them back-to-back and quarantined the worker as "something other than its shim" (review of
2026-12-07: 150k blocks of many requests on one system prompt, 4.44 MiB, went past the 4 MiB
burst). An engine's own events (~200 batches a second, far under 2 MiB a second) cost the pace
nothing, but the publisher's outbox is one queue in seq order, which none may jump: a live batch
sealed during a snapshot waits for the rest of it, at most its pace time (~5.5 s for 13 MiB).

`wait(size)` books one batch of `size` bytes and sleeps until both buckets hold it; the clock and
the sleep are injected (tests run it on a clock of their own). At 2 MiB up front then 2 MiB a
second, a 13 MiB snapshot takes ~5.5 s to send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from protocol.kv_budget import KV_PACE_BATCH_BURST, KV_PACE_BATCHES_PER_S, KV_PACE_MIB_BURST, KV_PACE_MIB_PER_S

__all__ = ["KvPace"]

_MIB = 1 << 20


class KvPace:
    """Buckets of `batch_burst` batches refilled at `batches_per_s`, and `bytes_burst` bytes refilled
    at `bytes_per_s`. One caller at a time (the publisher's send loop): a booking waits for every
    byte booked before it, its own included, so the bytes sent by any time t are at most
    bytes_burst + bytes_per_s x t (and the batches alike)."""

    def __init__(
        self,
        batches_per_s: float = KV_PACE_BATCHES_PER_S,
        batch_burst: float = KV_PACE_BATCH_BURST,
        bytes_per_s: float = KV_PACE_MIB_PER_S * _MIB,
        bytes_burst: float = KV_PACE_MIB_BURST * _MIB,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not (batches_per_s > 0 and batch_burst >= 1 and bytes_per_s > 0 and bytes_burst >= 1):
            raise ValueError(f"a KV pace needs positive rates and bursts >= 1: {batches_per_s=}, {batch_burst=}, "
                             f"{bytes_per_s=}, {bytes_burst=}")  # fmt: skip
        self.batches_per_s, self.batch_burst = batches_per_s, batch_burst
        self.bytes_per_s, self.bytes_burst = bytes_per_s, bytes_burst
        self._clock, self._sleep = clock, sleep
        self._batches, self._bytes = batch_burst, bytes_burst
        self._at = clock()

    def delay(self, size: int) -> float:
        """Book one batch of `size` bytes now; how long to wait before sending it (0 within both buckets)."""
        now = self._clock()
        elapsed, self._at = now - self._at, now
        self._batches = min(self.batch_burst, self._batches + elapsed * self.batches_per_s) - 1
        self._bytes = min(self.bytes_burst, self._bytes + elapsed * self.bytes_per_s) - size
        return max(0.0, -self._batches / self.batches_per_s, -self._bytes / self.bytes_per_s)

    async def wait(self, size: int, interrupt: asyncio.Event | None = None) -> bool:
        """Book one batch of `size` bytes and sleep until it may go, the loop running meanwhile; False
        if `interrupt` was set first (its owner stopping: the batch is not to go)."""
        if (delay := self.delay(size)) <= 0:
            return True
        if interrupt is None:
            await self._sleep(delay)
            return True
        slept = asyncio.ensure_future(self._sleep(delay))
        stopped = asyncio.ensure_future(interrupt.wait())
        await asyncio.wait({slept, stopped}, return_when=asyncio.FIRST_COMPLETED)
        slept.cancel()
        stopped.cancel()
        return not interrupt.is_set()
