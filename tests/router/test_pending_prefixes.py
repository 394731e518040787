"""Pending prefixes: what a worker was routed and no KV event confirmed yet. Entries count as leading
prompt blocks, end when events speak for them, and expire when nothing ever does; a burst of
requests on one new prefix lands on the worker that will hold it."""

from __future__ import annotations

import random
from collections import deque

import pytest

from protocol import BlockHasher
from protocol.config import RouterSettings
from router.block_index import BlockIndex
from router.load_view import LoadView
from router.pending_prefixes import Claim, PendingPrefixes
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


def test_withdrawing_a_claim_ends_its_entries_but_keeps_another_requests_renewal() -> None:
    """A client left before its prefill: its entries go, but for the blocks a second request on
    the same prefix, still in flight, booked there too; withdrawing the second ends those."""
    pending = PendingPrefixes(20.0, Clock())
    first = pending.add("a", [1, 2, 3, 4])
    second = pending.add("a", [1, 2])
    assert first is not None and second is not None
    pending.withdraw(first)
    assert pending.match([1, 2, 3, 4]) == {"a": 2}
    pending.withdraw(first)  # once only: the second's entries stay
    assert pending.match([1, 2, 3, 4]) == {"a": 2}
    pending.withdraw(second)
    assert pending.match([1, 2, 3, 4]) == {} and len(pending) == 0


def test_a_settled_claim_keeps_its_entries_against_a_later_claims_withdrawal() -> None:
    """The first request prefilled on `a` (its events are on their way); a second one booked there
    and failed: the prefix is still `a`'s until the events confirm it."""
    pending = PendingPrefixes(20.0, Clock())
    first = pending.add("a", [1, 2, 3])
    assert first is not None
    pending.settle(first)
    second = pending.add("a", [1, 2, 3, 4])
    assert second is not None
    pending.withdraw(second)
    assert pending.match([1, 2, 3, 4]) == {"a": 3}
    pending.confirm("a", [1, 2, 3])  # the index speaks for them: a settled claim keeps them no more
    third = pending.add("a", [1, 2, 3])
    assert third is not None
    pending.withdraw(third)
    assert pending.match([1, 2, 3]) == {} and len(pending) == 0


def test_a_claim_in_flight_past_its_expiry_keeps_a_later_renewal_on_withdrawal() -> None:
    clock = Clock()
    pending = PendingPrefixes(20.0, clock)
    hung = pending.add("a", [1, 2, 3])  # a prefill that hangs past the TTL
    assert hung is not None
    clock.now += 25
    pending.prune()
    assert len(pending) == 0
    retry = pending.add("a", [1, 2, 3])
    assert retry is not None
    pending.withdraw(hung)
    assert pending.match([1, 2, 3]) == {"a": 3}
    pending.withdraw(retry)
    assert pending.match([1, 2, 3]) == {}


def test_a_forgotten_workers_old_claims_end_nothing_when_it_is_back() -> None:
    pending = PendingPrefixes(20.0, Clock())
    old = pending.add("a", [1, 2, 3])
    assert old is not None
    pending.forget_worker("a")
    new = pending.add("a", [1, 2, 3])
    assert new is not None
    pending.withdraw(old)
    pending.settle(old)
    assert pending.match([1, 2, 3]) == {"a": 3}
    pending.withdraw(new)
    assert pending.match([1, 2, 3]) == {}


def test_withdrawals_in_any_order_leave_the_entries_of_the_claims_still_standing() -> None:
    """Three requests on one prefix: the first prefilled, the second's client left, then the third's.
    The prefix is the first's again, to its own expiry: not the second's, withdrawn under the third."""
    clock = Clock()
    pending = PendingPrefixes(20.0, clock)
    first = pending.add("a", [1, 2, 3])
    assert first is not None
    pending.settle(first)
    clock.now += 5
    second = pending.add("a", [1, 2, 3])
    clock.now += 5
    third = pending.add("a", [1, 2])
    assert second is not None and third is not None
    pending.withdraw(second)  # 3 goes back to the first's entry, 1 and 2 stay the third's
    pending.withdraw(third)
    assert pending.match([1, 2, 3]) == {"a": 3}
    clock.now += 10  # the first's entries expire, the second's would have lived 5 s more
    assert pending.match([1, 2, 3]) == {}
    pending.prune()
    assert len(pending) == 0


def test_a_claim_withdrawn_under_a_renewal_is_passed_over_after_prunes_while_it_would_live() -> None:
    clock = Clock()
    pending = PendingPrefixes(20.0, clock)
    first = pending.add("a", [1, 2])  # expires at 120
    clock.now += 5
    second = pending.add("a", [1, 2])  # at 125
    clock.now += 5
    third = pending.add("a", [1, 2])  # at 130
    assert first is not None and second is not None and third is not None
    pending.settle(first)
    pending.withdraw(second)
    clock.now += 11  # the first's entries expired; the second's would live 4 s more
    pending.prune()
    pending.withdraw(third)
    assert pending.match([1, 2]) == {} and len(pending) == 0


class _CountedGets(dict[int, object]):
    """A worker's withdrawn-claims map that counts its lookups: one per step of a withdrawal's walk."""

    gets = 0

    def get(self, key: int, default: object = None) -> object:
        _CountedGets.gets += 1
        return super().get(key, default)


def test_claims_failing_in_booking_order_cost_each_withdrawal_one_step_and_no_record_per_block() -> None:
    """A hung worker: every attempt on a shared 32-block prefix, 20 a second, times out 5 s after it
    was booked and is withdrawn, under the renewals booked since. Each withdrawal looks up one
    withdrawn claim per block, and what they keep names no block (none had a live value under them).
    Until 2026-12-07 (270ddb8) each kept its raw `prev` per block and the next withdrawal walked the
    chain of all of them: ~300 steps per block here (384k for a 256-block prefix at 100 a second)."""
    clock = Clock()
    pending = PendingPrefixes(20.0, clock)
    prefix = list(range(1, 33))
    in_flight: deque[tuple[float, Claim]] = deque()
    steps: list[int] = []  # per withdrawal
    kept: list[int] = []  # after each, the blocks the withdrawn claims' records name
    records = 0  # the most withdrawn claims' records at once
    for n in range(20 * 45):
        clock.now = 100.0 + n / 20
        if n < 20 * 40:  # then no more requests: the last ones time out too
            claim = pending.add("a", prefix)
            assert claim is not None
            in_flight.append((clock.now + 5.0, claim))
        table = pending._by_worker["a"]
        if not isinstance(table.withdrawn, _CountedGets):  # a prune makes a new map
            table.withdrawn = _CountedGets(table.withdrawn)  # type: ignore[assignment]
        while in_flight and in_flight[0][0] <= clock.now:
            _CountedGets.gets = 0
            pending.withdraw(in_flight.popleft()[1])
            steps.append(_CountedGets.gets)
            kept.append(sum(len(blocks) for _, blocks in table.withdrawn.values()))
            records = max(records, len(table.withdrawn))
        if n == 20 * 40 - 1:
            assert pending.match(prefix) == {"a": 32}  # the claims in flight hold it
            assert len(table.withdrawn) > 200  # the claims withdrawn under a renewal within the TTL
    assert len(steps) == 20 * 40
    assert max(steps) <= len(prefix)
    assert max(kept) == 0
    # a record lives to the first prune past its claim's expiry (prunes run at bookings, every 10 s
    # at most): the claims booked in the last TTL and prune period
    assert records <= 20 * 30
    assert pending.match(prefix) == {} and len(pending) == 0


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("ttl_s", [86_400.0, 20.0, 5.0])
def test_claims_end_entries_as_a_naive_model_of_them_does(ttl_s: float, seed: int) -> None:
    """Random bookings, settlements, withdrawals, confirmations, workers leaving and clock steps (up
    to 1.6 TTLs: prunes drop whole tables) on three workers over prompts that share prefixes, against
    per entry the claims made on it since it was made: its expiry is the latest of those neither
    withdrawn nor expired, and `match` (with and without `after`) counts the leading blocks that have
    one.

    A KV event ends the entry and every claim's hold on it: a claim in flight then holds nothing
    there, and an entry booked again after the event goes with that booking's withdrawal. (The
    model of ef80a8d's per-block counts kept it for the claim in flight; harmless to drop: the index
    speaks for the block, which the worker stored, or dropped and the claim's prefill stores again
    with an event of its own.)"""
    rng = random.Random(seed)
    clock = Clock()
    pending = PendingPrefixes(ttl_s, clock)
    workers = "abc"
    prompts = [list(range(1, 13)), [1, 2, 3, 4, 50, 51, 52], [1, 2, 60, 61], [70, 71, 72]]
    entries: dict[tuple[str, int], list[int]] = {}  # (worker, hash) -> claims made on it since it was made
    expiry: dict[int, float] = {}  # claim -> when its entries expire
    withdrawn: set[int] = set()
    live: list[tuple[int, Claim | None]] = []  # claims neither settled nor withdrawn

    def standing(w: str, h: int) -> list[float]:
        return [expiry[c] for c in entries.get((w, h), []) if c not in withdrawn and expiry[c] > clock.now]

    for n in range(3000):
        op = rng.random()
        if op < 0.08:
            clock.now += rng.choice([0.0, rng.random(), rng.random() * ttl_s, ttl_s * 1.6])
            if op < 0.03:
                pending.prune()
        elif op < 0.10:
            w = rng.choice(workers)
            pending.forget_worker(w)
            for key in [key for key in entries if key[0] == w]:
                del entries[key]
        elif op < 0.45 or not live:
            w, hashes = rng.choice(workers), rng.choice(prompts)[: rng.randint(1, 12)]
            live.append((n, pending.add(w, hashes)))
            expiry[n] = clock.now + ttl_s
            for h in hashes:
                entries.setdefault((w, h), []).append(n)
        elif op < 0.88:
            made, claim = live.pop(rng.randrange(len(live)))
            assert claim is not None
            if op < 0.6:
                pending.settle(claim)
            else:
                pending.withdraw(claim)
                withdrawn.add(made)
        else:
            w, hashes = rng.choice(workers), rng.sample(range(1, 73), 4)
            pending.confirm(w, hashes)
            for h in hashes:
                entries.pop((w, h), None)
        for w in workers:
            table = pending._by_worker.get(w)
            for h in range(1, 73):
                got = table.held.get(h) if table is not None else None
                want = standing(w, h)
                assert (got if got is not None and got > clock.now else None) == max(want, default=None), (n, w, h)
                assert pending.holds(w, h) == bool(want), (n, w, h)
            for prompt in prompts:
                for after in (0, 2):
                    k = after
                    while k < len(prompt) and standing(w, prompt[k]):
                        k += 1
                    assert pending.match(prompt, {w: after}).get(w) == (k if k > after else None), (n, w, prompt)


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
