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
- failed after the decode leg showed output, or ended well: nothing; the KV came. One that ended
  with an error or an abort is marked cut all the same (nothing to cancel): its reader falls back.
- a decode leg that ends with nothing (an abort, or an engine's 5xx: SGLang ends a decode request
  whose prefill peer failed with a 500, and its reply may come first) asks for the verdict
  (`verdict`): a failure falls back as above. Until 2026-12-07 such an abort was the client's empty
  answer, the prefill's 500 never judged; and one that came with the prefill's failure in one reply
  batch freed the attempt's booking before the cut, and the fallback booked it again for good (a
  phantom load on the worker). Until 2026-12-07 (review of f51606a) the decode engine's 500 was its
  own failed KV pull in either order: the pair blamed, the prefill worker never judged.

A lost NATS connection is no failure here: the decode leg, on the same connection, judges itself.
A decode leg fed by its handle that ends well (`fed()`) shows the prefill worked, whether or not the
prefill leg's own final chunk has come (a one-token answer's decode leg may end first): judged so
at once, and the prefill leg is left to end by itself, not aborted. Until 2026-12-07 the decode
leg's end cancelled the watch, so such a prefill was never judged (a `prefill_failing` probe
episode ran on) and its engine was sent a needless abort.
`close()` ends the watch with its attempt: a prefill leg whose final chunk came is read to it; one
still open after an attempt that failed (or a client that left) is cancelled on its worker and read
to its end, three silent heartbeats or the deadline, as a retry may send its worker a prefill leg
under the same request id, which its shim refuses (409) while this one still aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from router.leg import Leg, LegError
from router.tracing import RequestTracer

__all__ = ["PREFILL_ABORTED", "PrefillWatch"]

# Watches left reading a prefill leg to its end after their attempt (`fed`): held until done
_LEFT: set[asyncio.Task[None]] = set()

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
        self._leg = leg
        self._judged = False  # on_done called, or a failure found
        self._closing = False  # cancelled with its attempt: its end is no verdict
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

    async def verdict(self, within_s: float) -> LegError | None:
        """The prefill's failure, once its leg has ended (waited for up to `within_s`); None when it
        worked, or has not ended by then. For a decode leg that ended with nothing (an abort, or
        its engine's 5xx before output: SGLang's for a failed transfer):
        its end may be its prefill peer's failure, which is heard of on the prefill leg."""
        if not self._task.done():
            await asyncio.wait({self._task}, timeout=within_s)
        return self.failure

    def fed(self) -> None:
        """The decode leg its handle went to ended well: the KV came, so the prefill worked."""
        self._worked()

    def _worked(self) -> None:
        if not self._judged and self.failure is None:
            self._judged = True
            self._on_done()

    async def close(self) -> None:
        task = self._task
        if task.done():
            return
        if self._judged and not self._leg.done:  # fed: nothing to retry, nothing to abort; it ends by itself
            _LEFT.add(task)
            task.add_done_callback(_LEFT.discard)
            return
        if not self._leg.done:  # its attempt failed, or its client left: aborted, and waited for
            self._closing = True
            await self._cut(self._leg)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise

    async def _read(self, leg: Leg, context: contextlib.AsyncExitStack, until: float, silence_s: float) -> None:
        async with context:  # leaving it cancels the leg on its worker unless it ended
            try:
                while not (chunk := await leg.next(until - time.monotonic(), silence_s)).final:
                    pass  # heartbeats
                if chunk.finish_reason == "abort":
                    why = "its engine ended the prefill as aborted: no KV goes to the decode worker"
                    raise LegError(self.worker, 502, PREFILL_ABORTED, why, retryable=True, role="prefill")
            except LegError as exc:
                if exc.nats_lost or self._closing or self._judged:
                    return  # its end after a cancel, or after the KV came, says nothing of the prefill
                RequestTracer.failed(leg.span, str(exc))
                self.failure = exc
                await self._cut_decode()
                return
            self._worked()

    async def _cut_decode(self) -> None:
        decode = self._decode
        if decode is None or self.cut_at is not None or decode.done or decode.tokens_seen or decode.prefilled:
            return
        if decode.ended_well:  # the KV came: its end is the answer
            return
        self.cut_at = time.monotonic()
        if not decode.finished:  # an error or abort that came ends it already: nothing to cancel
            await self._cut(decode)
