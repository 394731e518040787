"""A LoRA adapter unloaded or re-pointed at another path: vLLM 0.32 hashes an adapter's blocks by
its name and path, so the engine reuses its chains no more, while its KV events name the adapter
alone. The normaliser drops them from what it publishes and keeps them dropped whatever the engine
still says of them (worker_shim/normaliser.py, drop_adapter)."""

from __future__ import annotations

from protocol import Removed, Stored, block_hashes
from protocol.hashing import chain_salt
from worker_shim import EngineRemoved, EngineStored, Normaliser
from worker_shim.normaliser import DROPPED_FOR_S

B = 4
TOKENS = list(range(1, 13))


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, salt: str = "") -> EngineStored:
    return EngineStored(hashes=hashes, parent=parent, token_ids=tokens, block_size=B, salt=salt)


def loaded() -> Normaliser:
    """Adapter A's chain (engine hashes 1-3, the last a child event) and its cache-salted one
    (21), adapter B's (31) and the base model's (41) over the same tokens."""
    n = Normaliser(B)
    n.apply(
        [
            stored([1, 2], TOKENS[:8], salt="A"),
            stored([3], TOKENS[8:], parent=2, salt="A"),  # vLLM names the adapter on a child too
            stored([21], TOKENS[:4], salt=chain_salt("A", "tenant")),
            stored([31], TOKENS[:4], salt="B"),
            stored([41], TOKENS[:4]),
        ]
    )
    return n


def test_dropping_an_adapter_removes_its_chains_and_only_its() -> None:
    n = loaded()
    others = n.canonical_hashes() - set(block_hashes(TOKENS, B, salt="A"))
    others -= set(block_hashes(TOKENS[:4], B, salt=chain_salt("A", "tenant")))
    (removed,) = n.drop_adapter("A", "/a")
    assert isinstance(removed, Removed)
    assert set(removed.hashes) == {*block_hashes(TOKENS, B, salt="A"), *block_hashes(TOKENS[:4], B, salt="A\x00tenant")}
    assert n.canonical_hashes() == others and len(others) == 2
    assert n.drop_adapter("A", "/a") == [], "nothing left to drop"


def test_what_the_engine_still_says_of_a_dropped_chain_is_dropped_quietly() -> None:
    n = loaded()
    n.drop_adapter("A", "/a")
    # A request begun before the change adds a block to the old chain: no unknown parent, no rebuild.
    assert n.apply([stored([4], [13, 14, 15, 16], parent=3, salt="A")]) == []
    assert not n.needs_rebuild and n.stats.unknown_parent == 0
    # A replay re-sends the old chains after a reset; their eviction is no unknown removal.
    n.reset(exact=True)
    n.apply([stored([41], TOKENS[:4])])
    assert n.apply([stored([1, 2, 3], TOKENS, salt="A"), stored([4], [13, 14, 15, 16], parent=3, salt="A")]) == []
    assert n.apply([EngineRemoved(hashes=[1, 2, 3, 4])]) == [] and n.stats.unknown_removed == 0
    # The adapter's blocks from its new path are its own again.
    new = n.apply([stored([101, 102, 103], TOKENS, salt="A")])
    assert new == [Stored(hashes=block_hashes(TOKENS, B, salt="A"), parent=None)]


def test_an_adapter_loaded_again_from_a_dropped_path_gets_those_chains_back() -> None:
    n = loaded()
    n.drop_adapter("A", "/a")
    assert n.revive_adapter("A", "/elsewhere") is False
    assert n.revive_adapter("A", "/a") is True, "the owner then rebuilds from the engine's replay"
    assert n.revive_adapter("A", "/a") is False
    assert n.apply([stored([1, 2, 3], TOKENS, salt="A")]) == [
        Stored(hashes=block_hashes(TOKENS, B, salt="A"), parent=None)
    ]


def test_a_chain_still_growing_from_a_dropped_block_after_a_minute_is_taken_back() -> None:
    """What the engine caches between the change and the shim's reading of it is dropped with the
    old path's (the events cannot tell them apart). A chain that grows from it a minute on is the
    new path's, live: it was dropped for as long as the engine kept that prefix."""
    now = [0.0]
    n = Normaliser(B, clock=lambda: now[0])
    n.apply([stored([101, 102], TOKENS[:8], salt="A")])  # the new path's, cached before the shim saw the change
    n.drop_adapter("A", "/a")
    now[0] = DROPPED_FOR_S - 1
    assert n.apply([stored([103], TOKENS[8:], parent=102, salt="A")]) == [] and not n.needs_rebuild
    now[0] = DROPPED_FOR_S + 1
    assert n.apply([stored([104], [13, 14, 15, 16], parent=103, salt="A")]) == []
    assert n.needs_rebuild and n.stats.unknown_parent == 1, "the rebuild takes back what the engine holds"
    n.reset(exact=True)
    replayed = n.apply([stored([101, 102], TOKENS[:8], salt="A"), stored([103], TOKENS[8:], parent=102, salt="A")])
    assert n.canonical_hashes() == set(block_hashes(TOKENS, B, salt="A")) and replayed
