"""A leg: one GenerateRequest on `{ns}.gen.{role}.{worker}` and its stream of ResponseChunks, read
in `seq` order from 0 until a `final` chunk or an `error` one (router.dispatch sends it and routes
its replies here). `LegError` is how a leg ends without a final chunk.

Silence is judged here: every leg asks for a heartbeat every `stream_heartbeat_s`, and three
silent periods end it (`worker_silent`), unless this router's own NATS outage or loop stall
explains them. After the first token, silence or a seq gap may be chunks lost on the way, so
they are asked for again (GenerateRequest.resume), up to MAX_RESUMES times.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import msgspec
from opentelemetry.trace import Span

from protocol import GenerateRequest, ResponseChunk
from router.client_buffers import ClientBuffers
from router.tracing import RequestTracer

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_RESUMES",
    "NATS_LOST",
    "NATS_LOST_WHY",
    "NO_LOCAL_PREFILL",
    "SLOW_READER",
    "Leg",
    "LegError",
    "LegOwner",
    "RoundTrip",
    "time_up",
]

log = logging.getLogger(__name__)
MAX_RESUMES = 3  # times one leg may ask for lost chunks again
# The most a worker's whole utility answer, or one SSE event cut across chunks, may hold: the
# router keeps either until it is complete, so a shim that never completes one would otherwise
# grow the replica's memory until the request's deadline. An honest /tokenize of the largest body
# the router takes (16 MiB) answers about 30 MB; one event with a long prompt's logprobs, tens.
MAX_ANSWER_BYTES = 256 << 20
SLOW_READER = "slow_reader"
NATS_LOST = "nats_lost"
NATS_LOST_WHY = "the router has lost its NATS connection and is reconnecting: no worker can be reached"
# A remote prefill failed for a decode worker that cannot prefill locally (WorkerInfo.local_prefill):
# retried on another prefill worker, else the client's 503 (router.api_errors)
NO_LOCAL_PREFILL = "no_local_prefill"


def time_up(deadline: float) -> bool:
    """The request's deadline (time.monotonic()) has passed: a retry or fallback leg would not be
    sent (Dispatcher._open), so none is begun, counted or logged."""
    return time.monotonic() >= deadline


class RoundTrip(enum.Enum):
    """How the router's NATS answered a round trip asked before a silent leg's worker is blamed
    (LegOwner.answers)."""

    NONE = "none"  # not within three heartbeats: hung, or down
    PROMPT = "prompt"
    LATE = "late"  # after more than a heartbeat: what it held up comes late


class LegError(Exception):
    """A leg ended without a final chunk. `retryable`: the worker failed before doing any work a
    client saw, so another worker may take the request."""

    def __init__(
        self,
        worker: str,
        code: int,
        kind: str,
        message: str,
        *,
        retryable: bool,
        body: bytes = b"",
        retry_after_s: int | None = None,
        role: str = "",
    ) -> None:
        self.worker = worker
        self.role = role  # the leg's: prefill, decode or agg ("" for none: a utility call's)
        self.code = code
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.body = body  # the engine's own error body, when it refused the request
        self.retry_after_s = retry_after_s  # the engine's Retry-After (its 429's)
        super().__init__(f"worker {worker}: {kind}: {message}")

    @property
    def refused(self) -> bool:
        """The engine refused the request itself (bad input, too long): no other worker would
        take it either."""
        return 400 <= self.code < 500 and self.code not in (408, 409, 410, 429)

    @property
    def busy(self) -> bool:
        """The engine turned the request away for now (its 429, or a 408 from it or a proxy before
        it): another worker may take it, and this one is no worse for it (nothing is blamed)."""
        return self.code in (408, 429) and self.kind == "engine_rejected"

    @property
    def unknown_model(self) -> bool:
        """The engine does not serve the model named: a LoRA adapter unloaded since its shim last
        read /v1/models (every 5 s). Another worker may still serve it."""
        return self.code == 404

    @property
    def engine_failed(self) -> bool:
        """The engine itself answered with a server error (vLLM's 500 for a request that failed in
        the engine), not a worker gone, silent or unreachable."""
        return self.kind == "engine_error" and self.code >= 500

    @property
    def worker_silent(self) -> bool:
        return self.kind == "worker_silent"

    @property
    def nats_lost(self) -> bool:
        """The router's own NATS connection dropped while it waited: no worker is at fault, and
        none other can be reached either."""
        return self.kind == NATS_LOST

    @property
    def slow_reader(self) -> bool:
        """The client read the stream too slowly (MAX_QUEUED_BYTES): its fault, not the worker's."""
        return self.kind == SLOW_READER

    @property
    def no_local_prefill(self) -> bool:
        """No prefill worker served the request for a decode worker that cannot prefill it locally."""
        return self.kind == NO_LOCAL_PREFILL

    @property
    def malformed(self) -> bool:
        """The worker's reply broke the protocol: a chunk that does not decode, or an event cut
        across chunks that never ends."""
        return self.kind == "malformed_chunk"


class LegOwner(Protocol):
    """What a leg needs of whoever sent it (router.dispatch.Dispatcher)."""

    resumes: int  # asks for lost chunks, every leg's

    @property
    def lost_at(self) -> float | None: ...
    def awake_for(self) -> float: ...
    def is_connected(self) -> bool: ...
    async def connected(self) -> bool: ...
    async def answers(self) -> RoundTrip: ...
    def back_within(self, window_s: float, since: float | None = None) -> bool: ...
    @property
    def buffers(self) -> ClientBuffers: ...  # the replica's bytes held for clients: a stream's queue counts
    async def send(self, leg: Leg, request: GenerateRequest) -> None: ...  # to the leg's worker, replies to it
    async def closed(self, leg: Leg) -> None: ...  # its reader left: forget it, cancel it unless done


class Leg:
    """One leg's reply stream; use as `async with`, iterate chunks; leaving early cancels it.

    Chunks wait in a deque and wake the reader through one future, not an asyncio.Queue read under
    `wait_for`, which would cost a task per chunk. `on_end` runs once (`end`), when the final chunk
    arrives or the leg is dropped (`drop`), whichever is first: the engine is done with it, whether
    or not it was read; its argument says
    whether the engine prefilled the prompt (router.ledger keeps or withdraws its pending prefixes).
    (Not at an error chunk: one may be followed by a retry or a fallback that keeps the attempt's
    booking.)"""

    def __init__(
        self,
        owner: LegOwner,
        token: str,
        worker: str,
        role: str,
        request: GenerateRequest,
        span: Span,
        on_end: Callable[[bool], None],
    ) -> None:
        self.owner = owner
        self.token = token
        self.worker = worker
        self.role = role
        self.request = request
        self.request_id = request.request_id
        self.span = span
        self.on_end = on_end
        self.resumes = 0
        self.resuming = False  # chunks after a gap are dropped until the resent ones arrive
        self.resumed_at = 0.0  # time.monotonic() of the last ask
        self._items: deque[tuple[ResponseChunk | LegError, int]] = deque()  # with its size on the wire
        self.queued = 0  # bytes waiting in _items
        # when its reader last came for a chunk or was waiting for one (router.client_buffers: how
        # far behind its client is)
        self.taken_at = time.monotonic()
        # A stream's queue is held for its client, under the replica's budget (router.client_buffers);
        # a whole answer's leg is read as it comes
        self._buffers = owner.buffers if request.stream else None
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        # One timer for its reader's waits, left armed from one wait to the next (router.leg's
        # _wait): a timer made and cancelled per wait cost ~1 µs of every streamed chunk.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # the loop time it is armed for
        self._wake_at = 0.0  # the loop time the waiting reader's wait ends
        self.next_seq = 0
        self.done = False
        self.finished = False  # its final chunk came: its worker runs it no more (nothing to cancel)
        self.ended_well = False  # ... with no error, not aborted (router.prefill_watch: its KV came)
        self._ended = False  # on_end ran
        self.tokens_seen = False
        self.prefilled = False  # a chunk said the engine prefilled the prompt (ResponseChunk.prefilled)
        self.sent_at = time.monotonic()  # its request goes out as it is made (Dispatcher._open)
        self.heard_at = self.sent_at  # when it was sent, or its last chunk came
        self._graced_for: float | None = None  # the outage (Dispatcher.lost_at) it waited one more window for
        self._late_graced = False  # it waited one more window for a round trip answered late (_through_hang)
        self._cut: list[bytes] = []  # the pieces of an event cut short (ResponseChunk.continued), and its tokens
        self._cut_tokens = 0

    def push(self, item: ResponseChunk | LegError, size: int = 0) -> None:
        self.heard_at = time.monotonic()
        self._items.append((item, size))
        self.queued += size
        if self._buffers is not None:
            self._buffers.held += size
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self.taken_at = self.heard_at  # its reader was waiting for it: behind by nothing
            waiter.set_result(None)

    def drop(self, error: LegError) -> None:
        """End the leg with `error` at the reader's next read, dropping the chunks it has not read."""
        self._forget_queued()
        self.done = True  # cancelled by whoever dropped it
        self.push(error)
        self.end(self.tokens_seen)

    def end(self, prefilled: bool) -> None:
        """The engine is done with the leg: `on_end(prefilled)`, unless it ran already (a stream
        whose final chunk came, unread, is still dropped over the client buffer budget)."""
        if not self._ended:
            self._ended = True
            self.on_end(prefilled)

    async def __aenter__(self) -> Leg:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        # a reader done with it, or gone once the engine had ended it, fails no leg
        if e is not None and not ((self.done or self.finished) and isinstance(e, GeneratorExit)):
            RequestTracer.failed(self.span, str(e) or type(e).__name__)
        self.span.end()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._forget_queued()  # no reader is left for them
        await self.owner.closed(self)

    def _forget_queued(self) -> None:
        self._items.clear()
        if self._buffers is not None:
            self._buffers.held -= self.queued
        self.queued = 0

    async def _wait(self, timeout_s: float) -> None:
        """Until a chunk comes or `timeout_s` passes. The timer is re-armed only for a wait that
        ends before it: one armed for an earlier wait's end arms itself again when it fires
        (_on_timer), so a reader waiting for chunk after chunk arms one per silence window."""
        loop = self._loop
        self._waiter = waiter = loop.create_future()
        self._wake_at = wake_at = loop.time() + max(timeout_s, 0.0)
        if self._timer is None or self._timer_at > wake_at:
            self._arm(wake_at)
        try:
            await waiter
        finally:
            self._waiter = None

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # no reader waits: its next wait arms a timer of its own
        if self._timer_at < self._wake_at:
            self._arm(self._wake_at)  # armed for an earlier wait, which a chunk ended
        else:
            waiter.set_result(None)

    async def _wait_heard(self, timeout_s: float, silence_s: float, until: float) -> None:
        """`_wait`, then, while nothing came, on until this router has been awake for `silence_s`
        (runtime.loop_watch), one more silence window at most (a loop that stalls again and again
        must not hide a dead worker), or `until` (monotonic) passes: after a stall of its own, libuv
        runs the due timer before it reads the heartbeats that filled the socket meanwhile, and a
        1 s stall ended every leg in flight as worker_silent."""
        await self._wait(timeout_s)
        until = min(until, time.monotonic() + silence_s)
        while not self._items and (awake := self.owner.awake_for()) < silence_s and time.monotonic() < until:
            await self._wait(min(silence_s - awake, until - time.monotonic()))

    async def next(self, deadline_s: float, silence_s: float) -> ResponseChunk:
        """The next chunk; LegError 504 once `deadline_s` (seconds from now) passes, 503 (the worker
        went silent, retryable before the first token) after `silence_s` without any chunk.

        Chunks lost on the way (a NATS node died under the stream: a seq gap, or silence after the
        first token) are asked for again (GenerateRequest.resume) up to MAX_RESUMES times; copies
        of chunks already read are dropped."""
        now = time.monotonic()
        self.taken_at = now  # its reader came for more: what it read went to its client
        until = now + deadline_s
        while True:
            if not self._items:
                left = until - time.monotonic()
                await self._wait_heard(min(left, silence_s), silence_s, until)
                if not self._items:
                    if left <= silence_s:
                        # Since it was sent: `deadline_s` is what was left at this read, as little
                        # as a heartbeat's period on a leg that heard from its worker.
                        waited = time.monotonic() - self.sent_at
                        why = f"no answer by its deadline, {waited:.2f}s after it was sent"
                        raise LegError(self.worker, 504, "timeout", why, retryable=False, role=self.role)
                    if await self._through_outage(silence_s):
                        continue
                    if self._heard_from() and self.resumes < MAX_RESUMES:
                        await self._resume()
                        continue
                    if await self._through_hang(silence_s):
                        continue
                    raise LegError(
                        self.worker,
                        503,
                        "worker_silent",
                        f"no chunk or heartbeat for {silence_s:.2f}s",
                        retryable=not self.tokens_seen,
                        role=self.role,
                    )
            item, size = self._items.popleft()
            self.queued -= size
            if self._buffers is not None:
                self._buffers.held -= size
            if isinstance(item, LegError):
                raise item
            if item.seq < self.next_seq:
                continue  # sent again after a resume
            if item.seq > self.next_seq:
                if self.resuming and time.monotonic() - self.resumed_at < silence_s:
                    continue  # sent before our request to resend arrived: it comes again
                # A gap, or a resend that has not come while later chunks do (the ask or its answer
                # lost): each dropped chunk restarted the silence, so the stream stalled until the
                # worker had ended the whole leg.
                if self.resumes < MAX_RESUMES:
                    await self._resume()
                elif not await self._through_outage(silence_s):  # that asks again itself
                    why = f"chunk {item.seq}, expected {self.next_seq}"
                    raise LegError(self.worker, 502, "stream_gap", why, retryable=not self.tokens_seen, role=self.role)
                continue
            self.resuming = False
            self.next_seq += 1
            if item.error is not None:
                self.done = True  # the worker ended it itself: nothing to cancel
                err = item.error
                # see unknown_model and busy: another worker may serve it
                retryable = (err.code >= 500 and err.code != 504) or err.code in (404, 408, 429)
                raise LegError(
                    self.worker,
                    err.code,
                    err.kind,
                    err.message,
                    retryable=retryable,
                    body=err.body,
                    retry_after_s=err.retry_after_s,
                    role=self.role,
                )
            if item.continued or self._cut:
                item = self._joined(item)
            if item.final:
                self.done = True
            return item

    def _joined(self, chunk: ResponseChunk) -> ResponseChunk:
        """`chunk` with whole events only: a piece cut short waits for the rest, with the tokens
        of a chunk left without a whole event. An event's pieces are joined once, at its end (joined
        at each piece, a long event cost its size squared)."""
        events, tokens = list(chunk.events), chunk.tokens + self._cut_tokens
        if self._cut and events:
            if chunk.continued and len(events) == 1:
                self._cut.append(events.pop())  # the same event goes on
            else:
                events[0] = b"".join([*self._cut, events[0]])
                self._cut = []
        if chunk.continued and events:
            self._cut = [events.pop()]
        if sum(map(len, self._cut)) > MAX_ANSWER_BYTES:
            why = f"an event cut across chunks passed {MAX_ANSWER_BYTES} bytes"
            raise LegError(self.worker, 502, "malformed_chunk", why, retryable=False, role=self.role)
        self._cut_tokens = 0
        if self._cut and not events:
            self._cut_tokens, tokens = tokens, 0
        if chunk.final and self._cut:
            raise LegError(
                self.worker,
                502,
                "malformed_chunk",
                "the stream ended inside a cut-short event",
                retryable=False,
                role=self.role,
            )
        return msgspec.structs.replace(chunk, events=events, tokens=tokens, continued=False)

    async def _through_outage(self, silence_s: float) -> bool:
        """Silence, or chunks lost, that this router's own NATS outage explains, blaming no worker:
        each leg in flight through an outage ended as worker_silent, its worker was left out as
        unreachable, and the request was retried or fell back across the fleet into the same dead
        connection, to end in "no worker could serve the request". With the connection down past
        the wait a new request gets (Dispatcher.connected), the leg fails as that (LegError
        nats_lost). Back within a silence window of an outage that began since the worker was last
        heard, the worker gets another window, and lost chunks are asked for again, uncounted: the
        asks sent into the outage, or before the shim subscribed again, were lost with it. True
        when the leg should wait again."""
        owner = self.owner
        if not owner.is_connected() and not await owner.connected():
            raise LegError(self.worker, 503, NATS_LOST, NATS_LOST_WHY, retryable=False, role=self.role)
        if not owner.back_within(silence_s, since=self.heard_at) or self._graced_for == owner.lost_at:
            return False
        self._graced_for = owner.lost_at  # one more window, once per outage
        if self._heard_from():
            await self._resume(counted=False)
        return True

    async def _through_hang(self, silence_s: float) -> bool:
        """Silence that a hung NATS explains, asked before the worker is blamed for it: the
        connection stays up while the server does not answer (stopped, or behind a partition that
        drops packets), and each leg in flight ended as worker_silent, its worker left out as
        unreachable (replica audit of 2026-12-07). With no round trip answered within the wait a
        dropped connection gets (Dispatcher.answers), the leg fails as a dropped one does; one
        answered late may have held the worker's chunks up: one more window, once per leg, since a
        NATS slow all along (busy, a lossy link) answers every round trip late and a dead worker
        was never blamed, its request a 504 at its deadline. True when the leg should wait again."""
        answer = await self.owner.answers()
        if answer is RoundTrip.NONE:
            raise LegError(self.worker, 503, NATS_LOST, NATS_LOST_WHY, retryable=False, role=self.role)
        if await self._through_outage(silence_s):  # it dropped and came back while asked
            return True
        if answer is RoundTrip.PROMPT or self._late_graced:
            return False
        self._late_graced = True
        if self._heard_from():
            await self._resume(counted=False)
        return True

    def _heard_from(self) -> bool:
        """Whether silence now means chunks lost on the way rather than a dead worker: a stream's
        tokens came, or a whole answer's (a prefill leg's included) heartbeats did. A whole answer
        has no token until its end, so one that lost chunks for three heartbeats was failed as a
        silent worker after minutes of work that a resume recovers; a stream with no token yet is
        retried elsewhere at once instead."""
        return self.tokens_seen or (not self.request.stream and self.next_seq > 0)

    async def _resume(self, *, counted: bool = True) -> None:
        self.resuming = True
        self.resumed_at = time.monotonic()
        if counted:  # an ask sent into the router's own outage does not count against the leg
            self.resumes += 1
        self.owner.resumes += 1
        log.warning(
            "request %s: chunks from %d lost on the way from worker %s; asking for them again",
            self.request_id,
            self.next_seq,
            self.worker,
            extra={"request_id": self.request_id},
        )
        with contextlib.suppress(Exception):  # NATS reconnecting: the next silence asks again
            await self.owner.send(self, msgspec.structs.replace(self.request, resume=self.next_seq))
