"""The normaliser: engine hashes to canonical ones, reference counts, unknown parents, dumps."""

from __future__ import annotations

import logging
import random

import pytest

from protocol import Cleared, KvEvent, Removed, Stored, block_hashes, root_hash
from router.block_index import BlockIndex
from worker_shim import EngineCleared, EngineRemoved, EngineStored, Normaliser

B = 4


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, salt: str = "") -> EngineStored:
    return EngineStored(hashes=hashes, parent=parent, token_ids=tokens, block_size=B, salt=salt)


def fold(events: list[KvEvent], into: set[int] | None = None) -> set[int]:
    s = set() if into is None else into
    for e in events:
        if isinstance(e, Stored):
            s.update(e.hashes)
        elif isinstance(e, Removed):
            s.difference_update(e.hashes)
        elif isinstance(e, Cleared):
            s.clear()
    return s


def test_root_chain_hashes_are_the_canonical_ones() -> None:
    n = Normaliser(B)
    toks = list(range(1, 13))
    out = n.apply([stored([101, 102, 103], toks)])
    assert out == [Stored(hashes=block_hashes(toks, B), parent=None)]
    assert n.canonical_hashes() == set(block_hashes(toks, B))


def test_child_chain_continues_from_the_parents_canonical_hash() -> None:
    n = Normaliser(B)
    toks = list(range(1, 13))
    n.apply([stored([101, 102], toks[:8])])
    out = n.apply([stored([103], toks[8:], parent=102)])
    full = block_hashes(toks, B)
    assert out == [Stored(hashes=[full[2]], parent=full[1])]


def test_lora_salt_starts_another_chain() -> None:
    n = Normaliser(B)
    out = n.apply([stored([1], [1, 2, 3, 4], salt="adapter-a")])
    assert out == [Stored(hashes=block_hashes([1, 2, 3, 4], B, salt="adapter-a"), parent=None)]
    assert out[0].hashes != block_hashes([1, 2, 3, 4], B)  # type: ignore[union-attr]


def test_a_block_stored_twice_is_stored_once_and_removed_on_the_last_removal() -> None:
    n = Normaliser(B)
    h = block_hashes([1, 2, 3, 4], B)
    assert n.apply([stored([7], [1, 2, 3, 4])]) == [Stored(hashes=h, parent=None)]
    assert n.apply([stored([7], [1, 2, 3, 4])]) == []
    assert n.apply([EngineRemoved(hashes=[7])]) == []
    assert n.canonical_hashes() == set(h)
    assert n.apply([EngineRemoved(hashes=[7])]) == [Removed(hashes=h)]
    assert n.canonical_hashes() == set()


def test_two_engine_hashes_naming_one_canonical_block_are_counted_together() -> None:
    n = Normaliser(B)
    h = block_hashes([9, 9, 9, 9], B)
    assert n.apply([stored([1], [9, 9, 9, 9]), stored([2], [9, 9, 9, 9])]) == [Stored(hashes=h, parent=None)]
    assert n.apply([EngineRemoved(hashes=[1])]) == []
    assert n.apply([EngineRemoved(hashes=[2])]) == [Removed(hashes=h)]


def test_a_chain_crossing_held_blocks_splits_into_runs_with_their_parents() -> None:
    n = Normaliser(B)
    toks = list(range(1, 17))
    full = block_hashes(toks, B)
    n.apply([stored([11], toks[:4]), stored([12], toks[4:8], parent=11)])
    n.apply([EngineRemoved(hashes=[11])])  # the root block leaves, its child stays
    out = n.apply([stored([11, 12, 13, 14], toks)])
    assert out == [Stored(hashes=[full[0]], parent=None), Stored(hashes=[full[2], full[3]], parent=full[1])]


def test_unknown_parent_emits_nothing_and_asks_for_a_rebuild() -> None:
    n = Normaliser(B)
    assert n.apply([stored([5], [1, 2, 3, 4], parent=999)]) == []
    assert n.needs_rebuild and n.stats.unknown_parent == 1 and not n.canonical_hashes()


def test_after_an_incomplete_reset_unknown_parents_are_only_counted() -> None:
    n = Normaliser(B)
    assert n.reset(exact=False) == [Cleared()]
    assert n.apply([stored([5], [1, 2, 3, 4], parent=999)]) == []
    assert not n.needs_rebuild and n.stats.unknown_parent == 1


def test_a_parent_removed_before_its_child_is_stored_still_resolves() -> None:
    n = Normaliser(B)
    toks = list(range(1, 9))
    n.apply([stored([1], toks[:4])])
    n.apply([EngineRemoved(hashes=[1])])
    out = n.apply([stored([2], toks[4:], parent=1)])
    full = block_hashes(toks, B)
    assert out == [Stored(hashes=[full[1]], parent=full[0])] and not n.needs_rebuild


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (EngineStored(hashes=[1, 2], parent=None, token_ids=[1, 2, 3, 4], block_size=B), "token count"),
        (EngineStored(hashes=[1], parent=None, token_ids=[1] * 8, block_size=8), "block size"),
        (EngineStored(hashes=[1], parent=None, token_ids=[1, 2, -3, 4], block_size=B), "negative token"),
    ],
)
def test_malformed_stores_are_counted_and_dropped(event: EngineStored, why: str) -> None:
    n = Normaliser(B)
    assert n.apply([event]) == [], why
    assert n.stats.malformed == 1 and not n.canonical_hashes()


def test_malformed_stores_are_logged_once_per_kind_whatever_their_values(caplog: pytest.LogCaptureFixture) -> None:
    # keyed on the message, which names the event's values: one line and one set entry per event
    n = Normaliser(B)
    with caplog.at_level(logging.WARNING):
        for i in range(1, 41):
            n.apply([EngineStored(hashes=[i], parent=None, token_ids=[1] * (B + i), block_size=B)])  # token count
            n.apply([EngineStored(hashes=[100 + i], parent=None, token_ids=[1, 2, -i, 4], block_size=B)])  # token id
    lines = [r.getMessage() for r in caplog.records if "malformed KV event" in r.getMessage()]
    assert len(lines) == 2 and n.stats.malformed == 80
    assert "5 token ids for 1 blocks of 4" in lines[0]


@pytest.mark.parametrize(
    "bad",
    [
        EngineStored(hashes=[1], parent=None, token_ids=[1, 2, -3, 4], block_size=B),
        EngineStored(hashes=[1], parent=None, token_ids=[1] * 8, block_size=8),
    ],
    ids=["bad-token", "bad-block-size"],
)
def test_the_chain_below_a_malformed_block_is_dropped_without_a_rebuild(bad: EngineStored) -> None:
    """The child of a malformed block read as an unknown parent after a complete replay: the shim
    asked for another replay, which sent the same bytes, forever (a Cleared to every router per
    poll, and an empty index)."""
    n = Normaliser(B)
    n.reset(exact=True)
    events = [bad, stored([2], [5, 6, 7, 8], parent=1), stored([3], [9, 10, 11, 12], parent=2)]
    assert n.apply(events) == []
    assert not n.needs_rebuild and n.stats.unknown_parent == 0
    assert n.stats.malformed == 3  # the malformed block and both blocks below it, dropped
    assert n.apply([EngineRemoved(hashes=[1, 2, 3])]) == [] and n.stats.unknown_removed == 0
    # Kept over resets (an engine hash names fixed content), while other chains are stored as before.
    n.reset(exact=True)
    assert n.apply([stored([4], [13, 14, 15, 16], parent=3)]) == [] and not n.needs_rebuild
    assert n.apply([stored([9], [1, 2, 3, 4])]) == [Stored(hashes=block_hashes([1, 2, 3, 4], B), parent=None)]


def test_unknown_removals_are_counted_and_ignored() -> None:
    n = Normaliser(B)
    assert n.apply([EngineRemoved(hashes=[42])]) == []
    assert n.stats.unknown_removed == 1


def test_engine_cleared_clears() -> None:
    n = Normaliser(B)
    n.apply([stored([1], [1, 2, 3, 4])])
    assert n.apply([EngineCleared()]) == [Cleared()]
    assert not n.canonical_hashes()


def test_dump_puts_every_parent_before_its_children() -> None:
    n = Normaliser(B)
    toks = list(range(1, 17))
    full = block_hashes(toks, B)
    n.apply([stored([1, 2, 3, 4], toks)])
    n.apply([EngineRemoved(hashes=[1])])
    n.apply([stored([1], toks[:4])])  # re-stored after its children: dump must still lead with it
    dump = n.dump()
    assert sorted(dump) == sorted(full)
    assert [dump.index(h) for h in full] == sorted(dump.index(h) for h in full)
    assert fold(n.snapshot()) == set(full)


class _EngineModel:
    """What an engine holds, as prefixes, for the randomized comparison."""

    def __init__(self) -> None:
        self.prefix: dict[int, list[int]] = {}
        self.refs: dict[int, int] = {}

    def canonical(self) -> set[int]:
        return {block_hashes(self.prefix[h], B)[-1] for h, r in self.refs.items() if r > 0}


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_match_an_independent_prefix_model(seed: int) -> None:
    rng = random.Random(seed)
    n = Normaliser(B)
    model = _EngineModel()
    subscriber: set[int] = set()
    next_hash = iter(range(1_000, 10**9))
    by_prefix: dict[tuple[int, ...], int] = {}
    for _ in range(400):
        if rng.random() < 0.6 or not model.refs:
            held = [h for h, r in model.refs.items() if r > 0]
            parent = rng.choice(held) if held and rng.random() < 0.7 else None
            base = model.prefix[parent] if parent is not None else []
            k = rng.randrange(1, 4)
            toks = [rng.randrange(0, 3) for _ in range(k * B)]  # tiny vocabulary: collisions happen
            hashes = []
            for i in range(k):
                prefix = tuple(base + toks[: (i + 1) * B])
                eh = by_prefix.setdefault(prefix, next(next_hash))
                model.prefix[eh] = list(prefix)
                model.refs[eh] = model.refs.get(eh, 0) + 1
                hashes.append(eh)
            fold(n.apply([stored(hashes, toks, parent=parent)]), subscriber)
        else:
            eh = rng.choice([h for h, r in model.refs.items() if r > 0] or [next(next_hash)])
            if model.refs.get(eh, 0) > 0:
                model.refs[eh] -= 1
            fold(n.apply([EngineRemoved(hashes=[eh])]), subscriber)
        assert n.canonical_hashes() == model.canonical() == subscriber
    assert not n.needs_rebuild and n.stats.malformed == 0
    assert root_hash() not in n.canonical_hashes()


def test_cached_prefix_blocks_counts_leading_held_blocks_only() -> None:
    n = Normaliser(B)
    n.apply([stored([101, 102], list(range(1, 9)))])  # the engine holds the first two blocks
    prompt = list(range(1, 13))  # ... of this three-block prompt
    assert n.cached_prefix_blocks(block_hashes(prompt, B)) == 2
    assert n.cached_prefix_blocks(block_hashes(list(range(50, 62)), B)) == 0
    assert n.cached_prefix_blocks([]) == 0


def test_a_clear_after_an_unknown_parent_in_one_batch_asks_for_no_rebuild() -> None:
    """The engine's own Cleared starts it afresh: the unknown parent before it names nothing to
    rebuild (the flag and the parents it kept used to disagree after such a batch)."""
    n = Normaliser(B)
    n.reset(exact=True)
    n.apply([stored([2], [5, 6, 7, 8], parent=999), EngineCleared()])
    assert not n.needs_rebuild and n.rebuild_parents == set()


def test_a_snapshot_is_a_stored_per_chain_that_rebuilds_the_per_block_index() -> None:
    """A registration's snapshot of a branching tree (prompts sharing prefixes, some evicted and
    stored again): a Stored per run of chained blocks, each after its parent's run, where it was one
    per block (~54 B each on the wire: 100k blocks went past a router's byte burst). The router's
    index built from it is the one the per-block form built."""
    rng = random.Random(7)
    n = Normaliser(B)
    parent_of: dict[int, int | None] = {}
    trunks = [[rng.randrange(1, 1000) for _ in range(B * rng.randint(1, 6))] for _ in range(5)]
    engine = 1
    for _ in range(60):
        toks = rng.choice(trunks) + [rng.randrange(1, 1000) for _ in range(B * rng.randint(0, 8))]
        full = block_hashes(toks, B)
        parent_of.update(zip(full, [None, *full[:-1]], strict=True))
        n.apply([stored(list(range(engine, engine + len(full))), toks)])
        engine += len(full)
    n.apply([EngineRemoved(hashes=list(range(40, 60)))])  # evictions cut chains in the middle
    held = n.canonical_hashes()
    snap = n.snapshot()
    assert all(isinstance(e, Stored) and e.medium is None for e in snap)
    runs = [e for e in snap if isinstance(e, Stored)]
    assert len(runs) < len(held) // 3  # a Stored per chain, not per block
    out: set[int] = set()
    for e in runs:
        assert e.parent == parent_of[e.hashes[0]]
        assert e.parent is None or e.parent in out or e.parent not in held  # parent-first
        hashes = list(e.hashes)
        assert [parent_of[h] for h in hashes[1:]] == hashes[:-1]  # each run one chain
        out.update(hashes)
    assert out == held
    per_block = [Stored(hashes=[h], parent=parent_of[h]) for h in n.dump()]
    by_run, by_block = BlockIndex(), BlockIndex()
    by_run.apply("w", [Cleared(), *snap])
    by_block.apply("w", [Cleared(), *per_block])
    assert by_run.worker_hashes("w") == by_block.worker_hashes("w") == held
    assert by_run.digest("w") == by_block.digest("w")
