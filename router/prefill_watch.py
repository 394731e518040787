"""The rest of a prefill leg whose transfer handle came before its end (GenerateRequest.early_transfer).

An SGLang prefill engine holds its request until its decode peer connects, so the decode leg must
run while the prefill does: its shim sends the handle in a non-final chunk, and the leg's final
chunk then says how the engine's prefill ended. The dispatcher sends the decode leg with the
handle at once, and this watch reads the prefill leg on beside it until its final chunk, its time
(`until`: the request's deadline, as its engine now waits on its decode peer) or three silent heartbeats:

- ended well: `on_done()` (its worker worked, its booking settles);
- failed (an error chunk, the engine's own abort, silence, out of time) while the decode leg it
  feeds has shown nothing (no token, no `prefilled`): `failure` says why, and that decode leg is cut
  (`cut(leg)`: cancelled on its worker). Its reader (router.dispatch) drops what it still sends,
  waits for its end, and takes the bypass path as for any failed remote prefill. Until 2026-12-07
  the router read the handle as the end of the prefill: a prefill the engine refused or failed was
  never heard of, and the client waited on a decode leg for KV that never came.
- failed after the decode leg showed output: nothing; the KV came.

A lost NATS connection is no failure here: the decode leg, on the same connection, judges itself.
`close()` ends the watch with its attempt: a prefill leg still open is cancelled on its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from router.leg import Leg, LegError
from router.tracing import RequestTracer

__all__ = ["PREFILL_ABORTED", "PrefillWatch"]

# The LegError kind of a prefill leg whose engine ended its prefill as aborted without an error
# (SGLang's abort of a request in its queue): no KV goes to the decode peer.
PREFILL_ABORTED = "prefill_aborted"


class PrefillWatch:
    """Owns the prefill leg (and its `context`, whose exit closes it) from its early handle on, and
    the one task reading it."""

    def __init__(
        self,
        leg: Leg,
        context: contextlib.AsyncExitStack,
        *,
        until: float,
        silence_s: float,
        left_s: float,
        on_done: Callable[[], None],
        cut: Callable[[Leg], Awaitable[None]],
    ) -> None:
        self.worker = leg.worker
        self.left_s = left_s  # what the request had left as the prefill leg went (router.dispatch._prefill_fault)
        self.failure: LegError | None = None
        self.cut_at: float | None = None  # time.monotonic() its decode leg was cut
        self._decode: Leg | None = None
        self._on_done = on_done
        self._cut = cut
        self._task = asyncio.create_task(self._read(leg, context, until, silence_s), name=f"prefill-{leg.request_id}")

    @property
    def cut(self) -> bool:
        """The decode leg it feeds was cancelled for the prefill's failure."""
        return self.cut_at is not None

    async def feeding(self, leg: Leg) -> None:
        """`leg` is the decode leg its handle went to; cut at once if the prefill failed meanwhile."""
        self._decode = leg
        if self.failure is not None:
            await self._cut_decode()

    async def close(self) -> None:
        task = self._task
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _read(self, leg: Leg, context: contextlib.AsyncExitStack, until: float, silence_s: float) -> None:
        async with context:  # leaving it cancels the leg on its worker unless it ended
            try:
                while not (chunk := await leg.next(until - time.monotonic(), silence_s)).final:
                    pass  # heartbeats
                if chunk.finish_reason == "abort":
                    why = "its engine ended the prefill as aborted: no KV goes to the decode worker"
                    raise LegError(self.worker, 502, PREFILL_ABORTED, why, retryable=True, role="prefill")
            except LegError as exc:
                if exc.nats_lost:
                    return
                RequestTracer.failed(leg.span, str(exc))
                self.failure = exc
                await self._cut_decode()
                return
            self._on_done()

    async def _cut_decode(self) -> None:
        decode = self._decode
        if decode is None or self.cut_at is not None or decode.done or decode.tokens_seen or decode.prefilled:
            return
        self.cut_at = time.monotonic()
        await self._cut(decode)
