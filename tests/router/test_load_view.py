"""LoadView: reports, bookings, and the rule that a booking stops counting once a report covers it."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocol.messages import LoadReport, SyncBooking
from router.load_view import INFLOW_TAU_S, MAX_CLOCK_SKEW_S, MAX_REORDER_S, Expired, LoadView, WorkerLoad


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def report(worker: str = "w1", ts: float = 0.0, **kw: int) -> LoadReport:
    return LoadReport(worker=worker, ts=ts, **kw)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def view(clock: Clock) -> LoadView:
    return LoadView(clock=clock)


def test_unknown_worker_reads_as_idle_with_unknown_capacity(view: LoadView) -> None:
    assert view.load("nobody") == WorkerLoad("nobody", 0, 0, 0, None, 0, 0, None)


def test_report_fields_pass_through_with_their_age(view: LoadView, clock: Clock) -> None:
    view.update(
        report(ts=999.0, running=3, waiting=2, kv_used_blocks=40, kv_total_blocks=100, prefill_tokens_queued=512)
    )
    clock.now += 1.5
    load = view.load("w1")
    assert (load.running, load.waiting, load.kv_used_blocks, load.kv_total_blocks) == (3, 2, 40, 100)
    assert load.prefill_tokens_queued == 512
    assert load.active_blocks == 40
    assert load.report_age_s == pytest.approx(1.5)
    assert load.decode_context == 0.0  # a shim that does not count
    view.update(LoadReport(worker="w1", ts=999.5, running=3, decode_context=4200.5))
    assert view.load("w1").decode_context == 4200.5


def test_an_older_report_does_not_replace_a_newer_one(view: LoadView) -> None:
    view.update(report(ts=10.0, running=5))
    view.update(report(ts=9.0, running=1))
    assert view.load("w1").running == 5


def test_a_late_report_is_dropped_but_proves_the_worker_alive(view: LoadView, clock: Clock) -> None:
    view.update(report(ts=clock.now, running=5))
    clock.now += 2.0
    assert view.update(report(ts=clock.now - 2.0 - MAX_REORDER_S, running=1)) is None
    assert view.load("w1").running == 5
    live = view.liveness("w1")
    assert live is not None and live.age_s == 0.0


def test_a_worker_whose_clock_steps_back_stays_live_and_its_figures_follow(view: LoadView, clock: Clock) -> None:
    """An NTP step or a VM resume: before, every report was dropped as reordered until the clock
    passed the last stamp, so the worker read as silent (eligibility) for the whole step."""
    view.update(report(ts=clock.now, running=1, kv_used_blocks=10))
    for i in range(10):
        clock.now += 1.0
        back = view.update(report(ts=clock.now - 60.0, running=7, kv_used_blocks=30 + i))
        assert back == (pytest.approx(59.0) if i == 0 else None)  # said once, at the step
        live = view.liveness("w1")
        assert live is not None and live.age_s == 0.0
        assert (view.load("w1").running, view.load("w1").kv_used_blocks) == (7, 30 + i)


def test_what_a_report_covered_stays_covered_after_the_clock_steps_back(view: LoadView, clock: Clock) -> None:
    """The newer stamp saw the booking: a report from a clock that then stepped back must not make
    it count again, read or not in between."""
    view.book("r1", "w1", 2000, 130)
    view.prefill_done("r1")
    clock.now += 0.1
    view.update(report(ts=clock.now, prefill_tokens_queued=0, kv_used_blocks=130))  # covers r1 whole
    view.update(report(ts=clock.now - 30.0, prefill_tokens_queued=0, kv_used_blocks=131))
    assert (view.load("w1").prefill_tokens_queued, view.load("w1").active_blocks) == (0, 131)
    clock.now += 1.0
    view.book("r2", "w1", 500, 20)  # booked after the step: counted until its own clock passes the booking
    view.update(report(ts=clock.now - 30.0, prefill_tokens_queued=500, kv_used_blocks=131))
    assert (view.load("w1").prefill_tokens_queued, view.load("w1").active_blocks) == (1000, 151)


def test_a_request_booked_after_the_clock_steps_back_counts_until_the_workers_clock_passes_it(
    view: LoadView, clock: Clock
) -> None:
    """No stamp from a stepped-back clock proves a report made after a booking until that clock passes
    the booking: from 2026-12-08 its stamps were moved forward by the step, which a later forward
    step or a slower delivery turned into stamps past their making, so a report made before a
    booking covered it (load audit). Counting it twice meanwhile errs the safe way."""
    view.update(report(ts=clock.now, kv_total_blocks=1000))
    assert view.update(report(ts=clock.now - 600.0, kv_total_blocks=1000)) == pytest.approx(600.0)
    clock.now += 1.0
    view.book("r", "w1", 100, 50)
    booked = clock.now
    clock.now += 0.5
    view.update(report(ts=clock.now - 600.0, running=1, kv_used_blocks=50, kv_total_blocks=1000))
    load = view.load("w1")
    assert (load.running, load.booked_requests, load.active_blocks, load.prefill_tokens_queued) == (1, 1, 100, 100)
    view.prefill_done("r")
    clock.now = booked + 600.9
    view.update(report(ts=booked + 0.6, running=1, kv_used_blocks=50, kv_total_blocks=1000))
    load = view.load("w1")
    assert (load.running, load.booked_requests, load.active_blocks, load.prefill_tokens_queued) == (1, 0, 50, 0)


def test_a_clock_stepped_back_then_partly_forward_never_covers_a_booking_made_after_a_report(
    view: LoadView, clock: Clock
) -> None:
    """Back 5 s, then NTP forward 1.2 s, reports 0.3 s on the way: the offset kept from the step put
    every stamp 0.2 s past its making for good, and a report made 0.15 s before a booking covered it
    (review of fa683ec)."""
    for made, err in [(1000, 0.0), (1001, -5.0), (1002, -5.0), (1003, -3.8), (1004, -3.8), (1005, -3.8)]:
        clock.now = made + 0.3
        view.update(report(ts=made + err))
    clock.now = 1006.15
    view.book("r", "w1", 100, 5)
    clock.now = 1006.3
    view.update(report(ts=1006.0 - 3.8))
    assert (view.load("w1").booked_requests, view.load("w1").prefill_tokens_queued) == (1, 100)


def test_a_clock_that_steps_back_then_forward_again_leaves_no_booking_covered_early(
    view: LoadView, clock: Clock
) -> None:
    """Once NTP set the worker right again, a report made before a booking never covers it (an offset
    kept from the step, as 5b236cb had, put every stamp ahead of ours)."""
    view.update(report(ts=clock.now))
    view.update(report(ts=clock.now - 600.0))
    clock.now += 1.0
    view.update(report(ts=clock.now))  # set right again
    clock.now += 0.5
    view.book("r", "w1", 100, 5)
    clock.now += 0.5
    view.update(report(ts=clock.now - 0.8))  # made before the booking
    assert (view.load("w1").booked_requests, view.load("w1").prefill_tokens_queued) == (1, 100)


def test_a_takeover_from_a_clock_behind_does_not_leave_an_offset_that_uncounts_a_booking(
    view: LoadView, clock: Clock
) -> None:
    """A publisher 5 s behind took the worker's name for one report, then the one set right came
    back with a report 0.8 s late. Until 2026-12-08 the offset was shed to the delivery delay and,
    a stamp it put less than MAX_CLOCK_SKEW_S ahead of ours being kept, stayed for good: a report
    made before a booking covered it (load audit)."""
    view.update(report(ts=clock.now))
    clock.now += 0.5
    assert view.update(report(ts=clock.now - 5.0)) is not None  # the other publisher: a step back
    clock.now += 0.5
    made = clock.now
    clock.now += 0.8
    view.update(report(ts=made))  # arrives late
    for _ in range(3):  # then prompt
        clock.now += 1.0
        view.update(report(ts=clock.now))
    clock.now += 0.6
    view.book("r", "w1", 100, 5)
    clock.now += 0.01
    view.update(report(ts=clock.now - 0.7))  # made 0.1 s before the booking
    assert (view.load("w1").booked_requests, view.load("w1").prefill_tokens_queued) == (1, 100)


def test_two_publishers_under_one_name_do_not_move_the_right_ones_stamps_ahead_of_ours(
    view: LoadView, clock: Clock
) -> None:
    """A reporting 1 s apart with its clock right, B 0.9 s after it with its clock 2 s behind, each
    report 0.2 s on the way; then A alone. Until 2026-12-08 B's report set an offset of 1.1 s that
    put A's stamps 0.9 s ahead of ours for good (load audit)."""
    clock.now = 1000.2
    view.update(report(ts=1000.0))
    clock.now = 1001.1
    view.update(report(ts=1000.9 - 2.0))  # B: a step back
    for k in range(1, 10):
        clock.now = 1000.0 + k + 0.2
        view.update(report(ts=1000.0 + k))
        assert view._reports["w1"].report.ts <= clock.now
    clock.now = 1009.3
    view.book("r", "w1", 100, 5)
    clock.now = 1010.2
    view.update(report(ts=1009.25))  # made before the booking
    assert (view.load("w1").booked_requests, view.load("w1").prefill_tokens_queued) == (1, 100)


def test_a_slow_delivery_after_a_step_back_does_not_become_a_forward_shift(view: LoadView, clock: Clock) -> None:
    """Set right again while every report takes 0.5 s to arrive: until 2026-12-08 the offset was shed
    to now - stamp, the delay, and kept, so a booking made while a report was on the way was covered
    by it."""
    view.update(report(ts=clock.now))
    view.update(report(ts=clock.now - 600.0))
    for _ in range(3):
        clock.now += 1.0
        view.update(report(ts=clock.now - 0.5))
    clock.now += 0.8
    view.book("r", "w1", 100, 5)
    clock.now += 0.2
    view.update(report(ts=clock.now - 0.5))  # made 0.3 s before the booking
    assert (view.load("w1").booked_requests, view.load("w1").prefill_tokens_queued) == (1, 100)


def test_what_a_stepped_back_worker_held_is_let_go_by_its_next_reports(view: LoadView, clock: Clock) -> None:
    """A report made while a request waited holds its prompt tokens (`released`) until one as new as
    its first token comes: after a step back the stamps never were, so every finished request's
    entry was kept for the step's length and `load()` summed them all (10 min at 200 requests/s:
    120,000 entries). They go with the next report now."""
    view.update(report(ts=clock.now))
    view.update(report(ts=clock.now - 600.0))
    for i in range(100):
        clock.now += 0.005
        view.book(f"r{i}", "w1", 100, 2)
        view.prefill_done(f"r{i}")
        view.free(f"r{i}")
    clock.now += 0.01
    view.update(report(ts=clock.now - 600.0, prefill_tokens_queued=0))
    view.load("w1")
    assert view._by_worker.get("w1") is None  # nothing held: no release left to sum


def test_booking_counts_at_once_on_top_of_an_older_report(view: LoadView, clock: Clock) -> None:
    view.update(report(ts=clock.now - 1, prefill_tokens_queued=100, kv_used_blocks=10))
    view.book("r1", "w1", 2000, 130)
    load = view.load("w1")
    assert load.prefill_tokens_queued == 2100
    assert load.active_blocks == 140
    assert view.bookings("w1") == 1


def test_a_report_newer_than_the_booking_covers_its_prefill_tokens(view: LoadView, clock: Clock) -> None:
    view.book("r1", "w1", 2000, 130)
    clock.now += 0.01
    view.update(report(ts=clock.now, prefill_tokens_queued=2000, kv_used_blocks=0))
    load = view.load("w1")
    assert load.prefill_tokens_queued == 2000  # the shim's count, not 4000
    assert load.active_blocks == 130  # not allocated yet: still booked


def test_a_report_as_old_as_the_booking_covers_it(view: LoadView, clock: Clock) -> None:
    view.book("r1", "w1", 2000, 0)
    view.update(report(ts=clock.now, prefill_tokens_queued=2000))
    assert view.load("w1").prefill_tokens_queued == 2000


def test_prefill_done_removes_booked_prefill_tokens(view: LoadView, clock: Clock) -> None:
    view.book("r1", "w1", 2000, 130)
    clock.now += 0.1
    view.prefill_done("r1")
    load = view.load("w1")
    assert load.prefill_tokens_queued == 0
    assert load.active_blocks == 130


def test_prefill_done_on_one_worker_leaves_the_requests_other_bookings_counting(view: LoadView, clock: Clock) -> None:
    """A remote request's prefill leg ended; its decode worker may not have scheduled it yet, so a
    report from there must not end its blocks (bookings audit, D1)."""
    view.book("r1", "p", 2000, 0)
    view.book("r1", "d", 0, 130)
    clock.now += 0.1
    view.prefill_done("r1", worker="p")
    view.update(report("d", ts=clock.now + 0.05, kv_used_blocks=40, waiting=1))
    assert view.load("p").prefill_tokens_queued == 0
    assert view.load("d").active_blocks == 40 + 130
    clock.now += 0.1
    view.prefill_done("r1")  # the decode leg's first token
    view.update(report("d", ts=clock.now, kv_used_blocks=170))
    assert view.load("d").active_blocks == 170


def test_a_report_made_while_the_request_waited_stops_counting_it_once_its_prefill_is_done(
    view: LoadView, clock: Clock
) -> None:
    """The README demo's fourth request: a report from before the first token must not keep the
    finished request's prompt queued until the next report."""
    view.book("r1", "w1", prefill_tokens=4256, decode_blocks=266)
    clock.now += 0.01
    view.update(report(ts=clock.now, prefill_tokens_queued=4256 + 100))  # covers r1, plus 100 of others
    assert view.load("w1").prefill_tokens_queued == 4356
    clock.now += 0.01
    view.prefill_done("r1")
    view.free("r1")
    assert view.load("w1").prefill_tokens_queued == 100
    view.update(report(ts=clock.now - 0.005, prefill_tokens_queued=4256))  # still made before the first token
    assert view.load("w1").prefill_tokens_queued == 0
    view.update(report(ts=clock.now, prefill_tokens_queued=50))  # made after: counts as it is
    assert view.load("w1").prefill_tokens_queued == 50


def test_a_report_made_while_waiting_that_arrives_after_the_first_token_does_not_count_it(
    view: LoadView, clock: Clock
) -> None:
    view.book("r1", "w1", prefill_tokens=4256, decode_blocks=266)
    booked = clock.now
    clock.now += 0.02
    view.prefill_done("r1")
    view.free("r1")
    view.update(report(ts=booked + 0.01, prefill_tokens_queued=4256 + 7))  # in flight until now
    assert view.load("w1").prefill_tokens_queued == 7
    view.update(report(ts=clock.now + 0.01, prefill_tokens_queued=9))
    assert view.load("w1").prefill_tokens_queued == 9


def test_a_booked_request_counts_until_a_report_covers_it_whether_its_prefill_is_done_or_not(
    view: LoadView, clock: Clock
) -> None:
    """Its shim's next report counts it in running or waiting; until then only the booking does."""
    view.update(report(ts=clock.now - 1, running=3))
    view.book("r1", "w1", 1000, 10)
    view.book("r2", "w1", 1000, 10)
    view.prefill_done("r1")  # its first token came: running on the engine, still in no report
    assert view.load("w1").booked_requests == 2
    view.free("r2")
    assert view.load("w1").booked_requests == 1
    clock.now += 0.01
    view.update(report(ts=clock.now, running=4))
    assert (view.load("w1").running, view.load("w1").booked_requests) == (4, 0)


def test_prefill_done_before_any_covering_report_releases_nothing(view: LoadView, clock: Clock) -> None:
    view.update(report(ts=clock.now - 1, prefill_tokens_queued=300))
    view.book("r1", "w1", prefill_tokens=1000, decode_blocks=10)
    assert view.load("w1").prefill_tokens_queued == 1300
    view.prefill_done("r1")
    assert view.load("w1").prefill_tokens_queued == 300  # the old report never held r1's tokens


def test_decode_blocks_count_until_a_report_after_the_first_token(view: LoadView, clock: Clock) -> None:
    view.book("r1", "w1", 2000, 130)
    clock.now += 0.1
    view.prefill_done("r1")
    view.update(report(ts=clock.now - 0.05, kv_used_blocks=64))  # generated before the first token
    assert view.load("w1").active_blocks == 64 + 130
    clock.now += 0.1
    view.update(report(ts=clock.now, kv_used_blocks=129))
    assert view.load("w1").active_blocks == 129
    assert view.bookings("w1") == 1  # still in flight, just covered


def test_free_drops_every_booking_of_the_request(view: LoadView) -> None:
    view.book("r1", "prefill1", 3000, 0)
    view.book("r1", "decode1", 0, 200)
    view.book("r2", "decode1", 10, 20)
    view.free("r1")
    assert view.bookings("prefill1") == 0
    assert view.bookings("decode1") == 1
    assert view.load("decode1").active_blocks == 20
    view.free("r1")  # twice is harmless
    view.free("never-booked")


def test_booking_again_on_the_same_worker_replaces_the_claim(view: LoadView) -> None:
    view.book("r1", "w1", 100, 10)
    view.book("r1", "w1", 300, 30)
    assert view.bookings("w1") == 1
    assert view.load("w1").prefill_tokens_queued == 300


def test_peer_bookings_are_kept_apart_from_ours(view: LoadView) -> None:
    view.book("r1", "w1", 100, 10)
    view.book("r1", "w1", 50, 5, router="peer")
    assert view.load("w1").prefill_tokens_queued == 150
    view.free("r1")
    assert view.load("w1").prefill_tokens_queued == 50
    view.prefill_done("r1", router="peer")
    assert view.load("w1").prefill_tokens_queued == 0


def test_forget_router_drops_only_that_routers_bookings(view: LoadView) -> None:
    view.book("a", "w1", 1, 1, router="p1")
    view.book("b", "w2", 1, 1, router="p1")
    view.book("c", "w1", 1, 1, router="p2")
    view.book("d", "w1", 1, 1)
    assert view.forget_router("p1") == 2
    assert (view.bookings("w1"), view.bookings("w2")) == (2, 0)


def test_expire_drops_old_peer_bookings_and_keeps_ours(view: LoadView, clock: Clock) -> None:
    view.book("old", "w1", 1, 1, router="p1")
    view.book("mine", "w1", 1, 1)
    clock.now += 100
    view.book("new", "w1", 1, 1, router="p1")
    assert view.expire(50) == {"p1": Expired(1, 1)}
    assert view.bookings("w1") == 2
    assert view.expire(50, peers_only=False) == {None: Expired(1, 1)}
    assert view.bookings("w1") == 1


def test_confirm_all_says_what_differs_and_keeps_what_it_names_from_expiring(view: LoadView, clock: Clock) -> None:
    """A peer's snapshot part: its bookings held as stated come back as nothing, those not held
    with None, those held in another state with the booking as held; each held one named is live
    again for `expire`, and another router's bookings are no concern of it."""
    view.book("same", "w1", 8, 2, router="p1")
    view.book("done", "w1", 8, 2, router="p1")
    view.prefill_done("done", router="p1")
    view.book("quiet", "w1", 8, 2, router="p1")
    view.book("same", "w1", 8, 2, router="p2")
    clock.now += 100
    stated = [
        SyncBooking(request_id="same", worker="w1", tokens=8, blocks=2),
        SyncBooking(request_id="done", worker="w1", tokens=8, blocks=2),  # held with its prefill done
        SyncBooking(request_id="same", worker="w2", tokens=8, blocks=2),  # on a worker it is not held on
        SyncBooking(request_id="new", worker="w1", tokens=8, blocks=2),
    ]
    held_done = SyncBooking(request_id="done", worker="w1", tokens=8, blocks=2, prefill_done=True)
    assert view.confirm_all("p1", stated) == [(stated[1], held_done), (stated[2], None), (stated[3], None)]
    assert view.expire(50) == {"p1": Expired(1, 1), "p2": Expired(1, 1)}  # "quiet", and p2's "same"
    assert view.keys("p1") == {("same", "w1"), ("done", "w1")}


def test_expire_says_which_bookings_still_counted_in_their_workers_load(view: LoadView, clock: Clock) -> None:
    """A request past its first token that a report covers counts nothing (a long one's usual case);
    a decode booking with no prefill_done counts its blocks until it goes (a lost free's case)."""
    view.book("long#1", "w1", 512, 4, router="p1")
    view.prefill_done("long#1", router="p1")
    view.book("lost#1", "w1", 512, 2, router="p1")
    view.book("lost#2", "w2", 0, 3, router="p2")
    clock.now += 1
    view.update(report("w1", ts=clock.now))  # after the first token: covers long#1's blocks, lost#1's tokens
    view.update(report("w2", ts=clock.now))
    assert view.load("w1").active_blocks == 2
    clock.now += 600
    assert view.expire(600) == {"p1": Expired(2, 1), "p2": Expired(1, 1)}
    assert view.load("w1").active_blocks == view.load("w2").active_blocks == 0


def test_expire_judges_coverage_by_the_report_held_even_unread(view: LoadView, clock: Clock) -> None:
    view.book("long#1", "w1", 512, 4, router="p1")
    view.prefill_done("long#1", router="p1")
    clock.now += 1
    view.update(report("w1", ts=clock.now))  # no load() since: the view has not applied it yet
    clock.now += 600
    assert view.expire(600) == {"p1": Expired(1, 0)}


def test_expire_drops_what_a_peer_booked_on_a_worker_that_had_left(view: LoadView, clock: Clock) -> None:
    view.update(report("w1", ts=clock.now))
    view.remove_worker("w9")  # its key went here before the peer's booking on it arrived
    for worker in ("w1", "w9"):
        view.book(f"r-{worker}", worker, 512, 4, router="peer")
        view.prefill_done(f"r-{worker}", router="peer")
        view.free(f"r-{worker}", router="peer")
    clock.now += 599
    view.expire(600)
    assert view.workers() == ["w1", "w9"]  # a first report of w9 could still need its releases
    clock.now += 2
    view.expire(600)
    assert view.workers() == ["w1"]
    assert view.load("w9").prefill_inflow == 0.0  # its rate went too, not just decayed


def test_remove_worker_drops_its_report_and_bookings(view: LoadView) -> None:
    view.update(report(running=4))
    view.book("r1", "w1", 10, 1)
    view.book("r1", "w2", 10, 1)
    view.remove_worker("w1")
    assert view.load("w1").report_age_s is None
    assert view.bookings("w1") == 0
    assert view.workers() == ["w2"]
    view.free("r1")
    assert view.workers() == []


def test_a_report_stamped_far_in_the_future_does_not_hide_later_ones() -> None:
    clock = Clock(1000.0)
    view = LoadView(clock=clock)
    view.update(LoadReport(worker="w1", ts=1000.0 + 1e7, running=9))  # a forged or broken clock
    clock.now += 2.0
    view.update(LoadReport(worker="w1", ts=clock.now, running=1))
    assert view.load("w1").running == 1
    # Clamped to now + MAX_CLOCK_SKEW_S, not kept: a report stamped 10^7 s ahead would read every
    # booking made before that stamp as counted in it already, and drop it from the load.
    clock.now += 0.5
    view.book("r1", "w1", 1000, 5)
    assert view.load("w1").prefill_tokens_queued == 1000


def test_prefill_inflow_is_an_exponentially_weighted_rate_of_booked_prompt_tokens(view: LoadView, clock: Clock) -> None:
    view.book("r1", "w1", 1000, 5)
    assert view.load("w1").prefill_inflow == pytest.approx(1000 / INFLOW_TAU_S)
    view.book("r2", "w1", 500, 0, router="peer")  # a peer's bookings count too
    view.free("r1")  # and freeing takes nothing back: it is a rate of arrivals
    assert view.load("w1").prefill_inflow == pytest.approx(1500 / INFLOW_TAU_S)
    clock.now += INFLOW_TAU_S
    assert view.load("w1").prefill_inflow == pytest.approx(1500 / INFLOW_TAU_S / math.e)
    view.book("r3", "w1", 0, 3)  # no prompt tokens: no inflow
    assert view.load("w1").prefill_inflow == pytest.approx(1500 / INFLOW_TAU_S / math.e)
    assert view.load("w2").prefill_inflow == 0.0
    view.remove_worker("w1")
    assert view.load("w1").prefill_inflow == 0.0


def test_negative_booking_is_refused_with_the_values(view: LoadView) -> None:
    with pytest.raises(ValueError, match="-5"):
        view.book("r1", "w1", -5, 0)


# --- property test: the incremental sums against a scan of every booking --------------------------


class NaiveView:
    """The reference: every booking in a list, the coverage rule evaluated by a scan on each read."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.report_ts: dict[str, float] = {}  # the newest stamp taken: coverage
        self.raw_ts: dict[str, float] = {}  # the stamp of the report held
        self.live: list[dict[str, Any]] = []
        self.arrivals: list[tuple[str, float, int]] = []  # (worker, at, prompt tokens) of every booking

    def book(self, key: tuple[str | None, str], worker: str, tokens: int, blocks: int) -> None:
        self.arrivals.append((worker, self.clock.now, tokens))
        self.live = [b for b in self.live if (b["key"], b["worker"]) != (key, worker)]
        self.live.append({"key": key, "worker": worker, "tokens": tokens, "blocks": blocks,
                          "at": self.clock.now, "confirmed": self.clock.now, "done": None})  # fmt: skip

    def prefill_done(self, key: tuple[str | None, str], worker: str | None) -> None:
        for b in self.live:
            if b["key"] == key and b["done"] is None and worker in (None, b["worker"]):
                b["done"] = self.clock.now

    def report(self, worker: str, ts: float) -> None:
        """A stamp within MAX_CLOCK_SKEW_S of now: taken unless it is before the one held by at most
        MAX_REORDER_S; coverage is the newest stamp taken."""
        held = self.raw_ts.get(worker)
        if held is None or not 0 < held - ts <= MAX_REORDER_S:
            self.raw_ts[worker] = ts
            self.report_ts[worker] = max(ts, self.report_ts.get(worker, ts))

    def drop(
        self, keys: Collection[tuple[str | None, str]] = (), worker: str | None = None, router: str | None = None
    ) -> None:
        self.live = [
            b
            for b in self.live
            if b["key"] not in keys and b["worker"] != worker and (router is None or b["key"][0] != router)
        ]

    def held(self, router: str | None) -> list[tuple[str, str, int, int, bool]]:
        return sorted(
            (b["key"][1], b["worker"], b["tokens"], b["blocks"], b["done"] is not None)
            for b in self.live
            if b["key"][0] == router
        )

    def inflow(self, worker: str) -> float:
        now = self.clock.now
        return sum(t / INFLOW_TAU_S * math.exp(-(now - at) / INFLOW_TAU_S) for w, at, t in self.arrivals if w == worker)

    def sums(self, worker: str) -> tuple[int, int, int]:
        ts = self.report_ts.get(worker, float("-inf"))
        mine = [b for b in self.live if b["worker"] == worker]
        prefill = sum(b["tokens"] for b in mine if b["done"] is None and b["at"] > ts)
        blocks = sum(b["blocks"] for b in mine if not (b["done"] is not None and ts >= b["done"]))
        return prefill, blocks, sum(b["at"] > ts for b in mine)


LV_WORKERS = ["w1", "w2", "w3"]
LV_ROUTERS = [None, "p1", "p2"]
LV_REQUESTS = ["r1", "r2", "r3", "r4"]
LV_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("book"), st.sampled_from(LV_ROUTERS), st.sampled_from(LV_REQUESTS),
                  st.sampled_from(LV_WORKERS), st.integers(0, 500), st.integers(0, 50)),
        st.tuples(st.just("done"), st.sampled_from(LV_ROUTERS), st.sampled_from(LV_REQUESTS),
                  st.sampled_from([None, *LV_WORKERS])),
        st.tuples(st.just("free"), st.sampled_from(LV_ROUTERS), st.sampled_from(LV_REQUESTS)),
        st.tuples(st.just("report"), st.sampled_from(LV_WORKERS), st.integers(-3, 3)),
        st.tuples(st.just("tick"), st.integers(0, 2)),
        st.tuples(st.just("remove"), st.sampled_from(LV_WORKERS)),
        st.tuples(st.just("forget"), st.just("p1")),
        st.tuples(st.just("drop"), st.sampled_from(["p1", "p2"]), st.sampled_from(LV_REQUESTS),
                  st.sampled_from(LV_WORKERS)),
        st.tuples(st.just("confirm"), st.sampled_from(["p1", "p2"]),
                  st.lists(st.tuples(st.sampled_from(LV_REQUESTS), st.sampled_from(LV_WORKERS),
                                     st.integers(0, 500), st.integers(0, 50), st.booleans()), max_size=4)),
        st.tuples(st.just("expire"), st.integers(0, 6), st.booleans()),
    ),
    max_size=80,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(ops=LV_OPS)
# a step back by 3 s, then a report 1 s ahead of the moved stamps, not 1 s past now: the offset goes
@example(ops=[("tick", 2), ("report", "w1", 0), ("report", "w1", -3), ("tick", 2),
              ("book", None, "r1", "w1", 5, 1), ("tick", 1), ("report", "w1", -2)])  # fmt: skip
def test_incremental_sums_agree_with_a_full_scan(ops: list[tuple[Any, ...]]) -> None:
    clock = Clock(0.0)
    view, ref = LoadView(clock=clock), NaiveView(clock)
    for op, *args in ops:
        if op == "book":
            router, request, worker, tokens, blocks = args
            view.book(request, worker, tokens, blocks, router=router)
            ref.book((router, request), worker, tokens, blocks)
        elif op == "done":
            view.prefill_done(args[1], router=args[0], worker=args[2])
            ref.prefill_done((args[0], args[1]), args[2])
        elif op == "free":
            view.free(args[1], router=args[0])
            ref.drop(keys={(args[0], args[1])})
        elif op == "report":  # late (dropped) or from a clock stepped back (taken, its stamps moved on)
            worker, ts = args[0], min(clock.now + args[1], clock.now + MAX_CLOCK_SKEW_S)  # future stamps clamped
            view.update(LoadReport(worker=worker, ts=ts))
            ref.report(worker, ts)
            live = view.liveness(worker)
            assert live is not None and live.age_s == 0.0
        elif op == "tick":
            clock.now += args[0]
        elif op == "remove":
            view.remove_worker(args[0])
            ref.report_ts.pop(args[0], None)
            ref.raw_ts.pop(args[0], None)
            ref.drop(worker=args[0])
            ref.arrivals = [a for a in ref.arrivals if a[0] != args[0]]
        elif op == "forget":
            view.forget_router(args[0])
            ref.drop(router=args[0])
        elif op == "drop":
            router, request, worker = args
            dropped = [b for b in ref.live if (b["key"], b["worker"]) == ((router, request), worker)]
            assert view.drop(request, worker, router=router) == bool(dropped)
            ref.live = [b for b in ref.live if b not in dropped]
        elif op == "confirm":  # a snapshot's part: what differs comes back, and what is held is live again
            router, stated = args
            got = view.confirm_all(router, [SyncBooking(request_id=r, worker=w, tokens=t, blocks=k, prefill_done=d)
                                            for r, w, t, k, d in stated])  # fmt: skip
            want = []
            for r, w, t, k, d in stated:
                held = [b for b in ref.live if (b["key"], b["worker"]) == ((router, r), w)]
                for b in held:
                    b["confirmed"] = clock.now
                now = [(r, w, b["tokens"], b["blocks"], b["done"] is not None) for b in held]
                if now != [(r, w, t, k, d)]:
                    want.append(((r, w, t, k, d), now[0] if now else None))
            assert [(msgspec.structs.astuple(s), h and msgspec.structs.astuple(h)) for s, h in got] == want
        else:  # expire: a request goes when all its bookings are older than the cutoff
            max_age, peers_only = args
            view.expire(max_age, peers_only=peers_only)
            cutoff = clock.now - max_age
            stale = {
                b["key"] for b in ref.live
                if (b["key"][0] is not None or not peers_only)
                and all(o["confirmed"] < cutoff for o in ref.live if o["key"] == b["key"])
            }  # fmt: skip
            ref.drop(keys=stale)
        for worker in LV_WORKERS:
            load = view.load(worker)
            sums = (load.prefill_tokens_queued, load.active_blocks, load.booked_requests)
            assert sums == ref.sums(worker), (op, worker)
            assert view.bookings(worker) == sum(b["worker"] == worker for b in ref.live)
            assert load.prefill_inflow == pytest.approx(ref.inflow(worker), rel=1e-9, abs=1e-12), (op, worker)
        for router in LV_ROUTERS:  # what one router holds, read from its own index
            assert sorted(map(msgspec.structs.astuple, view.held(router))) == ref.held(router), (op, router)
            if router is not None:
                assert view.keys(router) == {(r, w) for r, w, *_ in ref.held(router)}, (op, router)


ORACLE_STEPS = st.lists(
    st.tuples(
        st.sampled_from([0.05, 0.2, 0.5, 1.0]),  # to the next report's making
        st.one_of(st.none(), st.sampled_from([0.0, -0.4, -1.2, -2.5, -5.0, -20.0])),  # its clock set to
        st.sampled_from([0.0, 0.01, 0.3, 0.6, 1.5]),  # its delivery delay
        st.lists(st.floats(0.0, 1.0), max_size=2),  # bookings, as shares of the time to its arrival
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(steps=ORACLE_STEPS)
@example(steps=[(1.0, None, 0.3, []), (1.0, -5.0, 0.3, []), (1.0, None, 0.3, []), (1.0, -3.8, 0.3, []),
                (1.0, None, 0.3, []), (1.0, None, 0.3, [0.5])])  # fmt: skip
@example(steps=[(1.0, None, 1.5, []), (1.0, -2.5, 1.5, []), (1.0, None, 1.5, []), (1.0, 0.0, 1.5, []),
                (1.0, None, 1.5, []), (1.0, None, 1.5, [0.9])])  # fmt: skip
def test_no_booking_is_covered_by_reports_all_made_before_it(steps: list[tuple[Any, ...]]) -> None:
    """An oracle independent of the rule: reports made at known times by a clock never ahead (stepped
    back and forward), delivered late in their order. A booking stops counting only once a report
    made at or after it has arrived: no stamp, moved or not, may pass its report's making (review of
    fa683ec: an offset kept from a step back did, after a forward step or with a slow delivery)."""
    clock = Clock(1000.0)
    view = LoadView(clock=clock)
    made, err, last_arrival = 1000.0, 0.0, 1000.0
    events: list[tuple[float, float | None, float]] = []  # (arrives, made at (None: a booking), stamp)
    for gap, new_err, delay, shares in steps:
        made += gap
        err = err if new_err is None else new_err
        arrival = max(last_arrival, made + delay)  # one publisher: NATS keeps its order
        events += [(last_arrival + share * (arrival - last_arrival), None, 0.0) for share in shares]
        events.append((arrival, made, made + err))
        last_arrival = arrival
    booked: list[float] = []
    newest_made = float("-inf")
    for at, made_at, stamp in sorted(events, key=lambda e: (e[0], e[1] is None)):
        clock.now = at
        if made_at is None:
            view.book(f"r{len(booked)}", "w1", 1, 0)
            booked.append(at)
        else:
            view.update(report(ts=stamp))
            newest_made = max(newest_made, made_at)
        # made after every report that has arrived: no report counts it yet
        assert view.load("w1").booked_requests >= sum(b > newest_made for b in booked)


def test_many_short_requests_on_a_silent_worker_keep_the_sums_right(view: LoadView, clock: Clock) -> None:
    # No report ever covers them, so only `free` retires them (and the heaps get compacted).
    view.book("long", "w1", 7, 3)
    for i in range(1000):
        view.book(f"r{i}", "w1", 100, 10)
        if i % 2:
            view.prefill_done(f"r{i}")
        view.free(f"r{i}")
        clock.now += 0.001
    view.book("last", "w1", 5, 1)
    assert view.bookings("w1") == 2
    assert (view.load("w1").prefill_tokens_queued, view.load("w1").active_blocks) == (12, 4)
    view.update(report(ts=clock.now))
    assert (view.load("w1").prefill_tokens_queued, view.load("w1").active_blocks) == (0, 4)


def test_reports_steadily_late_still_let_a_finished_prompt_go(view: LoadView, clock: Clock) -> None:
    """The worker's clock right, its reports 1.5 s on the way (a busy router, a slow NATS): the one
    made before A's first token still counts A, and A's release takes it off. 3bc08a4 read a report
    over MAX_REORDER_S in transit as a clock behind, recorded no release, and counted every finished
    prompt as queued on every worker (reverted)."""
    late = 1.5
    clock.now = 1000.0 + late
    view.update(report(ts=1000.0))
    clock.now = 1001.5
    view.book("A", "w1", 800, 1)
    clock.now = 1001.6
    view.book("C", "w1", 1000, 1)
    clock.now = 1002.0 + late
    view.update(report(ts=1002.0, prefill_tokens_queued=1800))  # made while both were queued
    clock.now = 1003.6
    view.prefill_done("A")
    clock.now = 1003.0 + late
    view.update(report(ts=1003.0, prefill_tokens_queued=1800))  # made before A's first token
    assert view.load("w1").prefill_tokens_queued == 1000
