"""HashChains: memoised hash chains, held no longer than a request or a cached block holds them."""

from __future__ import annotations

import gc

from engine_sim.block_hash import HashChains, HashedBlock, root_hash


def test_a_chain_memoised_is_the_chain_computed_afresh_and_salts_part_chains() -> None:
    root = root_hash()
    chains = HashChains(root)
    a = chains.child(None, (1, 2, 3, 4))
    assert chains.child(None, (1, 2, 3, 4)) is a
    assert chains.child(a, (5, 6, 7, 8)) is chains.child(a, (5, 6, 7, 8))
    fresh = HashedBlock(None, (1, 2, 3, 4), root, None, None)
    assert a.ext == fresh.ext
    salted = chains.child(None, (1, 2, 3, 4), salt="tenant-1")
    assert salted is not a and salted.ext != a.ext
    assert salted.ext == HashedBlock(None, (1, 2, 3, 4), root, "tenant-1", None).ext


def test_every_salt_a_client_sent_leaves_nothing_once_its_blocks_are_gone() -> None:
    # cache_salt is the client's value: a table kept per salt grew by one for each ever seen.
    chains = HashChains(root_hash())
    held = chains.child(None, (9, 9, 9, 9), salt="kept")
    for i in range(1000):
        chains.child(None, (1, 2, 3, 4), salt=f"tenant-{i}")  # a request's block, freed at once
    gc.collect()
    assert len(chains._first) == 1
    assert chains.child(None, (9, 9, 9, 9), salt="kept") is held
