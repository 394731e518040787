"""The cost function, temperature sampling and the comparison modes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.calibration import timing_of
from router.request_context import Candidate
from router.selection import Selector, held_tokens, over_queue_threshold, worker_cost
from tests.router.builders import BLOCK, cand, ctx, settings


def test_cost_is_weighted_prefill_blocks_plus_decode_blocks() -> None:
    c = cand(overlap=10, queued_prefill_tokens=320, active_blocks=7)
    r = ctx(1000, [c])
    uncached = 1000 - 10 * BLOCK
    expected = 2.5 * (uncached + 320) / BLOCK + 7 + (-(-1000 // BLOCK))
    assert worker_cost(r, c, 2.5) == pytest.approx(expected)


def test_kv_picks_the_worker_holding_the_prefix() -> None:
    pool = [cand("a"), cand("b", overlap=50), cand("c", overlap=10)]
    ranked = Selector(random.Random(1)).rank(ctx(1000, pool), pool, settings())
    assert [c.worker for c in ranked] == ["b", "c", "a"]


def test_kv_trades_prefix_against_decode_load() -> None:
    held = cand("held", overlap=50, active_blocks=2000)
    idle = cand("idle")
    ranked = Selector().rank(ctx(1000, [held, idle]), [held, idle], settings())
    assert ranked[0].worker == "idle"
    # With the prefill term weighted up, the cached prefix wins again.
    ranked = Selector().rank(ctx(1000, [held, idle]), [held, idle], settings(overlap_weight=50.0))
    assert ranked[0].worker == "held"


def test_zero_temperature_breaks_exact_ties_at_random_and_never_picks_a_worse_one() -> None:
    sel = Selector(random.Random(7))
    picks: Counter[str] = Counter()
    for _ in range(200):
        pool = [cand("a"), cand("b"), cand("worse", active_blocks=1)]
        picks[sel.rank(ctx(100, pool), pool, settings())[0].worker] += 1
    assert picks["worse"] == 0
    assert picks["a"] > 40 and picks["b"] > 40


def test_temperature_spreads_near_ties_but_not_clear_losers() -> None:
    sel = Selector(random.Random(3))
    picks: Counter[str] = Counter()
    for _ in range(400):
        pool = [cand("a"), cand("near", active_blocks=1), cand("far", active_blocks=500)]
        picks[sel.rank(ctx(1600, pool), pool, settings(temperature=0.1))[0].worker] += 1
    assert picks["near"] > 100
    assert picks["a"] > picks["near"]
    assert picks["far"] == 0


def test_round_robin_rotates_over_the_pool_as_requests_are_routed() -> None:
    sel = Selector()
    pool = [cand("c"), cand("a", overlap=60), cand("b")]
    firsts = []
    for _ in range(6):
        firsts.append(sel.rank(ctx(1000, pool), pool, settings(routing="round_robin"))[0].worker)
        assert sel.rank(ctx(1000, pool), pool, settings(routing="round_robin"))[0].worker == firsts[-1]  # a dry run
        sel.advance("decode")
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_random_ignores_the_cache() -> None:
    sel = Selector(random.Random(5))
    pool = [cand("a", overlap=60), cand("b")]
    picks = Counter(sel.rank(ctx(1000, pool), pool, settings(routing="random"))[0].worker for _ in range(200))
    assert picks["b"] > 50


def test_least_loaded_counts_requests_then_blocks() -> None:
    pool = [cand("a", overlap=60, running=3), cand("b", running=1, waiting=1, active_blocks=9), cand("c", running=2)]
    ranked = Selector().rank(ctx(1000, pool), pool, settings(routing="least_loaded"))
    assert [c.worker for c in ranked] == ["c", "b", "a"]
    pool[2].booked_requests = 2  # routed to c since its last report: 4 requests, not 2
    ranked = Selector().rank(ctx(1000, pool), pool, settings(routing="least_loaded"))
    assert [c.worker for c in ranked] == ["b", "a", "c"]


@pytest.mark.parametrize(("queued", "over"), [(2048, False), (2049, True)])
def test_queue_threshold_is_strict(queued: int, over: bool) -> None:
    assert over_queue_threshold(cand(queued_prefill_tokens=queued, max_num_batched_tokens=2048), 1.0) is over


def test_workers_over_the_queue_threshold_rank_last() -> None:
    pool = [cand("cached_but_busy", overlap=60, queued_prefill_tokens=5000), cand("free")]
    ranked = Selector().rank(ctx(1000, pool), pool, settings(queue_threshold=2.0))
    assert [c.worker for c in ranked] == ["free", "cached_but_busy"]
    assert not over_queue_threshold(cand(queued_prefill_tokens=10**9, max_num_batched_tokens=None), 0.0)


# --- the recomputation charge -------------------------------------------------------------------

HALF_SLO = 1.0  # settings() keeps slo_ttft_s at its default of 2 s


def timed(name: str, *, overlap: int = 0) -> Candidate:
    c = cand(name, overlap=overlap)
    c.timing = timing_of(c.info, None)
    return c


def queue_for_wait(c: Candidate, isl: int, wait_s: float) -> int:
    """The queued prefill tokens at which `c` would start this prompt after `wait_s`."""
    assert c.timing is not None
    r = ctx(isl, [c])
    rate = c.timing.prefill_rate(c.info.max_num_batched_tokens or 8192)
    assert rate is not None
    return int((wait_s - c.timing.prefill_s(r.uncached_tokens(c), r.cached_tokens(c))) * rate)


def test_cost_charges_recomputing_what_another_worker_holds() -> None:
    c = cand(overlap=10, queued_prefill_tokens=320, active_blocks=7)
    r = ctx(1000, [c])
    # 40 blocks are held elsewhere; this worker has 10 of them: 30 blocks recomputed, charged 1.5x.
    expected = 2.5 * (1000 - 10 * BLOCK + 320 + 1.5 * 30 * BLOCK) / BLOCK + 7 + (-(-1000 // BLOCK))
    assert worker_cost(r, c, 2.5, 40 * BLOCK, 1.5) == pytest.approx(expected)
    # A worker holding at least as much pays nothing extra.
    assert worker_cost(r, c, 2.5, 5 * BLOCK, 1.5) == pytest.approx(worker_cost(r, c, 2.5))


def test_a_holder_with_a_short_queue_beats_an_idle_worker_only_with_the_charge() -> None:
    isl = 4096
    holder = timed("holder", overlap=240)  # 3840 of 4096 tokens cached
    holder.queued_prefill_tokens = 8192
    pool = [holder, timed("idle")]
    seed = Selector().rank(ctx(isl, pool), pool, settings(recompute_weight=0.0))
    assert seed[0].worker == "idle"  # 4096 own tokens < 256 + 8192 queued
    charged = Selector().rank(ctx(isl, pool), pool, settings(recompute_weight=2.0))
    assert charged[0].worker == "holder"  # 4096 + 2 x 3840 > 256 + 8192


@pytest.mark.parametrize(("wait_s", "held"), [(HALF_SLO - 0.01, 240 * BLOCK), (HALF_SLO + 0.01, 0)])
def test_only_a_holder_within_half_the_ttft_slo_counts(wait_s: float, held: int) -> None:
    isl = 4096
    holder = timed("holder", overlap=240)
    holder.queued_prefill_tokens = queue_for_wait(holder, isl, wait_s)
    assert held_tokens(ctx(isl, [holder]), [holder, timed("idle")], HALF_SLO) == held


def test_an_overloaded_holder_sets_no_charge() -> None:
    isl = 4096
    holder = timed("holder", overlap=240)
    holder.queued_prefill_tokens = queue_for_wait(holder, isl, HALF_SLO + 0.5)
    pool = [holder, timed("idle")]
    ranked = Selector().rank(ctx(isl, pool), pool, settings(recompute_weight=50.0))
    assert ranked[0].worker == "idle"
    assert ranked[0].cost == pytest.approx(worker_cost(ctx(isl, pool), pool[1], 4.0))


def test_a_holder_without_timing_is_not_judged() -> None:
    isl = 4096
    unprofiled = cand("holder", overlap=240, timing_profile=None)  # no profile, no calibration
    assert held_tokens(ctx(isl), [unprofiled, timed("idle")], HALF_SLO) == 0
    assert held_tokens(ctx(isl), [timed("holder", overlap=240), timed("idle")], HALF_SLO) == 240 * BLOCK
