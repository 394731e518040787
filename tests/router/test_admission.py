"""Admission: by priority, then FIFO, at the router while no worker has room, bounded, woken only as
capacity frees."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import KEPT_RATES, Admission, Overloaded, Throughput
from router.disagg import RoutePlan
from router.request_context import RequestContext, RequestShape
from tests.router.builders import cand, ctx
from tests.router.polling import until


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """Plays the planner: `room` requests may be taken; each take books one of them."""

    def __init__(self, room: int = 0) -> None:
        self.room = room
        self.taken: list[str] = []
        self.abandoned: list[str] = []
        self.checked = 0

    def take(self, c: RequestContext) -> RoutePlan | None:
        self.checked += 1
        if self.room <= 0:
            return None
        self.room -= 1
        self.taken.append(c.request_id)
        d = cand()
        return RoutePlan(c, d, None, "agg", "aggregated", "", key=f"{c.request_id}#1")  # type: ignore[arg-type]


def admission(
    fleet: Fleet,
    *,
    max_queue: int | None = None,
    wait_s: float = 5.0,
    rate: float = 0.0,
    clock: Clock | None = None,
    reoffer_s: float = 1.0,
) -> Admission:
    clock = clock or Clock()
    adm = Admission(
        max_wait_s=lambda: wait_s,
        max_queue=lambda: max_queue,
        on_abandon=lambda plan: fleet.abandoned.append(plan.key),
        min_queue=2,
        clock=clock,
        cpu_clock=clock,  # planning takes what the test's clock says it does
        reoffer_s=reoffer_s,
    )
    adm.completed("m", round(rate * 10))  # over the 10 s window: `rate` per second for model m (ctx's)
    return adm


def req(i: int, priority: int = 0) -> RequestContext:
    c = ctx(16, request_id=f"r{i}")
    c.shape = RequestShape(priority=priority)
    return c


async def test_taken_at_once_when_a_worker_has_room() -> None:
    fleet = Fleet(room=1)
    plan = await admission(fleet).admit(req(0), fleet.take)
    assert plan.key == "r0#1" and fleet.taken == ["r0"]


async def test_waiters_are_granted_in_arrival_order_as_capacity_frees() -> None:
    fleet = Fleet(room=0)
    adm = admission(fleet, max_queue=10)
    tasks = [asyncio.create_task(adm.admit(req(i), fleet.take)) for i in range(3)]
    await asyncio.sleep(0)
    assert adm.depth == 3
    fleet.room = 2
    adm.notify()
    await asyncio.sleep(0)
    assert fleet.taken == ["r0", "r1"] and adm.depth == 1
    # only the head is offered when there is no room: waiters behind it are not re-planned
    checked = fleet.checked
    adm.notify()
    assert fleet.checked == checked + 1
    fleet.room = 1
    adm.notify()
    plans = await asyncio.gather(*tasks)
    assert [p.key for p in plans] == ["r0#1", "r1#1", "r2#1"]


async def test_waiters_are_granted_by_priority_then_arrival() -> None:
    """vLLM's `priority`: lower first, ties in arrival order, as a --scheduling-policy priority
    engine would serve them; a line of one priority stays FIFO."""
    fleet = Fleet(room=0)
    adm = admission(fleet, max_queue=10)
    order = [(0, 0), (1, 5), (2, -3), (3, 0), (4, -3), (5, 7)]
    tasks = [asyncio.create_task(adm.admit(req(i, p), fleet.take)) for i, p in order]
    await asyncio.sleep(0)
    fleet.room = len(order)
    adm.notify()
    await asyncio.gather(*tasks)
    assert fleet.taken == ["r2", "r4", "r0", "r3", "r1", "r5"]


async def test_a_full_line_turns_away_its_least_urgent_waiter_for_a_more_urgent_request() -> None:
    fleet = Fleet(room=0)
    adm = admission(fleet, max_queue=2)
    waiting = [asyncio.create_task(adm.admit(req(i, 5), fleet.take)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):  # as urgent as the last: turned away itself
        await adm.admit(req(8, 5), fleet.take)
    urgent = asyncio.create_task(adm.admit(req(9, -1), fleet.take))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await waiting[1]  # the last in line, the newest of the least urgent, leaves with the 429
    assert adm.refused == 2 and adm.depth == 2
    fleet.room = 2
    adm.notify()
    assert [(await urgent).key, (await waiting[0]).key] == ["r9#1", "r0#1"]


async def test_after_an_offer_finds_no_room_the_next_waits_ten_times_its_planning_time() -> None:
    clock, fleet = Clock(), Fleet(room=0)

    def take(c: RequestContext) -> RoutePlan | None:
        clock.now += 0.01  # each plan takes 10 ms
        return fleet.take(c)

    adm = admission(fleet, clock=clock, reoffer_s=60.0)  # no periodic offer to grant it instead
    waiter = asyncio.create_task(adm.admit(req(0), take))
    await asyncio.sleep(0)
    adm.notify()  # no room: 10 ms of planning, so no offer for the next 100 ms
    checked = fleet.checked
    fleet.room = 1
    for _ in range(100):  # a burst of load reports
        adm.notify()
    assert fleet.checked == checked and not waiter.done()
    plan = await asyncio.wait_for(waiter, 2.0)  # the one offer left for the end of the quiet time
    assert plan.key == "r0#1" and fleet.checked == checked + 1


async def test_a_new_request_does_not_overtake_waiters() -> None:
    fleet = Fleet(room=0)
    adm = admission(fleet, max_queue=10)
    first = asyncio.create_task(adm.admit(req(0), fleet.take))
    await asyncio.sleep(0)
    fleet.room = 1  # room appears, but nobody told admission: the newcomer must still queue
    second = asyncio.create_task(adm.admit(req(1), fleet.take))
    await asyncio.sleep(0)
    assert fleet.taken == [] and adm.depth == 2
    adm.notify()
    assert (await first).key == "r0#1"
    fleet.room = 1
    adm.notify()
    assert (await second).key == "r1#1"


async def test_a_full_queue_answers_429_with_retry_after_from_the_drain_rate() -> None:
    fleet = Fleet(room=0)
    adm = admission(fleet, rate=2.0, wait_s=1.5)  # derived bound: 2/s x 1.5 s = 3 waiters
    assert adm.bound("m") == 3
    tasks = [asyncio.create_task(adm.admit(req(i), fleet.take)) for i in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as full:
        await adm.admit(req(9), fleet.take)
    assert full.value.retry_after_s == 2  # (3 waiting + 1) / 2 per second
    assert adm.refused == 1
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.depth == 0


async def test_retry_after_a_quiet_spell_is_no_longer_than_a_waiter_may_wait() -> None:
    """The completion rate decays while the model is idle, so the first burst after a quiet spell
    read a rate near zero: Retry-After 60, where its line drained in about 2 s (client-fault
    audit). Every request in the line has been served or refused within the wait it is allowed,
    so that is the longest the line ahead can need."""
    clock = Clock()
    fleet = Fleet(room=0)
    adm = admission(fleet, rate=20.0, wait_s=1.0, clock=clock)
    clock.now = 120.0  # two idle minutes: the rate reads 20 x e^-12
    tasks = [asyncio.create_task(adm.admit(req(i), fleet.take)) for i in range(adm.bound("m"))]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as full:
        await adm.admit(req(9), fleet.take)
    assert full.value.retry_after_s == 1  # before: 60
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_configured_bound_wins_and_zero_refuses_every_waiter() -> None:
    fleet = Fleet(room=0)
    with pytest.raises(Overloaded):
        await admission(fleet, max_queue=0, rate=100.0).admit(req(0), fleet.take)


async def test_a_waiter_gives_up_after_the_wait_with_429() -> None:
    fleet = Fleet(room=0)
    adm = admission(fleet, wait_s=0.02)
    with pytest.raises(Overloaded, match="no worker had room"):
        await adm.admit(req(0), fleet.take)
    assert adm.timed_out == 1 and adm.depth == 0


async def test_the_429_names_the_wait_as_configured() -> None:
    """A 0.025 s wait read `no worker had room within 0.0s` (rendered to one decimal)."""
    fleet = Fleet(room=0)
    with pytest.raises(Overloaded, match=r"no worker had room within 0\.025s"):
        await admission(fleet, wait_s=0.025).admit(req(0), fleet.take)


async def test_a_plan_granted_to_a_waiter_that_left_is_released() -> None:
    fleet = Fleet(room=0)
    adm = admission(fleet)
    waiter = asyncio.create_task(adm.admit(req(0), fleet.take))
    await asyncio.sleep(0)
    fleet.room = 1
    adm.notify()  # granted ...
    waiter.cancel()  # ... as the client leaves, before the waiter ran again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert fleet.abandoned == ["r0#1"]


async def test_a_planning_error_reaches_the_waiter() -> None:
    adm = admission(Fleet())
    calls = 0

    def take(c: RequestContext) -> RoutePlan | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            return None
        raise LookupError("the model's last worker left")

    waiter = asyncio.create_task(adm.admit(req(0), take))
    await asyncio.sleep(0)
    adm.notify()
    with pytest.raises(LookupError):
        await waiter


async def test_a_waiter_is_offered_again_each_reoffer_s_though_nothing_notifies() -> None:
    """A worker that turns silent (no load report for 3 periods) does so with no notification: the
    head was offered again only when capacity freed, so a waiter whose model's last worker went
    silent waited out its whole wait for a 429 (admission audit, round 6, #1)."""
    loop = asyncio.get_running_loop()
    fleet, gone, plans = Fleet(room=0), False, 0

    def take(c: RequestContext) -> RoutePlan | None:
        nonlocal plans
        plans += 1
        if gone:
            raise LookupError("no decode or agg worker of model m can take the request now: w1: silent")
        return fleet.take(c)

    adm = Admission(
        max_wait_s=lambda: 60.0, max_queue=lambda: None, on_abandon=lambda _: None, clock=Clock(), reoffer_s=0.02
    )
    started = loop.time()
    waiter = asyncio.create_task(adm.admit(req(0), take))
    await until(lambda: plans >= 4, what="the head offered again, never notified")
    # one plan a period at most: the admitting one, then one per period
    assert plans <= 2 + (loop.time() - started) / 0.02
    gone = True
    with pytest.raises(LookupError, match="silent"):
        await waiter
    assert adm.depth == 0
    plans_then = plans
    await asyncio.sleep(0.1)
    assert plans == plans_then  # the line closed, and its periodic offer with it


def test_throughput_decays_without_completions() -> None:
    clock = Clock()
    t = Throughput(clock, window_s=10.0)
    t.completed(50)
    assert t.rate() == pytest.approx(5.0)
    clock.now = 10.0
    assert t.rate() == pytest.approx(5.0 / 2.718281828, rel=1e-6)


def test_rates_of_names_long_idle_are_not_kept_for_good() -> None:
    clock = Clock()
    adm = admission(Fleet(), rate=5.0, clock=clock)
    for i in range(1000):  # adapters loaded, used once and unloaded
        adm.completed(f"adapter-{i}")
        adm.completed("m")  # in steady use
        clock.now += 60.0
    assert len(adm._rates) <= 2 * KEPT_RATES
    assert adm.throughput("m").rate() > 0
