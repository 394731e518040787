"""Admission keeps one line per model: a model whose workers are full holds none of another's
requests, neither at the door, nor at a notify, nor against its bound."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission, Overloaded
from router.disagg import RoutePlan
from router.request_context import RequestContext
from tests.router.builders import ctx
from tests.router.polling import until
from tests.router.test_admission import Clock, Fleet, admission
from tests.router.test_planner import Fleet as PlannedFleet
from tests.router.test_planner import winfo


def req(model: str, i: int) -> RequestContext:
    c = ctx(16, request_id=f"{model}{i}")
    c.model = model
    return c


async def _cancel(tasks: list[asyncio.Task[RoutePlan]], adm: Admission) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.depth == 0


async def test_a_request_whose_model_has_room_is_taken_at_once_beside_another_models_waiter() -> None:
    full, idle = Fleet(room=0), Fleet(room=5)
    adm = admission(full, max_queue=10)
    a = asyncio.create_task(adm.admit(req("a", 0), full.take))
    await asyncio.sleep(0)
    assert adm.depth == 1
    plan = await asyncio.wait_for(adm.admit(req("b", 0), idle.take), 0.1)
    assert plan.key == "b0#1" and idle.taken == ["b0"] and adm.depth == 1
    await _cancel([a], adm)


async def test_notify_offers_every_models_head_and_a_full_model_stops_only_its_own_line() -> None:
    clock = Clock()
    full, freed = Fleet(room=0), Fleet(room=0)
    adm = admission(full, max_queue=10, clock=clock)
    a = [asyncio.create_task(adm.admit(req("a", i), full.take)) for i in range(2)]
    b = [asyncio.create_task(adm.admit(req("b", i), freed.take)) for i in range(3)]
    await asyncio.sleep(0)
    assert adm.depth == 5
    freed.room = 2
    adm.notify()  # a's head finds no room; b's line is served all the same, in its own order
    assert freed.taken == ["b0", "b1"] and full.checked == 2 and adm.depth == 3
    assert [p.key for p in await asyncio.gather(*b[:2])] == ["b0#1", "b1#1"]
    # a's quiet time after its failed offer (zero planning time here, so none) is its own: b's
    # last waiter is offered at the next notify whatever a's line does
    freed.room = 1
    adm.notify()
    assert (await b[2]).key == "b2#1"
    full.room = 2
    adm.notify()
    assert [p.key for p in await asyncio.gather(*a)] == ["a0#1", "a1#1"] and adm.depth == 0


async def test_a_failed_offer_delays_only_its_own_models_next_offer() -> None:
    clock = Clock()
    full, freed = Fleet(room=0), Fleet(room=0)

    def slow_take(c: RequestContext) -> RoutePlan | None:
        clock.now += 0.01  # 10 ms of planning: a's next offer no sooner than 100 ms later
        return full.take(c)

    adm = admission(full, clock=clock)
    a = asyncio.create_task(adm.admit(req("a", 0), slow_take))
    b = asyncio.create_task(adm.admit(req("b", 0), freed.take))
    await asyncio.sleep(0)
    adm.notify()  # both fail; a's line is quiet for 100 ms, b's (no planning time) not at all
    checked = full.checked
    freed.room = 1
    adm.notify()
    assert (await asyncio.wait_for(b, 0.1)).key == "b0#1" and full.checked == checked
    await _cancel([a], adm)


async def test_each_model_is_bounded_by_its_own_line_and_its_own_drain_rate() -> None:
    full, idle = Fleet(room=0), Fleet(room=0)
    adm = admission(full, wait_s=1.5)  # no completions: the least bound, 2 per model
    adm.completed("b", 40)  # b drains 4 per second: 6 of its requests may wait
    assert (adm.bound("a"), adm.bound("b")) == (2, 6)
    a = [asyncio.create_task(adm.admit(req("a", i), full.take)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="every worker of a is at capacity and 2 requests for it") as refused:
        await adm.admit(req("a", 9), full.take)
    assert refused.value.retry_after_s == 2  # a's own figure: no completions, so the wait allowed
    # a's full line refuses none of b's requests: b queues up to its own bound
    b = [asyncio.create_task(adm.admit(req("b", i), idle.take)) for i in range(6)]
    await asyncio.sleep(0)
    assert adm.depth == 8 and adm.refused == 1
    with pytest.raises(Overloaded) as refused:
        await adm.admit(req("b", 9), idle.take)
    assert refused.value.retry_after_s == 2  # (6 waiting + 1) / 4 per second
    await _cancel([*a, *b], adm)


async def test_a_model_whose_line_emptied_is_taken_at_once_again() -> None:
    fleet = Fleet(room=0)
    adm = admission(fleet, wait_s=0.02)
    with pytest.raises(Overloaded, match="no worker had room"):
        await adm.admit(req("a", 0), fleet.take)
    fleet.room = 1
    assert (await asyncio.wait_for(adm.admit(req("a", 1), fleet.take), 0.1)).key == "a1#1"
    assert adm.depth == 0


async def test_names_that_share_workers_take_freed_capacity_in_arrival_order() -> None:
    """A model and its adapter (or an alias) have their own lines on the same workers: the older
    line took every slot that freed while it had waiters (review of the per-model lines)."""
    fleet = Fleet(room=0)
    adm = admission(fleet, max_queue=10)
    tasks = []
    for i in range(3):  # arrivals: base0, lora0, base1, lora1, base2, lora2
        for model in ("base", "lora"):
            tasks.append(asyncio.create_task(adm.admit(req(model, i), fleet.take)))
            await asyncio.sleep(0)
    for _ in range(6):  # one request ends at a time: one slot frees
        fleet.room += 1
        adm.notify()
    await asyncio.gather(*tasks)
    assert fleet.taken == ["base0", "lora0", "base1", "lora1", "base2", "lora2"]


async def test_an_adapter_whose_workers_are_full_holds_none_of_its_base_models_requests() -> None:
    """The adapter's line waits for d1; its base model has room on d2 and is planned at once. Lines
    grouped by base model (2026-12-08, reverted) queued it behind the adapter's waiter, to a 429."""
    f = PlannedFleet(winfo("d1", adapters=["sql"]), winfo("d2"))
    f.report("d1", prefill_tokens_queued=200_000)
    adm = Admission(max_wait_s=lambda: 5.0, max_queue=lambda: None, on_abandon=lambda plan: None)
    lora = asyncio.create_task(adm.admit(f.planner.context("a", "sql", list(range(64))), f.planner.take))
    await asyncio.sleep(0)
    assert adm.depth == 1
    plan = await asyncio.wait_for(adm.admit(f.ctx(list(range(64, 128)), "b"), f.planner.take), 0.1)
    assert plan.decode.worker == "d2" and adm.depth == 1
    await _cancel([lora], adm)


@pytest.mark.parametrize("names", [1, 16])
async def test_waiters_of_many_models_are_replanned_within_a_tenth_of_a_core(names: int) -> None:
    """The quiet time after an offer that found no room was per line: 16 waiting names re-planned
    16 times as much, a whole core at 1 ms plans (review of the per-model lines)."""
    clock = Clock()  # wall and CPU clock at once: a plan takes the time it adds
    planned = 0.0

    def take(_: RequestContext) -> RoutePlan | None:
        nonlocal planned
        clock.now += 0.001  # a plan of 1 ms that finds no room
        planned += 0.001
        return None

    adm = Admission(
        max_wait_s=lambda: 60.0, max_queue=lambda: 100, on_abandon=lambda _: None, clock=clock, cpu_clock=clock
    )
    tasks = [asyncio.create_task(adm.admit(req(f"adapter-{n}", 0), take)) for n in range(names)]
    await asyncio.sleep(0)
    planned, start = 0.0, clock.now
    while clock.now - start < 1.0:  # a load report every millisecond for a second
        clock.now += 0.001
        adm.notify()
    assert planned / (clock.now - start) <= 0.12
    await _cancel(tasks, adm)


async def test_the_periodic_offer_serves_the_oldest_head_first() -> None:
    """Room that frees with no notification (a peer router's free, a cooldown's end) goes to the
    oldest head at the periodic offer, as at a notification (review of the once-a-second offer: each
    line's own timer gave it to whichever line's fired first, lora1 before base0)."""
    fleet, clock = Fleet(room=0), Clock()
    adm = Admission(
        max_wait_s=lambda: 5.0, max_queue=lambda: 10, on_abandon=lambda _: None, clock=clock, cpu_clock=clock,
        reoffer_s=0.05,
    )  # fmt: skip
    tasks = []
    for model, i in (("lora", 0), ("base", 0), ("lora", 1)):
        tasks.append(asyncio.create_task(adm.admit(req(model, i), fleet.take)))
        await asyncio.sleep(0)
    fleet.room = 1
    adm.notify()
    await until(lambda: fleet.taken == ["lora0"], what="the oldest head served at the notification")
    fleet.room = 1  # frees with no notification
    await until(lambda: len(fleet.taken) == 2, what="the periodic offer")
    assert fleet.taken == ["lora0", "base0"]
    await _cancel(tasks, adm)
