"""BlockIndex: exact cases, then hypothesis sequences against a naive dict-of-sets reference, each
run on both cores (the C extension where it was built, and the pure-Python reference)."""

from __future__ import annotations

import shutil
import sysconfig
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import block_hashes
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
    everything = sorted(set().union(*ref.held.values()))
    for w, held in ref.held.items():
        assert all(idx.find_matches([h]).get(w) == 1 for h in held)
    assert sum(bool(idx.find_matches([h])) for h in range(3001)) == sum(h <= 3000 for h in everything)
    assert len(idx) == len(everything)


@pytest.mark.parametrize("bad", [-1, 2**64, "7", 1.5, None])
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


def test_a_prompt_hash_that_is_not_a_u64_ends_the_match(make_index: Callable[[], BlockIndex]) -> None:
    idx = make_index()
    idx.store("a", [1, 2, 2**64 - 1])
    assert idx.find_matches([1, -2, 2]) == {"a": 1}
    assert idx.find_matches([1, 2, 2**64 - 1, 2**64]) == {"a": 3}
    assert idx.find_matches([-1, 1]) == {}


def test_native_index_is_built_where_a_compiler_exists() -> None:
    """setup.py builds router._blockindex where a C compiler exists; a silent fallback to Python
    would cost the router its index targets (docs/router_index.md)."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the pure-Python index is in use")
    assert NATIVE
    assert BlockIndex().native
    assert not BlockIndex(native=False).native
