"""The value a model is served with where its workers disagree (router.fleet_vote), and the two
votes by it: the block size (router.eligibility) and the max_model_len (router.worker_registry)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import pytest

from discovery import Deleted, Discovery, Put
from protocol.config import EtcdSettings, RouterSettings
from protocol.messages import LoadReport, Role, WorkerInfo
from router.block_index import BlockIndex
from router.eligibility import Eligibility, Exclusion, WorkerStatus
from router.fleet_vote import HOLD_S, Ballot, Fit, Standing, model_value, votes
from router.load_view import Liveness, LoadView
from router.planner import standalone_planner
from router.worker_registry import ContextConflict, WorkerRegistry

MODEL = "m"


def info(worker: str, role: Role, block_size: int = 16, max_model_len: int | None = None) -> WorkerInfo:
    return WorkerInfo(
        worker=worker, model=MODEL, role=role, engine="vllm", block_size=block_size, max_model_len=max_model_len
    )


@pytest.mark.parametrize(("role", "decides"), [("decode", True), ("agg", True), ("prefill", False)])
def test_decode_and_agg_workers_decide(role: str, decides: bool) -> None:
    assert votes(role) is decides


def decode(value: int, serves: bool = True, created: int = 1) -> Ballot:
    return Ballot(value, True, Fit.SERVES if serves else Fit.OUT, created)


def prefill(value: int, serves: bool = True, created: int = 1) -> Ballot:
    return Ballot(value, False, Fit.SERVES if serves else Fit.OUT, created)


def test_the_decode_pools_value_wins_over_more_prefill_workers() -> None:
    assert model_value([decode(16), *(prefill(32) for _ in range(3))]) == 16


def test_a_model_without_decode_or_agg_workers_is_voted_by_all_of_them() -> None:
    assert model_value([prefill(16), *(prefill(32) for _ in range(3))]) == 32


def test_workers_that_cannot_serve_never_outvote_one_that_can() -> None:
    assert model_value([decode(16), decode(32, serves=False), decode(32, serves=False)]) == 16
    # and, none serving, they all count
    assert model_value([decode(16, serves=False), decode(32, serves=False), decode(32, serves=False)]) == 32


def test_a_tie_goes_to_the_value_more_serving_workers_hold_then_to_the_longest_registered() -> None:
    # a decode newcomer at 32 against the decode worker and prefill pool at 16
    assert model_value([decode(16, created=9), prefill(16, created=8), decode(32, created=1)]) == 16
    # a prefill worker that cannot serve backs nothing
    assert model_value([decode(16, created=9), prefill(16, serves=False), decode(32, created=1)]) == 32
    assert model_value([decode(16, created=5), decode(32, created=7)]) == 16
    assert model_value([decode(16, created=7), decode(32, created=5)]) == 32


@pytest.mark.parametrize("order", list(itertools.permutations([16, 32, 64])))
def test_a_tie_of_workers_registered_alike_goes_to_the_greater_value_whatever_the_order(order: tuple[int, ...]) -> None:
    # created alike (0: events made by hand): the value decides
    tied = [decode(v, created=0) for v in order for _ in range(2)]
    assert model_value(tied) == 64
    assert model_value([*tied, decode(16, created=0)]) == 16  # most win before any tie-break


class Replica:
    """A router's view of a fleet: its registry and its eligibility, fed the workers in its order,
    each key with its create_revision in etcd (`created`, by default the order of their ids): the same on
    every replica. `sync` and `live` are this router's readings of each worker (default: synced,
    reporting)."""

    def __init__(
        self,
        order: list[WorkerInfo],
        created: dict[str, int] | None = None,
        sync: dict[str, tuple[str, str]] | None = None,
        live: dict[str, Liveness] | None = None,
    ) -> None:
        self.now = 1000.0
        self.sync = sync if sync is not None else {}
        self.live = live if live is not None else {}
        disc = Discovery(EtcdSettings(), "vote")  # never connected: the records are fed to the registry here
        # each reads the other, as RouterService wires them
        self.registry = WorkerRegistry(disc, lambda _: None, lambda _: None, fit=self.elig_fit, clock=lambda: self.now)
        self.elig = Eligibility(
            clock=lambda: self.now,
            sync_state=self.sync.get,
            liveness=lambda worker: self.live.get(worker, Liveness(0.0, 0.5, True, True, False)),
            tokenizer="builtin",
            created=self.registry.created,
        )
        # by id where not given: etcd's order, whatever the order this replica saw them in
        revisions = created or {w.worker: n for n, w in enumerate(sorted(order, key=lambda w: w.worker), 1)}
        for revision, worker in enumerate(order, 100):
            self.registry.apply(Put(worker.worker, worker, revision, revisions[worker.worker]))
            self.elig.added(worker.worker)
            self.now += 5.0  # each seen later than the last, by this router's clock

    def elig_fit(self, worker: WorkerInfo) -> Fit:
        return self.elig.fit(worker)

    def verdict(
        self,
    ) -> tuple[
        dict[str, int], list[tuple[str, Exclusion | None, str]], list[tuple[str, str]], dict[str, ContextConflict]
    ]:
        routed = self.registry.workers()
        unrouted = [(i.worker, why) for i, why in self.registry.unrouted()]
        statuses = [(s.worker, s.exclusion, s.detail) for s in self.elig.statuses(routed)]
        return self.elig.block_sizes(routed), statuses, unrouted, self.registry.context_conflicts


# Decode workers split evenly on the block size; prefill workers registering another max_model_len.
FLEET = [
    info("d1", "decode", 16, 32768),
    info("d2", "decode", 32, 32768),
    info("p1", "prefill", 16, 16384),
    info("p2", "prefill", 32, 16384),
]


def test_two_replicas_fed_the_fleet_in_different_orders_agree() -> None:
    # Until 2026-12-07 a block-size tie went to the worker each router saw first: one replica
    # served while the other refused every request, and neither said so.
    forward, backward = Replica(FLEET).verdict(), Replica(FLEET[::-1]).verdict()
    assert forward == backward
    sizes, statuses, unrouted, _ = forward
    assert [w for w, _ in unrouted] == ["p1", "p2"]  # the decode workers' length: 32768
    assert sizes == {MODEL: 16}  # a tie of 2 against 2: d1's, registered first in etcd
    assert [(w, why) for w, why, _ in statuses] == [("d1", None), ("d2", Exclusion.BLOCK_SIZE)]


def test_replicas_agree_while_one_has_not_yet_bootstrapped_the_newcomer() -> None:
    # A decode worker at 32 joins one at 16: the replica that has read its state and the one still
    # bootstrapping it serve the model alike, at 16 (before, the first handed the tie to 32 and
    # left the serving worker out, the second kept it).
    fleet = [info("d_old", "decode", 16), info("d_new", "decode", 32)]
    created = {"d_old": 5, "d_new": 9}
    synced = Replica(fleet, created).verdict()
    bootstrapping = Replica(fleet, created, sync={"d_new": ("bootstrapping", "no state from its shim yet")}).verdict()
    assert synced[0] == bootstrapping[0] == {MODEL: 16}
    assert [(w, why) for w, why, _ in synced[1]] == [("d_new", Exclusion.BLOCK_SIZE), ("d_old", None)]


SERVING_POOL = [info("p1", "prefill", 16, 16384), info("p2", "prefill", 16, 16384), info("d_old", "decode", 16, 16384)]
NEWCOMER = info("d_new", "decode", 32, 32768)
CREATED = {"p1": 1, "p2": 2, "d_old": 3, "d_new": 10}


def test_a_newcomer_at_another_value_never_takes_over_a_pool_that_serves() -> None:
    # The routine scale-up of the audit of 2026-12-07 (second review): one decode worker at block
    # size 32 and max_model_len 32768 joining a decode worker and prefill pool at 16 and 16384 tied
    # 1-1, took the model over, and left the decode worker and the whole prefill pool out.
    replica = Replica([*SERVING_POOL, NEWCOMER], CREATED)
    sizes, statuses, unrouted, conflicts = replica.verdict()
    assert sizes == {MODEL: 16}
    assert [w for w, why, _ in statuses if why is not None] == []
    assert [w for w, _ in unrouted] == ["d_new"] and conflicts[MODEL].served == 16384
    assert [i.worker for i, _ in replica.registry.unrouted()] == ["d_new"]
    # and where it is the pool's lone decode worker that it joins, the incumbent keeps the model
    lone = Replica([SERVING_POOL[2], NEWCOMER], CREATED)
    assert lone.verdict()[0] == {MODEL: 16} and [w for w, _ in lone.verdict()[2]] == ["d_new"]


NOT_SERVING = {
    "bootstrapping": ({"d_new1": ("bootstrapping", "x"), "d_new2": ("bootstrapping", "x")}, {}),
    "silent": ({}, dict.fromkeys(("d_new1", "d_new2"), Liveness(60.0, 0.5, True, True, False))),
    "events_down": ({}, dict.fromkeys(("d_new1", "d_new2"), Liveness(0.0, 0.5, False, True, False))),
    "engine_unhealthy": ({}, dict.fromkeys(("d_new1", "d_new2"), Liveness(0.0, 0.5, True, False, False))),
}


@pytest.mark.parametrize("why", list(NOT_SERVING))
def test_newcomers_that_cannot_serve_never_decide_over_the_worker_that_serves(why: str) -> None:
    # Two decode newcomers at 32 and 32768 whose shims never bootstrapped, went silent, see no KV
    # events or report their engine failing: before, they outvoted the serving decode worker 2-1
    # (the length vote counted every record, the block-size vote all but the bootstrapping), and
    # the model was a 503 while its old worker was healthy.
    sync, live = NOT_SERVING[why]
    newcomers = [info(f"d_new{n}", "decode", 32, 32768) for n in (1, 2)]
    created = {"d_old": 3, "d_new1": 10, "d_new2": 11}
    replica = Replica([SERVING_POOL[2], *newcomers], created, sync=dict(sync), live=dict(live))
    sizes, statuses, unrouted, conflicts = replica.verdict()
    assert sizes == {MODEL: 16} and conflicts[MODEL].served == 16384
    assert [w for w in replica.registry.workers() if w.worker == "d_old"] and statuses[0] == ("d_old", None, "")
    assert [w for w, _ in unrouted] == ["d_new1", "d_new2"]
    # Once they serve, they are most of the model's serving decode workers: a revote within a
    # second moves the length, and the block size moves at once.
    replica.sync.clear()
    replica.live.clear()
    replica.registry.revote()
    sizes, statuses, unrouted, conflicts = replica.verdict()
    assert sizes == {MODEL: 32} and conflicts[MODEL].served == 32768
    assert [w for w, _ in unrouted] == ["d_old"]


def test_the_decode_pool_decides_the_max_model_len_not_the_prefill_majority() -> None:
    # Three prefill workers at 16384 left the decode worker at 32768 out (context_conflict), and
    # with it the model, for a fault of the prefill pool.
    replica = Replica(
        [*(info(f"p{n}", "prefill", max_model_len=16384) for n in range(3)), info("d1", "decode", 16, 32768)]
    )
    assert [i.worker for i in replica.registry.workers()] == ["d1"]
    unrouted = replica.registry.unrouted()
    assert [i.worker for i, _ in unrouted] == ["p0", "p1", "p2"]
    assert (
        "but model m is served with 32768, the length most of its decode and agg workers that serve" in unrouted[0][1]
    )
    assert replica.registry.context_conflicts[MODEL].served == 32768


def test_the_decode_pool_decides_the_block_size_not_the_prefill_majority() -> None:
    replica = Replica([info("p1", "prefill", 32), info("p2", "prefill", 32), info("d1", "decode", 16)])
    d1, p1, p2 = replica.elig.statuses(replica.registry.workers())
    assert d1.routable and p1.exclusion is p2.exclusion is Exclusion.BLOCK_SIZE
    assert "block size 32, but model m is served with 16" in p1.detail


# A decode worker at 16 and 16384 that served alone, and a misconfigured newcomer at 32 and 32768.
INCUMBENT = info("d_old", "decode", 16, 16384)
INTRUDER = info("d_new", "decode", 32, 32768)
UP = Liveness(0.0, 0.5, True, True, False)


def served(replica: Replica) -> tuple[int, int | None, list[str]]:
    """The model's block size and context on `replica`, and the workers it routes (registry and eligibility)."""
    routed = replica.registry.workers()
    sizes = replica.elig.block_sizes(routed)
    return (
        sizes[MODEL],
        replica.registry.max_model_len(MODEL),
        [s.worker for s in replica.elig.statuses(routed) if s.routable],
    )


def test_a_restart_of_the_only_incumbent_never_hands_the_model_to_a_misconfigured_newcomer() -> None:
    # The third review of 2026-12-07: the tie went to the least create_revision, and the incumbent's
    # shim, restarted, registers its key anew (the newest): the model moved to the newcomer for
    # good, the healthy worker named as the configuration error.
    replica = Replica([INCUMBENT, INTRUDER], {"d_old": 100, "d_new": 200})
    assert served(replica) == (16, 16384, ["d_old"])
    replica.live["d_old"] = Liveness(0.0, 0.5, True, True, True)  # SIGTERM: its shim drains
    replica.registry.revote()
    assert served(replica)[:2] == (16, 16384)
    # its lease revoked: the newcomer, the only worker, serves meanwhile
    replica.registry.apply(Deleted("d_old", 300))
    replica.elig.removed("d_old")
    replica.now += 5.0
    assert served(replica) == (32, 32768, ["d_new"])
    # the shim up again, its key created anew (rev 400), bootstrapping: still the newcomer's
    del replica.live["d_old"]
    replica.sync["d_old"] = ("bootstrapping", "no state from its shim yet")
    replica.registry.apply(Put("d_old", INCUMBENT, 400, 400))
    replica.elig.added("d_old")
    replica.registry.revote()
    assert served(replica)[:2] == (32, 32768)
    # and once it serves, the model is served as it was before the restart
    replica.sync.clear()
    replica.now += 1.0
    replica.registry.revote()
    assert served(replica) == (16, 16384, ["d_old"])


def test_the_standing_value_lapses_hold_s_after_it_was_last_decided() -> None:
    now = [0.0]
    standing = Standing(lambda: now[0])
    assert standing.decide(MODEL, [decode(16, created=1), decode(32, created=9)]) == 16
    standing.agreed(MODEL, 32)  # its only worker gone: 32 serves, 16 stands
    now[0] += HOLD_S - 1
    assert standing.decide(MODEL, [decode(16, created=10), decode(32, created=9)]) == 16
    standing.agreed(MODEL, 32)
    now[0] += HOLD_S + 1  # gone for good: a worker at 16 returning later finds 32 standing
    standing.agreed(MODEL, 32)
    assert standing.decide(MODEL, [decode(16, created=1), decode(32, created=9)]) == 32
    # one that beats it in a vote it takes part in takes its place at once
    assert standing.decide(MODEL, [decode(16), decode(16), decode(32)]) == 16
    assert standing.decide(MODEL, [decode(16), decode(32)]) == 16


MARKS: dict[str, Callable[[Replica], None]] = {
    "unreachable": lambda r: r.elig.mark_unreachable("d_old", "no responders"),
    "malformed": lambda r: r.elig.mark_malformed("d_old", "a ResponseChunk that does not decode"),
    "draining": lambda r: r.live.__setitem__("d_old", Liveness(0.0, 0.5, True, True, True)),
    "engine_unhealthy": lambda r: r.live.__setitem__("d_old", Liveness(0.0, 0.5, True, False, False)),
    "repairing": lambda r: r.sync.__setitem__("d_old", ("repairing", "a gap in its KV events")),
}


@pytest.mark.parametrize("mark", list(MARKS))
def test_a_passing_mark_on_the_incumbent_moves_neither_value(mark: str) -> None:
    # One malformed answer (30 s of cooldown), a request that found no responder, a drain, a
    # failed load poll or a repair took the incumbent's vote away: the newcomer at 32 took the
    # block size (and, at the next revote, the context) until the mark passed.
    replica = Replica([INCUMBENT, INTRUDER], {"d_old": 100, "d_new": 200})
    MARKS[mark](replica)
    replica.registry.revote()
    size, context, _ = served(replica)
    assert (size, context) == (16, 16384)
    statuses = replica.elig.statuses([INCUMBENT, INTRUDER])
    assert [s.worker for s in statuses if s.exclusion is Exclusion.BLOCK_SIZE] == ["d_new"]


def test_a_blinking_incumbent_never_flips_the_values(caplog: pytest.LogCaptureFixture) -> None:
    # The reviewer's ctxflap: a worker in and out of serving every other second flipped the context
    # at each revote, each flip an ERROR "configuration error", and the block size with it.
    replica = Replica([INCUMBENT, INTRUDER], {"d_old": 100, "d_new": 200})
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    caplog.clear()
    seen = set()
    for second in range(8):
        replica.now += 1.0
        replica.live.pop("d_old", None)
        if second % 2 == 0:
            MARKS[list(MARKS)[second // 2 % len(MARKS)]](replica)
        else:
            replica.elig.reported("d_old")  # a load report ends an unreachable mark
        replica.registry.revote()
        size, context, _ = served(replica)
        seen.add((size, context))
    assert seen == {(16, 16384)}
    assert [r for r in caplog.records if "max_model_len" in r.getMessage()] == []


def test_a_replica_started_during_a_tie_breaks_it_by_create_revision() -> None:
    # What docs/router.md ("What replicas agree on") says: the standing value is each replica's
    # own; one started after the incumbent's restart has none, and the newcomer's key is older.
    fresh = Replica([INTRUDER, INCUMBENT], {"d_old": 400, "d_new": 200})
    assert served(fresh)[:2] == (32, 32768)


def test_a_request_reads_each_workers_status_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # With one of 500 workers at another block size, a request read each worker's status three
    # times (once per vote, the planner's context and refresh voting twice): 1,500 reads of a
    # status, 8 ms more per request.
    now = 1000.0
    view = LoadView(clock=lambda: now)
    infos = [
        WorkerInfo(worker=f"w{n:04d}", model=MODEL, role="agg", engine="vllm", block_size=32 if n == 0 else 16)
        for n in range(500)
    ]
    planner = standalone_planner(
        RouterSettings(), lambda: infos, index=BlockIndex(), view=view, clock=lambda: now, tokenizer="builtin"
    )
    for i in infos:
        view.update(LoadReport(worker=i.worker, ts=now, kv_total_blocks=10_000, period_s=0.5))
    reads = [0]
    status = Eligibility._status

    def counted(self: Eligibility, *args: Any) -> WorkerStatus:
        reads[0] += 1
        return status(self, *args)

    monkeypatch.setattr(Eligibility, "_status", counted)
    ctx = planner.context("r", MODEL, list(range(512)))
    planner.take(ctx)
    assert ctx.block_size == 16 and reads[0] == 500
