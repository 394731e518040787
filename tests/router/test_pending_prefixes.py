"""Pending prefixes: what a worker was routed and no KV event confirmed yet. Entries count as leading
prompt blocks, end when events speak for them, and expire when nothing ever does; a burst of
requests on one new prefix lands on the worker that will hold it."""

from __future__ import annotations

import random

import pytest

from protocol import BlockHasher
from protocol.config import RouterSettings
from router.block_index import BlockIndex
from router.load_view import LoadView
from router.pending_prefixes import PendingPrefixes
from router.planner import standalone_planner
from tests.router.builders import worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_match_counts_leading_live_blocks_per_worker() -> None:
    clock = Clock()
    pending = PendingPrefixes(20.0, clock)
    pending.add("a", [1, 2, 3, 4])
    pending.add("b", [1, 2])
    assert pending.match([1, 2, 3, 9]) == {"a": 3, "b": 2}
    assert pending.match([7, 1, 2]) == {}


def test_events_confirm_entries_and_a_cleared_worker_holds_none() -> None:
    pending = PendingPrefixes(20.0, Clock())
    pending.add("a", [1, 2, 3])
    pending.confirm("a", [2])  # the index holds block 2 on a now: the pending run stops before it
    assert pending.match([1, 2, 3]) == {"a": 1}
    pending.forget_worker("a")
    assert pending.match([1, 2, 3]) == {} and len(pending) == 0


def test_an_entry_never_confirmed_expires() -> None:
    clock = Clock()
    pending = PendingPrefixes(20.0, clock)
    pending.add("a", [1, 2, 3])
    clock.now += 19.9
    assert pending.match([1, 2, 3]) == {"a": 3}
    clock.now += 0.1
    assert pending.match([1, 2, 3]) == {}
    pending.prune()
    assert len(pending) == 0


def test_booking_again_renews_and_expiry_cuts_a_run_where_it_ends() -> None:
    clock = Clock()
    pending = PendingPrefixes(20.0, clock)
    pending.add("a", [1, 2, 3, 4])
    clock.now += 10
    pending.add("a", [1, 2])  # a second request on the first two blocks
    clock.now += 15  # the first booking's entries are gone, the second's live
    assert pending.match([1, 2, 3, 4]) == {"a": 2}
    pending.prune()
    assert len(pending) == 2


def test_the_pending_run_may_start_where_the_index_ends() -> None:
    pending = PendingPrefixes(20.0, Clock())
    pending.add("a", [1, 2, 3, 4])
    pending.add("b", [1, 2, 3, 4])
    pending.confirm("a", [1, 2])  # a's first chunk is stored: the index holds 1 and 2 there
    assert pending.match([1, 2, 3, 4, 5], after={"a": 2}) == {"a": 4, "b": 4}
    assert pending.match([1, 2, 3, 4, 5]) == {"b": 4}  # without the index, a's run has no start
    assert pending.match([1, 2, 3], after={"a": 3}) == {"b": 3}  # nothing past the index is pending


def test_a_prompt_longer_than_a_chunk_counts_as_held_while_its_tail_is_pending() -> None:
    """The engine stores a long prompt's first prefill chunk, whose events end those entries, while
    the rest is still pending: a second request on that prompt sees the whole prompt on the holder,
    not the first chunk, and goes there."""
    infos = [worker(f"d{i}", "agg") for i in range(4)]
    clock = Clock()
    index = BlockIndex()
    planner = standalone_planner(
        RouterSettings().validate(),
        lambda: infos,
        index=index,
        view=LoadView(clock=clock),
        clock=clock,
        rng=random.Random(0),
    )
    prompt = list(range(1000, 1000 + 64 * 16))
    ctx = planner.context("r0", "m", prompt, 16)
    first = planner.take(ctx)
    assert first is not None and len(ctx.hashes) == 64
    holder = first.decode.worker
    chunk = ctx.hashes[:32]
    index.store(holder, chunk)
    planner.pending.confirm(holder, chunk)
    second = planner.context("r1", "m", prompt + list(range(9000, 9016)), 16)
    planner.refresh(second)
    held = {c.worker: (c.overlap_blocks, c.pending_blocks) for c in second.decode_pool}
    assert held[holder] == (64, 32)
    assert all(held[w] == (0, 0) for w in held if w != holder)


def test_ttl_zero_is_off() -> None:
    pending = PendingPrefixes(0.0, Clock())
    pending.add("a", [1, 2, 3])
    assert pending.match([1, 2, 3]) == {} and len(pending) == 0


def _burst(pending_ttl_s: float, n: int = 8) -> list[str]:
    """`n` requests sharing a 2,048-token prefix (distinct 64-token tails) planned in one instant on
    four idle decode workers: no KV event and no load report arrives in between."""
    infos = [worker(f"d{i}", "agg") for i in range(4)]
    clock = Clock()
    view = LoadView(clock=clock)
    settings = RouterSettings(pending_ttl_s=pending_ttl_s).validate()
    planner = standalone_planner(
        settings, lambda: infos, index=BlockIndex(), view=view, clock=clock, rng=random.Random(0)
    )
    prefix = list(range(1000, 3048))
    chosen = []
    for i in range(n):
        tokens = prefix + [50_000 + 64 * i + j for j in range(64)]
        plan = planner.take(planner.context(f"r{i}", "m", tokens, 16))
        assert plan is not None
        chosen.append(plan.decode.worker)
    return chosen


def test_a_burst_on_one_prefix_lands_on_one_worker() -> None:
    chosen = _burst(pending_ttl_s=20.0)
    assert len(set(chosen)) == 1


def test_without_pending_entries_the_burst_spreads() -> None:
    chosen = _burst(pending_ttl_s=0.0)
    assert len(set(chosen)) == 4


@pytest.mark.parametrize("blocks", [1, 128])
def test_a_prompt_is_matched_by_its_canonical_hashes(blocks: int) -> None:
    hashes = BlockHasher(16)(list(range(16 * blocks)))
    pending = PendingPrefixes(20.0, Clock())
    pending.add("a", hashes)
    assert pending.match(hashes) == {"a": blocks}
