"""The prefix-caching block pool: references, LRU eviction and the events each change emits."""

from __future__ import annotations

import pytest

from engine_sim.block_hash import HashedBlock, root_hash
from engine_sim.block_pool import BlockPool
from protocol.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored

ROOT = root_hash("0")


def chain(tokens: list[int], bs: int = 4) -> list[HashedBlock]:
    out: list[HashedBlock] = []
    for i in range(0, len(tokens) - len(tokens) % bs, bs):
        out.append(HashedBlock(out[-1] if out else None, tuple(tokens[i : i + bs]), ROOT))
    return out


def test_stored_event_names_parent_and_tokens() -> None:
    pool = BlockPool(8, 4)
    c = chain(list(range(12)))
    blocks = pool.allocate(3)
    pool.cache(blocks, c, 0, 2)
    pool.cache(blocks, c, 2, 3)
    first, second = pool.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == [c[0].ext, c[1].ext] and first.parent_block_hash is None
    assert first.token_ids == list(range(8))
    assert second.parent_block_hash == c[1].ext and second.token_ids == [8, 9, 10, 11]


def test_freed_blocks_stay_cached_until_evicted_lru() -> None:
    pool = BlockPool(5, 4)  # 4 hold KV: block 0 is the null block
    a, b = chain(list(range(8))), chain(list(range(100, 108)))
    ba = pool.allocate(2)
    pool.cache(ba, a, 0, 2)
    pool.free(ba)
    bb = pool.allocate(2)  # the two never-used blocks come first
    pool.cache(bb, b, 0, 2)
    pool.free(bb)
    pool.take_events()
    assert len(pool.longest_hit(a, 2)) == 2 and len(pool.longest_hit(b, 2)) == 2
    pool.allocate(1)  # evicts a's tail (freed tail-first, least recently used)
    (removed,) = pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [a[1].ext]
    assert len(pool.longest_hit(a, 2)) == 1


def test_touch_protects_a_hit_from_eviction() -> None:
    pool = BlockPool(3, 4)
    a = chain(list(range(8)))
    blocks = pool.allocate(2)
    pool.cache(blocks, a, 0, 2)
    pool.free(blocks)
    hit = pool.longest_hit(a, 2)
    pool.touch(hit[:1])
    assert pool.num_free == 1
    pool.allocate(1)
    assert [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved)] == [[a[1].ext]]
    assert pool.longest_hit(a, 2) == hit[:1]


def test_duplicate_blocks_are_stored_and_removed_twice() -> None:
    pool = BlockPool(3, 4)
    a = chain([7] * 4)
    b1, b2 = pool.allocate(1), pool.allocate(1)
    pool.cache(b1, a, 0, 1)
    pool.cache(b2, a, 0, 1)
    pool.free(b1)
    pool.free(b2)
    pool.allocate(2)
    events = pool.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved"]
    assert {tuple(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared)} == {(a[0].ext,)}


def test_reset_refused_while_blocks_in_use() -> None:
    pool = BlockPool(2, 4)
    a = chain(list(range(4)))
    blocks = pool.allocate(1)
    pool.cache(blocks, a, 0, 1)
    assert pool.reset() is False
    pool.free(blocks)
    pool.take_events()
    assert pool.reset() is True
    assert isinstance(pool.take_events()[0], AllBlocksCleared)
    assert pool.longest_hit(a, 1) == [] and pool.cached_blocks() == []


def test_hash_chain_is_seeded_like_vllm() -> None:
    toks = list(range(16))
    same = [HashedBlock(None, tuple(toks), root_hash("0")).ext for _ in range(2)]
    assert same[0] == same[1]
    assert HashedBlock(None, tuple(toks), root_hash("1")).ext != same[0]
    # Unseeded (no PYTHONHASHSEED): a random root per engine, so hashes are opaque across restarts.
    assert (
        HashedBlock(None, tuple(toks), root_hash("random")).ext
        != HashedBlock(None, tuple(toks), root_hash("random")).ext
    )
    assert 0 <= same[0] < 2**64


def test_prefix_of_block_survives_parent_eviction() -> None:
    c = chain(list(range(12)))
    assert c[2].prefix() == list(range(12))


def test_block_pool_emits_no_events_when_disabled() -> None:
    pool = BlockPool(4, 16, emit_events=False)
    pool.allocate(2)
    assert pool.take_events() == []


def test_block_0_is_the_null_block_and_usage_is_over_the_rest() -> None:
    # vLLM's BlockPool takes block 0 out as its null block; get_usage() is over num_gpu_blocks - 1
    pool = BlockPool(5, 4)
    assert pool.num_free == 4
    blocks = pool.allocate(4)
    assert 0 not in [b.block_id for b in blocks]
    assert (pool.num_free, pool.num_used, pool.usage) == (0, 4, 1.0)
    pool.free(blocks)
    assert (pool.num_free, pool.num_used, pool.usage) == (4, 0, 0.0)
    assert pool.reset() is True  # the null block is not "in use"


def test_a_freed_block_caching_nothing_is_reused_before_any_cached_block_is_evicted() -> None:
    # vLLM reuses unhashed free blocks first (LRU only for proper cache entries): a request's partial
    # last block went behind the cached ones, and the next allocation evicted a prefix vLLM keeps.
    pool = BlockPool(4, 4)
    a = chain(list(range(8)))
    blocks = pool.allocate(3)  # two full blocks cached, one partial
    pool.cache(blocks, a, 0, 2)
    pool.free(blocks)
    pool.take_events()
    (reused,) = pool.allocate(1)
    assert reused is blocks[2] and pool.take_events() == [] and len(pool.longest_hit(a, 2)) == 2
    pool.allocate(1)  # then the LRU cached block, the tail
    assert [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved)] == [[a[1].ext]]


def test_a_pool_needs_room_besides_its_null_block() -> None:
    with pytest.raises(ValueError, match="2 blocks or more"):
        BlockPool(1, 4)
