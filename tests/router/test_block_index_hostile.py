"""BlockIndex against what one worker can send: hashes chosen to collide in the C table, and one
worker more than the index has slots for (docs/router_index.md, "Keyed buckets and the worker cap")."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.client import Client

from protocol import pack_hashes
from protocol.messages import Stored
from router.block_index import MAX_WORKERS, NATIVE, BlockIndex, IndexFullError
from router.kv_ingest import KvIngest
from tests.router.polling import until
from tests.router.test_kv_ingest import FakeShim

NATIVE_FLAGS = [pytest.param(False, id="python")] + ([pytest.param(True, id="native")] if NATIVE else [])
native_only = pytest.mark.skipif(not NATIVE, reason="router._blockindex was not built")

# k * INV has bucket 0 under unkeyed Fibonacci hashing ((key * GOLDEN) >> shift) at every table size.
GOLDEN = 0x9E3779B97F4A7C15
INV = pow(GOLDEN, -1, 2**64)


@native_only
def test_hashes_crafted_to_collide_unkeyed_share_no_probe_run() -> None:
    from router._blockindex import Core

    core = Core()
    hostile = [k * INV % 2**64 for k in range(1, 100_001)]
    core.store(0, pack_hashes(hostile))
    # Every insertion, lookup and deletion walks at most one run of taken buckets. Placed at random
    # (load 0.38 here) the longest is a few dozen; unkeyed, these 100,000 form one run, and storing
    # and clearing them walked ~10^10 buckets (~20 s of a router's event loop).
    assert core.longest_run() < 1_000
    assert core.match(hostile[-3:]) == (1, [(1, 3)])
    core.clear(0)
    assert len(core) == core.entries == core.longest_run() == 0


@native_only
def test_max_workers_is_the_native_cores_slot_limit() -> None:
    from router._blockindex import Core

    core = Core()
    assert core.store(MAX_WORKERS - 1, [1]) == 1
    with pytest.raises(ValueError, match="slot must be"):
        core.store(MAX_WORKERS, [2])


def fill(idx: BlockIndex) -> None:
    """MAX_WORKERS workers w0, w1, ... each holding their own number."""
    for i in range(MAX_WORKERS):
        idx.store(f"w{i}", [i])


@pytest.mark.parametrize("native", NATIVE_FLAGS)
def test_a_worker_past_max_workers_is_refused_and_the_index_stays_whole(native: bool) -> None:
    idx = BlockIndex(native=native)
    fill(idx)
    assert idx.full
    late = MAX_WORKERS + 7
    with pytest.raises(IndexFullError, match="late refused: the prefix index holds blocks of 65,534 workers"):
        idx.store("late", [late])
    with pytest.raises(IndexFullError):
        idx.apply("late", [Stored(hashes=pack_hashes([late]))])
    idx.store("late", [])  # holding nothing takes no slot
    assert "late" not in idx.workers() and len(idx.workers()) == MAX_WORKERS
    assert idx.count("late") == 0 and idx.digest("late") == (0, 0) and idx.find_matches([late]) == {}
    idx.clear("late")
    idx.remove("late", [late])
    dump = idx.dump()
    assert len(dump) == MAX_WORKERS and dump["w65533"] == [65533]
    idx.store("w9", [late])  # a worker holding blocks still gains more
    idx.clear("w0")  # a slot frees: the next worker gets it
    assert not idx.full
    idx.store("late", [late])
    assert idx.find_matches([late]) == {"late": 1, "w9": 1}
    assert idx.full and idx.slots == MAX_WORKERS


async def test_ingest_refuses_a_worker_past_max_workers_loudly_and_takes_it_when_one_leaves(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    index = BlockIndex()
    fill(index)
    ingest = KvIngest(nc, ns, index, request_timeout_s=0.2, retry_max_s=0.2)
    shim = FakeShim(nc, ns, "new")
    await shim.start()
    await shim.publish(Stored(hashes=[10**9, 10**9 + 1]))
    await ingest.start()
    try:
        caplog.set_level(logging.ERROR)
        ingest.add_worker("new", shim.epoch)
        await until(lambda: "65,534" in (ingest.sync_state("new") or ("", ""))[1], what="the refusal")
        await until(lambda: "kv-repair-new" not in {t.get_name() for t in asyncio.all_tasks()}, what="repair ended")
        assert len(shim.requests) == 1  # its dump, refused once: no loop fetching it again and again
        assert not ingest.needs_repair("new") and not ingest.synced
        assert "new" not in index.workers() and len(index.dump()) == MAX_WORKERS
        assert ingest.stats.malformed == 0
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [
            "worker new refused: the prefix index holds blocks of 65,534 workers, its most; "
            "out of routing until a worker leaves"
        ]
        ingest.remove_worker("idle")  # held nothing: no slot frees
        assert not ingest.needs_repair("new")
        ingest.remove_worker("w0")  # its slot goes to the refused worker, which bootstraps now
        assert await ingest.wait_synced(10.0)
        assert index.dump()["new"] == [10**9, 10**9 + 1] and "w0" not in index.workers()
        assert len(shim.requests) == 2
    finally:
        await ingest.stop()
