"""A hybrid model's sliding-window groups: the hit ends a shim publishes, against vLLM's own
reuse (tests/vllm/capture_hybrid.py) and at the window rule's boundaries."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence

import pytest

from protocol import Removed, Stored, block_hashes
from protocol.hashing import endpoint_key
from protocol.vllm_events import END_SEQ, decode_replay_reply
from tests.protocol.vllm_captures import FIXTURES
from worker_shim.adapters.vllm_events import decode_payload
from worker_shim.engine_events import FULL, WINDOW, EngineRemoved, EngineStored
from worker_shim.normaliser import Normaliser
from worker_shim.window_endpoints import WindowEndpoints

BS = 32


def _reused(keys: set[int], prompt: list[int]) -> int:
    """What a router predicts vLLM reuses: the longest held prefix, at most all but the last
    token, cut back to a published hit end."""
    hashes = block_hashes(prompt, BS)[: (len(prompt) - 1) // BS]
    held = next((i for i, h in enumerate(hashes) if h not in keys), len(hashes))
    return next((n for n in range(held, 0, -1) if endpoint_key(hashes[n - 1]) in keys), 0) * BS


def test_the_published_hit_ends_predict_what_vllm_reused_for_each_captured_request() -> None:
    batches = []
    for line in (FIXTURES / "bs32" / "hybrid_replay_from_0.jsonl").read_text().splitlines()[1:]:
        _, seq, payload = decode_replay_reply([bytes.fromhex(h) for h in json.loads(line)["frames_hex"]])
        if seq != END_SEQ:
            batches.append(decode_payload(payload))
    requests = json.loads((FIXTURES / "bs32" / "hybrid_requests.json").read_text())
    assert [r["cached_tokens"] for r in requests] == [0, 288, 0, 192, 192]
    for r in requests:
        norm = Normaliser(BS)
        for batch in batches[: r["batches_before"]]:
            norm.apply(batch)
        assert norm.stats.malformed == norm.stats.unknown_parent == norm.stats.unknown_removed == 0
        assert _reused(norm.canonical_hashes(), r["prompt"]) == r["cached_tokens"]
        # The shim's own count of a prompt's cached blocks (for its queued prefill tokens).
        hashes = block_hashes(r["prompt"], BS)[: (len(r["prompt"]) - 1) // BS]
        assert norm.cached_prefix_blocks(hashes) * BS == r["cached_tokens"]
    # Without the window rule, the last three would be predicted at 192, 192 and 256.
    norm = Normaliser(BS)
    for batch in batches:
        norm.apply(batch)
    assert norm.windows.window == 64


def _chain(n: int, base: int = 0) -> tuple[list[int], list[int]]:
    tokens = list(range(base, base + n * BS))
    return tokens, block_hashes(tokens, BS)


def _stored(hashes: list[int], tokens: list[int], kind: str = FULL, group: int = 1, window: int = 0) -> EngineStored:
    return EngineStored(
        hashes=hashes, parent=None, token_ids=tokens, block_size=BS, group=group, kind=kind, window=window
    )


def _ends(out: Sequence[object]) -> tuple[set[int], set[int]]:
    gained = {h for e in out if isinstance(e, Stored) for h in e.hashes}
    lost = {h for e in out if isinstance(e, Removed) for h in e.hashes}
    return gained, lost


def test_a_window_cached_before_the_full_blocks_in_one_batch_is_resolved_through_them() -> None:
    tokens, canon = _chain(4)
    engine = [1000 + i for i in range(4)]
    norm = Normaliser(BS)
    # vLLM's order: the window group (0) first, holding the last two blocks of a 96-token window.
    out = norm.apply([_stored(engine[2:], tokens, WINDOW, 0, 96), _stored(engine, tokens)])
    gained, _ = _ends(out)
    need = -(-(96 - 1) // BS)  # 3 blocks, of which only 2 are held: no end at block 4
    assert need == 3 and endpoint_key(canon[3]) not in gained
    out = norm.apply([_stored([engine[1]], tokens[: 2 * BS], WINDOW, 0, 96)])
    assert _ends(out)[0] == {endpoint_key(canon[3])}


def test_a_model_with_only_a_window_group_is_said_once_not_silently_uncredited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM accepts an all-sliding-window model as one group; kvswitch chains window blocks through
    a full-attention group, so such a worker publishes nothing and gets no prefix credit: that was
    said nowhere but a counter."""
    tokens, _ = _chain(4)
    norm = Normaliser(BS)
    with caplog.at_level(logging.WARNING, logger="worker_shim.normaliser"):
        for base in (0, 100):
            assert norm.apply([_stored([base + i for i in range(4)], tokens, WINDOW, 0, 4096)]) == []
    said = [r.getMessage() for r in caplog.records if "no full-attention group" in r.getMessage()]
    assert len(said) == 1 and "no prefix credit" in said[0]
    assert norm.stats.unknown_parent == 8


def test_a_prefix_shorter_than_the_window_is_an_end_when_every_block_from_the_root_is_held() -> None:
    ends = WindowEndpoints()
    _, canon = _chain(2)
    ends.stored(0, 4 * BS, BS, [(10, canon[0], None), (11, canon[1], canon[0])])
    assert set(ends.settle()[0]) == {canon[0], canon[1]}


def test_an_evicted_window_block_takes_the_ends_that_needed_it_and_only_those() -> None:
    ends = WindowEndpoints()
    _, canon = _chain(6)
    parents = [None, *canon[:-1]]
    ends.stored(0, 2 * BS, BS, [(100 + i, canon[i], parents[i]) for i in range(6)])  # need 2
    assert set(ends.settle()[0]) == set(canon)
    assert ends.removed(0, [102]) == 0
    gained, lost = ends.settle()
    assert (gained, set(lost)) == ([], {canon[2], canon[3]})  # blocks 3 and 4 end runs through 2
    ends.stored(0, 2 * BS, BS, [(102, canon[2], canon[1])])
    assert set(ends.settle()[0]) == {canon[2], canon[3]}


def test_every_window_group_must_hold_the_window() -> None:
    ends = WindowEndpoints()
    _, canon = _chain(3)
    ends.stored(0, 2 * BS, BS, [(1, canon[1], canon[0]), (2, canon[2], canon[1])])
    assert ends.settle()[0] == [canon[2]]
    ends.stored(2, 2 * BS, BS, [(2, canon[2], canon[1])])  # a second window group lacks block 2
    assert ends.settle() == ([], [canon[2]])


def test_a_copy_held_twice_stays_until_both_are_removed() -> None:
    ends = WindowEndpoints()
    _, canon = _chain(1)
    ends.stored(0, BS, BS, [(1, canon[0], None)])
    ends.stored(0, BS, BS, [(1, canon[0], None)])
    ends.settle()
    ends.removed(0, [1])
    assert ends.settle() == ([], [])
    ends.removed(0, [1])
    assert ends.settle() == ([], [canon[0]])
    assert ends.removed(0, [1]) == 1  # no longer held: counted unknown


def test_full_attention_removals_leave_the_window_groups_alone_and_the_reverse() -> None:
    tokens, canon = _chain(2)
    norm = Normaliser(BS)
    norm.apply([_stored([1, 2], tokens, WINDOW, 0, 2 * BS), _stored([1, 2], tokens)])
    assert endpoint_key(canon[1]) in norm.canonical_hashes()
    norm.apply([EngineRemoved(hashes=[2], group=0)])  # the window group evicts block 2
    assert canon[1] in norm.canonical_hashes() and endpoint_key(canon[1]) not in norm.canonical_hashes()
    norm.apply([EngineRemoved(hashes=[1], group=1)])  # the full group evicts block 1
    assert canon[0] not in norm.canonical_hashes() and endpoint_key(canon[0]) in norm.canonical_hashes()


def test_a_group_kind_kvswitch_does_not_model_is_counted_and_named_once(caplog: pytest.LogCaptureFixture) -> None:
    tokens, canon = _chain(1)
    norm = Normaliser(BS)
    with caplog.at_level(logging.WARNING):
        out = norm.apply([_stored([1], tokens, "mamba", 2), _stored([1], tokens), _stored([1], tokens, "mamba", 2)])
    assert norm.stats.other_groups == 2 and norm.canonical_hashes() == {canon[0]}
    assert _ends(out) == ({canon[0]}, set())
    assert sum("'mamba'" in r.getMessage() for r in caplog.records) == 1


def test_a_second_full_attention_group_is_counted_and_named_once(caplog: pytest.LogCaptureFixture) -> None:
    # vLLM splits full attention into groups when it has 1.5x the layers of the smallest kind, and
    # reuses a block only while every full group holds it; the shim folds them into one chain.
    tokens, canon = _chain(9)
    engine = list(range(700, 709))
    norm = Normaliser(BS)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            norm.apply(
                [
                    _stored(engine[7:], tokens, WINDOW, 0, 2 * BS),
                    _stored(engine, tokens, FULL, 1),
                    _stored(engine, tokens, FULL, 2),
                ]
            )
    assert norm.stats.full_groups_folded == 1 and norm.canonical_hashes() >= set(canon)
    assert sum("group 2 is another full-attention group" in r.getMessage() for r in caplog.records) == 1


def test_a_removal_from_a_group_never_named_is_counted_not_applied() -> None:
    tokens, canon = _chain(1)
    norm = Normaliser(BS)
    norm.apply([_stored([1], tokens)])
    norm.apply([EngineRemoved(hashes=[1], group=3)])
    assert norm.canonical_hashes() == {canon[0]} and norm.stats.unknown_removed == 1


def test_a_reset_forgets_the_windows_and_a_dump_holds_the_ends() -> None:
    tokens, canon = _chain(1)
    norm = Normaliser(BS)
    norm.apply([_stored([1], tokens, WINDOW, 0, BS), _stored([1], tokens)])
    assert set(norm.dump()) == {canon[0], endpoint_key(canon[0])}
    norm.reset(exact=True)
    assert norm.dump() == [] and not norm.windows.endpoints


# A window of 3 blocks and a token: a hit needs the 3 blocks ending there. Small ints iterate a set in
# value order, so the chains below are named deepest-first: a set of changed blocks lists the child
# before its ancestor.
_NEED3 = 3 * BS + 1


def test_an_end_settled_before_its_ancestor_was_evicted_is_lost() -> None:
    b0, b1, b2 = 30, 20, 10
    assert list({b0, b2}) == [b2, b0]
    ends = WindowEndpoints()
    ends.stored(0, _NEED3, BS, [(100, b0, None), (101, b1, b0), (102, b2, b1)])
    assert set(ends.settle()[0]) == {b0, b1, b2}  # a prefix shorter than the window, from the root
    # One engine step: b0 evicted, and b2's copy evicted and cached again by another request.
    ends.removed(0, [100])
    ends.removed(0, [102])
    ends.stored(0, _NEED3, BS, [(102, b2, b1)])
    gained, lost = ends.settle()
    assert (gained, set(lost), ends.endpoints) == ([], {b0, b1, b2}, set())


def test_an_end_settled_before_its_ancestor_was_cached_is_gained() -> None:
    b0, b1, b2, b3 = 40, 30, 20, 10
    assert list({b1, b3}) == [b3, b1]
    ends = WindowEndpoints()
    ends.stored(0, _NEED3, BS, [(100, b0, None), (102, b2, b1)])
    assert ends.settle() == ([b0], [])
    ends.stored(0, _NEED3, BS, [(101, b1, b0), (103, b3, b2)])
    gained, lost = ends.settle()
    assert (set(gained), lost, ends.endpoints) == ({b1, b2, b3}, [], {b0, b1, b2, b3})


def test_an_end_gained_and_lost_in_one_settle_is_neither() -> None:
    b0, b1, b2, b3 = 40, 30, 20, 10
    assert list({b1, b3}) == [b3, b1]
    ends = WindowEndpoints()
    ends.stored(0, _NEED3, BS, [(100, b0, None), (101, b1, b0), (102, b2, b1)])
    ends.settle()
    ends.stored(0, _NEED3, BS, [(103, b3, b2)])  # its window (b1, b2, b3) held, for a moment
    ends.removed(0, [101])
    gained, lost = ends.settle()
    assert (gained, set(lost), ends.endpoints) == ([], {b1, b2}, {b0})


def _brute_ends(held: dict[int, set[int]], need: dict[int, int], parent: dict[int, int | None]) -> set[int]:
    """The rule, block by block: every group holds the `need` blocks ending there, or all from the root."""
    out = set()
    for ch in set().union(*held.values()) if held else set():
        ok = True
        for g, blocks in held.items():
            block: int | None = ch
            for _ in range(need[g]):
                if block is None:
                    break
                if block not in blocks:
                    ok = False
                    break
                block = parent[block]
        if ok:
            out.add(ch)
    return out


def _random_stores_and_evictions(seed: int, events: int, settle_p: float, name: Callable[[int], int]) -> None:
    rng = random.Random(seed)
    # A tree of 120 blocks: three prompts branching off one another, as chains of blocks do.
    parent: dict[int, int | None] = {}
    for b in range(1, 121):
        parent[name(b)] = None if b in (1, 50) else name(b - 1 if b != 80 else 20)
    need = {0: 3, 1: 5}
    ends = WindowEndpoints()
    copies: dict[int, dict[int, int]] = {0: {}, 1: {}}
    for _ in range(events):
        g, b = rng.choice((0, 1)), name(rng.randint(1, 120))
        if rng.random() < 0.6:
            ends.stored(g, need[g] * BS + 1, BS, [(b, b, parent[b])])
            copies[g][b] = copies[g].get(b, 0) + 1
        elif copies[g].get(b):
            assert ends.removed(g, [b]) == 0
            copies[g][b] -= 1
        if rng.random() < settle_p:
            ends.settle()
            held = {g: {b for b, n in c.items() if n} for g, c in copies.items() if c}
            assert ends.endpoints == _brute_ends(held, {g: need[g] for g in held}, parent)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_ends_equal_the_rule_over_random_stores_and_evictions(seed: int) -> None:
    _random_stores_and_evictions(seed, 400, 0.3, lambda b: b)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_ends_equal_the_rule_when_children_settle_before_their_ancestors(seed: int) -> None:
    # Blocks named so a set iterates children before parents, and many changes per settle (as a
    # batch of a long prefill): a block may be settled before an ancestor's change reaches it.
    _random_stores_and_evictions(seed, 1000, 0.05, lambda b: 1000 - b)
