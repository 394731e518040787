"""The request service on `{ns}.gen.{role}.{worker}` and `{ns}.cancel.{worker}`.

Each GenerateRequest runs as its own task (kept in `inflight` until it ends). The subject's role
says what the leg is:
- prefill: the engine's remote-prefill leg; one final chunk with the TransferHandle and usage. An
  engine whose prefill waits for its decode leg (SGLang: LegOutcome.engine_done) hands the handle
  over before it is done: to a router that asks for it early (GenerateRequest.early_transfer) in a
  non-final chunk, the final chunk following with the engine's outcome (or its error); to one that
  does not, in the final chunk at once, a failure after it only logged. Either way the leg stays in
  flight (its prompt queued, drained at stop, bound by its deadline) until the engine is done;
- decode: with `disagg` (and no bypass annotation) continue from the prefill leg's handle; with the
  bypass annotation or no handle, prefill locally and decode;
- agg: prefill and decode locally.
Responses go to the message's reply subject as ResponseChunks, `seq` from 0, stamped with the worker
id of the subject the request came on (during a re-registration's grace period that is the old id).
Every leg ends with exactly one final chunk: finish_reason and usage, or `error` (engine failure,
an engine the shim found hung (its stall watchdog), deadline, draining, bad request; an
engine's refusal carries its own error body and, a 429's, its Retry-After), or
finish_reason "abort" on cancel. A cancel read before its leg's task takes its first step only
marks the leg (a task cancelled then skips its body: the leg stayed in flight, its prompt queued
and its heartbeats beating, for good); one read before its request is kept EARLY_CANCEL_S and
ends that request on arrival.

A pass-through leg (GenerateRequest.endpoint set) carries the engine's own answer: each SSE
payload in `events`, or the whole body of a non-streaming answer in `body`, cut into pieces that
each fit NATS's payload limit. Token ids still ride along for the router's accounting.

Coalescing adapts to load: while the service is idle (fewer than `busy_legs` legs in flight and
NATS's outbound buffer under `BEHIND_BYTES`), output goes out the moment it arrives, one chunk per
read of the engine's stream (a shim that fell behind reads several events at once and sends them
together, without waiting for anything). Under load, a token that comes less than `COALESCE_S`
(5 ms) after the leg's previous chunk waits for that mark with whatever else arrives meanwhile, so
frames carry several tokens and no token waits longer.

A whole (non-streamed) answer has no first token to say its prefill is done, so while such a leg
runs the service looks every PREFILL_POLL_S at whether the engine's KV events cover the prompt's
full blocks; when they do its tokens stop counting as queued and a `prefilled` chunk tells the
router. An engine that caches nothing (no prefix caching) leaves them queued until the answer.

A utility call (GenerateRequest.endpoint in UTILITY_ENDPOINTS: the engine's /tokenize or
/detokenize) is no leg of a generation: it queues no prefill and decodes nothing, and its answer
comes whole (in pieces when large) in the final chunk's body. An engine without the route refuses
it (404).

`contexts` counts the legs decoding (worker_shim.decode_context): a decode or agg leg from its
first streamed token, or a whole answer's leg from that `prefilled` moment at its prompt's length,
until it ends. The load reports carry their mean as `decode_context`.

Heartbeats: a leg whose request asks for them (`heartbeat_s` > 0) sends an empty, non-final chunk
with the next seq whenever it has sent nothing for `heartbeat_s`, prefill and non-streaming legs
included, so a router tells a long prefill from a dead worker.

A chunk NATS refuses (an outage that filled its reconnect buffer) is counted, logged once per
outage and kept with the leg's others: the router asks for it again (GenerateRequest.resume) and
the leg runs on. Legs past `max_legs` in flight (leg_cap: each holds a file descriptor) are
refused at once with a retryable 503 `overloaded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from opentelemetry.trace import Span

from protocol import (
    CancelRequest,
    ConfigError,
    ErrorInfo,
    GenerateRequest,
    ProtocolError,
    ResponseChunk,
    TransferHandle,
    Usage,
    adapter_named,
    asks_prompt_logprobs,
    decode_msg,
    encode_msg,
)
from protocol.hashing import chain_salt
from protocol.messages import ANNOTATION_BYPASS, ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, ENGINE_HEADERS, UTILITY_ENDPOINTS
from runtime import StopSteps, background, cancel_and_wait
from runtime.fd_limit import fd_limit
from worker_shim.adapters.base import EngineAdapter, EngineError, LegOutcome, LegRequest
from worker_shim.credit_check import reusable
from worker_shim.decode_context import DecodeContext
from worker_shim.tracing import LegTracer

__all__ = [
    "BEHIND_BYTES",
    "BURST_BYTES",
    "BURST_BYTES_S",
    "BUSY_LEGS",
    "COALESCE_S",
    "FD_RESERVE",
    "PACED_BYTES",
    "PREFILL_POLL_S",
    "ChunkWriter",
    "RequestService",
    "leg_cap",
]

log = logging.getLogger(__name__)
# Ended legs whose chunks a router may still ask for again, bounded in number, bytes and age. A
# router asks within MAX_RESUMES (3) x 3 silent heartbeats of the last chunk it got
# (router.dispatch): 3.6 s at the default stream_heartbeat_s of 0.4; RECENT_S covers heartbeats
# up to 3.3 s. A resume for chunks dropped by then gets 410 `gone`.
RECENT_LEGS = 256
RECENT_BYTES = 64 * 1024 * 1024
RECENT_S = 30.0
# One leg's chunks kept for a resume past the window in which a router asks for them (RESUME_HEARTBEATS
# of its heartbeats: MAX_RESUMES + 1 silences of three), at most: an eighth of RECENT_BYTES, so one
# ended leg never pushes out every other. Within that window every chunk is kept, so a burst (a whole
# answer's 20 MiB body, sent in milliseconds) can still be asked for again.
LEG_KEPT_BYTES = RECENT_BYTES // 8
RESUME_HEARTBEATS = 12
# File descriptors kept free beside the legs' engine connections (one each) for what the shim
# opens besides: health probes, load polls, NATS, etcd, ZMQ event sockets, /metrics scrapes.
FD_RESERVE = 64
OVERLOAD_LOG_S = 60.0  # refusals past the cap are logged at most this often (all are counted)
# A cancel can come before its request: nats-py reads the gen and cancel subjects in tasks of
# their own, and a backlog on one is no backlog on the other. Such a cancel waits this long.
EARLY_CANCEL_S = 10.0
# Legs settled (their prefix reuse surely counted by the engine) kept with when: a load poll's
# answer looks back to its ask, a round trip.
SETTLED_KEPT = 1024
# The reuse booked for a leg whose engine requests the shim cannot weigh (a batch of prompts, beam
# search): no reuse-counter proof can lean on a window it overlaps (worker_shim.event_health).
UNWEIGHED_REUSE = 1 << 50
COALESCE_S = 0.005
BUSY_LEGS = 32
BEHIND_BYTES = 256 * 1024
# The legs' output to one router (reply subjects under one inbox prefix: `destination`) goes out
# at once up to BURST_BYTES, then at BURST_BYTES_S, however many legs send it (a token bucket per
# router, _Pace, that its legs share). A whole answer's body (or an event cut in pieces: a long
# prompt's prompt_logprobs, 193 MB at 130k tokens and 20) went out as fast as NATS took it, faster
# than a router with other work reads, and nats-server cut the router's connection, every leg on
# it, past its max_pending (64 MiB by default). At 128 MiB/s a 193 MB answer takes 1.3 s more to
# send; a token stream never comes near either bound. The first pace (2026-12-06) had a bucket per
# leg: 3 whole answers at once to one router went at 3 x 128 MiB/s, and the router was cut.
BURST_BYTES = 16 << 20
BURST_BYTES_S = 128 << 20
# Only chunks this large are paced: a whole answer's pieces and a long event's (about max_payload
# each). A token stream's chunks go at once: booked in its router's bucket behind whole answers, a
# stream got one chunk through per chunk of theirs and fell ever further behind (1.7 s at 100
# tokens a second beside three 193 MB answers; review of the shared pace, 2026-12-06).
PACED_BYTES = 64 << 10
_PACES_KEPT = 64  # routers' buckets kept before those filled up again are forgotten
PREFILL_POLL_S = 0.05
_ENVELOPE = 4096  # room left in a chunk for everything but its events, token ids or body
# msgpack's most bytes around one event (a bin 32 header) or for one token id (a uint 32): a full
# chunk of ~230-byte events held ~10 kB of framing, past the envelope, and NATS refused it for good
_FRAME = 5
_ENDPOINTS = frozenset({"", ENDPOINT_COMPLETIONS, ENDPOINT_CHAT})


def destination(reply: str) -> str:
    """The router a reply subject goes to: its inbox prefix. A router's dispatcher subscribes one
    wildcard inbox, `prefix.*`, on its NATS connection, and each leg replies to `prefix.token`
    (router.dispatch), so nats-server's max_pending for that connection bounds all of them."""
    return reply.rpartition(".")[0]


class _Pace:
    """A token bucket of BURST_BYTES, filled at BURST_BYTES_S: `delay(now, size)` books `size` bytes
    to publish at `now` (time.monotonic()) and says how long to wait first (0 within the bucket).

    One per router, shared by its legs' large chunks (PACED_BYTES): each leg books its next chunk
    only once it has published the one before (ChunkWriter._pump), and a booking waits for every byte
    booked before it, so legs in debt take turns a chunk each. A token stream's small chunks are
    not booked: they go at once."""

    def __init__(self, burst: int, rate: float, now: float) -> None:
        self.burst, self.rate = burst, rate
        self.left = float(burst)
        self.at = now

    def delay(self, now: float, size: int) -> float:
        self.left = min(float(self.burst), self.left + (now - self.at) * self.rate) - size
        self.at = now
        return max(0.0, -self.left / self.rate)

    def full(self, now: float) -> bool:
        """Filled up again: no different from a new bucket."""
        return self.left + (now - self.at) * self.rate >= self.burst


class ChunkWriter:
    """Numbers, coalesces and heartbeats one leg's chunks to its reply subject.

    Chunks go out in seq order, one coroutine publishing at a time (`_pump`): a chunk numbered
    while another coroutine publishes (a heartbeat's, a resume's) goes out with it. A resume moves
    the next chunk to publish back to the one asked for; what was not yet published goes once."""

    def __init__(
        self,
        service: RequestService,
        reply: str,
        request_id: str,
        worker: str,
        role: str,
        heartbeat_s: float = 0.0,
        *,
        first_seq: int = 0,
    ) -> None:
        self.service = service
        self.reply = reply
        self.request_id = request_id
        self.worker = worker
        self.role = role
        self.seq = first_seq
        self.sent_tokens = 0
        # The chunks a router may still ask for again, from seq `first` (_keep): those published
        # within RECENT_S, at most LEG_KEPT_BYTES of the newest; `sent_bytes` is their size. The
        # chunks from `_next` on are not yet published (each before it was, to one reply or another).
        self.sent: deque[bytes] = deque()
        self._sent_at: deque[float] = deque()
        self.first = self._next = first_seq
        self.sent_bytes = 0
        self._pumping = False
        self._resent_from: int | None = None  # a resume's re-send under way, from this seq
        self._resume_s = min(RECENT_S, RESUME_HEARTBEATS * heartbeat_s) if heartbeat_s > 0 else RECENT_S
        self.ended = 0.0  # time.monotonic() when the leg ended (RequestService.remember)
        self.done = False
        self.closed = False  # its final chunk numbered (in `sent`, published or not)
        self._pending: list[int] = []
        self._events: list[bytes] = []
        self._event_bytes = 0
        self._counted = 0  # tokens the pending events carry
        self._room = max(service.nc.max_payload - _ENVELOPE, 1024)
        self._last_sent = time.monotonic()
        self._timer: asyncio.Task[None] | None = None  # the coalescing timer, until it fires
        self._flushing: set[asyncio.Task[None]] = set()  # timers that fired, their flush under way
        self._lost: Exception | None = None  # what a timer's flush failed with, for the leg to end on
        self._heartbeat: asyncio.Task[None] | None = None
        if heartbeat_s > 0:
            self._heartbeat = asyncio.create_task(self._beat(heartbeat_s), name=f"heartbeat-{request_id}")

    async def _send(self, chunk: ResponseChunk) -> None:
        self._number(chunk)
        await self._pump()

    def _number(self, chunk: ResponseChunk) -> None:
        """`chunk` takes the next seq, kept in `sent` for _pump to publish."""
        data = encode_msg(chunk)  # first: a chunk that cannot be encoded takes no seq
        self.seq += 1
        if chunk.final:  # the outcome sent: counted before, a final chunk that failed counted as meant, not the 500
            self.closed = True
            self.service.outcomes[(self.role, _outcome(chunk))] += 1
        self._last_sent = now = time.monotonic()
        self.sent.append(data)
        self._sent_at.append(now)
        self.sent_bytes += len(data)
        self._keep(now)

    async def _pump(self, *, paced: bool = True) -> None:
        """Publish the chunks from `_next` on, in seq order and at its router's pace (_Pace, shared
        with that router's other legs), unless another coroutine is at it (it publishes these too
        before it returns). `paced` False: a cut leg's rest (_cut_short). A resume published
        what it had while the leg went on publishing its newest chunks: the router got new chunks
        amid the old, dropped them as sent before its ask, and asked again, and each ask sent a
        whole answer's burst again."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._next < self.seq:
                size = len(self.sent[self._next - self.first])
                # the router's pace is read for each chunk: a resume may name another router
                if (
                    paced
                    and size >= PACED_BYTES
                    and (wait := self.service.pace(self.reply).delay(time.monotonic(), size)) > 0
                ):
                    await asyncio.sleep(wait)  # a resume may move _next meanwhile: read it after
                data = self.sent[self._next - self.first]
                self._next += 1
                await self.service.publish(self.reply, data)
        finally:
            self._pumping = False
            if self._next >= self.seq:
                self._resent_from = None

    def _keep(self, now: float) -> None:
        """Forget the chunks no router will ask for again: it asks within a few silent heartbeats of
        the last chunk it got, so not for one published over RECENT_S ago, as for an ended leg's, nor,
        past LEG_KEPT_BYTES, for one published before its resume window. A leg in flight kept every
        chunk since its first (74 MiB in 10 s for 8 legs with logprobs)."""
        sent, at = self.sent, self._sent_at
        while (
            len(sent) > 1
            and self.first < self._next
            and (at[0] < now - RECENT_S or (self.sent_bytes > LEG_KEPT_BYTES and at[0] < now - self._resume_s))
        ):
            self.sent_bytes -= len(sent.popleft())
            at.popleft()
            self.first += 1

    def resume(self, reply: str, seq: int) -> bool:
        """Send the chunks from `seq` on again, to `reply`, which gets the rest of the leg too:
        those published go again, those not yet published (a whole answer's burst under way) once.
        An ask that a re-send under way to the same reply covers (a router that asked twice) adds
        nothing. False when `seq` is not one this leg still keeps or will send next."""
        if not self.first <= seq <= self.seq:
            return False
        covered = reply == self.reply and self._resent_from is not None and self._resent_from <= seq
        self.reply = reply
        self._last_sent = time.monotonic()
        if seq < self._next and not covered:
            self._next = self._resent_from = seq
        if not self._pumping:
            # In a task of its own: the ask came in the shim's generate handler, which NATS runs one
            # call at a time, and a paced resend there held every new request to this shim back
            # (a 60 MiB answer: 245 ms; review of 2026-12-06).
            self.service.resend(self._pump(), self.request_id)
        return True

    def _chunk(self, tokens: list[int], events: list[bytes] | None = None, **final: object) -> ResponseChunk:
        counted, self._counted = (self._counted, 0) if events else (0, self._counted)
        self.sent_tokens += len(tokens) + counted
        return ResponseChunk(
            request_id=self.request_id,
            seq=self.seq,
            token_ids=tokens,
            worker=self.worker,
            events=events or [],
            tokens=counted,
            **final,  # type: ignore[arg-type]
        )

    async def _beat(self, period: float) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._last_sent + period - time.monotonic()))
            if time.monotonic() - self._last_sent >= period:
                self.service.heartbeats += 1
                await self._send(self._chunk([]))

    async def output(self, tokens: int, events: list[bytes], toks: list[int]) -> None:
        if (lost := self._lost) is not None:  # the leg ends with a 500, as when a flush here fails
            self._lost = None
            raise lost
        counted = tokens  # one read's tokens go with the first chunk that carries its events
        room = self._room
        piece = room - _FRAME
        for event in events:
            if self._events and self._event_bytes + len(event) + _FRAME > room:
                await self._flush()
            self._counted += counted
            counted = 0
            cut = 0
            while len(event) - cut > piece:  # over a whole chunk: in pieces the router joins
                self._events.append(event[cut : cut + piece])
                self._event_bytes += piece + _FRAME  # so that token ids pending go in chunks of their own
                cut += piece
                await self._flush(continued=True)
            rest = event[cut:] if cut else event
            self._events.append(rest)
            self._event_bytes += len(rest) + _FRAME
        self._pending.extend(toks)
        if len(self._pending) * _FRAME > room:
            await self._flush()
        if self._timer is not None:
            return
        # A leg's first output follows none, so it never waits: not after a heartbeat or a prefilled
        # notice either (_last_sent is the heartbeat's clock).
        wait = self._last_sent + COALESCE_S - time.monotonic() if self.sent_tokens and self.service.busy() else 0.0
        if wait <= 0:
            await self._flush()
        else:
            self._timer = asyncio.create_task(self._flush_later(wait), name=f"coalesce-{self.request_id}")

    async def _flush_later(self, wait: float) -> None:
        """The held chunk after `wait`. A flush that fails has taken the tokens and events pending:
        its error ends the leg with a 500 at its next output() or final(). Left in this task, the
        leg's final chunk said the answer was whole with tokens missing ("Task exception was never
        retrieved" alone said otherwise; review of 2026-12-06)."""
        await asyncio.sleep(wait)
        task = asyncio.current_task()
        assert task is not None
        self._timer = None  # output() sets a new one for what comes while this flush waits on NATS
        self._flushing.add(task)  # final() waits for it: a cancel mid-publish would lose a chunk
        try:
            self.service.held_chunks += 1
            await self._flush()
        except Exception as exc:
            self._lost = self._lost or exc
        finally:
            self._flushing.discard(task)

    async def prefilled(self) -> None:
        await self._flush()
        await self._send(self._chunk([], prefilled=True))

    async def transfer_first(self, transfer: TransferHandle) -> None:
        """A prefill leg's handle before its final chunk (GenerateRequest.early_transfer)."""
        await self._send(self._chunk([], transfer=transfer))

    async def _flush(self, *, continued: bool = False) -> None:
        if self._pending or self._events:
            toks, self._pending = self._pending, []
            events, used = self._events, self._event_bytes
            self._events, self._event_bytes = [], 0
            toks = await self._send_ids_over(toks, used)
            await self._send(self._chunk(toks, events, continued=continued))

    async def _send_ids_over(self, toks: list[int], used: int) -> list[int]:
        """Sends the leading token ids past what a chunk holds beside `used` bytes, in chunks of
        their own (a whole token-id answer is every id of it); the rest, for the chunk to come."""
        fit = max(self._room - used, 0) // _FRAME
        if len(toks) <= fit:
            return toks
        head, rest = toks[: len(toks) - fit], toks[len(toks) - fit :]
        per = self._room // _FRAME
        for i in range(0, len(head), per):
            await self._send(self._chunk(head[i : i + per]))
        return rest

    async def final(
        self,
        *,
        finish_reason: str | None = None,
        usage: Usage | None = None,
        transfer: TransferHandle | None = None,
        error: ErrorInfo | None = None,
        tokens: list[int] | None = None,
        body: bytes = b"",
    ) -> None:
        """The leg's last chunks. One that fails to go is said with its traceback, and the leg ends
        with a 500 `internal` final chunk instead: raised, it ended the leg's task silently ("Task
        exception was never retrieved"), heartbeats stopped, and the router, hearing nothing, took
        the worker for unreachable (an engine's Retry-After past the encoder's bounds did it).
        A cancellation while its helpers are reaped (abort_all cancelling the leg again, past
        CANCEL_AGAIN_S) is raised after the final chunk went: raised there, the chunk never went and
        the router waited on silence. One that cuts the chunks short (a whole answer paced out) is
        raised after a final chunk that says why (_cut_short). A second call is a bug (RuntimeError):
        its chunk would come after the final one its router ended the leg on."""
        if self.done:
            raise RuntimeError(f"request {self.request_id}: its final chunk went already")
        steps = StopSteps()
        try:
            for helper, what in ((self._timer, "the coalescing timer"), (self._heartbeat, "the heartbeat")):
                with steps:
                    await _reap(helper, f"request {self.request_id}: {what}")
            self._timer = self._heartbeat = None
            try:
                with steps:
                    await self._final(finish_reason, usage, transfer, error, tokens, body)
            except Exception as exc:
                if self.closed:  # numbered, counted and kept: an error chunk after it was a second end, counted too
                    log.exception("request %s: its final chunk could not be published; kept for its router to "
                                  "ask for again", self.request_id)  # fmt: skip
                else:
                    log.exception("request %s: its final chunk could not be sent; ending it with an error",
                                  self.request_id)  # fmt: skip
                    why = ErrorInfo(code=500, kind="internal", message=f"shim error: the final chunk failed: {exc!r}")
                    try:
                        await self._send(self._chunk([], final=True, error=why))
                    except Exception:
                        log.exception("request %s: its error chunk could not be sent either", self.request_id)
            if steps.cut is not None:
                await self._cut_short(steps, usage)
        finally:
            self.done = True
        steps.end()

    async def _cut_short(self, steps: StopSteps, usage: Usage | None) -> None:
        """The end of a leg whose final chunks a cancellation cut short: the rest of its answer never
        goes, a final chunk says why (RequestService.cut_short), unless the final one was numbered, and
        what is numbered is published, unpaced: waiting again the pace wait the cancel cut, a second
        cancel (a stop after its router's cancel) cut that wait too and the final chunk never went,
        and the piece under way was booked against its router's pace twice. Until 2026-12-07 a leg
        cancelled as its whole answer was paced out ended with no final chunk, its heartbeats
        stopped, counted `ok`; a resume got silence at the end."""
        for task in list(self._flushing):  # a held chunk's flush: what it took is dropped with the rest
            with steps:
                await _reap(task, f"request {self.request_id}: a held chunk's flush")
        with steps:
            if not self.closed:
                why = self.service.cut_short(self.request_id)
                abort = why is None
                self._number(
                    self._chunk(
                        [],
                        final=True,
                        finish_reason="abort" if abort else None,
                        usage=usage if abort else None,
                        error=why,
                    )
                )
            await self._pump(paced=False)

    async def _final(
        self,
        finish_reason: str | None,
        usage: Usage | None,
        transfer: TransferHandle | None,
        error: ErrorInfo | None,
        tokens: list[int] | None,
        body: bytes,
    ) -> None:
        if self._flushing:
            await asyncio.wait(self._flushing)
        if (lost := self._lost) is not None:
            self._lost = None
            log.error("request %s: a chunk of its answer could not be sent; it ends with an error", self.request_id,
                      exc_info=lost)  # fmt: skip
            if error is None:  # the answer is not whole: none of it is said to be
                finish_reason = usage = transfer = tokens = None
                body = b""
                error = ErrorInfo(code=500, kind="internal", message=f"shim error: {lost!r}")
        toks, self._pending = self._pending + (tokens or []), []
        events, used = self._events, self._event_bytes
        self._events, self._event_bytes = [], 0
        if events and error is not None:
            await self._send(self._chunk(await self._send_ids_over(toks, used), events))  # said before it failed
            toks, events, used = [], [], 0
        pieces = [body[i : i + self._room] for i in range(0, len(body), self._room)] or [b""]
        for piece in pieces[:-1]:
            await self._send(self._chunk([], body=piece))
        if events and len(pieces[-1]) + used > self._room:
            await self._send(self._chunk(await self._send_ids_over(toks, used), events))
            toks, events, used = [], [], 0
        used += len(pieces[-1]) + (len(encode_msg(transfer)) if transfer is not None else 0)
        toks = await self._send_ids_over(toks, used)
        await self._send(
            self._chunk(
                toks,
                events,
                final=True,
                finish_reason=finish_reason,
                usage=usage,
                transfer=transfer,
                error=error,
                body=pieces[-1],
            )
        )


def _outcome(final: ResponseChunk) -> str:
    """A final chunk's outcome, as kvswitch_shim_requests_total counts it."""
    if final.error is not None:
        return final.error.kind
    return "abort" if final.finish_reason == "abort" else "ok"


async def _reap(task: asyncio.Task[Any] | None, what: str) -> None:
    """Cancel a leg's helper task and wait for it. An error it ended with is logged, not raised:
    the leg's final chunk and bookkeeping come after this."""
    if task is None:
        return
    await cancel_and_wait(task)
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s failed", what, exc_info=exc)


def _open_fds() -> int:
    for path in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(path))
    return 0


def leg_cap(configured: int | None) -> int | None:
    """The most legs in flight at once (None: no bound). Each holds a connection to the engine, a
    file descriptor: past the open-file limit the shim's own health probes and polls fail, and the
    engine would be blamed. The most the limit allows leaves FD_RESERVE descriptors beside those
    open now; that is the default, and a larger `configured` is refused."""
    limit = fd_limit()
    if limit is None:
        return configured
    room = limit - _open_fds() - FD_RESERVE
    if configured is None:
        if room < 1:
            log.warning(
                "the open-file limit (%d) leaves no room for legs beside the %d descriptors the shim keeps for "
                "itself: serving one leg at a time; raise the limit (ulimit -n)",
                limit,
                FD_RESERVE,
            )
        return max(room, 1)
    if configured > room:
        raise ConfigError(
            "max_inflight_legs",
            configured,
            f"the open-file limit ({limit}) allows at most {max(room, 0)} legs beside the {FD_RESERVE} descriptors "
            "the shim keeps for itself: lower --max-inflight-legs or raise the limit (ulimit -n)",
        )
    return configured


_SHUTDOWN = ErrorInfo(code=503, kind="shutdown", message="the worker shut down before the request ended")
_ORPHANED = ErrorInfo(
    code=503,
    kind="router_gone",
    message="the worker cancelled this leg: its router's keys had been gone from etcd for the shim's "
    "--orphan-grace-s (a router cut off from etcd, or one that died)",
)


@dataclass(slots=True)
class _Leg:
    request_id: str
    queued_tokens: int
    writer: ChunkWriter | None = None
    task: asyncio.Task[None] | None = None
    cancelled: bool = False
    # Cancelled as its router's orphan (cancel_from), not by that router: it ends in an error, as
    # a router cut off from etcd only is alive and reading, and an abort ended its client's stream
    # as if the answer were whole.
    orphaned: bool = False
    # Ended by the service itself (abort_all): the shim stops, or its stall watchdog finds its engine hung.
    ended: ErrorInfo | None = None
    # The task took its first step. A task cancelled before that never runs its body, so its
    # cleanup and final chunk never came: until then a cancel only marks the leg (_stop).
    running: bool = False
    started: float = field(default_factory=time.monotonic)
    # Prefix reuse (tokens) the engine may count for it, until it surely has (RequestService._settle).
    reuse: int = 0
    reuse_before: int = 0  # RequestService.reuse_started as it began
    predicted: int = 0  # prompt tokens the engine should find cached, until it has scheduled the leg
    origin: str = ""  # the router process that sent it (GenerateRequest.origin)


class RequestService:
    """Runs legs against one adapter; serves every worker id it is subscribed under.

    `on_served(request_id, token_ids, salt, usage)` is called after each leg that prefilled its
    prompt locally and ended well (the shim checks that the engine's KV events followed).
    `on_transfer_failed()` is called for each leg fed by a KV transfer that the engine failed (its
    own 5xx, `engine_error`) before any output: its pull, most likely (worker_shim.transfer_failures).
    `on_scheduled(dispatched, at, predicted)` is called once the engine has scheduled a leg whose
    prompt it should find `predicted` tokens of cached (worker_shim.credit_check.CreditCheck), with
    the time.monotonic() of its dispatch and of now.
    """

    def __init__(
        self,
        nc: Nats,
        adapter: EngineAdapter,
        on_change: Callable[[], None],
        cached_tokens: Callable[[list[int], str], int] = lambda _ids, _salt: 0,
        *,
        on_served: Callable[[str, list[int], str, Usage], None] = lambda _rid, _ids, _salt, _usage: None,
        on_scheduled: Callable[[float, float, int], None] = lambda _dispatched, _at, _predicted: None,
        on_transfer_failed: Callable[[], None] = lambda: None,
        block_size: Callable[[], int | None] = lambda: None,
        max_model_len: Callable[[], int | None] = lambda: None,
        model: str = "",
        busy_legs: int = BUSY_LEGS,
        max_legs: int | None = None,
        tracer: LegTracer | None = None,
    ) -> None:
        self.nc = nc
        self.tracer = tracer or LegTracer()
        # Prompt tokens the engine already caches: they cost no prefill, so they are not "queued".
        self.cached_tokens = cached_tokens
        self.adapter = adapter
        self.on_change = on_change
        self.on_served = on_served
        self.on_scheduled = on_scheduled
        self.on_transfer_failed = on_transfer_failed
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model = model  # the engine's own; a leg naming another (not an alias) runs a LoRA adapter
        self.aliases: frozenset[str] = frozenset()  # other names the engine serves `model` under
        self.busy_legs = busy_legs
        self.max_legs = max_legs  # legs past it are refused at once (503 overloaded): leg_cap
        self.accepting = True
        self.inflight: dict[str, _Leg] = {}
        # The prefix reuse the legs started could earn, and that of the legs whose reuse the engine
        # has surely counted, with when: how much of a reuse counter's rise other legs may hold.
        self.reuse_started = 0
        self._reuse_settled = 0
        self._settled: deque[tuple[float, int]] = deque(maxlen=SETTLED_KEPT)
        self.completed = 0
        self.failed = 0
        # Messages on the worker's subjects that cannot be served, by kind ("generate": no
        # GenerateRequest, "no_reply": no reply subject, "cancel"): counted, each kind logged once,
        # as anyone who may publish there can send any number
        self.malformed: Counter[str] = Counter()
        self.heartbeats = 0
        self.held_chunks = 0  # chunks held back for the coalescing mark (under load only)
        self.chunks_unsent = 0  # chunks NATS refused (reconnecting with a full buffer, closed): kept for resume
        self._unsent_since: float | None = None  # the NATS outage chunks went unsent in, logged once
        self._unsent_reconnects = 0  # nc.stats["reconnects"] then: a reconnect since ends that outage
        self._overload_logged = -OVERLOAD_LOG_S  # when a refusal past max_legs was last logged
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self._queued = 0
        self.contexts = DecodeContext()  # the legs decoding, for LoadReport.decode_context
        self.resumes = 0
        self._resends: set[asyncio.Task[None]] = set()  # legs' resends under way (resend)
        self._paces: dict[str, _Pace] = {}  # by router (destination), while not full again
        # Legs that ended lately, for a router that lost their last chunks (a NATS node died).
        self.recent: OrderedDict[str, ChunkWriter] = OrderedDict()
        self._recent_bytes = 0  # of the chunks in `recent`
        self._early_cancels: OrderedDict[str, float] = OrderedDict()  # request id -> when (EARLY_CANCEL_S)

    @property
    def prefill_tokens_queued(self) -> int:
        return self._queued

    def busy(self) -> bool:
        """Coalesce only under load: many legs in flight, or NATS not keeping up with the output."""
        return len(self.inflight) >= self.busy_legs or self.nc.pending_data_size >= BEHIND_BYTES

    def pace(self, reply: str) -> _Pace:
        """The pace of the router `reply` goes to, which every leg to it shares. Past _PACES_KEPT
        routers, those whose bucket has filled up again are forgotten (a new one is the same); on
        each new router, they were remade for every chunk where two routers take turns."""
        to = destination(reply)
        pace = self._paces.get(to)
        if pace is None:
            now = time.monotonic()
            if len(self._paces) >= _PACES_KEPT:
                for gone in [d for d, p in self._paces.items() if p.full(now)]:
                    del self._paces[gone]
            pace = self._paces[to] = _Pace(BURST_BYTES, BURST_BYTES_S, now)
        return pace

    def resend(self, pump: Coroutine[Any, Any, None], request_id: str) -> None:
        """Run a leg's resend (ChunkWriter.resume) in a task, kept until it ends, and cancelled at stop."""
        task = background(pump, f"resend-{request_id}", f"request {request_id}'s chunks are not sent again")
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    async def publish(self, subject: str, data: bytes) -> None:
        """Publish a leg's chunk. A chunk NATS refuses (its reconnect buffer full during an outage,
        the connection closed) is counted and logged once per outage, not raised: it stays in its
        writer's `sent`, for the router's resume, and the leg runs on."""
        try:
            await self.nc.publish(subject, data)
        except NatsError as exc:
            self.chunks_unsent += 1
            reconnects = self.nc.stats["reconnects"]
            if self._unsent_since is None or reconnects != self._unsent_reconnects:  # a new outage
                self._unsent_since, self._unsent_reconnects = time.monotonic(), reconnects
                log.warning(
                    "NATS refused a response chunk (%r): chunks go unsent until it takes them again, kept "
                    "for routers to ask for again (kvswitch_shim_chunks_unsent_total)",
                    exc,
                )
            return
        if self._unsent_since is not None and self.nc.is_connected:
            log.info("NATS takes response chunks again after %.1fs", time.monotonic() - self._unsent_since)
            self._unsent_since = None

    # --- NATS handlers --------------------------------------------------------------------------

    async def on_generate(self, msg: Msg) -> None:
        *_, role, worker = msg.subject.split(".")
        if not msg.reply:
            self._malformed("no_reply", f"generate request on {msg.subject} has no reply subject: dropped")
            return
        try:
            req = decode_msg(msg.data, GenerateRequest)
        except ProtocolError as exc:
            self._malformed("generate", f"malformed generate request answered with a 400: {exc}")
            writer = ChunkWriter(self, msg.reply, "", worker, role)
            await writer.final(error=ErrorInfo(code=400, kind="bad_request", message=str(exc)))
            return
        if req.resume is not None:
            await self._resume(req, msg.reply, worker, role)
            return
        writer = ChunkWriter(self, msg.reply, req.request_id, worker, role, req.heartbeat_s)
        if not self.accepting:
            await writer.final(error=ErrorInfo(code=503, kind="draining", message="the worker is shutting down"))
            return
        if req.request_id in self.inflight:
            await writer.final(
                error=ErrorInfo(code=409, kind="bad_request", message=f"request {req.request_id} is already running")
            )
            return
        early = self._early_cancels.pop(req.request_id, None)
        if early is not None and time.monotonic() - early < EARLY_CANCEL_S:
            await writer.final(finish_reason="abort", usage=Usage(prompt_tokens=len(req.token_ids)))
            return
        if self.max_legs is not None and len(self.inflight) >= self.max_legs:
            # Refused before any work: the router retries it on another worker.
            why = f"the worker has {len(self.inflight)} legs in flight (--max-inflight-legs)"
            if time.monotonic() - self._overload_logged >= OVERLOAD_LOG_S:
                self._overload_logged = time.monotonic()
                log.warning("%s: refusing more with 503 overloaded (kvswitch_shim_requests_total)", why)
            await writer.final(error=ErrorInfo(code=503, kind="overloaded", message=why))
            return
        if req.endpoint in UTILITY_ENDPOINTS:
            state = _Leg(req.request_id, 0, writer, origin=req.origin)
            self._begin(state)
            state.task = asyncio.create_task(self._call(req, state, writer), name=f"call-{req.request_id}")
            return
        leg = self._leg_request(req, role)
        if isinstance(leg, ErrorInfo):
            await writer.final(error=leg)
            return
        queued = predicted = 0  # a transferred prompt costs this engine no prefill
        # The most reuse the engine may count for it: a pulled prompt in full (a vLLM without the
        # by-source series counts pulls in), else its whole blocks short of the last token.
        reuse, bs = len(req.token_ids), self.block_size()
        if leg.transfer is None:
            held = self.cached_tokens(req.token_ids, self._salt(req))
            queued, predicted = len(req.token_ids) - held, self._reuse(req, held)
            reuse = reusable(reuse, reuse, bs) if bs else reuse
        copies = engine_requests(req.params)
        reuse = UNWEIGHED_REUSE if copies is None else reuse * copies
        state = _Leg(req.request_id, max(queued, 0), writer, predicted=predicted, reuse=reuse, origin=req.origin)
        self._begin(state)
        self._queued += state.queued_tokens
        self.on_change()
        span = self.tracer.start(req.trace, role, worker, req.request_id)
        engine = {h: v for h, v in req.headers.items() if h in ENGINE_HEADERS}
        leg.headers = {**engine, **LegTracer.headers(span, req.trace)}
        state.task = asyncio.create_task(self._run(req, leg, state, writer, role, span), name=f"leg-{req.request_id}")

    def _begin(self, state: _Leg) -> None:
        state.reuse_before = self.reuse_started
        self.reuse_started += state.reuse
        self.inflight[state.request_id] = state

    def _settle(self, state: _Leg) -> None:
        """The engine has counted the leg's reuse: it does so as it schedules the leg, before its
        first output; or the leg ended."""
        if state.reuse:
            self._reuse_settled += state.reuse
            state.reuse = 0
            self._settled.append((time.monotonic(), self._reuse_settled))

    def _end(self, state: _Leg) -> None:
        self._settle(state)
        self.inflight.pop(state.request_id, None)

    def reuse_settled_by(self, at: float) -> int:
        """The prefix reuse of the legs settled by `at` (time.monotonic()); less where that is no
        longer kept, which overstates what other legs may hold."""
        return next((total for when, total in reversed(self._settled) if when <= at), 0)

    async def _resume(self, req: GenerateRequest, reply: str, worker: str, role: str) -> None:
        assert req.resume is not None
        state = self.inflight.get(req.request_id)
        self._forget_old()
        writer = state.writer if state is not None else self.recent.get(req.request_id)
        if writer is not None and writer.resume(reply, req.resume):
            self.resumes += 1
            return
        gone = ChunkWriter(self, reply, req.request_id, worker, role, first_seq=req.resume)
        await gone.final(error=ErrorInfo(code=410, kind="gone", message=f"no chunks from {req.resume} to send again"))

    def remember(self, writer: ChunkWriter) -> None:
        old = self.recent.pop(writer.request_id, None)
        if old is not None:
            self._recent_bytes -= old.sent_bytes
        if writer.sent_bytes > RECENT_BYTES:
            return  # kept, it would push out every other leg, then itself
        writer.ended = time.monotonic()
        self.recent[writer.request_id] = writer
        self._recent_bytes += writer.sent_bytes
        self._forget_old()

    def _forget_old(self) -> None:
        """Drop ended legs' chunks, oldest first, past RECENT_LEGS, RECENT_BYTES or RECENT_S."""
        recent, old = self.recent, time.monotonic() - RECENT_S
        while recent and (
            len(recent) > RECENT_LEGS or self._recent_bytes > RECENT_BYTES or next(iter(recent.values())).ended < old
        ):
            _, writer = recent.popitem(last=False)
            self._recent_bytes -= writer.sent_bytes

    def _malformed(self, kind: str, what: str) -> None:
        self.malformed[kind] += 1
        if self.malformed[kind] == 1:
            log.warning("%s (logged once per kind; counted in kvswitch_shim_requests_malformed_total)", what)

    async def on_cancel(self, msg: Msg) -> None:
        try:
            req = decode_msg(msg.data, CancelRequest)
        except ProtocolError as exc:
            self._malformed("cancel", f"ignoring malformed cancel: {exc}")
            return
        state = self.inflight.get(req.request_id)
        if state is None:
            if req.request_id not in self.recent:  # a leg that ended before its cancel came needs none
                self._remember_cancel(req.request_id)
        elif not state.cancelled:
            state.cancelled = True
            self._stop(state)

    def origins(self) -> set[str]:
        """The routers (RouterInfo.instance) with legs in flight here that a cancel could end."""
        return {s.origin for s in self.inflight.values() if s.origin and not s.cancelled}

    def cancel_from(self, origin: str) -> int:
        """Cancel every leg in flight that router `origin` sent, as its cancels would; how many."""
        legs = [s for s in self.inflight.values() if s.origin == origin and not s.cancelled]
        for state in legs:
            state.cancelled = state.orphaned = True
            self._stop(state)
        return len(legs)

    def _remember_cancel(self, request_id: str) -> None:
        now = time.monotonic()
        early = self._early_cancels
        early[request_id] = now
        while early and (len(early) > RECENT_LEGS or next(iter(early.values())) < now - EARLY_CANCEL_S):
            early.popitem(last=False)

    def cut_short(self, request_id: str) -> ErrorInfo | None:
        """What a final chunk cut short by a cancellation says in its place: None for an abort (its
        router's cancel), else the error: its router gone (cancel_from), the service's own end of it
        (abort_all), the shim's stop."""
        state = self.inflight.get(request_id)
        if state is None:
            return _SHUTDOWN
        if state.orphaned:
            return _ORPHANED
        return None if state.cancelled else state.ended or _SHUTDOWN

    @staticmethod
    def _stop(state: _Leg) -> None:
        """Cancel the leg's task once it runs; before, the flags set say it to the task as it starts."""
        if state.running and state.task is not None:
            state.task.cancel()

    # --- one leg --------------------------------------------------------------------------------

    def _salt(self, req: GenerateRequest) -> str:
        """The canonical chain salt of the leg's prompt, whose blocks the engine keys by them: the
        LoRA adapter it names instead of the engine's model (under any of its names), and the
        client's `cache_salt` (vLLM's per-tenant cache isolation)."""
        salt = req.params.get("cache_salt")
        lora = adapter_named(req.model, self.model, self.aliases) if self.model else ""
        return chain_salt(lora, salt if isinstance(salt, str) else "")

    def _reuse(self, req: GenerateRequest, held: int) -> int:
        """Of the `held` leading prompt tokens the KV events say are cached, those the engine should
        reuse: all but the last token (vLLM computes it to sample from), none when the leg asks for
        prompt logprobs (vLLM then reads no cache, as it needs every prompt token's logits)."""
        bs = self.block_size()
        if not bs or asks_prompt_logprobs(req.params, chat=req.endpoint == ENDPOINT_CHAT):
            return 0
        return reusable(held, len(req.token_ids), bs)

    def _scheduled(self, state: _Leg) -> None:
        if state.predicted:
            self.on_scheduled(state.started, time.monotonic(), state.predicted)
            state.predicted = 0

    def _leg_request(self, req: GenerateRequest, role: str) -> LegRequest | ErrorInfo:
        leg = LegRequest(
            request_id=req.request_id,
            model=req.model,
            token_ids=req.token_ids,
            sampling=req.sampling,
            stream=req.stream,
            endpoint=req.endpoint,
            params=req.params,
            engine_request_id=req.engine_request_id,
            max_model_len=self.max_model_len(),
        )
        if not req.token_ids:
            return ErrorInfo(code=400, kind="bad_request", message="token_ids is empty")
        if req.endpoint not in _ENDPOINTS:
            return ErrorInfo(code=400, kind="bad_request", message=f"unknown endpoint {req.endpoint!r}")
        if role == "prefill":
            leg.prefill_only = True
        elif role == "decode" and req.disagg is not None and ANNOTATION_BYPASS not in req.annotations:
            if req.disagg.engine != self.adapter.kind:
                return ErrorInfo(
                    code=400,
                    kind="bad_request",
                    message=f"transfer handle from a {req.disagg.engine} engine cannot feed a {self.adapter.kind} one",
                )
            leg.transfer = req.disagg.params
        elif role not in ("decode", "agg"):
            return ErrorInfo(code=400, kind="bad_request", message=f"unknown role {role!r} in the subject")
        return leg

    def _first_token(self, state: _Leg) -> None:
        if state.queued_tokens:
            self._queued -= state.queued_tokens
            state.queued_tokens = 0
            self.on_change()

    async def _run(
        self, req: GenerateRequest, leg: LegRequest, state: _Leg, writer: ChunkWriter, role: str, span: Span
    ) -> None:
        async def on_output(tokens: int, events: list[bytes], toks: list[int]) -> None:
            self._first_token(state)
            self._settle(state)
            self._scheduled(state)
            if not leg.prefill_only:
                self.contexts.grow(req.request_id, tokens, len(req.token_ids), engine_requests(req.params) or 1)
            await writer.output(tokens, events, toks)

        state.running = True
        watch = None
        rest: asyncio.Task[LegOutcome] | None = None  # the engine's prefill after its handle went
        # A leg fed by a transfer queues nothing, but the router books its blocks here until `prefilled`.
        if not leg.stream and not leg.prefill_only and (state.queued_tokens or leg.transfer is not None):
            watch = asyncio.create_task(
                self._watch_prefill(req.token_ids, self._salt(req), engine_requests(req.params) or 1, state, writer),
                name=f"prefill-{req.request_id}",
            )
        try:
            try:
                if state.cancelled or state.ended is not None:
                    raise asyncio.CancelledError  # asked before this task took its first step
                remaining = None if req.deadline is None else req.deadline - time.time()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):
                    outcome = await self.adapter.generate(leg, on_output)
                    rest = outcome.engine_done
                    if rest is not None and req.early_transfer:
                        await writer.transfer_first(self._handle(outcome, writer))
                        done = await rest
                        outcome = LegOutcome(done.finish_reason, done.usage, outcome.transfer_params)
            except TimeoutError:
                self.failed += 1
                LegTracer.failed(span, "deadline")
                await writer.final(error=ErrorInfo(code=504, kind="deadline", message="the request's deadline passed"))
                return
            except EngineError as exc:
                self.failed += 1
                # The engine's own 500, as router.dispatch's LegError.engine_failed: most likely its KV
                # pull (kv_load_failure_policy fail). An engine gone or a stream cut counts no pull.
                engine_failed = exc.kind == "engine_error" and exc.code >= 500
                if leg.transfer is not None and engine_failed and writer.sent_tokens == 0:
                    self.on_transfer_failed()
                LegTracer.failed(span, f"{exc.kind} ({exc.code})")
                await writer.final(error=_error_info(exc))
                return
            except asyncio.CancelledError:
                if state.orphaned:
                    await writer.final(error=_ORPHANED)
                    return
                if state.cancelled:
                    await writer.final(finish_reason="abort", usage=Usage(prompt_tokens=len(req.token_ids)))
                    return
                if state.ended is not None and state.ended is not _SHUTDOWN:  # its engine's failure
                    self.failed += 1
                    LegTracer.failed(span, f"{state.ended.kind} ({state.ended.code})")
                await writer.final(error=state.ended or _SHUTDOWN)
                raise
            except Exception as exc:
                self.failed += 1
                LegTracer.failed(span, repr(exc))
                log.exception("request %s failed", req.request_id)
                await writer.final(error=ErrorInfo(code=500, kind="internal", message=f"shim error: {exc!r}"))
                return
            self.completed += 1
            self._scheduled(state)
            await self._finish(writer, outcome, role, leg)
            if outcome.engine_done is not None:  # its router asked for no early handle
                untold = await self._untold(req, outcome.engine_done)
                if untold is None:
                    return
                outcome = untold
            if leg.transfer is None:
                self.on_served(req.request_id, req.token_ids, self._salt(req), outcome.usage)
        finally:
            span.end()
            # a cancel landing while the helpers are reaped is raised after the bookkeeping: raised
            # from the reap, it left the leg in flight for good (its slot, its prompt counted queued)
            steps = StopSteps()
            if rest is not None and not rest.done():  # the leg ended before the engine: aborted
                with steps:
                    await _reap(rest, f"request {req.request_id}: the engine's prefill")
            with steps:
                await _reap(watch, f"request {req.request_id}: the prefill watch")
            self._first_token(state)
            self.contexts.end(req.request_id)
            self._end(state)
            self.remember(writer)
            steps.end()

    async def _call(self, req: GenerateRequest, state: _Leg, writer: ChunkWriter) -> None:
        """A utility call (no generation: nothing queued, nothing decoding): the engine's whole
        answer in the final chunk's body, or its refusal."""
        state.running = True
        try:
            try:
                if state.cancelled or state.ended is not None:
                    raise asyncio.CancelledError  # asked before this task took its first step
                remaining = None if req.deadline is None else req.deadline - time.time()
                async with asyncio.timeout(remaining):
                    raw = await self.adapter.call(req.endpoint, {**req.params, "model": req.model})
            except TimeoutError:
                await writer.final(error=ErrorInfo(code=504, kind="deadline", message="the request's deadline passed"))
                return
            except EngineError as exc:
                await writer.final(error=_error_info(exc))
                return
            except asyncio.CancelledError:
                if state.orphaned:
                    await writer.final(error=_ORPHANED)
                    return
                if state.cancelled:
                    await writer.final(finish_reason="abort")
                    return
                await writer.final(error=state.ended or _SHUTDOWN)
                raise
            # out of the handlers: a cancellation while it reaps its helpers is raised after the
            # answer went (ChunkWriter.final), not answered with a second final chunk
            await writer.final(body=raw)
        finally:
            self._end(state)
            self.remember(writer)

    async def _watch_prefill(
        self, token_ids: list[int], salt: str, sequences: int, state: _Leg, writer: ChunkWriter
    ) -> None:
        """Until the engine's KV events hold every full block of the prompt; then the prompt no
        longer counts as queued, its `sequences` decode (decode_context), and the router hears that
        its prefill is done."""
        while True:
            await asyncio.sleep(PREFILL_POLL_S)
            block = self.block_size()
            if block and len(token_ids) - self.cached_tokens(token_ids, salt) < block:
                # Not yet scheduled for the credit check: these events come from the engine core
                # straight, and its reuse counter may lag them; the answer comes after it.
                self._first_token(state)
                self.contexts.grow(state.request_id, 0, len(token_ids), sequences)  # its output comes at the end
                await writer.prefilled()
                return

    async def _untold(self, req: GenerateRequest, engine: asyncio.Task[LegOutcome]) -> LegOutcome | None:
        """The engine's outcome of a prefill whose handle went in the final chunk already, to a
        router that did not ask for it early (one of before 2026-12-07): the leg stays in flight
        until the engine is done; None when the engine failed, which that router cannot be told
        (logged). Not bound by the leg's deadline: that router sets it to its prefill timeout, but
        the engine now waits on the decode leg, whose deadline (the request's) this shim never sees;
        aborting it there failed a slow pair's request that would have been served. The engine's
        own P/D timeouts (SGLang's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT and _WAITING_TIMEOUT)
        bound it, and drain aborts it past its grace."""
        try:
            return await engine
        except EngineError as exc:
            why = str(exc)
            log.warning(
                "request %s: the engine's prefill failed after its transfer handle went (%s); its router predates "
                "GenerateRequest.early_transfer and cannot be told, so its decode leg waits for KV that never comes",
                req.request_id,
                why,
            )
        except Exception:
            log.exception("request %s: the engine's prefill failed after its transfer handle went", req.request_id)
        return None

    def _handle(self, outcome: LegOutcome, writer: ChunkWriter) -> TransferHandle:
        return TransferHandle(
            engine=self.adapter.kind, params=outcome.transfer_params or {}, prefill_worker=writer.worker
        )

    async def _finish(self, writer: ChunkWriter, outcome: LegOutcome, role: str, leg: LegRequest) -> None:
        if role == "prefill":
            # The prefill leg's sampled token is not part of the answer: the decode leg produces it all.
            handle = self._handle(outcome, writer)
            await writer.final(finish_reason=outcome.finish_reason, usage=outcome.usage, transfer=handle)
            return
        tokens = outcome.token_ids if not leg.stream and not leg.endpoint else []
        await writer.final(finish_reason=outcome.finish_reason, usage=outcome.usage, tokens=tokens, body=outcome.body)

    # --- lifecycle --------------------------------------------------------------------------------

    async def drain(self, grace_s: float) -> tuple[int, int]:
        """Stop taking requests; let in-flight ones run up to `grace_s`, then abort the rest. A prefill
        leg whose handle went already is in flight until its engine is done, so it is waited for too.
        The legs that finished meanwhile and those cut, each said (until 2026-12-07 the end was not:
        a shim's log ended at "draining N legs")."""
        self.accepting = False
        tasks = [s.task for s in self.inflight.values() if s.task is not None]
        started = time.monotonic()
        if tasks:
            log.info("draining %d legs, up to %gs (--drain-grace-s)", len(tasks), grace_s)
            await asyncio.wait(tasks, timeout=grace_s)
        # Each ends with a 503 `shutdown`, counted in kvswitch_shim_requests_total{outcome="shutdown"};
        # until 2026-12-07 they were cut without a word, their clients' 502s unexplained in this log.
        cut = sum(not t.done() for t in tasks)
        if cut:
            log.warning(
                "%d legs still running after the %gs drain (--drain-grace-s): ended with 503 shutdown "
                '(kvswitch_shim_requests_total{outcome="shutdown"}); %d finished within it',
                cut,
                grace_s,
                len(tasks) - cut,
            )
        elif tasks:
            log.info("drained: the %d legs finished in %.1fs", len(tasks), time.monotonic() - started)
        await self.abort_all()
        return len(tasks) - cut, cut

    async def abort_all(self, error: ErrorInfo = _SHUTDOWN) -> None:
        """End every in-flight leg with `error` (the shim stops: `shutdown`; its engine hangs or is
        down: a retryable 503 that says so), closing its engine connection, which the engines
        take for an abort."""
        for resend in list(self._resends):
            resend.cancel()
        running: list[asyncio.Task[None]] = []
        unstarted: list[asyncio.Task[None]] = []
        for s in list(self.inflight.values()):
            if s.task is not None and not s.task.done():
                s.ended = s.ended or error
                (running if s.running else unstarted).append(s.task)
        # A leg not yet started ends at its first step, told by its flags (_stop): cancelled before
        # it, it would never run, nor send its final chunk.
        await cancel_and_wait(*running)
        for t in running:
            if not t.cancelled():
                t.result()  # a leg's own error, raised as awaiting it did
        for t in unstarted:
            with contextlib.suppress(asyncio.CancelledError):
                await t


def _error_info(exc: EngineError) -> ErrorInfo:
    return ErrorInfo(code=exc.code, kind=exc.kind, message=exc.message, body=exc.body, retry_after_s=exc.retry_after_s)


def engine_requests(params: dict[str, Any] | None) -> int | None:
    """How many requests the engine runs for a leg's prompt: the client's `n` (vLLM runs each
    sample as its own request, and the second counts the first's blocks as hits); None where the
    shim cannot weigh them: a batch of prompts (routed and hashed by its first) or beam search."""
    if not params:
        return 1
    prompt = params.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (list, str)):
        return None
    if params.get("use_beam_search"):
        return None
    n = params.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
