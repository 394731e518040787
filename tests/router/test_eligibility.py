"""Eligibility: each reason a worker is left out, and the one that wins when several apply."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import pytest

from protocol.messages import Role, WorkerInfo
from router.eligibility import Eligibility, Exclusion, model_block_sizes
from router.load_view import Liveness
from runtime.loop_watch import TICK_S, LoopWatch

MODEL = "m"


def info(name: str, block_size: int = 16, *, tokenizer: str = "builtin", events_ok: bool = True) -> WorkerInfo:
    return WorkerInfo(
        worker=name, model=MODEL, role="decode", engine="vllm", block_size=block_size,
        tokenizer=tokenizer, events_ok=events_ok,
    )  # fmt: skip


class World:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sync: dict[str, tuple[str, str]] = {}
        self.live: dict[str, Liveness] = {}
        self.stalls: list[tuple[float, float]] = []  # (start, end) of the router's loop's stalls
        self.elig = Eligibility(
            clock=lambda: self.now,
            sync_state=self.sync.get,
            liveness=self.live.get,
            tokenizer="builtin",
            stalled_within=self.stalled_within,
        )

    def stalled_within(self, seconds: float, *, older_at_most: float = math.inf) -> float:
        """As runtime.loop_watch says it: the latest stall in full, those before `older_at_most`."""
        spans = [max(0.0, min(b, self.now) - max(a, self.now - seconds)) for a, b in self.stalls]
        spans = [s for s in spans if s > 0]
        return spans[-1] + min(sum(spans[:-1]), older_at_most) if spans else 0.0

    def wait(self, seconds: float, *, stalled: bool = False) -> None:
        """`seconds` pass, nothing heard; `stalled`: the router's loop stood still through them."""
        if stalled:
            self.stalls.append((self.now, self.now + seconds))
        self.now += seconds
        for worker, live in self.live.items():
            self.live[worker] = msgspec.structs.replace(live, age_s=live.age_s + seconds)

    def report(
        self,
        worker: str,
        *,
        age: float = 0.0,
        period: float = 0.5,
        events_ok: bool = True,
        healthy: bool = True,
        draining: bool = False,
    ) -> None:
        self.live[worker] = Liveness(age, period, events_ok, healthy, draining)

    def status(self, i: WorkerInfo) -> tuple[Exclusion | None, str]:
        st = self.elig.statuses([i])[0]
        return st.exclusion, st.detail


@pytest.fixture
def world() -> World:
    w = World()
    w.elig.added("w1")
    w.report("w1")
    return w


def test_a_synced_live_worker_is_routable(world: World) -> None:
    assert world.status(info("w1")) == (None, "")


def test_bootstrapping_and_repairing_exclude_with_their_reason(world: World) -> None:
    world.sync["w1"] = ("repairing", "gap: seq 9 after 7")
    assert world.status(info("w1")) == (Exclusion.REPAIRING, "gap: seq 9 after 7")
    world.sync["w1"] = ("bootstrapping", "waiting")
    assert world.status(info("w1"))[0] is Exclusion.BOOTSTRAPPING


def test_events_down_in_the_record_or_the_report(world: World) -> None:
    assert world.status(info("w1", events_ok=False))[0] is Exclusion.EVENTS_DOWN
    world.report("w1", events_ok=False)
    assert world.status(info("w1"))[0] is Exclusion.EVENTS_DOWN


@pytest.mark.parametrize(("age", "silent"), [(1.49, False), (1.5, False), (1.51, True)])
def test_silent_after_three_report_periods(world: World, age: float, silent: bool) -> None:
    world.report("w1", age=age, period=0.5)
    assert (world.status(info("w1"))[0] is Exclusion.SILENT) is silent


def test_a_worker_that_never_reports_is_silent_three_default_periods_after_registering(world: World) -> None:
    world.elig.added("w2")
    assert world.status(info("w2"))[0] is None
    world.now += 3.01
    exclusion, why = world.status(info("w2"))
    assert exclusion is Exclusion.SILENT and "since it registered" in why


def test_silence_counts_only_while_the_router_was_awake_to_hear_it(world: World) -> None:
    """After a stall of the router's own loop (a paused VM, a long GC, a debugger), its workers'
    reports wait unread in its socket: until 2026-12-07 one of 2x the silence limit marked every
    worker silent as the router woke, before it read them (a model's every request a 503)."""
    world.report("w1", age=0.0, period=0.5)  # silent after 1.5 s awake
    world.elig.added("w2")  # no report yet: silent after 3 s awake
    world.wait(7.0, stalled=True)
    assert world.status(info("w1"))[0] is None and world.status(info("w2"))[0] is None
    world.wait(1.4)
    assert world.status(info("w1"))[0] is None
    world.wait(0.11)
    assert world.status(info("w1"))[0] is Exclusion.SILENT, "1.51 s awake with nothing heard"
    assert world.status(info("w2"))[0] is None
    world.wait(1.5)
    assert world.status(info("w2"))[0] is Exclusion.SILENT


def test_a_loop_stalling_again_and_again_still_finds_a_dead_worker(world: World) -> None:
    """0.1 s awake in each 0.5 s: of a report's age, the latest stall (0.4 s) is taken off in full
    and those before it one limit (1.5 s) at most, so a worker heard from 7 cycles ago (3.5 s, less
    1.9 s: 1.6 s, past its 1.5 s) is silent, one heard 6 cycles ago (3.0 s, 1.1 s) is not. Until
    2026-12-07 all were taken off: silent only after 16 cycles (1.6 s awake), 8 s."""
    world.report("w1", age=0.0, period=0.5)
    world.report("w2", age=0.0, period=0.5)
    for cycle in range(7):
        if cycle == 1:
            world.report("w2", age=0.0, period=0.5)
        world.wait(0.4, stalled=True)
        world.wait(0.1)
    assert world.status(info("w1"))[0] is Exclusion.SILENT
    assert world.status(info("w2"))[0] is None


async def test_a_router_stalled_most_of_the_time_finds_a_dead_worker_within_twice_the_limit() -> None:
    """The real loop watch, stalled 0.45 s in each 0.5 s (a review's schedule, 2026-12-07): a dead
    worker at a 0.6 s limit is silent by twice the limit, the latest stall and the longest (each a
    tick longer as the watch measures it), where crediting every stall within its age kept it
    routable until 6 s (awake 0.6 s of it)."""
    watch = LoopWatch("this router")
    watch.start()
    loop = asyncio.get_running_loop()
    live: dict[str, Liveness] = {}
    elig = Eligibility(
        clock=loop.time, sync_state=lambda _w: None, liveness=live.get, tokenizer="builtin",
        stalled_within=watch.stalled_within,
    )  # fmt: skip
    try:
        await asyncio.sleep(0.3)
        died = loop.time()  # its last report: period 0.2 s, so silent after 0.6 s
        while (age := loop.time() - died) < 10.0:
            live["w1"] = Liveness(age, 0.2, True, True, False)
            if elig.statuses([info("w1")])[0].exclusion is Exclusion.SILENT:
                break
            time.sleep(0.45)
            await asyncio.sleep(0.05)
    finally:
        await watch.stop()
    assert 0.6 < age < 2 * 0.6 + 2 * (0.45 + TICK_S) + 0.5  # a cycle late at most


def test_unreachable_until_the_next_report(world: World) -> None:
    world.elig.mark_unreachable("w1", "no responder on its subject")
    exclusion, why = world.status(info("w1"))
    assert exclusion is Exclusion.UNREACHABLE and "no responder" in why
    world.elig.reported("w1")
    assert world.status(info("w1"))[0] is None


def test_engine_unhealthy(world: World) -> None:
    world.report("w1", healthy=False)
    assert world.status(info("w1"))[0] is Exclusion.ENGINE_UNHEALTHY


def test_a_draining_worker_takes_no_new_request_even_when_it_is_the_last(world: World) -> None:
    world.report("w1", draining=True)
    st = world.elig.statuses([info("w1")])[0]
    assert st.exclusion is Exclusion.DRAINING and not st.routable and not st.soft  # it would refuse (503)
    assert "SIGTERM" in st.detail


def test_the_minority_block_size_is_excluded_not_the_fleet(world: World) -> None:
    for w in ("w2", "w3"):
        world.elig.added(w)
        world.report(w)
    statuses = world.elig.statuses([info("w1", 32), info("w2"), info("w3")])
    assert [s.exclusion for s in statuses] == [Exclusion.BLOCK_SIZE, None, None]
    assert "block size 32, but model m is served with 16" in statuses[0].detail


def test_a_block_size_tie_goes_to_the_greater_whatever_order_each_replica_saw_the_workers_in() -> None:
    # Until 2026-12-07 it went to the worker this router saw first: two replicas of one fleet
    # disagreed, one routing to the worker the other left out (neither said so).
    verdicts = []
    for order in (["w16", "w32"], ["w32", "w16"]):
        replica = World()
        for w in order:
            replica.elig.added(w)
            replica.report(w)
            replica.now += 5.0
        statuses = replica.elig.statuses([info("w16", 16), info("w32", 32)])
        verdicts.append([(s.worker, s.exclusion, s.detail) for s in statuses])
    assert verdicts[0] == verdicts[1]
    assert verdicts[0][0][1] is Exclusion.BLOCK_SIZE and "served with 32" in verdicts[0][0][2]
    assert verdicts[0][1][1] is None


def of_role(name: str, block_size: int, role: Role) -> WorkerInfo:
    return msgspec.structs.replace(info(name, block_size), role=role)


def test_prefill_workers_at_another_block_size_are_left_out_never_their_decode_pool(world: World) -> None:
    # Two prefill workers at 32 outvoted the decode worker at 16: it was excluded, and with it the
    # model (every request a 503), for a fault of the prefill pool, which cannot serve alone.
    for w in ("p1", "p2", "d1"):
        world.report(w)
    infos = [of_role("p1", 32, "prefill"), of_role("p2", 32, "prefill"), of_role("d1", 16, "decode")]
    assert world.elig.block_sizes(infos) == {MODEL: 16}
    p1, p2, d1 = world.elig.statuses(infos)
    assert d1.routable, d1.detail
    assert p1.exclusion is p2.exclusion is Exclusion.BLOCK_SIZE
    assert p1.detail.startswith("block size 32, but model m is served with 16")
    agg = of_role("a1", 32, "agg")  # an agg worker decides as a decode worker does: a tie, the greater
    assert model_block_sizes([*infos, agg]) == {MODEL: 32}


def test_a_model_with_prefill_workers_alone_is_voted_by_them() -> None:
    # It serves no request either way; its views still say which prefill workers are at odds.
    infos = [of_role("p1", 16, "prefill"), of_role("p2", 32, "prefill"), of_role("p3", 16, "prefill")]
    assert model_block_sizes(infos) == {MODEL: 16}


def test_the_tokenizer_is_a_per_request_check_not_an_exclusion(world: World) -> None:
    st = world.elig.statuses([info("w1", tokenizer="tok-0123456789abcdef")])[0]
    assert st.routable and not st.tokenizer_ok
    assert world.elig.statuses([info("w1")])[0].tokenizer_ok


def test_sync_state_outranks_liveness(world: World) -> None:
    world.sync["w1"] = ("repairing", "digest")
    world.report("w1", age=100.0)
    assert world.status(info("w1"))[0] is Exclusion.REPAIRING
