"""The value a model is served with where its workers disagree (router.fleet_vote), and the two
votes by it: the block size (router.eligibility) and the max_model_len (router.worker_registry)."""

from __future__ import annotations

import itertools

import pytest

from discovery import Discovery, Put
from protocol.config import EtcdSettings
from protocol.messages import Role, WorkerInfo
from router.eligibility import Eligibility, Exclusion
from router.fleet_vote import model_value, votes
from router.load_view import Liveness
from router.worker_registry import ContextConflict, WorkerRegistry

MODEL = "m"


def info(worker: str, role: Role, block_size: int = 16, max_model_len: int | None = None) -> WorkerInfo:
    return WorkerInfo(
        worker=worker, model=MODEL, role=role, engine="vllm", block_size=block_size, max_model_len=max_model_len
    )


@pytest.mark.parametrize(("role", "decides"), [("decode", True), ("agg", True), ("prefill", False)])
def test_decode_and_agg_workers_decide(role: str, decides: bool) -> None:
    assert votes(role) is decides


def test_the_decode_pools_value_wins_over_more_prefill_workers() -> None:
    assert model_value({16: 1}, {16: 1, 32: 3}) == 16


def test_a_model_without_decode_or_agg_workers_is_voted_by_all_of_them() -> None:
    assert model_value({}, {16: 1, 32: 3}) == 32


@pytest.mark.parametrize("order", list(itertools.permutations([16, 32, 64])))
def test_a_tie_goes_to_the_greater_value_whatever_the_order(order: tuple[int, ...]) -> None:
    tied = dict.fromkeys(order, 2)
    assert model_value(tied, tied) == 64
    assert model_value({**tied, 16: 3}, tied) == 16  # most win before any tie-break


class Replica:
    """A router's view of a fleet: its registry and its eligibility, fed the workers in its order."""

    def __init__(self, order: list[WorkerInfo]) -> None:
        self.now = 1000.0
        disc = Discovery(EtcdSettings(), "vote")  # never connected: the records are fed to the registry here
        self.registry = WorkerRegistry(disc, lambda _: None, lambda _: None)
        self.elig = Eligibility(
            clock=lambda: self.now,
            sync_state=lambda worker: None,
            liveness=lambda worker: Liveness(0.0, 0.5, True, True, False),
            tokenizer="builtin",
        )
        for revision, worker in enumerate(order, 1):
            self.registry.apply(Put(worker.worker, worker, revision))
            self.elig.added(worker.worker)
            self.now += 5.0  # each seen later than the last, by this router's clock

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
    assert sizes == {MODEL: 32}  # a tie: the greater
    assert [(w, why) for w, why, _ in statuses] == [("d1", Exclusion.BLOCK_SIZE), ("d2", None)]


def test_the_decode_pool_decides_the_max_model_len_not_the_prefill_majority() -> None:
    # Three prefill workers at 16384 left the decode worker at 32768 out (context_conflict), and
    # with it the model, for a fault of the prefill pool.
    replica = Replica(
        [*(info(f"p{n}", "prefill", max_model_len=16384) for n in range(3)), info("d1", "decode", 16, 32768)]
    )
    assert [i.worker for i in replica.registry.workers()] == ["d1"]
    unrouted = replica.registry.unrouted()
    assert [i.worker for i, _ in unrouted] == ["p0", "p1", "p2"]
    assert "but model m is served with 32768, the length most of its decode and agg workers register" in unrouted[0][1]
    assert replica.registry.context_conflicts[MODEL].served == 32768


def test_the_decode_pool_decides_the_block_size_not_the_prefill_majority() -> None:
    replica = Replica([info("p1", "prefill", 32), info("p2", "prefill", 32), info("d1", "decode", 16)])
    d1, p1, p2 = replica.elig.statuses(replica.registry.workers())
    assert d1.routable and p1.exclusion is p2.exclusion is Exclusion.BLOCK_SIZE
    assert "block size 32, but model m is served with 16" in p1.detail
