"""The normaliser with offload tiers: vLLM's placeholder events, references per medium, no void of
a known block; and no per-salt memory."""

from __future__ import annotations

import tracemalloc

import pytest

from protocol import KvEvent, Removed, Stored, block_hashes
from protocol.hashing import chain_salt
from protocol.vllm_events import BlockRemoved, BlockStored, KVEvent, decode_events, encode_batch
from worker_shim import EngineRemoved, EngineStored, Normaliser
from worker_shim.adapters.vllm_events import to_engine_event
from worker_shim.engine_events import WINDOW

B = 16
TURN1 = list(range(B))
TURN2 = list(range(100, 100 + B))
A, CHILD = 0x1111, 0x2222


def wire(n: Normaliser, events: list[KVEvent], form: str) -> list[KvEvent]:
    """Fold vLLM events as the shim does: wire bytes, decode_events, the adapter, the normaliser."""
    batch, errors = decode_events(encode_batch(1.0, events, form=form))
    assert not errors
    return n.apply([to_engine_event(e) for e in batch.events])


def gpu(hashes: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=B)


def placeholder(engine_hash: int, medium: str = "CPU", group: int = 0) -> BlockStored:
    """What vLLM 0.32's OffloadingConnector sends for an offloaded block (events.py _placeholder_stored)."""
    return BlockStored(
        block_hashes=[engine_hash],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=None,  # type: ignore[arg-type]  # vLLM sends none
    )


@pytest.mark.parametrize("form", ["array", "map"])
def test_a_placeholder_offload_keeps_the_chain_growing_from_the_block_even_after_a_reset(form: str) -> None:
    n = Normaliser(B)
    a, child = block_hashes(TURN1 + TURN2, B)
    assert wire(n, [gpu([A], TURN1)], form) == [Stored(hashes=[a], parent=None, medium="GPU")]
    assert wire(n, [placeholder(A)], form) == []
    assert wire(n, [gpu([CHILD], TURN2, parent=A)], form) == [Stored(hashes=[child], parent=a, medium="GPU")]
    assert n.stats.malformed == 0
    n.reset(exact=True)  # the engine's replay rebuilds the same chains
    wire(n, [gpu([A], TURN1)], form)
    assert wire(n, [gpu([CHILD], TURN2, parent=A)], form) == [Stored(hashes=[child], parent=a, medium="GPU")]
    assert n.canonical_hashes() == {a, child}


def test_sglangs_host_tier_keeps_a_block_published_as_vllms_cpu_tier_does() -> None:
    """SGLang's HiCache names its host tier CPU_PINNED (StorageMedium.CPU) and stores there with the
    tokens and parent once the copy is written; it reports each eviction from it. The shim left
    CPU_PINNED uncredited, so the GPU copy's eviction took a prefix SGLang loads back from host."""
    n = Normaliser(B)
    (a,) = block_hashes(TURN1, B)
    host = BlockStored(block_hashes=[A], parent_block_hash=None, token_ids=TURN1, block_size=B, medium="CPU_PINNED")
    wire(n, [gpu([A], TURN1), host], "array")
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="GPU")], "array") == []
    assert n.holds(a) and n.stats.placeholders_dropped == 0
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="CPU_PINNED")], "array") == [
        Removed(hashes=[a], medium="CPU_PINNED")
    ]


@pytest.mark.parametrize("form", ["array", "map"])
def test_evicting_the_cpu_copy_leaves_the_gpu_copy_published(form: str) -> None:
    n = Normaliser(B)
    (a,) = block_hashes(TURN1, B)
    wire(n, [gpu([A], TURN1), placeholder(A)], form)
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="CPU")], form) == []
    assert n.holds(a)
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="GPU")], form) == [Removed(hashes=[a], medium="GPU")]
    assert len(n) == 0


def test_an_offloaded_block_stays_published_until_its_last_tier_drops_it() -> None:
    n = Normaliser(B)
    (a,) = block_hashes(TURN1, B)
    wire(n, [gpu([A], TURN1), placeholder(A), placeholder(A)], "map")  # two CPU copies
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="GPU")], "map") == []
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="CPU")], "map") == []
    assert n.holds(a)
    # no GPU reference is left to undo: a second GPU removal does not take the CPU copy
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="GPU")], "map") == []
    assert n.holds(a) and n.stats.unknown_removed == 1
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="CPU")], "map") == [Removed(hashes=[a], medium="CPU")]


def test_a_disk_tiers_placeholder_keeps_nothing_published() -> None:
    """vLLM 0.32's disk tiers (fs, obj) report no eviction: a block only they held stayed credited
    for the engine's life, 100,000 of them after 100,000 prompts (review of the offload fix)."""
    n = Normaliser(B)
    (a,) = block_hashes(TURN1, B)
    wire(n, [gpu([A], TURN1), placeholder(A, "STORAGE")], "map")
    assert n.stats.placeholders_dropped == 1
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="GPU")], "map") == [Removed(hashes=[a], medium="GPU")]
    assert not n.holds(a) and len(n) == 0


def test_a_placeholder_of_an_unknown_block_is_counted_and_never_voids_it() -> None:
    n = Normaliser(B)
    a, child = block_hashes(TURN1 + TURN2, B)
    assert wire(n, [placeholder(A)], "map") == []
    assert n.stats.placeholders_dropped == 1 and n.stats.malformed == 0 and len(n) == 0
    wire(n, [gpu([A], TURN1)], "map")
    assert wire(n, [gpu([CHILD], TURN2, parent=A)], "map") == [Stored(hashes=[child], parent=a, medium="GPU")]
    # its CPU eviction undoes no reference: the dropped placeholder counted none
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="CPU")], "map") == []
    assert n.holds(a) and n.stats.unknown_removed == 1


def test_a_cpu_removal_without_a_cpu_reference_leaves_the_block() -> None:
    n = Normaliser(B)
    (a,) = block_hashes(TURN1, B)
    wire(n, [gpu([A], TURN1)], "map")
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="CPU")], "map") == []
    assert n.holds(a) and n.stats.unknown_removed == 1


def test_a_malformed_re_announcement_of_a_known_block_does_not_void_it() -> None:
    n = Normaliser(B)
    a, child = block_hashes(TURN1 + TURN2, B)
    wire(n, [gpu([A], TURN1)], "map")
    bad = BlockStored(block_hashes=[A], parent_block_hash=None, token_ids=TURN1[:8], block_size=8)
    assert wire(n, [bad], "map") == []
    assert n.stats.malformed == 1
    assert wire(n, [gpu([CHILD], TURN2, parent=A)], "map") == [Stored(hashes=[child], parent=a, medium="GPU")]


def test_self_describing_offload_events_count_per_medium() -> None:
    n = Normaliser(B)
    a, child = block_hashes(TURN1 + TURN2, B)
    cpu_a = BlockStored(block_hashes=[A], parent_block_hash=None, token_ids=TURN1, block_size=B, medium="CPU")
    cpu_child = BlockStored(block_hashes=[CHILD], parent_block_hash=A, token_ids=TURN2, block_size=B, medium="CPU")
    wire(n, [gpu([A], TURN1)], "map")
    assert wire(n, [cpu_a, cpu_child], "map") == [Stored(hashes=[child], parent=a, medium="CPU")]
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="GPU")], "map") == []
    assert wire(n, [BlockRemoved(block_hashes=[A, CHILD], medium="CPU")], "map") == [
        Removed(hashes=[a, child], medium="CPU")
    ]
    assert len(n) == 0 and n.stats.unknown_removed == 0


def test_a_placeholder_of_a_window_group_keeps_the_groups_kind_and_blocks() -> None:
    n = Normaliser(B)
    (a,) = block_hashes(TURN1, B)
    window = BlockStored(
        block_hashes=[A],
        parent_block_hash=None,
        token_ids=TURN1,
        block_size=B,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=B,
    )
    wire(n, [gpu([A], TURN1), window], "map")
    assert n._groups[1] == WINDOW
    assert wire(n, [placeholder(A, group=1)], "map") == []
    assert n._groups[1] == WINDOW and n.stats.placeholders_dropped == 1 and n.stats.malformed == 0
    # the window's CPU eviction (no CPU reference was counted) leaves the GPU window copy
    assert wire(n, [BlockRemoved(block_hashes=[A], medium="CPU", group_idx=1)], "map") == []
    assert n.holds(a) and n.cached_prefix_blocks([a]) == 1
    # a window group's removal is the window's, not the full-attention chain's
    out = wire(n, [BlockRemoved(block_hashes=[A], medium="GPU", group_idx=1)], "map")
    assert n.holds(a) and n.cached_prefix_blocks([a]) == 0
    assert all(a not in e.hashes for e in out if isinstance(e, Removed))


def test_distinct_cache_salts_leave_no_memory_behind() -> None:
    """A cache_salt is the client's: the normaliser keeps nothing per salt once its blocks are gone."""
    n = Normaliser(4, memo_size=16)
    toks = [1, 2, 3, 4]
    n.apply([EngineStored(hashes=[1], parent=None, token_ids=toks, block_size=4, salt="warm-up")])
    n.apply([EngineRemoved(hashes=[1])])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):
            salt = chain_salt("", f"session-{i:08d}")
            n.apply([EngineStored(hashes=[i], parent=None, token_ids=toks, block_size=4, salt=salt)])
            n.apply([EngineRemoved(hashes=[i])])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(n) == 0
    assert grown < 256 * 1024, f"{grown} bytes kept after 20,000 salts"


def test_dropped_placeholders_are_counted_on_the_shims_metrics() -> None:
    """The count was kept and read by nobody: a drop must not pass in silence."""
    from prometheus_client.parser import text_string_to_metric_families

    from protocol.config import EtcdSettings, NatsSettings
    from worker_shim.config import ShimConfig
    from worker_shim.shim import WorkerShim

    cfg = ShimConfig(engine="vllm", model="m", engine_url="http://127.0.0.1:1")
    shim = WorkerShim(cfg, NatsSettings(servers=["nats://127.0.0.1:1"]), EtcdSettings(endpoints=["http://127.0.0.1:1"]))
    wire(Normaliser(B, stats=shim.norm_stats), [placeholder(A), placeholder(CHILD)], "map")
    name = "kvswitch_shim_kv_placeholders_dropped_total"
    text = shim.metrics_text().decode()
    assert [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name] == [2.0]


def test_evictions_of_blocks_never_stored_are_counted_on_the_shims_metrics() -> None:
    """Before 2026-12-07 the normaliser counted them and no metric showed it: a shim that missed
    every store (events lost before it started) looked healthy."""
    from prometheus_client.parser import text_string_to_metric_families

    from protocol.config import EtcdSettings, NatsSettings
    from worker_shim.config import ShimConfig
    from worker_shim.shim import WorkerShim

    cfg = ShimConfig(engine="vllm", model="m", engine_url="http://127.0.0.1:1")
    shim = WorkerShim(cfg, NatsSettings(servers=["nats://127.0.0.1:1"]), EtcdSettings(endpoints=["http://127.0.0.1:1"]))
    n = Normaliser(B, stats=shim.norm_stats)
    wire(n, [gpu([A], list(range(B)))], "map")
    wire(n, [BlockRemoved(block_hashes=[A, CHILD, 0x3333])], "map")
    name = "kvswitch_shim_kv_unknown_removed_total"
    text = shim.metrics_text().decode()
    assert [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name] == [2.0]
