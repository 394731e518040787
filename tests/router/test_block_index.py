"""BlockIndex: exact cases, then hypothesis sequences against a naive dict-of-sets reference, each
run on both cores (the C extension where it was built, and the pure-Python reference)."""

from __future__ import annotations

import random
import shutil
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from functools import reduce
from operator import xor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import block_hashes, pack_hashes
from protocol.messages import Cleared, Removed, Stored
from router.block_index import NATIVE, BlockIndex

NATIVE_FLAGS = [pytest.param(False, id="python")] + ([pytest.param(True, id="native")] if NATIVE else [])


@pytest.fixture(params=NATIVE_FLAGS)
def make_index(request: pytest.FixtureRequest) -> Callable[[], BlockIndex]:
    native: bool = request.param
    return lambda: BlockIndex(native=native)


class NaiveIndex:
    """The reference: worker -> set of hashes, matches by walking the prompt per worker."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def store(self, worker: str, hashes: Sequence[int]) -> None:
        if hashes:
            self.held.setdefault(worker, set()).update(hashes)

    def remove(self, worker: str, hashes: Sequence[int]) -> None:
        if worker in self.held:
            self.held[worker].difference_update(hashes)
            if not self.held[worker]:
                del self.held[worker]

    def clear(self, worker: str) -> None:
        self.held.pop(worker, None)

    def find_matches(self, hashes: Sequence[int]) -> dict[str, int]:
        out = {}
        for worker, held in self.held.items():
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                out[worker] = n
        return out


def assert_matches(idx: BlockIndex, ref: NaiveIndex, prompt: Sequence[int], workers: Sequence[str]) -> None:
    """find_matches, and the lazy `match` read the ways routing and tests read it, agree with `ref`."""
    expected = ref.find_matches(prompt)
    assert idx.find_matches(prompt) == expected
    overlap = idx.match(prompt)
    assert {w: overlap.get(w, 0) for w in workers} == {w: expected.get(w, 0) for w in workers}
    assert dict(overlap) == expected
    assert len(overlap) == len(expected)
    for worker in workers:
        assert (worker in overlap) == (worker in expected)


def digest_of(hashes: Iterable[int]) -> tuple[int, int]:
    held = set(hashes)
    return len(held), reduce(xor, held, 0)


def assert_digests(idx: BlockIndex, ref: NaiveIndex, workers: Iterable[str]) -> None:
    for worker in workers:
        assert idx.digest(worker) == digest_of(ref.held.get(worker, ()))


def chain(n: int, start: int = 0) -> list[int]:
    return block_hashes(list(range(start, start + 4 * n)), 4)


def test_find_matches_counts_leading_blocks_per_worker(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    prompt = chain(6)
    idx.store("a", prompt[:2])
    idx.store("b", prompt)
    idx.store("c", prompt[:4])
    assert idx.find_matches(prompt) == {"a": 2, "b": 6, "c": 4}
    assert idx.find_matches(prompt[:3]) == {"a": 2, "b": 3, "c": 3}


def test_block_held_without_its_predecessor_does_not_count(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    prompt = chain(4)
    idx.store("a", [prompt[0], prompt[2], prompt[3]])
    assert idx.find_matches(prompt) == {"a": 1}
    idx.store("b", prompt[1:])
    assert idx.find_matches(prompt) == {"a": 1}


def test_unknown_prompt_and_empty_prompt_match_nothing(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    idx.store("a", chain(3))
    assert idx.find_matches(chain(3, start=1000)) == {}
    assert idx.find_matches([]) == {}


def test_remove_drops_only_that_workers_bits(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    prompt = chain(3)
    idx.store("a", prompt)
    idx.store("b", prompt)
    idx.remove("a", prompt[1:])
    assert idx.find_matches(prompt) == {"a": 1, "b": 3}
    assert len(idx) == 3
    assert idx.entries == 4
    assert idx.worker_hashes("a") == {prompt[0]}


def test_remove_of_unheld_hashes_and_unknown_worker_is_harmless(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    idx.store("a", [1, 2])
    idx.remove("a", [3])
    idx.remove("zz", [1])
    assert idx.dump() == {"a": [1, 2]}


def test_clear_removes_every_entry_and_frees_the_slot_for_reuse(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    idx.store("a", [1, 2, 3])
    idx.store("b", [1, 2])
    idx.clear("a")
    assert idx.workers() == ["b"]
    assert idx.entries == 2
    assert len(idx) == 2
    idx.store("c", [3])
    assert idx.slots == 2  # "c" took the slot "a" left
    assert idx.find_matches([1, 2]) == {"b": 2}
    assert idx.find_matches([3]) == {"c": 1}


def test_storing_twice_counts_once(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    idx.store("a", [5, 6])
    idx.store("a", [6, 7, 7])
    assert idx.entries == 3
    assert idx.worker_hashes("a") == {5, 6, 7}


def test_apply_runs_a_batch_of_events_in_order(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    idx.apply("a", [Stored(hashes=[1, 2, 3]), Removed(hashes=[3]), Cleared(), Stored(hashes=[9])])
    assert idx.dump() == {"a": [9]}


def test_dump_rebuilds_an_identical_index(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    idx.store("b", [3, 1, 2])
    idx.store("a", [2, 9])
    idx.remove("b", [1])
    copy = make_index()
    for worker, hashes in idx.dump().items():
        copy.store(worker, hashes)
    assert copy.dump() == idx.dump() == {"a": [2, 9], "b": [2, 3]}
    assert copy.find_matches([2, 3]) == idx.find_matches([2, 3])


@pytest.mark.parametrize("workers", [3, 17, 40, 300])
def test_many_workers_dropping_at_one_depth_are_all_named(make_index: Callable[[], BlockIndex], workers: int) -> None:
    # Exercises both ways of naming bits (few set bits, and the bulk path).
    idx = make_index()
    prompt = chain(5)
    names = [f"w{i}" for i in range(workers)]
    for i, name in enumerate(names):
        idx.store(name, prompt[: 2 + i % 3])
    expected = {name: 2 + i % 3 for i, name in enumerate(names)}
    assert idx.find_matches(prompt) == expected


def test_digest_counts_and_xors_what_the_worker_holds(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    assert idx.digest("a") == (0, 0)
    idx.store("a", [0, 5, 2**64 - 1, 5])
    assert idx.digest("a") == (3, 5 ^ (2**64 - 1))
    idx.store("b", [5])
    idx.remove("a", [5, 7])
    assert idx.digest("a") == (2, 2**64 - 1)
    assert idx.digest("b") == (1, 5)
    idx.clear("a")
    assert idx.digest("a") == (0, 0)
    idx.store("c", [9])  # takes the slot "a" left: nothing of a's digest carries over
    assert idx.digest("c") == (1, 9)


@pytest.mark.parametrize("holders", [1, 3, 4, 5, 6, 70])
def test_holders_crossing_the_inline_limit_both_ways(make_index: Callable[[], BlockIndex], holders: int) -> None:
    # The C core keeps up to 4 holders in the bucket and moves a hash to a bitset row at the 5th,
    # back at 3: every step up and down must answer as the reference does.
    idx, ref = make_index(), NaiveIndex()
    prompt = chain(3)
    names = [f"w{i}" for i in range(holders)]
    for name in names:
        idx.store(name, prompt)
        ref.store(name, prompt)
        assert_matches(idx, ref, prompt, names)
    for name in names:
        idx.remove(name, prompt[1:2])
        ref.remove(name, prompt[1:2])
        assert_matches(idx, ref, prompt, names)
    for name in reversed(names):
        idx.clear(name)
        ref.clear(name)
        assert_matches(idx, ref, prompt, names)
    assert len(idx) == 0 and idx.entries == 0


def test_blocks_dropped_and_stored_again_are_listed_once(make_index: Callable[[], BlockIndex]) -> None:
    # The C core logs each slot's gains and compacts the log later: churn over the same blocks must
    # neither repeat them in listings nor grow memory.
    idx = make_index()
    blocks = list(range(100))
    idx.store("a", blocks)
    idx.store("b", blocks[:10])
    settled = idx.memory_bytes()
    for r in range(300):
        gone = blocks[r % 100 : r % 100 + 40]
        idx.remove("a", gone)
        idx.store("a", gone[::2])
        idx.store("a", blocks)
    assert idx.worker_hashes("a") == set(blocks)
    assert idx.dump() == {"a": blocks, "b": blocks[:10]}
    assert idx.digest("a") == digest_of(blocks)
    assert idx.entries == 110
    assert idx.memory_bytes() <= 2 * settled
    idx.clear("a")
    assert idx.find_matches(blocks) == {"b": 10}


# --- memory ----------------------------------------------------------------------------------------


def fill(idx: BlockIndex, rng: random.Random, workers: int, entries: int, holders: int = 1) -> None:
    """Store random 64-block sequences until the index holds `entries` pairs, each sequence held by
    `holders` consecutive workers."""
    seq = 0
    while idx.entries < entries:
        hashes = [rng.getrandbits(64) for _ in range(64)]
        for k in range(holders):
            idx.store(f"w{(seq + k) % workers}", hashes)
        seq += 1


@pytest.mark.parametrize("holders", [1, 3])
def test_memory_grows_linearly_with_entries(make_index: Callable[[], BlockIndex], holders: int) -> None:
    idx, rng = make_index(), random.Random(holders)
    per_entry = []
    for entries in (2**12, 2**13, 2**14, 2**15, 2**16):
        fill(idx, rng, 64, entries, holders)
        assert idx.memory_bytes() > 0
        per_entry.append(idx.bytes_per_entry)
    # Over 16x the entries the cost per entry stays within one table doubling: linear growth.
    assert max(per_entry) <= 2.2 * min(per_entry), per_entry


@pytest.mark.skipif(not NATIVE, reason="router._blockindex was not built")
@pytest.mark.parametrize(("holders", "popular"), [(1, 0), (2, 0), (1, 1000)])
def test_native_index_costs_under_64_bytes_per_entry_at_1000_workers(holders: int, popular: int) -> None:
    # The sizing target is 125 B per (worker, block) at 1,000 workers (docs/router_index.md). A
    # bitset per hash would cost 128 B for the row alone; inline holders cost a bucket share.
    idx, rng = BlockIndex(native=True), random.Random(holders)
    shared = [rng.getrandbits(64) for _ in range(popular)]
    if shared:
        for w in range(1000):
            idx.store(f"w{w}", shared)  # a system prompt every worker holds
    fill(idx, rng, 1000, idx.entries + 131_072, holders)
    assert idx.bytes_per_entry <= 64, idx.bytes_per_entry


@pytest.mark.skipif(not NATIVE, reason="router._blockindex was not built")
def test_native_index_gives_memory_back_when_workers_leave() -> None:
    idx, rng = BlockIndex(native=True), random.Random(3)
    empty = idx.memory_bytes()
    fill(idx, rng, 200, 100_000, holders=6)
    assert idx.memory_bytes() > 20 * empty
    for w in range(200):
        idx.clear(f"w{w}")
    assert idx.memory_bytes() <= 2 * empty + 200 * 64  # the table back to its least; per-slot headers


# --- property tests ------------------------------------------------------------------------------

WORKERS = [f"w{i}" for i in range(6)]
HASHES = st.lists(st.integers(min_value=0, max_value=12), max_size=8)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(WORKERS), HASHES),
        st.tuples(st.just("remove"), st.sampled_from(WORKERS), HASHES),
        st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.just([])),
        st.tuples(st.just("leave_and_rejoin"), st.sampled_from(WORKERS), HASHES),
    ),
    max_size=60,
)


@pytest.mark.parametrize("native", NATIVE_FLAGS)
@settings(max_examples=300, deadline=None)
@given(ops=OPS, prompts=st.lists(st.lists(st.integers(min_value=0, max_value=12), max_size=10), max_size=6))
def test_index_agrees_with_naive_reference(
    native: bool, ops: list[tuple[str, str, list[int]]], prompts: list[list[int]]
) -> None:
    idx, ref = BlockIndex(native=native), NaiveIndex()
    for op, worker, hashes in ops:
        if op == "store":
            idx.store(worker, hashes)
            ref.store(worker, hashes)
        elif op == "remove":
            idx.remove(worker, hashes)
            ref.remove(worker, hashes)
        elif op == "clear":
            idx.clear(worker)
            ref.clear(worker)
        else:  # the worker leaves (its slot is recycled) and comes back holding `hashes`
            idx.clear(worker)
            ref.clear(worker)
            idx.store(worker, hashes)
            ref.store(worker, hashes)
        for prompt in prompts:
            assert_matches(idx, ref, prompt, WORKERS)
        assert_digests(idx, ref, WORKERS)
    assert idx.dump() == {w: sorted(h) for w, h in sorted(ref.held.items())}
    assert idx.workers() == sorted(ref.held)
    assert len(idx) == len(set().union(*ref.held.values()))
    assert idx.entries == sum(len(h) for h in ref.held.values())
    assert idx.slots <= len(WORKERS)
    for worker in WORKERS:
        assert idx.worker_hashes(worker) == ref.held.get(worker, set())


@pytest.mark.parametrize("native", NATIVE_FLAGS)
@settings(max_examples=100, deadline=None)
@given(
    depths=st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=80),
    gaps=st.lists(st.integers(min_value=0, max_value=11), max_size=20),
)
def test_wide_masks_agree_with_reference(native: bool, depths: list[int], gaps: list[int]) -> None:
    # Many workers along one chain, some with holes: the masks span several machine words.
    prompt = chain(12)
    idx, ref = BlockIndex(native=native), NaiveIndex()
    for i, depth in enumerate(depths):
        held = [h for j, h in enumerate(prompt[:depth]) if not (gaps and j == gaps[i % len(gaps)])]
        idx.store(f"w{i}", held)
        ref.store(f"w{i}", held)
    assert_matches(idx, ref, prompt, [f"w{i}" for i in range(len(depths) + 1)])


@pytest.mark.parametrize("native", NATIVE_FLAGS)
@settings(max_examples=20, deadline=None)
@given(
    n_workers=st.integers(min_value=60, max_value=1100),
    depths=st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=40),
    churn=st.lists(
        st.tuples(st.sampled_from(["remove", "clear", "leave_and_rejoin"]), st.integers(0, 1099), st.integers(0, 7)),
        max_size=40,
    ),
)
def test_slots_beyond_64_and_1000_workers_agree_with_reference(
    native: bool, n_workers: int, depths: list[int], churn: list[tuple[str, int, int]]
) -> None:
    # Bitsets start one word wide and double as slots pass 64, 128, ..., 1024.
    prompt = chain(8)
    names = [f"w{i}" for i in range(n_workers)]
    idx, ref = BlockIndex(native=native), NaiveIndex()
    for i, name in enumerate(names):
        held = prompt[: depths[i % len(depths)]]
        idx.store(name, held)
        ref.store(name, held)
    for op, who, depth in churn:
        name = names[who % n_workers]
        if op == "remove":  # a hole at `depth`: the worker's prefix ends there
            idx.remove(name, prompt[depth : depth + 1])
            ref.remove(name, prompt[depth : depth + 1])
        else:
            idx.clear(name)
            ref.clear(name)
            if op == "leave_and_rejoin":
                idx.store(name, prompt[:depth])
                ref.store(name, prompt[:depth])
    for cut in (8, 5, 1):
        assert idx.find_matches(prompt[:cut]) == ref.find_matches(prompt[:cut])
    overlap = idx.match(prompt)
    assert {w: overlap.get(w, 0) for w in names} == {w: ref.find_matches(prompt).get(w, 0) for w in names}
    assert idx.dump() == {w: sorted(h) for w, h in sorted(ref.held.items())}
    assert idx.entries == sum(len(h) for h in ref.held.values())
    assert len(idx) == len(set().union(*ref.held.values()))
    assert idx.slots <= n_workers
    assert_digests(idx, ref, names)


BIG_HASHES = st.lists(
    st.one_of(st.integers(min_value=0, max_value=3000), st.integers(min_value=2**64 - 50, max_value=2**64 - 1)),
    max_size=300,
)


@pytest.mark.parametrize("native", NATIVE_FLAGS)
@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "remove", "clear"]), st.sampled_from(WORKERS[:3]), BIG_HASHES),
        max_size=25,
    )
)
def test_crowded_table_agrees_with_reference(native: bool, ops: list[tuple[str, str, list[int]]]) -> None:
    # Thousands of keys: the C table grows and its probe runs get long, so removals shift keys back
    # across them; every later lookup checks that the shifting kept each key findable.
    idx, ref = BlockIndex(native=native), NaiveIndex()
    for op, worker, hashes in ops:
        for index in (idx, ref):
            if op == "clear":
                index.clear(worker)
            else:
                getattr(index, op)(worker, hashes)
        for w in WORKERS[:3]:
            assert idx.worker_hashes(w) == ref.held.get(w, set())
        assert_digests(idx, ref, WORKERS[:3])
    everything = sorted(set().union(*ref.held.values()))
    for w, held in ref.held.items():
        assert all(idx.find_matches([h]).get(w) == 1 for h in held)
    assert sum(bool(idx.find_matches([h])) for h in range(3001)) == sum(h <= 3000 for h in everything)
    assert len(idx) == len(everything)


@pytest.mark.parametrize("bad", [-1, 2**64, 2**100, -(2**70), "7", 1.5, None])
def test_a_hash_that_is_not_a_u64_is_refused_and_changes_nothing(
    make_index: Callable[[], BlockIndex], bad: object
) -> None:
    idx = make_index()
    with pytest.raises(ValueError, match=r"block hashes must be integers in \[0, 2\*\*64\): got "):
        idx.store("new", [1, bad])  # type: ignore[list-item]
    assert idx.workers() == [] and idx.entries == 0 and len(idx) == 0
    idx.store("a", [0, 2**64 - 1])
    with pytest.raises(ValueError, match=repr(bad)):
        idx.store("a", iter([5, bad]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=repr(bad)):
        idx.remove("a", [0, bad])  # type: ignore[list-item]
    assert idx.dump() == {"a": [0, 2**64 - 1]}
    assert idx.entries == 2


def test_packed_hashes_store_and_remove_as_their_ints_do(make_index: Callable[[], BlockIndex]) -> None:
    hashes = [0, 1, 2**30, 2**63, 2**64 - 1, 12345678901234567]
    as_ints, as_packed = make_index(), make_index()
    as_ints.store("a", hashes)
    as_packed.store("a", pack_hashes(hashes))
    as_ints.remove("a", hashes[1:3])
    as_packed.remove("a", pack_hashes(hashes[1:3]))
    as_packed.apply("b", [Stored(hashes=pack_hashes(hashes[:2])), Removed(hashes=pack_hashes(hashes[:1]))])
    as_ints.apply("b", [Stored(hashes=hashes[:2]), Removed(hashes=hashes[:1])])
    assert as_packed.dump() == as_ints.dump()
    assert as_packed.worker_hashes("a") == {0, 2**63, 2**64 - 1, 12345678901234567}
    assert as_packed.worker_hashes("b") == {1}
    assert as_packed.digest("a") == as_ints.digest("a")
    assert as_packed.find_matches(hashes) == as_ints.find_matches(hashes)


@pytest.mark.parametrize("size", [1, 7, 9, 15])
def test_packed_hashes_that_are_not_whole_u64s_are_refused_and_change_nothing(
    make_index: Callable[[], BlockIndex], size: int
) -> None:
    idx = make_index()
    idx.store("a", [5])
    with pytest.raises(ValueError, match=f"multiple of 8 bytes, got {size}"):
        idx.store("a", b"\x01" * size)
    with pytest.raises(ValueError, match=f"multiple of 8 bytes, got {size}"):
        idx.remove("a", b"\x05" + b"\x00" * (size - 1))
    assert idx.dump() == {"a": [5]} and idx.entries == 1


def test_hashes_at_every_digit_boundary_are_kept_exactly(make_index: Callable[[], BlockIndex]) -> None:
    # The C core reads CPython's 30-bit digits directly: one, two and three digits, and the top.
    edges = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 2, 2**64 - 1]
    idx = make_index()
    idx.store("a", edges)
    assert idx.dump() == {"a": edges}
    assert idx.find_matches(edges) == {"a": len(edges)}
    assert idx.digest("a") == digest_of(edges)
    for h in edges:
        assert idx.find_matches([h]) == {"a": 1}
    idx.remove("a", edges[::2])
    assert idx.dump() == {"a": edges[1::2]}


def test_a_prompt_hash_that_is_not_a_u64_ends_the_match(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    idx.store("a", [1, 2, 2**64 - 1])
    assert idx.find_matches([1, -2, 2]) == {"a": 1}
    assert idx.find_matches([1, 2, 2**64 - 1, 2**64]) == {"a": 3}
    assert idx.find_matches([1, 2, 2**100]) == {"a": 2}
    assert idx.find_matches([-1, 1]) == {}
    assert idx.find_matches([2**30, 1]) == {}  # one more than a single 30-bit digit holds


def test_native_index_is_built_where_a_compiler_exists() -> None:
    """setup.py builds router._blockindex where a C compiler exists; a silent fallback to Python
    would cost the router its index targets (docs/router_index.md)."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the pure-Python index is in use")
    assert NATIVE
    assert BlockIndex().native
    assert not BlockIndex(native=False).native
