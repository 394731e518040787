"""Per-worker load as routing sees it: the latest LoadReport plus bookings not yet in a report.

A booking is one request's claim on one worker, made the moment the router picks it (so the next
request sees it at once), by this router or, via router.replica_sync, by a peer:
`prefill_tokens` until the first token, `decode_blocks` until the engine's own count shows them.

Double counting. A shim's report already counts what its engine has queued and allocated, so a
booking stops counting once a report covers it:

- prefill tokens count while the prefill is not done AND no report from that worker is at least as
  new as the booking (`report.ts >= booked_at`). A report that new was generated after the request
  was dispatched, so the shim's `prefill_tokens_queued` includes it (a shim reports on change).
- decode blocks count until the prefill is done AND a report at least as new as that moment has
  arrived: the engine allocates a request's blocks when it schedules it, and from then on
  `kv_used_blocks` includes them (and their growth while decoding).

Timestamps are wall-clock (`time.time`, like `LoadReport.ts`): the rule assumes the router and
shims keep NTP time. Skew only shifts when a booking hands over to the reports: a shim clock behind
ours double-counts a booking for the skew (never past the first token), and undercounts a finished
prompt for up to the skew (its release, stamped on our clock, is subtracted from a report its clock
stamps before it, though made after the first token); one ahead undercounts until the next report.
A peer's booking is stamped when it arrives here, a little after the peer made it, which errs on
the side of counting it.

Order. A worker's reports replace each other by stamp, not arrival: one stamped before the one held
by at most MAX_REORDER_S came late and only proves the worker alive. One older by more is the
worker's clock stepping back (NTP step, VM resume): it is taken, and `update` says how far back,
since dropping it would freeze the worker's figures and read it as silent for as long as the step
while it reports every second. Coverage stays at the newest stamp the worker has sent: a clock
never ahead of real time stamps each report at or before its making, and a later report was made
after an earlier one (one publisher: NATS keeps its order; a takeover's two publishers may not), so
no report held was made before that stamp. Nothing else is sound: a stamp
moved forward by the step (2026-12-08) went past its report's making once the clock stepped forward
again, or the delivery slowed, by as much (every stamp 0.2 s past its making for good after back
5 s, forward 1.2 s), and a report made before a booking covered it. So a booking made after a step
back of S counts, in the reports and as a booking, until the worker's own clock passes it (up to
S), erring toward counting it longer. The step drops the releases held for that worker (judged on the stamps before
it), and none is recorded while its clock is behind its newest stamp (a report made before a first
token and still on the way then counts that prompt as queued until the next one). Once its clock
passes that stamp but stays S behind ours, it is a clock behind (Skew above) by S: releases wait
up to S for a stamp past them (rate x S of them summed by `load()`) and a finished prompt is
undercounted for up to S, until NTP sets it right; 3bc08a4 judged "behind" by a report's transit
instead, and a steady delivery delay over MAX_REORDER_S then counted every finished prompt as
queued on every worker (reverted).

Bookings are kept per router (None is this router), then per request_id, so what one router holds
(`held`, `keys`, `confirm_all`: a peer's snapshots) costs its own bookings, not the fleet's. One
request may hold bookings on several workers (its prefill and decode legs); `free` drops them all.
Synchronous; one event loop.

Inflow. Every booking's prompt tokens also feed `prefill_inflow`, an exponentially weighted rate
(time constant INFLOW_TAU_S) of the prefill work routed to the worker by any router: what share of
its time a prefill worker will spend prefilling while a request spilled to it decodes
(router.policies.slo_aware).

Cost. Each worker keeps the sums of what no report covers yet, updated as bookings come, finish
and get covered (by the newest stamp the worker has sent, so coverage never reverts), so `load()`
costs the same with 5 or 5,000 requests in flight: a router that falls behind does not slow down
with it (bar a worker's clock S behind ours, whose releases wait up to S: above).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import msgspec

from protocol.config import MAX_LOAD_PERIOD_S, MIN_LOAD_PERIOD_S
from protocol.messages import LoadReport, SyncBooking

__all__ = ["MAX_CLOCK_SKEW_S", "MAX_REORDER_S", "Expired", "Liveness", "LoadView", "WorkerLoad"]

INFLOW_TAU_S = 10.0
"""Time constant of `prefill_inflow`, the exponentially weighted rate of prefill tokens booked on
a worker: long enough to span several requests' lives, short enough to follow a shift in load."""

MAX_CLOCK_SKEW_S = 1.0
"""A report stamped further ahead of this router's clock is taken as stamped now (plus this): one
bad clock or a forged stamp must not hide every later report from that worker."""

MAX_REORDER_S = 1.0
"""A report stamped before the one held by at most this arrived late and is dropped; by more, the
worker's clock stepped back and it is taken. A shim publishes from one task and NATS keeps one
publisher's order, so reports come out of order only from two publishers under one worker name."""


class WorkerLoad(msgspec.Struct, frozen=True):
    """What selection and the policies read about one worker."""

    worker: str
    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int | None
    prefill_tokens_queued: int  # reported + booked prefill tokens no report covers yet
    active_blocks: int  # kv_used_blocks + booked decode blocks no report covers yet
    report_age_s: float | None  # None: no report yet
    healthy: bool = True
    period_s: float = 1.0  # the shim reports at least this often
    events_ok: bool = True
    prefill_inflow: float = 0.0  # prompt tokens per second booked here lately (INFLOW_TAU_S), any router's
    decode_context: float = 0.0  # the decoding requests' mean length, as its shim last reported (0: unknown)
    booked_requests: int = 0  # requests booked here (any router's) that no report counts yet in running or waiting


class Liveness(msgspec.Struct, frozen=True):
    """What a worker's latest load report says about it being alive and trusted."""

    age_s: float  # since it arrived here
    period_s: float
    events_ok: bool
    healthy: bool
    draining: bool = False


@dataclass(eq=False, slots=True)
class _Booking:
    router: str | None
    request_id: str
    worker: str
    prefill_tokens: int
    decode_blocks: int
    booked_at: float
    confirmed_at: float  # booked, or last named by its router's snapshot: `expire` counts from it
    prefill_done_at: float | None = None
    prefill_counted: bool = True  # in its worker's `prefill` sum: not done, no report covers it
    blocks_counted: bool = True  # in its worker's `blocks` sum
    request_counted: bool = True  # in its worker's `requests` count: no report covers it


class _WorkerBookings:
    """One worker's live bookings and the sums of what no report covers yet.

    A booking's prefill tokens stop counting when its prefill is done or a report with
    `ts >= booked_at` arrives; the request itself (`requests`, beside the report's running and
    waiting) when such a report arrives; its blocks when a report with `ts >= prefill_done_at`
    arrives. Two
    heaps order the bookings by those times so `cover(report_ts)` pops exactly the ones a report
    covers; entries of bookings that stopped counting otherwise are skipped when popped, and the
    heaps are rebuilt when such entries outnumber the live ones (a worker that never reports).

    The mirror image: a report made while a request waited (`booked_at <= ts < prefill_done_at`)
    includes its prompt tokens as queued, and may arrive after the router saw the first token.
    `released(report_ts)` is what such a report still holds of requests whose prefill is done; the
    entries go once a report with `ts >= prefill_done_at` arrives.
    """

    __slots__ = ("_by_booked", "_by_done", "_by_released", "_order", "blocks", "bookings", "prefill", "requests")

    def __init__(self) -> None:
        self.bookings: set[_Booking] = set()
        self.prefill = 0
        self.blocks = 0
        self.requests = 0
        self._by_booked: list[tuple[float, int, _Booking]] = []  # prefill or request counted, by booked_at
        self._by_done: list[tuple[float, int, _Booking]] = []  # prefill done, blocks counted, by prefill_done_at
        self._by_released: list[tuple[float, int, float, int]] = []  # (prefill_done_at, order, booked_at, tokens)
        self._order = itertools.count()  # heap tie-break: bookings themselves do not compare

    def add(self, booking: _Booking) -> None:
        self.bookings.add(booking)
        self.prefill += booking.prefill_tokens
        self.blocks += booking.decode_blocks
        self.requests += 1
        heapq.heappush(self._by_booked, (booking.booked_at, next(self._order), booking))
        self._compact()

    def prefill_done(self, booking: _Booking, at: float, *, release: bool = True) -> None:
        booking.prefill_done_at = at
        if booking.prefill_tokens and release:
            entry = (at, next(self._order), booking.booked_at, booking.prefill_tokens)
            heapq.heappush(self._by_released, entry)
        self._uncount_prefill(booking)
        if booking.blocks_counted:
            heapq.heappush(self._by_done, (at, next(self._order), booking))

    def discard(self, booking: _Booking) -> None:
        self.bookings.discard(booking)
        self._uncount_prefill(booking)
        self._uncount_blocks(booking)
        self._uncount_request(booking)

    def cover(self, report_ts: float) -> None:
        """Stop counting what a report generated at `report_ts` includes."""
        by_booked, by_done = self._by_booked, self._by_done
        while by_booked and by_booked[0][0] <= report_ts:
            booking = heapq.heappop(by_booked)[2]
            self._uncount_prefill(booking)
            self._uncount_request(booking)
        while by_done and by_done[0][0] <= report_ts:
            self._uncount_blocks(heapq.heappop(by_done)[2])
        by_released = self._by_released
        while by_released and by_released[0][0] <= report_ts:
            heapq.heappop(by_released)

    def released(self, report_ts: float) -> int:
        """Prompt tokens a report made at `report_ts` counts as queued whose prefill is done since."""
        return sum(tokens for _, _, booked_at, tokens in self._by_released if booked_at <= report_ts)

    def drop_releases(self) -> None:
        self._by_released.clear()

    @property
    def holds_releases(self) -> bool:
        return bool(self._by_released)

    def idle_before(self, cutoff: float) -> bool:
        """No live booking, and every release held is of a prefill done before `cutoff`."""
        return not self.bookings and all(entry[0] < cutoff for entry in self._by_released)

    def _uncount_prefill(self, booking: _Booking) -> None:
        if booking.prefill_counted:
            booking.prefill_counted = False
            self.prefill -= booking.prefill_tokens

    def _uncount_blocks(self, booking: _Booking) -> None:
        if booking.blocks_counted:
            booking.blocks_counted = False
            self.blocks -= booking.decode_blocks

    def _uncount_request(self, booking: _Booking) -> None:
        if booking.request_counted:
            booking.request_counted = False
            self.requests -= 1

    def _compact(self) -> None:
        if len(self._by_booked) + len(self._by_done) > 4 * len(self.bookings) + 64:
            self._by_booked = [e for e in self._by_booked if e[2].prefill_counted or e[2].request_counted]
            self._by_done = [e for e in self._by_done if e[2].blocks_counted]
            heapq.heapify(self._by_booked)
            heapq.heapify(self._by_done)


@dataclass(frozen=True, slots=True)
class Expired:
    """One router's bookings dropped by `LoadView.expire`."""

    bookings: int
    counted: int  # of them, those still counted in their worker's load until dropped


@dataclass(frozen=True, slots=True)
class _Report:
    report: LoadReport
    received_at: float  # of the worker's latest report, taken or not
    covers: float  # the newest stamp taken from the worker: no later report of it was made before (Order)


_NO_REPORT = float("-inf")
_NO_REQUESTS: Mapping[str, list[_Booking]] = MappingProxyType({})  # a router with no booking


class LoadView:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._reports: dict[str, _Report] = {}
        # router -> request_id -> its bookings (a router with none has no entry)
        self._by_router: dict[str | None, dict[str, list[_Booking]]] = {}
        self._by_worker: dict[str, _WorkerBookings] = {}
        self._inflow: dict[str, tuple[float, float]] = {}  # worker -> (tokens/s, as of when)

    # --- reports -------------------------------------------------------------------------------

    def update(self, report: LoadReport) -> float | None:
        """The latest report of `report.worker`. One stamped before the one held by at most
        MAX_REORDER_S (reordered) is dropped, but the worker is alive; one older by more is taken,
        and the seconds its clock stepped back are returned (None otherwise)."""
        now = self._clock()
        if not report.ts <= now + MAX_CLOCK_SKEW_S:  # also NaN
            report = msgspec.structs.replace(report, ts=now + MAX_CLOCK_SKEW_S)
        held = self._reports.get(report.worker)
        if held is None:
            self._reports[report.worker] = _Report(report, now, report.ts)
            return None
        back = held.report.ts - report.ts
        if 0 < back <= MAX_REORDER_S:
            self._reports[report.worker] = _Report(held.report, now, held.covers)
            return None
        if back > 0:  # its clock stepped back: what it held was judged on the stamps before the step
            on_worker = self._by_worker.get(report.worker)
            if on_worker is not None:
                on_worker.drop_releases()
        self._reports[report.worker] = _Report(report, now, max(report.ts, held.covers))
        return back if back > 0 else None

    def liveness(self, worker: str) -> Liveness | None:
        """None before the worker's first report."""
        held = self._reports.get(worker)
        if held is None:
            return None
        r = held.report
        # NaN: the default
        period = min(max(r.period_s, MIN_LOAD_PERIOD_S), MAX_LOAD_PERIOD_S) if r.period_s == r.period_s else 1.0
        return Liveness(max(0.0, self._clock() - held.received_at), period, r.events_ok, r.healthy, r.draining)

    def capacity(self, worker: str) -> int | None:
        """The worker's KV capacity in blocks as its last report says; None when unknown."""
        held = self._reports.get(worker)
        if held is None:
            return None
        return held.report.kv_total_blocks or None  # 0, like None: the engine did not say

    def credit_short(self) -> list[str]:
        """The workers whose last report says their engine reuses far less than its KV events
        promise (LoadReport.prefix_credit_short)."""
        return sorted(w for w, held in self._reports.items() if held.report.prefix_credit_short)

    def remove_worker(self, worker: str) -> None:
        """`worker` left: its report and every booking on it go."""
        self._reports.pop(worker, None)
        self._inflow.pop(worker, None)
        held = self._by_worker.pop(worker, None)
        for booking in held.bookings if held is not None else ():
            self._unlink(booking)

    # --- bookings ------------------------------------------------------------------------------

    def book(
        self, request_id: str, worker: str, prefill_tokens: int, decode_blocks: int, *, router: str | None = None
    ) -> None:
        """Claim `prefill_tokens` and `decode_blocks` on `worker` for the request (booking the same
        request on the same worker again replaces the claim)."""
        if prefill_tokens < 0 or decode_blocks < 0:
            raise ValueError(
                f"booking {request_id}: negative prefill_tokens {prefill_tokens} or decode_blocks {decode_blocks}"
            )
        requests = self._by_router.get(router)
        if requests is None:
            requests = self._by_router[router] = {}
        bookings = requests.get(request_id)
        if bookings is None:
            bookings = requests[request_id] = []
        else:
            for old in [b for b in bookings if b.worker == worker]:
                bookings.remove(old)
                self._by_worker[worker].discard(old)
        now = self._clock()
        booking = _Booking(router, request_id, worker, prefill_tokens, decode_blocks, now, now)
        bookings.append(booking)
        on_worker = self._by_worker.get(worker)
        if on_worker is None:
            on_worker = self._by_worker[worker] = _WorkerBookings()
        on_worker.add(booking)
        if prefill_tokens:
            self._inflow[worker] = (self._inflow_at(worker, now) + prefill_tokens / INFLOW_TAU_S, now)

    def _inflow_at(self, worker: str, now: float) -> float:
        rate, at = self._inflow.get(worker, (0.0, now))
        return rate * math.exp(-max(now - at, 0.0) / INFLOW_TAU_S)

    def prefill_done(self, request_id: str, *, router: str | None = None, worker: str | None = None) -> None:
        """The request's first token came: its prefill tokens leave every queue it was booked on.
        With `worker`, only its booking there: a remote request's prefill leg ended, and its decode
        worker has yet to schedule it (its blocks count until that worker's own first token)."""
        now = self._clock()
        for booking in self._bookings_of(router, request_id):
            if booking.prefill_done_at is None and worker in (None, booking.worker):
                held = self._reports.get(booking.worker)
                # Its clock is back behind a stamp it sent before: no report it sends until it passes
                # that stamp can be told made before or after now, so no release is recorded.
                lagging = held is not None and held.report.ts < held.covers
                self._by_worker[booking.worker].prefill_done(booking, now, release=not lagging)

    def free(self, request_id: str, *, router: str | None = None) -> None:
        """The request ended, whichever way: all its bookings go."""
        self._drop_key(router, request_id)

    def held(self, router: str | None = None) -> list[SyncBooking]:
        """`router`'s live bookings (None: this router's), as its snapshot states them."""
        return [
            SyncBooking(
                request_id=b.request_id,
                worker=b.worker,
                tokens=b.prefill_tokens,
                blocks=b.decode_blocks,
                prefill_done=b.prefill_done_at is not None,
            )
            for bookings in self._by_router.get(router, _NO_REQUESTS).values()
            for b in bookings
        ]

    def keys(self, router: str) -> set[tuple[str, str]]:
        """(request_id, worker) of each of `router`'s live bookings."""
        return {
            (b.request_id, b.worker)
            for bookings in self._by_router.get(router, _NO_REQUESTS).values()
            for b in bookings
        }

    def confirm_all(self, router: str, stated: Iterable[SyncBooking]) -> list[tuple[SyncBooking, SyncBooking | None]]:
        """`router` says its bookings `stated` are live: the age for `expire` of each held here
        starts again. Returns those not held here (with None) or held in another state (with the
        booking as held here); the rest, a snapshot's usual all, cost one pass and no object."""
        now = self._clock()
        requests = self._by_router.get(router, _NO_REQUESTS)
        differ: list[tuple[SyncBooking, SyncBooking | None]] = []
        for s in stated:
            for b in requests.get(s.request_id, ()):
                if b.worker == s.worker:
                    b.confirmed_at = now
                    done = b.prefill_done_at is not None
                    if b.prefill_tokens != s.tokens or b.decode_blocks != s.blocks or done != s.prefill_done:
                        held = SyncBooking(
                            request_id=b.request_id,
                            worker=b.worker,
                            tokens=b.prefill_tokens,
                            blocks=b.decode_blocks,
                            prefill_done=done,
                        )
                        differ.append((s, held))
                    break
            else:
                differ.append((s, None))
        return differ

    def drop(self, request_id: str, worker: str, *, router: str) -> bool:
        """Drop `router`'s booking of the request on `worker` alone; whether there was one."""
        for b in self._bookings_of(router, request_id):
            if b.worker == worker:
                self._unlink(b)
                self._drop_from_worker(b)
                return True
        return False

    def forget_router(self, router: str) -> int:
        """A peer router is gone: drop its bookings. Returns how many went."""
        requests = self._by_router.pop(router, _NO_REQUESTS)
        for bookings in requests.values():
            for booking in bookings:
                self._drop_from_worker(booking)
        return sum(map(len, requests.values()))

    def expire(self, max_age_s: float, *, peers_only: bool = True) -> dict[str | None, Expired]:
        """Drop bookings booked or confirmed (`confirm_all`) longer than `max_age_s` ago (a safety
        net for a `free` that never came), and
        what is held of a worker with no report, no booking and nothing newer (releases), or
        nothing left (a decayed `prefill_inflow`): a worker that left before a peer's booking on
        it arrived, whose releases no report will ever cover. Returns what went per router that
        made it (None: this one), routers that lost none left out."""
        now = self._clock()
        cutoff = now - max_age_s
        stale = [
            (router, request_id, bookings)
            for router, requests in self._by_router.items()
            if router is not None or not peers_only
            for request_id, bookings in requests.items()
            if all(b.confirmed_at < cutoff for b in bookings)
        ]
        dropped: dict[str | None, Expired] = {}
        for router, request_id, bookings in stale:
            counted = sum(self._still_counted(b) for b in bookings)
            was = dropped.get(router, Expired(0, 0))
            dropped[router] = Expired(was.bookings + self._drop_key(router, request_id), was.counted + counted)
        for worker in (self._by_worker.keys() | self._inflow.keys()) - self._reports.keys():
            on_worker = self._by_worker.get(worker)
            if on_worker is not None and on_worker.idle_before(cutoff):
                del self._by_worker[worker]
            if worker in self._inflow and self._inflow_at(worker, now) < 1e-9:  # reads as none
                del self._inflow[worker]
        return dropped

    def _still_counted(self, booking: _Booking) -> bool:
        """Whether `load()` still adds anything of `booking` to its worker's figures (its blocks:
        no report as new as its prefill_done, or none came; its tokens or itself: no report as new
        as the booking)."""
        on_worker = self._by_worker.get(booking.worker)
        if on_worker is None:
            return False
        held = self._reports.get(booking.worker)
        on_worker.cover(held.covers if held is not None else _NO_REPORT)  # as load() would first
        return (
            (booking.blocks_counted and booking.decode_blocks > 0)
            or (booking.prefill_counted and booking.prefill_tokens > 0)
            or booking.request_counted
        )

    def _bookings_of(self, router: str | None, request_id: str) -> list[_Booking]:
        requests = self._by_router.get(router)
        return (requests.get(request_id) if requests is not None else None) or []

    def _drop_key(self, router: str | None, request_id: str) -> int:
        requests = self._by_router.get(router)
        if requests is None:
            return 0
        bookings = requests.pop(request_id, None)
        if bookings is None:
            return 0
        if not requests:
            del self._by_router[router]
        for booking in bookings:
            self._drop_from_worker(booking)
        return len(bookings)

    def _drop_from_worker(self, booking: _Booking) -> None:
        on_worker = self._by_worker.get(booking.worker)
        if on_worker is not None:
            on_worker.discard(booking)
            if not on_worker.bookings and not on_worker.holds_releases:
                del self._by_worker[booking.worker]

    def _unlink(self, booking: _Booking) -> None:
        """Take `booking` out of its router's requests (its worker's sums are the caller's)."""
        requests = self._by_router.get(booking.router)
        bookings = requests.get(booking.request_id) if requests is not None else None
        if requests is None or bookings is None:
            return
        bookings.remove(booking)
        if not bookings:
            del requests[booking.request_id]
            if not requests:
                del self._by_router[booking.router]

    # --- reads ---------------------------------------------------------------------------------

    def load(self, worker: str) -> WorkerLoad:
        """Report plus uncovered bookings; zeros (and `kv_total_blocks` None) before any report."""
        held = self._reports.get(worker)
        prefill = blocks = released = requests = 0
        on_worker = self._by_worker.get(worker)
        if on_worker is not None:
            on_worker.cover(held.covers if held is not None else _NO_REPORT)
            released = on_worker.released(held.report.ts) if held is not None else 0
            prefill, blocks, requests = on_worker.prefill, on_worker.blocks, on_worker.requests
            if not on_worker.bookings and not on_worker.holds_releases:
                del self._by_worker[worker]
        now = self._clock()
        inflow = self._inflow_at(worker, now) if worker in self._inflow else 0.0
        if held is None:
            return WorkerLoad(
                worker, 0, 0, 0, None, prefill, blocks, None, prefill_inflow=inflow, booked_requests=requests
            )
        r = held.report
        return WorkerLoad(
            worker=worker,
            running=r.running,
            waiting=r.waiting,
            kv_used_blocks=r.kv_used_blocks,
            kv_total_blocks=r.kv_total_blocks,
            prefill_tokens_queued=max(0, r.prefill_tokens_queued - released) + prefill,
            active_blocks=r.kv_used_blocks + blocks,
            report_age_s=max(0.0, now - held.received_at),
            healthy=r.healthy,
            period_s=r.period_s,
            events_ok=r.events_ok,
            prefill_inflow=inflow,
            decode_context=r.decode_context,
            booked_requests=requests,
        )

    def bookings(self, worker: str) -> int:
        """Live bookings (any router's) on `worker`, covered by a report or not."""
        on_worker = self._by_worker.get(worker)
        return len(on_worker.bookings) if on_worker is not None else 0

    def workers(self) -> list[str]:
        """Workers with a report or a booking, sorted."""
        return sorted(self._reports.keys() | self._by_worker.keys())
