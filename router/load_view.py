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
ours double-counts for the skew (never past the first token), one ahead undercounts until the next
report. A peer's booking is stamped when it arrives here, a little after the peer made it, which
errs on the side of counting it.

Bookings are keyed by (router, request_id): None is this router. One request may hold bookings on
several workers (its prefill and decode legs); `free` drops them all. Synchronous; one event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.messages import LoadReport

__all__ = ["LoadView", "WorkerLoad"]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
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


@dataclass(eq=False, slots=True)
class _Booking:
    router: str | None
    request_id: str
    worker: str
    prefill_tokens: int
    decode_blocks: int
    booked_at: float
    prefill_done_at: float | None = None

    def pending_prefill(self, report_ts: float) -> int:
        return self.prefill_tokens if self.prefill_done_at is None and self.booked_at > report_ts else 0

    def pending_blocks(self, report_ts: float) -> int:
        covered = self.prefill_done_at is not None and report_ts >= self.prefill_done_at
        return 0 if covered else self.decode_blocks


@dataclass(frozen=True, slots=True)
class _Report:
    report: LoadReport
    received_at: float


_NO_REPORT = float("-inf")


class LoadView:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._reports: dict[str, _Report] = {}
        self._by_request: dict[tuple[str | None, str], list[_Booking]] = {}
        self._by_worker: dict[str, set[_Booking]] = {}

    # --- reports -------------------------------------------------------------------------------

    def update(self, report: LoadReport) -> None:
        """The latest report of `report.worker`; an older one than held (reordered) is ignored."""
        held = self._reports.get(report.worker)
        if held is None or report.ts >= held.report.ts:
            self._reports[report.worker] = _Report(report, self._clock())

    def remove_worker(self, worker: str) -> None:
        """`worker` left: its report and every booking on it go."""
        self._reports.pop(worker, None)
        for booking in self._by_worker.pop(worker, set()):
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
        key = (router, request_id)
        bookings = self._by_request.setdefault(key, [])
        for old in [b for b in bookings if b.worker == worker]:
            bookings.remove(old)
            self._by_worker[worker].discard(old)
        booking = _Booking(router, request_id, worker, prefill_tokens, decode_blocks, self._clock())
        bookings.append(booking)
        self._by_worker.setdefault(worker, set()).add(booking)

    def prefill_done(self, request_id: str, *, router: str | None = None) -> None:
        """The request's first token came: its prefill tokens leave every queue it was booked on."""
        now = self._clock()
        for booking in self._by_request.get((router, request_id), ()):
            if booking.prefill_done_at is None:
                booking.prefill_done_at = now

    def free(self, request_id: str, *, router: str | None = None) -> None:
        """The request ended, whichever way: all its bookings go."""
        for booking in self._by_request.pop((router, request_id), ()):
            self._drop_from_worker(booking)

    def forget_router(self, router: str) -> int:
        """A peer router is gone: drop its bookings. Returns how many went."""
        keys = [k for k in self._by_request if k[0] == router]
        return sum(self._drop_key(k) for k in keys)

    def expire(self, max_age_s: float, *, peers_only: bool = True) -> int:
        """Drop bookings older than `max_age_s` (a safety net for a `free` that never came).
        Returns how many went."""
        cutoff = self._clock() - max_age_s
        stale = [
            key
            for key, bookings in self._by_request.items()
            if (key[0] is not None or not peers_only) and all(b.booked_at < cutoff for b in bookings)
        ]
        return sum(self._drop_key(k) for k in stale)

    def _drop_key(self, key: tuple[str | None, str]) -> int:
        bookings = self._by_request.pop(key, [])
        for booking in bookings:
            self._drop_from_worker(booking)
        return len(bookings)

    def _drop_from_worker(self, booking: _Booking) -> None:
        on_worker = self._by_worker.get(booking.worker)
        if on_worker is not None:
            on_worker.discard(booking)
            if not on_worker:
                del self._by_worker[booking.worker]

    def _unlink(self, booking: _Booking) -> None:
        key = (booking.router, booking.request_id)
        bookings = self._by_request.get(key)
        if bookings is not None:
            bookings.remove(booking)
            if not bookings:
                del self._by_request[key]

    # --- reads ---------------------------------------------------------------------------------

    def load(self, worker: str) -> WorkerLoad:
        """Report plus uncovered bookings; zeros (and `kv_total_blocks` None) before any report."""
        held = self._reports.get(worker)
        report_ts = held.report.ts if held is not None else _NO_REPORT
        prefill = blocks = 0
        for booking in self._by_worker.get(worker, ()):
            prefill += booking.pending_prefill(report_ts)
            blocks += booking.pending_blocks(report_ts)
        if held is None:
            return WorkerLoad(worker, 0, 0, 0, None, prefill, blocks, None)
        r = held.report
        return WorkerLoad(
            worker=worker,
            running=r.running,
            waiting=r.waiting,
            kv_used_blocks=r.kv_used_blocks,
            kv_total_blocks=r.kv_total_blocks,
            prefill_tokens_queued=r.prefill_tokens_queued + prefill,
            active_blocks=r.kv_used_blocks + blocks,
            report_age_s=max(0.0, self._clock() - held.received_at),
            healthy=r.healthy,
        )

    def bookings(self, worker: str) -> int:
        """Live bookings (any router's) on `worker`, covered by a report or not."""
        return len(self._by_worker.get(worker, ()))

    def workers(self) -> list[str]:
        """Workers with a report or a booking, sorted."""
        return sorted(self._reports.keys() | self._by_worker.keys())
