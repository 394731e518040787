"""Dispatch: a routed request's legs over NATS, streamed back.

A leg (router.leg) is one GenerateRequest on `{ns}.gen.{role}.{worker}`; its ResponseChunks come
back on a reply subject under one wildcard inbox this dispatcher subscribes once (a subscription
per request would cost a SUB/UNSUB round per request). Chunks must arrive in `seq` order from 0;
the leg ends with a `final` chunk or an `error` one.

`Dispatcher.run()` drives a whole request from its first plan, which the planner has booked:
- remote path: a prefill leg (max_tokens 1) on the prefill worker; its TransferHandle goes to the
  decode leg in `disagg`. A prefill leg that fails, finds no responder, loses its worker, goes
  silent or takes longer than `prefill_timeout_s` falls back to the bypass path (outcome
  fallback_prefill_failed). A prefill leg that fails through its worker's own fault (its time
  limit, no transfer handle, an engine that broke protocol) is reported (`on_prefill`): the worker
  is left out of prefill legs for a cooldown (router.eligibility). Not one that stopped on its one
  token with no handle (`prefill_stopped`: an EOS or a client's stop id; vLLM gives a handle only
  for a leg that ended on its length), which is the request's doing. A server error (5xx) is reported
  only once the fallback serves the request: one the request itself caused (vLLM 0.32: a grammar
  that fails to compile) fails the local prefill alike. A prefill engine that refuses the request
  (a 4xx error chunk, before any prefill) leaves it to the decode engine, on the bypass path on the
  same decode worker: one started with other flags may serve it, and its refusal is the client's
  answer. One it serves is the fallback (outcome fallback_prefill_refused), put down to the prefill
  worker (counted per worker in `refusals_overruled`, logged once per worker), which stays
  routable; one it refuses too fell back from nothing and keeps its plan's outcome. A 404, a model
  (a LoRA adapter) the prefill worker no longer serves, falls back as a failure. A prefill leg
  asks for its handle early (GenerateRequest.early_transfer): a shim whose engine waits for the
  decode leg (SGLang) sends it before its final chunk, the decode leg goes at once, and
  router.prefill_watch reads the rest of the prefill leg beside it; a failure there before the
  decode leg shows output cancels that leg, waits for its end, and takes the same ways as above. A
  decode leg that ends with nothing (an abort, or an engine's 5xx: SGLang's 500 for one whose prefill
  peer failed, maybe before the prefill leg's error comes) waits for the prefill's verdict, three
  heartbeats at most. Both legs' engines' 5xx (SGLang's failed KV transfer) blame the pair in
  transfer health, and neither worker alone.
- bypass path: the decode leg carries the `bypass_remote_prefill` annotation.
- a decode/agg leg whose worker dies (no responder, silent, a 5xx error chunk; not its etcd key
  gone, which legs in flight outlive: worker_gone) or answers 404 (an adapter unloaded there)
  before the first token is retried once on the next-best worker (a new plan, booked by the
  planner); after the first token the error goes to the client. Its engine's server error (a 5xx
  but 503) is reported (`on_engine`: three in a row leave the worker out) only once the retry
  generates output, as a prefill leg's is: one the request itself caused fails the retry too and
  costs neither worker anything, and one with no retry (no other worker, no time) says nothing of
  the worker. Every such failure but a failed
  KV pull (the pair's: router.transfer_health) is counted per worker and kind (`legs_failed`).
- liveness: every leg asks for a heartbeat every `stream_heartbeat_s`; a leg silent for three of them
  ends (its worker is reported unreachable), so a worker that dies before the first token costs a
  stream at most 3x that. After the first token, silence may be chunks lost on the way (a NATS
  node died under the stream), so they are asked for again, up to MAX_RESUMES times, each after
  three more periods of silence: a worker frozen mid-stream with its NATS connection up ends the
  leg after 12 periods (4.8 s at the default 0.4 s); a killed one's no-responder answer ends it at
  once. A leg that finds no responder reports its worker unreachable at once; so does one whose
  chunks stay lost after MAX_RESUMES asks (a stream gap, or a resend that has not come within
  three periods while later chunks do), retried before the first token.
- a malformed reply (a broken or hostile shim: a chunk that does not decode, an event cut across
  chunks that never ends) ends the leg; one that does not decode is retried before the first token
  like a dead worker's, a prefill leg falls back. The worker is reported malformed (left out for a
  cooldown, router.eligibility), counted per worker in `malformed_replies`, logged once per worker
  (a fleet's first few named, the rest counted in one line: router.fleet_lines).
- leaving early (client gone, deadline) cancels the leg on its worker (`{ns}.cancel.{worker}`).
  A cancel can be lost: sent while NATS is down it waits in nats-py's reconnect buffer, which
  goes out on reconnect, maybe before the worker's shim has subscribed again, and NATS drops it. So
  a leg cancelled (or given up on) is remembered until its deadline (CANCELLED_KEPT legs at most):
  a chunk of it that arrives later says its engine still runs it, and sends the cancel again, at
  most once per CANCEL_AGAIN_S per leg; its final chunk forgets it.
- a client that reads a stream slower than its worker writes it: the chunks waiting for it are
  bounded (MAX_QUEUED_BYTES); past that the leg ends at once with a 408 `slow_reader` LegError, is
  cancelled on its worker and its queue dropped, rather than the whole answer piling up here. So
  is the stream furthest behind (its client idle longest) when all the replica's clients hold more
  than its budget (router.client_buffers, --client-buffer-mib).
- a leg whose request's deadline has passed is not sent: a 504 `deadline_passed` LegError, the
  client's "the request's deadline passed" (a stall of this router's loop). Until 2026-12-07 it
  went out with a negative budget, for its shim to answer 504 a round trip later. A leg that fails
  at or past its request's deadline is neither retried nor fallen back from: the request ends with
  that leg's own error (a prefill leg that ran out the time: its 504 `timeout`, naming it), nothing
  counted or logged as a retry or fallback. Until 2026-12-07 the retry or fallback was counted and
  logged, then refused as `deadline_passed`, naming a worker that was sent nothing.
- a leg that NATS cannot carry is refused before it is sent: over the server's payload limit
  (413, naming the limit) or holding an integer no 64-bit field holds (400).
- a remote prefill whose decode leg NATS could not carry with its transfer handle (a vLLM handle
  names a block id per prompt block: protocol.transfer_handle_bound) takes the bypass path before
  its prefill leg is sent (outcome fallback_handle_too_large): its prefill leg is refused with
  that room kept. A decode leg over the limit all the same (a handle larger than the bound) falls
  back to the bypass path alike, rather than answering 413 for a prompt the bypass leg carries.
"The first token" is a leg's first generated output: token ids, or a pass-through leg's counted
tokens or body. The token-less events before it (a chat stream's role chunk, which vLLM sends before
a request's error, a failed KV pull's too) are held: sent just before it, dropped when a retry or the
KV-transfer fallback takes over (which sends its own), sent before the error when none does.
Every attempt's booking is released when the attempt ends, whichever way, or sooner: when its
decode leg's final chunk arrives (the engine is done with it), not when a slow client has read it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import nats.js.api
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from protocol import (
    CancelRequest,
    GenerateRequest,
    ProtocolError,
    ResponseChunk,
    TransferHandle,
    decode_msg,
    encode_msg,
    subjects,
)
from protocol.client_errors import brief
from protocol.config import RouterSettings
from protocol.messages import ANNOTATION_BYPASS, BAD_TRANSFER_HANDLE, PREFILL_STOPPED, transfer_handle_bound
from router.client_buffers import CLIENT_BUFFER_MIB, ClientBuffers
from router.disagg import RoutePlan
from router.eligibility import MALFORMED_COOLDOWN_S
from router.fleet_lines import FleetLines, FleetLog
from router.leg import MAX_ANSWER_BYTES, NO_LOCAL_PREFILL, SLOW_READER, Leg, LegError, RoundTrip, time_up
from router.leg_failures import LegFailures
from router.policies import Outcome, Path
from router.prefill_watch import PrefillWatch
from router.tracing import RequestTracer
from runtime import guarded
from runtime.nats_flush import nats_answers

__all__ = ["LEG_FAILED_KINDS", "Bookings", "Dispatcher", "Job"]

log = logging.getLogger(__name__)
_NO_RESPONDERS = "503"
# The most a streamed leg's chunks may wait for their reader (a client that stopped reading: its
# handler blocks on the socket while NATS goes on delivering): past it the leg ends (`slow_reader`).
# A client that keeps up holds about one chunk; a phone on a slow link falls behind by this much
# only after tens of seconds of long logprobs.
MAX_QUEUED_BYTES = 8 << 20
# Token-less chunks held before a leg's first token (its role chunks: a few hundred bytes). More
# means an engine streaming on without a counted token (empty deltas while it holds text back for a
# stop string): it serves the request, and the client must not wait, nor the router hold it all.
MAX_HELD_BYTES = 64 << 10
# A cancelled leg's late chunks send its cancel again at most this often (a flood of late chunks is
# no flood of cancels); cancelled legs remembered for that, the oldest forgotten first.
CANCEL_AGAIN_S = 1.0
CANCELLED_KEPT = 4096
CANCEL_KEPT_S = 600.0  # a cancelled leg without a deadline is remembered this long (--request-timeout's default)
_RECONNECT_POLL_S = 0.01


PAYLOAD_TOO_LARGE = "payload_too_large"
# A prefill leg refused for its decode leg: that one, with the transfer handle, would not fit
HANDLE_TOO_LARGE = "handle_too_large"
# A leg not sent: its request's deadline had passed (a stall of this router's loop, a retry or
# fallback begun at the deadline), where its shim would answer 504 at once, a round trip later
DEADLINE_PASSED = "deadline_passed"
# What a decode leg may take beyond its prefill leg besides the handle: its own max_tokens (the
# prefill leg's is 1), with room to spare
_DECODE_LEG_EXTRA = 64


class Bookings(Protocol):
    """The ledger's side the dispatcher needs (router.ledger.Ledger): plans arrive booked."""

    def rebook_bypass(self, key: str, plan: RoutePlan) -> None: ...  # after a fallback
    # idempotent per booking: the first call that reaches it counts
    def prefill_done(self, key: str, worker: str | None = None) -> None: ...
    def free(self, key: str, *, served: bool = False) -> None: ...


@dataclass(slots=True)
class Job:
    """A request being dispatched. `plan`, `path` and `outcome` follow retries and fallbacks, so
    whoever reads them after the first chunk sees where the request really went. `replan` returns
    a booked plan avoiding the given workers (router.planner.Planner.plan_again)."""

    request: GenerateRequest
    plan: RoutePlan
    replan: Callable[[frozenset[str]], RoutePlan | None]
    deadline: float  # time.monotonic() at which the request's time is up (on the wire: _wall)
    path: Path = Path.AGG
    outcome: Outcome = Outcome.AGGREGATED
    attempts: int = 0
    fallback: bool = False
    transfer: TransferHandle | None = None
    first_token_at: float | None = None  # at its first generated output (_generated)
    # The leg's token-less events before its first generated output (a chat stream's role chunk):
    # sent with that output, dropped when a retry or fallback takes over (which sends its own)
    held: list[ResponseChunk] = field(default_factory=list)
    held_bytes: int = 0  # of the events held, this leg's (MAX_HELD_BYTES)
    tried: set[str] = field(default_factory=set)
    # (worker, fault, role, time.monotonic() it failed) of its legs whose engines failed them with a
    # server error (a 5xx) before any output: put down to those workers only once another leg
    # generates output for the request, as one the request itself caused (vLLM 0.32: a grammar that
    # fails to compile) fails every engine alike; dropped when a later decode or agg leg fails with
    # an engine 5xx (a 503 too, as before: LegError.engine_failed), or the request ends unserved; a
    # later prefill leg's 5xx replaces only an earlier prefill leg's (one slot, as before)
    engine_errors: list[tuple[str, str, str, float]] = field(default_factory=list)
    # (prefill worker, its engine's message) of a prefill leg its engine refused (a 4xx): put down
    # to that worker only if a decode engine serves the request
    prefill_refused: tuple[str, str] | None = None
    released: bool = False  # its bookkeeping ended (router.request_path)
    booked: str | None = None  # the attempt's booking, until freed
    sequences: int = 1  # the engine's sequences for it: its prompts times `n` (RequestShape.sequences)

    @property
    def prefill_worker(self) -> str | None:
        """The worker whose prefill its decode leg pulled; None when its decode worker prefilled it."""
        return self.plan.prefill.worker if self.transfer is not None and self.plan.prefill else None

    def drop_held(self) -> None:
        self.held.clear()
        self.held_bytes = 0


def _ends_leg(msg: Msg) -> bool:
    """A reply that says its leg runs no more on its worker: its final chunk. (Not a no-responder
    answer: after an outage one comes for each ask for lost chunks the router sent before the
    worker had subscribed again, and says nothing of the leg.)"""
    try:
        return bool(msg.data) and decode_msg(msg.data, ResponseChunk).final
    except ProtocolError:
        return False


def _output(chunk: ResponseChunk) -> bool:
    """The chunk carries something a client would see."""
    return bool(chunk.token_ids or chunk.events or chunk.body)


def _served(leg: Leg, final: ResponseChunk) -> bool:
    """A leg that ended with `final` (no error) prefilled its prompt: not an abort with no output and
    no `prefilled` before it, which may have prefilled nothing (SGLang's abort before prefill, its
    abort after its prefill peer failed, the shim's answer to a cancel that came first)."""
    return final.finish_reason != "abort" or leg.tokens_seen or leg.prefilled


def _generated(chunk: ResponseChunk) -> bool:
    """The chunk carries generated output (tokens, a piece of a whole answer), not only token-less
    events: vLLM's chat stream sends its role chunk before a request's error (a failed KV pull too)."""
    return bool(chunk.token_ids or chunk.tokens or chunk.body)


# A shim of before 2026-12-07's BAD_TRANSFER_HANDLE (36ea325) said a bad handle so, as `engine_protocol`:
# routers are upgraded before shims (docs/deployment.md, Upgrades), so one may still answer this router
_OLD_BAD_HANDLE = "the prefill leg returned kv_transfer_params with "


def _prefill_fault(exc: LegError, timeout_s: float, left_s: float, *, handed: bool = False) -> tuple[str, bool] | None:
    """Why a failed prefill leg is its worker's fault, with the likely fix, and whether its engine
    still serves whole requests (it only returned no transfer handle, or one no decode engine would
    pull with); None when it is not its fault (the client's deadline, a refusal, a model unloaded)
    or is judged elsewhere (silent, malformed). `handed`: its handle came before its end (an SGLang
    prefill, router.prefill_watch), and its engine waits on its decode peer too: out of time, it
    is the pair's, not the prefill worker's alone."""
    # a handle there, its engine's flags right: no --kv-transfer-config advice
    if exc.kind == BAD_TRANSFER_HANDLE or (exc.kind == "engine_protocol" and exc.message.startswith(_OLD_BAD_HANDLE)):
        return (
            f"its prefill legs return a transfer handle a decode engine would not pull with ({exc.message}): "
            "something between the engine and its shim rewrites kv_transfer_params, or its connector is not "
            "NixlConnector"
        ), True
    if exc.kind == PREFILL_STOPPED:
        return None  # its one token was an EOS or a stop id: the request's, the engine answered
    # "deadline": the shim enforced the leg's deadline on its own clock before the router's timer fired
    if exc.kind in ("timeout", "deadline"):
        if timeout_s > left_s or handed:
            return None  # the client's deadline came first, or the decode peer kept it waiting
        return f"no prefill answer within prefill_timeout_s ({timeout_s:g}s): its engine hangs or is overloaded", False
    if exc.kind == "no_transfer" or (exc.kind == "engine_protocol" and "kv_transfer_params" in exc.message):
        return (
            f"its prefill legs return no transfer handle ({exc.message}): its engine most likely runs without a KV "
            "connector (vLLM: start the prefill engine with --kv-transfer-config)"
        ), True
    if exc.kind == "engine_protocol" or exc.engine_failed:
        return f"its engine failed a prefill leg ({exc.kind} {exc.code}: {exc.message}): see the engine's log", False
    return None


@dataclass(slots=True)
class _Cancelled:
    """A leg this router cancelled, while its worker may still run it (Dispatcher._cancelled)."""

    worker: str
    request_id: str
    sent_at: float  # time.monotonic() of its last cancel
    until: float  # time.monotonic() past which its worker no longer runs it (its deadline)


def _nothing(*_: object) -> None:  # a leg's on_end too
    pass


class _PrefillFailed(Exception):
    """A decode leg's prefill, read on beside it (router.prefill_watch), failed before the leg showed
    output: the leg is cancelled and ended, and the attempt takes the bypass path (_after_prefill).
    `decode_failed`: the leg ended with its engine's own 5xx (SGLang's for a failed transfer)."""

    def __init__(self, *, decode_failed: bool = False) -> None:
        super().__init__()
        self.decode_failed = decode_failed


async def _cut_short(leg: Leg, chunk: ResponseChunk, until: float, silence_s: float) -> None:
    """Read a cancelled decode leg, from `chunk`, to its end (the shim's answer to the cancel, after
    its engine's abort), dropping what it sends, until `until` at most (time.monotonic(): the
    request's deadline; three silent heartbeats end it sooner): its bypass leg goes to the same
    worker under the same request id, which the shim refuses (409) while the cancelled one is still
    in flight there. Not three heartbeats after the cut: an engine slow to abort (SGLang's abort is
    awaited up to 2 s) keeps its shim heartbeating, and the bypass sent then was refused, the
    client's 502."""
    while not chunk.final:
        try:
            chunk = await leg.next(until - time.monotonic(), silence_s)
        except LegError:
            return  # ended with an error, or not heard of in time: cancelled again as it is left


# kvswitch_router_worker_legs_failed_total's kinds, each with what it counts (the metric's help
# lists them): engine_busy takes a 408 before the 429 or 503 too, unreachable lost chunks. A
# client's refusal, its leaving and the router's own limits are no worker's.
LEG_FAILED_KINDS = {
    "engine_error": "its engine's server error, 5xx but 503; enough in a row, each retried on another worker that "
    "gave output, leave it out as engine_failing",
    "engine_busy": "its engine's 429 or 503",
    "engine_unavailable": "its shim could not reach the engine",
    "unreachable": "no responder, silent",
    "malformed": "a reply that broke the protocol",
}


def _failed_kind(exc: LegError) -> str | None:
    """`exc`'s kind among LEG_FAILED_KINDS, None for a failure that is not its worker's."""
    if exc.busy or (exc.kind == "engine_error" and exc.code == 503):
        return "engine_busy"
    if exc.engine_failed:
        return "engine_error"
    if exc.kind == "engine_unavailable":
        return "engine_unavailable"
    if exc.worker_silent or exc.kind in ("no_responders", "stream_gap"):
        return "unreachable"
    return "malformed" if exc.malformed else None


class Dispatcher:
    """Owns the reply inbox subscription; not the NATS connection. `stop()` is idempotent."""

    def __init__(
        self,
        nc: Client,
        ns: str,
        bookings: Bookings,
        *,
        settings: Callable[[], RouterSettings] = RouterSettings,
        on_fallback: Callable[[Job], None] = lambda job: None,
        on_transfer: Callable[[str, str, bool], None] = lambda decode, prefill, ok: None,
        on_unreachable: Callable[[str, str], None] = lambda worker, why: None,
        on_malformed: Callable[[str, str], None] = lambda worker, why: None,
        on_pull: Callable[[str, str], Callable[[], None]] = lambda decode, prefill: _nothing,
        on_prefill: Callable[[str, str | None, bool, float], None] = lambda worker, fault, serves_whole, ago_s: None,
        on_engine: Callable[[str, str | None, float], None] = lambda worker, fault, ago_s: None,
        tracer: RequestTracer | None = None,
        origin: str = "",
        registered: Callable[[str], bool] = lambda worker: True,
        clock_offset: Callable[[str], float] = lambda worker: 0.0,
        awake_for: Callable[[], float] = lambda: math.inf,
        fleet_log: FleetLog | None = None,
        client_buffer_bytes: int = CLIENT_BUFFER_MIB << 20,
    ) -> None:
        self._nc = nc
        # streams' queues and whole answers being written, under one budget (--client-buffer-mib)
        self.buffers = ClientBuffers(client_buffer_bytes, self._streams, self._over_budget)
        self._nats_lost_at: float | None = None  # time.monotonic() the connection last dropped
        self._nats_back_at: float | None = None  # ... and came back
        self._probe: asyncio.Future[bool] | None = None  # a round trip on it in flight (answers)
        self._probe_at = 0.0  # ... and when it was asked for
        self.awake_for = awake_for  # seconds since this router's loop last stalled (runtime.loop_watch)
        # A worker's clock less this router's (router.clock_skew): a leg's deadline goes out on the
        # worker's clock, which checks it, or one ahead by the request timeout fails every request.
        self._clock_offset = clock_offset
        # A departed worker's legs run on (worker_gone): what they show of it is no routing state to
        # keep, which nothing would then remove (a metric series, an exclusion).
        self._registered = registered
        self._origin = origin  # RouterInfo.instance: a shim aborts the legs of a router gone from etcd
        self._on_fallback = on_fallback
        # (decode worker, prefill worker, whether its pull worked) per decode leg fed by a transfer
        self._on_transfer = on_transfer
        self._on_unreachable = on_unreachable
        self._on_malformed = on_malformed
        # (decode, prefill) per decode leg fed by a transfer; what it returns is called once its pull is over
        self._on_pull = on_pull
        # (prefill worker, its fault or None, whether its engine still serves whole requests, how long
        # ago its leg failed: a 5xx is judged once the fallback gave output) per prefill leg that
        # worked or failed through that worker
        self._on_prefill = on_prefill
        # (worker, its engine's server error or None, how long ago its leg failed) per decode or agg
        # leg that failed before its first output with one, once another leg gave its request output
        # (Job.engine_errors), or gave that output itself (router.eligibility's `engine_failing`)
        self._on_engine = on_engine
        self._ns = ns
        self._bookings = bookings
        self._settings = settings  # read per leg: live config changes apply to the next one
        self._tracer = tracer or RequestTracer()
        self._prefix = ""
        self._sub: Subscription | None = None
        self._legs: dict[str, Leg] = {}
        self._cancelled: OrderedDict[str, _Cancelled] = OrderedDict()  # by leg token, oldest first
        self.cancels_again = 0  # cancels sent again on a cancelled leg's late chunks
        self._ids = itertools.count()
        self.retries = 0
        self.fallbacks = 0
        self.transfer_fallbacks = 0  # decode legs whose KV pull failed, prefilled locally instead
        # remote prefills whose decode leg NATS could not carry with its handle, prefilled locally instead
        self.handle_fallbacks = 0
        self.resumes = 0
        self.slow_readers = 0  # legs dropped because their client read too slowly (MAX_QUEUED_BYTES, self.buffers)
        self.malformed_replies: Counter[str] = Counter()  # by worker, while it is registered
        # decode and agg legs failed before their first output, by (worker, LEG_FAILED_KINDS), while it is registered
        self.legs_failed: Counter[tuple[str, str]] = Counter()
        self.refusal_fallbacks = 0  # requests a prefill engine refused that the decode engine then served
        # requests a prefill worker's engine refused and a decode engine served, by prefill worker
        # while it is registered: an engine configured unlike its decode workers
        self.refusals_overruled: Counter[str] = Counter()
        self.engine_refusals: Counter[int] = Counter()  # legs an engine turned away for now, by status (408, 429)
        self._malformed_lines = FleetLines(  # a fleet on a build whose replies this router cannot read
            log,
            logging.WARNING,
            f"sent malformed replies, left out of routing for {MALFORMED_COOLDOWN_S:g}s after each (one cause for "
            "many workers: shims of a build whose replies this router cannot read; counted in "
            "kvswitch_router_worker_malformed_replies_total)",
            fleet_log=fleet_log,
        )
        self._overruled_lines = FleetLines(  # a prefill pool started with other engine flags than its decode pool
            log,
            logging.WARNING,
            "their engines refused requests that decode engines served (started with other flags than their "
            "decode workers'; counted in kvswitch_router_worker_prefill_refusals_overruled_total)",
            fleet_log=fleet_log,
        )
        self._handle_mismatch_logged = False
        self._generation_failures: list[LegFailures] = []  # ended by a generated token
        self._utility_failures: list[LegFailures] = []  # ended by a utility call's answer
        self._retried = self.leg_failures(log)  # retries before the first token, per worker and kind

    async def start(self) -> None:
        self._prefix = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(
            self._prefix + ".*", cb=guarded(self._on_reply, "the reply handler"), pending_msgs_limit=-1
        )

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        for failures in self._generation_failures + self._utility_failures:
            failures.close()
        for leg in list(self._legs.values()):
            leg.push(
                LegError(leg.worker, 503, "router_stopping", "the router is stopping", retryable=False, role=leg.role)
            )
        if sub is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def nats_lost(self) -> None:
        """The router's NATS connection dropped (its disconnected callback)."""
        self._nats_lost_at = time.monotonic()

    @property
    def lost_at(self) -> float | None:
        """time.monotonic() the router's NATS connection last dropped."""
        return self._nats_lost_at

    def nats_back(self) -> None:
        """The router's NATS connection is back (its reconnected callback)."""
        self._nats_back_at = time.monotonic()

    def is_connected(self) -> bool:
        return self._nc.is_connected

    def _not_back_for(self, heard_at: float) -> bool:
        """NATS is down, or the router came back after a leg last heard from its worker."""
        lost, back = self._nats_lost_at, self._nats_back_at
        if not self._nc.is_connected:
            return True
        return lost is not None and (back is None or back < lost or heard_at < back)

    def back_within(self, window_s: float, since: float | None = None) -> bool:
        """The router's NATS connection dropped (after `since`, time.monotonic(), when given) and
        is back, less than `window_s` ago (or so lately that its reconnected callback has not run:
        nats-py reports the connection up first)."""
        lost, back = self._nats_lost_at, self._nats_back_at
        if lost is None or (since is not None and lost < since):
            return False
        return back is None or back < lost or time.monotonic() - back < window_s

    async def connected(self) -> bool:
        """NATS is up, or comes back within the time a leg waits for a silent worker (three
        heartbeats): a client reconnects to another node of a NATS cluster in milliseconds, and
        a request sent meanwhile should be served, not refused."""
        until = time.monotonic() + 3 * self._settings().stream_heartbeat_s
        while not self._nc.is_connected:
            if time.monotonic() >= until:
                return False
            await asyncio.sleep(_RECONNECT_POLL_S)
        return True

    async def answers(self) -> RoundTrip:
        """Whether NATS answers a round trip, or does again within the wait `connected` gives: a
        hung server (stopped, or behind a partition that drops packets) leaves the connection up
        until nats-py's own PINGs go unanswered, and each leg in flight went silent, its worker
        blamed and left out as unreachable (replica audit of 2026-12-07). One round trip at a time,
        for every leg that asks; LATE when it came back more than a heartbeat after it was asked. A
        late answer is no outage: recorded as one (`lost_at`, `back_within`), a NATS slow all along
        made each a new one, which excused "no responders" replies and every dead worker's silence."""
        wait = self._settings().stream_heartbeat_s
        until = time.monotonic() + 3 * wait
        while True:
            if self._probe is None or self._probe.done():
                self._probe_at = time.monotonic()
                self._probe = asyncio.ensure_future(nats_answers(self._nc, math.ceil(wait)))
            probe, asked = self._probe, self._probe_at
            await asyncio.wait([probe], timeout=max(until - time.monotonic(), 0.0))
            if probe.done() and probe.result():
                return RoundTrip.LATE if time.monotonic() - asked > wait else RoundTrip.PROMPT
            if time.monotonic() >= until:
                return RoundTrip.NONE
            if probe.done():  # no connection to ask on: it may come back
                await asyncio.sleep(_RECONNECT_POLL_S)

    @property
    def inflight_legs(self) -> int:
        return len(self._legs)

    def leg_failures(self, logger: logging.Logger, *, utility: bool = False) -> LegFailures:
        """Episodes of generation legs (with `utility`, utility calls) failing before their first
        output said on `logger`, ended as a leg of the same type on the worker gives output (a
        token; a utility call's answer), as the worker leaves, and as this dispatcher stops. An
        answered /tokenize says nothing of generation on its worker, nor a token of its /tokenize:
        until 2026-12-07 either ended both, a WARNING and an INFO per request of a client mixing them."""
        failures = LegFailures(logger)
        (self._utility_failures if utility else self._generation_failures).append(failures)
        return failures

    def worker_gone(self, worker: str) -> None:
        """The worker's etcd key is gone. Its legs in flight go on: a shim that lost its lease
        serves its old id on for --reregister-grace-s (docs/worker_shim.md), and one that died sends
        no more heartbeats, which ends its legs within three periods (retryable when no token came
        yet). Failing them here cut healthy streams short whenever a live worker's lease went (a
        stall past its TTL, an etcd pause, a revoke)."""
        self.malformed_replies.pop(worker, None)
        self.refusals_overruled.pop(worker, None)
        for key in [key for key in self.legs_failed if key[0] == worker]:
            del self.legs_failed[key]
        for failures in self._generation_failures + self._utility_failures:
            failures.forget(worker)

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        leg = self._legs.get(token)
        if leg is None:
            # a leg already finished or cancelled: late chunks are expected then
            if token in self._cancelled:
                await self._late(token, msg)
            return
        if not msg.data and msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == _NO_RESPONDERS:
            if self._not_back_for(leg.heard_at):
                # Sent as this router came back, before the shim subscribed again (nothing heard on
                # the leg since): no worker's fault. An ask to resend is asked again at the next
                # silence; a new leg is retried.
                if not leg.resuming:
                    why = "nobody serves it yet"
                    leg.push(LegError(leg.worker, 503, "no_responders", why, retryable=True, role=leg.role))
                return
            if self._registered(leg.worker):
                self._on_unreachable(leg.worker, "no responder on its subject")
            leg.push(LegError(leg.worker, 503, "no_responders", "nobody serves it", retryable=True, role=leg.role))
            return
        try:
            chunk = decode_msg(msg.data, ResponseChunk)
        except ProtocolError as exc:
            leg.push(
                LegError(leg.worker, 502, "malformed_chunk", str(exc), retryable=not leg.tokens_seen, role=leg.role)
            )
            return
        if _generated(chunk):
            leg.tokens_seen = True
        if chunk.prefilled:  # its reader may not have read it yet when the final chunk comes
            leg.prefilled = True
        leg.push(chunk, len(msg.data))
        if chunk.final:
            leg.finished = True
            leg.ended_well = chunk.error is None and chunk.finish_reason != "abort"
            # Not at an error: a retry or the KV-transfer fallback books the request again.
            if chunk.error is None:
                leg.end(_served(leg, chunk))
        elif leg.request.stream:  # a whole answer is read as it comes
            if leg.queued > MAX_QUEUED_BYTES:
                await self._slow_reader(leg)
            elif self.buffers.held > self.buffers.budget:
                await self.buffers.make_room()

    def _streams(self) -> Iterator[Leg]:
        """The legs whose queues wait for a streaming client (ClientBuffers' to cut)."""
        return (leg for leg in self._legs.values() if leg.request.stream)

    async def _over_budget(self, leg: Leg) -> None:
        await self._slow_reader(leg, over_budget=True)

    async def _slow_reader(self, leg: Leg, *, over_budget: bool = False) -> None:
        """The leg's reader (a streaming client) fell MAX_QUEUED_BYTES behind its worker, or furthest
        behind of all when this replica's clients held more than its budget (router.client_buffers):
        the leg ends now and is cancelled there (unless its final chunk came), rather than its whole
        answer piling up here."""
        self._legs.pop(leg.token, None)  # its later chunks are dropped
        self.slow_readers += 1
        idle = time.monotonic() - leg.taken_at
        why = f"the client read the stream too slowly: {leg.queued} bytes of it were waiting, " + (
            f"the client had taken none for {idle:.1f}s, the furthest behind of the router's clients when they "
            f"held more than its budget of {self.buffers.budget} bytes (--client-buffer-mib)"
            if over_budget
            else f"over the router's limit of {MAX_QUEUED_BYTES}"
        )
        leg.drop(LegError(leg.worker, 408, SLOW_READER, why, retryable=False, role=leg.role))
        if leg.finished:  # its worker is done with it: nothing to cancel
            log.info("request %s: %s", leg.request_id, why, extra={"request_id": leg.request_id})
            return
        log.info(
            "request %s: %s; its leg on worker %s is cancelled",
            leg.request_id,
            why,
            leg.worker,
            extra={"request_id": leg.request_id},
        )
        await self._cancel(leg)

    async def _late(self, token: str, msg: Msg) -> None:
        """A chunk of a leg this router cancelled: its engine still runs it, so the cancel was lost
        (or is still on its way); sent again, at most once per CANCEL_AGAIN_S."""
        gone = self._cancelled[token]
        now = time.monotonic()
        if now >= gone.until or _ends_leg(msg):
            del self._cancelled[token]  # its worker is done with it
            return
        if now - gone.sent_at < CANCEL_AGAIN_S:
            return
        if any(leg.worker == gone.worker and leg.request_id == gone.request_id for leg in self._legs.values()):
            del self._cancelled[token]  # its request runs there anew: the cancel would end that
            return
        gone.sent_at = now
        self.cancels_again += 1
        log.info(
            "request %s: its leg on worker %s, cancelled, still sends chunks; cancelling it again",
            gone.request_id,
            gone.worker,
            extra={"request_id": gone.request_id},
        )
        await self._publish_cancel(gone.worker, gone.request_id)

    async def _open(
        self,
        worker: str,
        role: str,
        req: GenerateRequest,
        until: float,
        on_end: Callable[[bool], None] = _nothing,
        keep: int = 0,
    ) -> Leg:
        """Send a leg, to run until `until` (time.monotonic(); on the wire: _wall), else a 504
        DEADLINE_PASSED when that has passed, sending nothing; `keep`: bytes under the payload limit
        it must leave (a prefill leg: for its decode leg's transfer handle), else a 413
        HANDLE_TOO_LARGE."""
        left = until - time.monotonic()
        if left <= 0:
            why = f"the request's deadline passed {-left:.2f}s before its leg was sent: not sent"
            raise LegError(worker, 504, DEADLINE_PASSED, why, retryable=False, role=role)
        token = str(next(self._ids))
        span = self._tracer.leg(role, worker, req.request_id)
        req = msgspec.structs.replace(
            req, deadline=self._wall(worker, until), trace=self._tracer.carrier(span), origin=self._origin
        )
        leg = Leg(self, token, worker, role, req, span, on_end)
        try:
            data = encode_msg(req)
        except (OverflowError, msgspec.EncodeError) as exc:
            span.end()
            raise LegError(
                worker,
                400,
                "bad_request",
                "a number in the request is out of the 64-bit integer range",
                retryable=False,
                role=role,
            ) from exc
        except ProtocolError as exc:  # nested past the recursion limit: the body's JSON was just under it
            span.end()
            why = "the body's JSON is nested too deeply"
            raise LegError(worker, 400, "bad_request", why, retryable=False, role=role) from exc
        if len(data) > self._nc.max_payload:
            span.end()
            raise LegError(
                worker,
                413,
                PAYLOAD_TOO_LARGE,
                f"the request is {len(data)} bytes on the wire, over the NATS server's payload limit of "
                f"{self._nc.max_payload} bytes (its max_payload setting): send a shorter prompt",
                retryable=False,
                role=role,
            )
        if len(data) + keep > self._nc.max_payload:
            span.end()
            raise LegError(
                worker,
                413,
                HANDLE_TOO_LARGE,
                f"its decode leg would be up to {len(data) + keep} bytes with the transfer handle, over the NATS "
                f"server's payload limit of {self._nc.max_payload} bytes (its max_payload setting)",
                retryable=False,
                role=role,
            )
        self._legs[token] = leg
        try:
            await self._nc.publish(subjects.gen(self._ns, role, worker), data, reply=f"{self._prefix}.{token}")
        except Exception as exc:
            self._legs.pop(token, None)
            self._tracer.failed(span, str(exc))
            span.end()
            raise
        return leg

    async def send(self, leg: Leg, request: GenerateRequest) -> None:
        """`request` to `leg`'s worker, its replies to the leg (an ask for lost chunks)."""
        await self._nc.publish(
            subjects.gen(self._ns, leg.role, leg.worker), encode_msg(request), reply=f"{self._prefix}.{leg.token}"
        )

    async def closed(self, leg: Leg) -> None:
        """`leg`'s reader is done with it: forgotten, and cancelled on its worker unless it ended
        (its final chunk came, read or not)."""
        self._legs.pop(leg.token, None)
        if not (leg.done or leg.finished):
            await self._cancel(leg)

    async def _cancel(self, leg: Leg) -> None:
        """Cancel `leg` on its worker, and remember it until its deadline (_late)."""
        now = time.monotonic()
        deadline = leg.request.deadline
        # Its deadline as the worker checks it (_wall), on this router's monotonic clock
        left = CANCEL_KEPT_S if deadline is None else deadline - time.time() - self._clock_offset(leg.worker)
        if left > 0:
            self._cancelled[leg.token] = _Cancelled(leg.worker, leg.request_id, now, now + left)
            kept = self._cancelled
            while kept and (len(kept) > CANCELLED_KEPT or next(iter(kept.values())).until <= now):
                kept.popitem(last=False)
        await self._publish_cancel(leg.worker, leg.request_id)

    async def _publish_cancel(self, worker: str, request_id: str) -> None:
        if self._nc.is_closed:
            return
        with contextlib.suppress(Exception):  # best effort: the worker may be gone already
            await self._nc.publish(subjects.cancel(self._ns, worker), encode_msg(CancelRequest(request_id=request_id)))

    def _wall(self, worker: str, deadline: float) -> float:
        """A deadline on time.monotonic() as the worker checks it: Unix time on its clock. The router
        times its own waits on the monotonic clock, which no step of the host's wall clock (NTP, a
        VM resumed) moves: one 60 s forward ended every stream with less left at once."""
        return time.time() + (deadline - time.monotonic()) + self._clock_offset(worker)

    # --- a utility call -------------------------------------------------------------------------

    async def call(self, worker: str, role: str, req: GenerateRequest, deadline: float) -> bytes:
        """A utility call (`req.endpoint` one of UTILITY_ENDPOINTS) on one worker: the engine's whole
        answer; LegError when it failed (retryable: the worker did nothing for it)."""
        req = msgspec.structs.replace(req, heartbeat_s=self._settings().stream_heartbeat_s)
        silence = 3 * self._settings().stream_heartbeat_s
        parts: list[bytes] = []
        size = 0
        try:
            async with await self._open(worker, role, req, deadline) as leg:
                while True:
                    chunk = await leg.next(deadline - time.monotonic(), silence)
                    parts.append(chunk.body)
                    size += len(chunk.body)
                    if size > MAX_ANSWER_BYTES:
                        why = f"the answer passed {MAX_ANSWER_BYTES} bytes"
                        raise LegError(worker, 502, "answer_too_large", why, retryable=False, role=role)
                    if chunk.final:
                        for failures in self._utility_failures:
                            failures.served(worker)
                        return b"".join(parts)
        except LegError as exc:
            self._blame(exc)
            raise

    def _blame(self, exc: LegError) -> None:
        """Leave out the worker a failed leg shows at fault: a silent one or one whose chunks stay
        lost until it reports again, one whose reply is malformed for a cooldown (its load
        reports go on: they say nothing of its replies). An engine that turned it away for now
        is at no fault: counted, apart from the router's own 429s (admission)."""
        if exc.busy:
            self.engine_refusals[exc.code] += 1
        if not self._registered(exc.worker):
            return
        if exc.worker_silent or exc.kind == "stream_gap":
            self._on_unreachable(exc.worker, str(exc))
        elif exc.malformed:
            first = exc.worker not in self.malformed_replies
            self.malformed_replies[exc.worker] += 1
            self._on_malformed(exc.worker, f"it sent a malformed reply: {exc.message}")
            if first:
                self._malformed_lines.say(
                    exc.worker,
                    "worker %s sent a malformed reply (%s): its requests go to other workers, and it "
                    "is left out of routing for %gs after each such reply (logged once per worker, counted in "
                    "kvswitch_router_worker_malformed_replies_total)",
                    exc.worker,
                    exc.message,
                    MALFORMED_COOLDOWN_S,
                )

    # --- a whole request ------------------------------------------------------------------------

    async def run(self, job: Job) -> AsyncGenerator[ResponseChunk, None]:
        """The decode leg's chunks, after the prefill leg (if any); retries and falls back as the
        module docstring says. Raises LegError when the request cannot be served."""
        plan: RoutePlan | None = job.plan
        while plan is not None:
            job.plan = plan
            job.booked = plan.key
            job.attempts += 1
            job.tried.add(plan.decode.worker)
            job.path, job.outcome, job.fallback, job.transfer = plan.path, plan.outcome, False, None
            try:
                # Closed when this is (a reader that stops at the final chunk, or leaves): nested
                # generators left suspended end at the collector, their legs open until then.
                async with contextlib.aclosing(self._attempt(job, plan)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except LegError as exc:
                self._blame(exc)
                if exc.engine_failed:
                    job.engine_errors.clear()  # it failed here too: the request's doing, not those workers'
                if job.first_token_at is None and exc.role != "prefill":
                    self._failed_before_output(job, exc)
                retry = job.first_token_at is None and exc.retryable and job.attempts == 1
                retry = retry and not time_up(job.deadline)  # past it, the retry's leg would not be sent
                plan = job.replan(frozenset(job.tried)) if retry else None
                if plan is None:
                    for held in job.held:  # its role chunk goes out before its error, as its engine sent it
                        yield held
                    raise
                job.drop_held()  # the retry sends its own
                self._retried.failed(
                    exc.worker,
                    exc.kind,
                    job.request.request_id,
                    "request %s: worker %s: %s: %s before the first token; retrying on %s",
                    job.request.request_id,
                    exc.worker,
                    exc.kind,
                    brief(exc.message),
                    plan.decode.worker,
                )
                self.retries += 1
            finally:
                self._free(job)

    def _failed_before_output(self, job: Job, exc: LegError) -> None:
        """A decode or agg leg of `job` failed before its first output: counted by worker and kind,
        an engine's own server error held for the request's retry to judge (Job.engine_errors). Not
        a failed pull of a transfer (_after_prefill), the pair's (router.transfer_health)."""
        if job.transfer is not None and exc.engine_failed:
            return
        kind = _failed_kind(exc)
        if kind is None or not self._registered(exc.worker):
            return
        self.legs_failed[exc.worker, kind] += 1
        if kind == "engine_error":
            job.engine_errors.append((exc.worker, f"{exc.code} {brief(exc.message)}", exc.role, time.monotonic()))

    def _served_despite(self, job: Job) -> None:
        """A leg generated output for `job`: the server errors its earlier legs met were their engines'."""
        now = time.monotonic()
        for worker, fault, role, at in job.engine_errors:
            if not self._registered(worker):
                continue  # it left meanwhile: its state went with it, one back under its name starts clean
            if role == "prefill":  # its own time, as an engine's: a probe's or not (router.failing_workers)
                self._on_prefill(worker, fault, False, now - at)
            else:
                self._on_engine(worker, fault, now - at)  # its own time: a trial's or not (router.failing_workers)
        job.engine_errors.clear()

    def _free(self, job: Job, *, served: bool = False) -> None:
        """Free the attempt's booking, once: at its decode leg's end (`served`: its worker prefilled the
        prompt) or at the attempt's."""
        key, job.booked = job.booked, None
        if key is not None:
            self._bookings.free(key, served=served)

    def _fall_back(self, job: Job, plan: RoutePlan, outcome: Outcome) -> None:
        """The attempt takes the bypass path after all: counted, its booking moved to its decode worker."""
        self._to_bypass(job, plan)
        self._fell_back(job, outcome)

    def _to_bypass(self, job: Job, plan: RoutePlan) -> None:
        """The attempt's decode leg goes as a bypass: its booking moved to its decode worker."""
        job.transfer = None
        job.path = Path.BYPASS
        self._bookings.rebook_bypass(plan.key, plan)

    def _fell_back(self, job: Job, outcome: Outcome) -> None:
        """The attempt's fallback, `outcome`, counted in the decisions."""
        job.outcome, job.fallback = outcome, True
        self._on_fallback(job)

    def _handle_too_large(self, job: Job, plan: RoutePlan, exc: LegError) -> None:
        self.handle_fallbacks += 1
        self._fall_back(job, plan, Outcome.FALLBACK_HANDLE_TOO_LARGE)
        log.warning(
            "request %s: %s; prefilling it on %s instead (a larger max_payload in nats-server's configuration "
            "lets such prompts prefill remotely)",
            job.request.request_id,
            exc,
            plan.decode.worker,
            extra={"request_id": job.request.request_id},
        )

    async def _attempt(self, job: Job, plan: RoutePlan) -> AsyncGenerator[ResponseChunk, None]:
        watch: PrefillWatch | None = None
        try:
            if plan.path is Path.REMOTE and plan.prefill is not None:
                try:
                    prefilled = await self._prefill(job, plan)
                except LegError as exc:
                    if exc.kind != HANDLE_TOO_LARGE or not plan.decode.info.local_prefill:
                        raise
                    self._handle_too_large(job, plan, exc)  # decided before the prefill leg went out
                else:
                    if prefilled is not None:  # else it fell back (_prefill)
                        job.transfer, watch = prefilled
            async with contextlib.aclosing(self._after_prefill(job, plan, watch)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if watch is not None:
                await watch.close()

    async def _after_prefill(
        self, job: Job, plan: RoutePlan, watch: PrefillWatch | None
    ) -> AsyncGenerator[ResponseChunk, None]:
        """The attempt's decode leg, and the fallbacks from it. `watch`: its prefill leg, read on
        beside the decode leg (router.prefill_watch); closed before any fallback, whose own leg it
        must not cut."""
        req = job.request
        annotations = [a for a in req.annotations if a != ANNOTATION_BYPASS]
        try:
            async with contextlib.aclosing(self._decode(job, plan, annotations, watch)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except _PrefillFailed as failed:
            assert watch is not None and watch.failure is not None
            failure, left = watch.failure, watch.left_s
            await watch.close()
            job.drop_held()  # the fallback sends its own
            # (a decode worker that prefills locally is none of SGLang's, whose decode servers never do)
            pair = failed.decode_failed and failure.engine_failed and not plan.decode.info.local_prefill
            if pair:
                # Both engines' 5xx: SGLang's answer to a failed KV transfer on either side. The pair
                # is blamed in transfer health (its only pair signal for SGLang), as a failed pull is,
                # and neither worker alone: held, the prefill's 5xx took that worker out for every
                # decode worker for a fault of one link (review of 47fbaa6).
                assert job.transfer is not None
                self._on_transfer(plan.decode.worker, self._prefilled_on(job.transfer, plan), False)
            self._prefill_failed(job, plan, failure, left, handed=True, pair=pair)
            async with contextlib.aclosing(self._decode(job, plan, annotations)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except LegError as exc:
            if watch is not None:
                await watch.close()
            local = plan.decode.info.local_prefill  # else no bypass: the engine waits for a peer's KV
            if job.transfer is not None and job.first_token_at is None and exc.kind == PAYLOAD_TOO_LARGE and local:
                # Refused before it was sent: a handle larger than its bound. The bypass leg, no
                # larger than the prefill leg that went, carries the prompt.
                job.drop_held()
                self._handle_too_large(job, plan, exc)
                async with contextlib.aclosing(self._decode(job, plan, annotations)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            if job.transfer is None or job.first_token_at is not None or not exc.engine_failed:
                raise
            # The decode engine took the handle and failed before any output: its KV pull failed
            # (vLLM's default kv_load_failure_policy). The prefill is lost either way, so the
            # worker chosen for this request prefills it itself rather than a retry elsewhere
            # paying for another remote prefill.
            prefill = self._prefilled_on(job.transfer, plan)
            self._on_transfer(plan.decode.worker, prefill, False)
            if time_up(job.deadline) or not local:
                raise  # no time for the fallback's leg: the request ends with this one's error
            log.warning(
                "request %s: decode worker %s failed to load the KV prefilled on %s (%s); prefilling it there",
                req.request_id,
                plan.decode.worker,
                prefill,
                exc,
                extra={"request_id": req.request_id},
            )
            job.drop_held()  # the fallback sends its own
            self.transfer_fallbacks += 1
            self._fall_back(job, plan, Outcome.FALLBACK_TRANSFER_FAILED)
            async with contextlib.aclosing(self._decode(job, plan, annotations)) as chunks:
                async for chunk in chunks:
                    yield chunk

    def _prefilled_on(self, transfer: TransferHandle, plan: RoutePlan) -> str:
        """The prefill worker a transfer's outcome is put down to: the one this router sent the leg
        to. The handle's own `prefill_worker` is only the shim's word ("" when it names none): were it
        trusted, a wrong one would close an innocent pair, or "" every pair into the decode worker."""
        assert plan.prefill is not None  # a transfer comes from a remote plan's prefill leg
        sent_to = plan.prefill.worker
        named = transfer.prefill_worker
        if named and named != sent_to and not self._handle_mismatch_logged:
            self._handle_mismatch_logged = True
            log.warning(
                "a transfer handle names prefill worker %s, but the leg went to %s: its outcome is put down to %s "
                "(logged once)",
                named,
                sent_to,
                sent_to,
            )
        return sent_to

    async def _decode(
        self, job: Job, plan: RoutePlan, annotations: list[str], watch: PrefillWatch | None = None
    ) -> AsyncGenerator[ResponseChunk, None]:
        """The decode (or agg) leg of an attempt, fed by `job.transfer` when it has one. `watch`: the
        prefill leg still running beside it; _PrefillFailed once it failed before this leg showed
        output, this leg cancelled and ended (or its end not heard within three heartbeats)."""
        if watch is not None and watch.failure is not None:
            raise _PrefillFailed  # before this leg went: nothing to cut
        # a request spilled to a prefill worker is an agg leg there: every shim serves all three roles
        role = "decode" if plan.decode.info.role == "decode" else "agg"
        if role == "decode" and job.transfer is None:
            annotations = [*annotations, ANNOTATION_BYPASS]
        req = job.request
        leg_req = msgspec.structs.replace(
            req,
            annotations=annotations,
            disagg=job.transfer,
            heartbeat_s=self._settings().stream_heartbeat_s,
        )
        silence = 3 * self._settings().stream_heartbeat_s
        # The pull runs until the first token (a whole answer's: its `prefilled` chunk): a rise in
        # the decode engine's failed-pull count is put down to the pulls under way then
        # (router.transfer_health).
        pulled = (
            _nothing
            if job.transfer is None
            else self._on_pull(plan.decode.worker, self._prefilled_on(job.transfer, plan))
        )
        unjudged = job.transfer is not None  # the pull, until the leg shows it worked

        def ended(served: bool) -> None:
            # A watched leg's abort with nothing before it waits for its prefill's verdict: a failure
            # there falls back, and the fallback's bypass leg keeps the attempt's booking (run frees it)
            if served or watch is None:
                self._free(job, served=served)

        try:
            async with await self._open(plan.decode.worker, role, leg_req, job.deadline, ended) as leg:
                if watch is not None:
                    await watch.feeding(leg)
                while True:
                    try:
                        chunk = await leg.next(job.deadline - time.monotonic(), silence)
                    except LegError as exc:
                        if watch is None:
                            raise
                        # An engine's 5xx before output may be its prefill peer's failure (SGLang's
                        # decode server ends such a request with a 500), its reply maybe ahead of the
                        # prefill leg's: asked of the watch as an abort's is.
                        unserved = exc.engine_failed and not (leg.tokens_seen or leg.prefilled)
                        if watch.cut or (unserved and await watch.verdict(silence) is not None):
                            raise _PrefillFailed(decode_failed=unserved) from None  # the bypass takes over
                        raise
                    if watch is not None and watch.cut_at is not None:  # its prefill failed: cut
                        await _cut_short(leg, chunk, job.deadline, silence)
                        raise _PrefillFailed
                    # An abort with nothing before it (SGLang aborts a decode request whose prefill peer
                    # failed, its reply maybe ahead of the prefill leg's): a prefill that failed falls
                    # back; one that did not, or says nothing within three heartbeats, leaves the abort
                    # the client's answer.
                    unserved = watch is not None and chunk.final and chunk.error is None and not _served(leg, chunk)
                    if unserved and watch is not None and await watch.verdict(silence) is not None:
                        raise _PrefillFailed
                    generated = _generated(chunk)
                    if not generated and job.first_token_at is None and not chunk.final and _output(chunk):
                        job.held_bytes += sum(map(len, chunk.events))
                        if job.held_bytes > MAX_HELD_BYTES:
                            generated = leg.tokens_seen = True
                    if generated and job.first_token_at is None:
                        job.first_token_at = time.monotonic()
                        for failures in self._generation_failures:
                            failures.served(plan.decode.worker)
                        self._on_engine(plan.decode.worker, None, 0.0)
                        self._prefill_done(job)
                    elif chunk.prefilled:
                        self._prefill_done(job)  # a whole answer's prefill, done before any output
                    # The pull worked at the first token, or at a whole answer's prefill, or at a clean end
                    # with none (an EOS-first chat stream).
                    if unjudged and (job.first_token_at is not None or chunk.prefilled or chunk.final):
                        assert job.transfer is not None
                        pulled()
                        pulled = _nothing
                        self._on_transfer(plan.decode.worker, self._prefilled_on(job.transfer, plan), True)
                        unjudged = False
                    # Generated output, not a chat stream's role chunk, which vLLM sends before a
                    # request's own error: only then did the engines of its earlier legs fail a sound request.
                    if job.engine_errors and (generated or chunk.final):
                        self._served_despite(job)
                    if job.prefill_refused is not None and (generated or chunk.final):
                        if plan.path is Path.REMOTE and job.transfer is None and not job.fallback:
                            # This attempt's prefill leg was refused (_prefill): only now a fallback.
                            # One the decode engine refuses too fell back from nothing, and keeps its
                            # decision's outcome, as a request refused on any path does.
                            self.refusal_fallbacks += 1
                            self._fell_back(job, Outcome.FALLBACK_PREFILL_REFUSED)
                        self._refusal_overruled(*job.prefill_refused, plan.decode.worker)
                        job.prefill_refused = None
                    if not chunk.final and (job.first_token_at is None or not _output(chunk)):
                        if _output(chunk):
                            job.held.append(chunk)  # until the leg shows it serves the request
                        continue  # else a heartbeat
                    if watch is not None and chunk.final and chunk.error is None and chunk.finish_reason != "abort":
                        watch.fed()  # the KV came: its prefill worked, its own final chunk read or not
                    for held in job.held:
                        yield held
                    job.drop_held()
                    yield chunk
                    if chunk.final:
                        return
        finally:
            pulled()

    def _prefill_done(self, job: Job) -> None:
        if job.booked is not None:  # freed already when its final chunk came before it was read
            self._bookings.prefill_done(job.booked)

    def _refusal_overruled(self, worker: str, message: str, decode: str) -> None:
        """Prefill worker `worker`'s engine refused a request (`message`) that `decode`'s engine
        served: counted, and said once per worker while it is registered. It stays in: such a
        request costs it a refused leg before its bypass, and it prefills the others."""
        if not self._registered(worker):
            return
        first = worker not in self.refusals_overruled
        self.refusals_overruled[worker] += 1
        if first:
            self._overruled_lines.say(
                worker,
                "prefill worker %s's engine refused a request (%s) that decode worker %s's engine served: it runs "
                "with other flags than its decode workers. Such requests prefill on their decode worker; start its "
                "engine as theirs (logged once per worker, counted in "
                "kvswitch_router_worker_prefill_refusals_overruled_total)",
                worker,
                message,
                decode,
            )

    async def _prefill(self, job: Job, plan: RoutePlan) -> tuple[TransferHandle, PrefillWatch | None] | None:
        """The prefill leg's transfer handle, with the watch reading the rest of the leg where the
        handle came before its end (router.prefill_watch); or None when the bypass takes over (fallen
        back to: its outcome counted). A leg refused before it is sent is raised: NATS would not carry
        the bypass leg either, and a decode leg too large for its handle takes the bypass path
        (_attempt)."""
        assert plan.prefill is not None
        worker = plan.prefill.worker
        req = job.request
        settings = self._settings()
        leg_req = msgspec.structs.replace(
            req,
            sampling=msgspec.structs.replace(req.sampling, max_tokens=1),
            stream=False,
            annotations=[a for a in req.annotations if a != ANNOTATION_BYPASS],
            disagg=None,
            heartbeat_s=settings.stream_heartbeat_s,
            early_transfer=True,
        )
        left = job.deadline - time.monotonic()
        until = time.monotonic() + min(settings.prefill_timeout_s, left)
        # Its decode leg is this one with the handle in `disagg` (_decode): room kept for that.
        # It goes with the request's deadline, not `until`: once its handle came (SGLang), its
        # engine waits on the decode peer, and the time left is the pair's; before, this router's
        # own timer ends it at `until` and cancels it on its worker (closed).
        keep = transfer_handle_bound(plan.prefill.info, len(req.token_ids), plan.prefill.kv_total_blocks)
        opened = await self._open(worker, "prefill", leg_req, job.deadline, keep=keep + _DECODE_LEG_EXTRA)
        silence = 3 * settings.stream_heartbeat_s
        try:
            async with contextlib.AsyncExitStack() as stack:
                leg = await stack.enter_async_context(opened)
                while True:
                    chunk = await leg.next(until - time.monotonic(), silence)
                    if chunk.final:
                        if chunk.transfer is None:
                            why = "final chunk without a transfer"
                            raise LegError(worker, 502, "no_transfer", why, retryable=False, role="prefill")
                        self._prefill_worked(job, plan)
                        return chunk.transfer, None
                    if chunk.transfer is not None:  # before its engine is done (SGLang): read on beside the decode leg
                        watch = PrefillWatch(
                            leg,
                            stack.pop_all(),
                            until=job.deadline,
                            silence_s=silence,
                            left_s=left,
                            on_done=lambda: self._prefill_worked(job, plan),
                            cut=self._cut,
                        )
                        return chunk.transfer, watch
        except LegError as exc:
            self._prefill_failed(job, plan, exc, left)
            return None

    def _no_local_prefill(self, job: Job, plan: RoutePlan, exc: LegError) -> LegError:
        """The error that ends an attempt whose remote prefill failed (`exc`) for a decode worker that
        cannot prefill locally (WorkerInfo.local_prefill false: an SGLang decode server, where a
        bypass leg would wait for KV that never comes, to the client's deadline). Retryable: run()
        plans the request again without that prefill worker, the same decode worker allowed, once;
        with no other prefill worker (or no time) it is the client's 503, naming why."""
        assert plan.prefill is not None
        job.tried.add(plan.prefill.worker)
        job.tried.discard(plan.decode.worker)  # the decode worker did nothing wrong
        why = (
            f"its remote prefill on {plan.prefill.worker} failed ({exc}), and decode worker {plan.decode.worker} "
            "cannot prefill locally (its engine waits for a prefill peer's KV: an SGLang decode server)"
        )
        return LegError(plan.prefill.worker, 503, NO_LOCAL_PREFILL, why, retryable=True, role="prefill")

    def _prefill_worked(self, job: Job, plan: RoutePlan) -> None:
        """The attempt's prefill leg ended well: its worker worked, and its booking there settles."""
        assert plan.prefill is not None
        self._on_prefill(plan.prefill.worker, None, True, 0.0)
        # The prefill worker's part only: the decode worker's blocks count until its own first
        # token (or `prefilled`), as its engine may keep the request waiting for KV room. Not
        # where d's engine announces no blocks (no prefix caching) and the answer comes whole:
        # no `prefilled` comes, and d's booking would count on top of its reports to the end.
        scoped = plan.decode.info.prefix_caching or job.request.stream
        self._bookings.prefill_done(plan.key, plan.prefill.worker if scoped else None)

    async def _cut(self, leg: Leg) -> None:
        """Cancel a decode leg whose prefill failed before it showed output. Its end frees nothing:
        its attempt's booking goes on with the bypass leg that follows (_after_prefill)."""
        leg.on_end = _nothing
        await self._publish_cancel(leg.worker, leg.request_id)

    def _prefill_failed(
        self, job: Job, plan: RoutePlan, exc: LegError, left: float, *, handed: bool = False, pair: bool = False
    ) -> None:
        """The attempt's prefill leg failed with `exc` (`left`: the request's time as it went;
        `handed`: after its handle came, router.prefill_watch; `pair`: a 5xx its decode leg's 5xx
        matched, already the pair's in transfer health): the bypass takes over, its outcome
        counted (or, for an engine's refusal, judged by the decode leg); `exc` is raised where none can
        (NATS lost, the request's time up)."""
        assert plan.prefill is not None
        worker = plan.prefill.worker
        req = job.request
        settings = self._settings()
        if exc.nats_lost:
            raise exc
        if exc.refused and not exc.unknown_model and not plan.decode.info.local_prefill:
            raise exc  # the decode engine cannot take it as a bypass: the refusal is the client's answer
        if exc.refused and not exc.unknown_model:
            # Its engine refused the request before any prefill. The decode engine has its say:
            # one started with other flags takes what this one does not (vLLM's tool choice
            # "auto" needs --enable-auto-tool-choice), and a request it refuses too costs no
            # prefill there either; its answer, served or refused, is the client's.
            job.prefill_refused = (worker, exc.message)  # judged, and counted, by its decode leg (_decode)
            self._to_bypass(job, plan)
            return
        fault = _prefill_fault(exc, settings.prefill_timeout_s, left, handed=handed)
        if fault is not None and not exc.engine_failed:
            self._on_prefill(worker, *fault, 0.0)
        if time_up(job.deadline):
            # No time for the bypass leg: the request ends with this leg's error (blamed by run),
            # a 504 naming this worker where it ran out the time, not the decode worker's unsent
            # leg's. A 5xx stays unjudged: only a fallback that serves puts it down to the worker.
            raise exc
        self._blame(exc)
        if fault is not None and exc.engine_failed and not pair:
            # Judged by the fallback or the retry (_decode, run). The latest prefill leg's only: a
            # request's second prefill 5xx (its retry's) puts down neither its first nor the same worker twice.
            job.engine_errors[:] = [held for held in job.engine_errors if held[2] != "prefill"]
            job.engine_errors.append((worker, fault[0], "prefill", time.monotonic()))
        if not plan.decode.info.local_prefill:
            raise self._no_local_prefill(job, plan, exc)
        if not exc.malformed:  # that one is logged once per worker (_blame), not per request
            log.warning(
                "request %s: remote prefill failed (%s); falling back to local prefill on %s",
                req.request_id,
                exc,
                plan.decode.worker,
                extra={"request_id": req.request_id},
            )
        self.fallbacks += 1
        self._fall_back(job, plan, Outcome.FALLBACK_PREFILL_FAILED)
