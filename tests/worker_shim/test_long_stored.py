"""A long prompt's one Stored is folded in parts, the shim's loop running between them.

A 128 k-token prompt's vLLM BlockStored holds 8,192 blocks; folded in one piece it held a decode
shim's loop (every leg's chunks and heartbeats, /health) until it was all linked (docs/worker_shim.md).
"""

from __future__ import annotations

import asyncio
import random
import time

from protocol import Cleared, KvEvent, Removed, Stored, block_hashes, unpack_hashes
from protocol.hashing import chain_salt
from protocol.vllm_events import BlockStored, encode_batch
from router.block_index import BlockIndex
from tests.worker_shim.test_rebuild_guard import _shim
from worker_shim import EngineStored, Normaliser
from worker_shim.adapters.zmq_events import ZmqEventSource
from worker_shim.normaliser import FOLD_BLOCKS

B = 16
N = 8192  # a 128 k-token prompt's blocks


def _prompt(seed: int) -> tuple[list[int], list[int]]:
    """(engine hashes, token ids) of a chain of N blocks."""
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(N)], [rng.randrange(100_000) for _ in range(N * B)]


async def test_a_long_prompts_one_stored_gives_the_loop_turns_and_publishes_the_same_chain() -> None:
    engine, tokens = _prompt(1)
    child, child_tokens = 7, list(range(B))  # a later block continuing the chain: its parent resolves
    stored = BlockStored(block_hashes=engine, parent_block_hash=None, token_ids=tokens, block_size=B)
    more = BlockStored(block_hashes=[child], parent_block_hash=engine[-1], token_ids=child_tokens, block_size=B)
    shim = _shim()
    shim.normaliser = Normaliser(B, stats=shim.norm_stats)
    published: list[KvEvent] = []
    shim._publish = published.extend  # type: ignore[method-assign,assignment]
    source = ZmqEventSource("vllm", "tcp://*:5557", "auto", "kv-events", None, "127.0.0.1")
    turns = 0
    during: list[int] = []

    async def other_task() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    other = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    for seq, ev in enumerate((stored, more)):
        before = turns
        await source._on_message([b"kv-events", seq.to_bytes(8, "big"), encode_batch(time.time(), [ev])], shim._sink)
        during.append(turns - before)
    other.cancel()
    # a turn between every FOLD_BLOCKS blocks linked; a one-block Stored takes none
    assert during == [N // FOLD_BLOCKS - 1, 0]
    chain = block_hashes(tokens + child_tokens, B, salt=chain_salt("", ""))
    stores = [e for e in published if isinstance(e, Stored)]
    assert stores == published
    # consecutive parts of one chain, each one's parent the last hash of the part before
    got = [unpack_hashes(e.hashes) for e in stores]
    assert [h for part in got for h in part] == chain
    assert [e.parent for e in stores] == [None] + [part[-1] for part in got[:-1]]
    assert shim.normaliser.dump() == chain and shim.norm_stats.malformed == shim.norm_stats.unknown_parent == 0
    # a router's index folds the parts into what the chain in one Stored makes
    parts, whole = BlockIndex(), BlockIndex()
    parts.apply("w", published)
    whole.apply("w", [Stored(hashes=chain)])
    assert parts.digest("w") == whole.digest("w") and parts.match(chain).to_dict() == {"w": N + 1}


def test_an_adapter_dropped_while_its_long_chain_is_folded_drops_the_rest_of_the_chain() -> None:
    """What the engine stores of a dropped adapter's chain is dropped (Normaliser.drop_adapter):
    so is the rest of a long chain whose folding paused when it was dropped."""
    engine, tokens = _prompt(2)
    n = Normaliser(B)
    out: list[KvEvent] = []
    folding = n.folding([EngineStored(hashes=engine, parent=None, token_ids=tokens, block_size=B, salt="A")], out)
    next(folding)  # paused after the first FOLD_BLOCKS blocks
    assert len(n) == FOLD_BLOCKS
    (removed,) = n.drop_adapter("A", "/a")
    assert isinstance(removed, Removed) and len(unpack_hashes(removed.hashes)) == FOLD_BLOCKS
    assert list(folding) == [] and len(n) == 0
    # the engine's later blocks of that chain are dropped quietly: no unknown parent, no rebuild
    tail = EngineStored(hashes=[7], parent=engine[-1], token_ids=list(range(B)), block_size=B, salt="A")
    assert n.apply([tail]) == [] and n.stats.unknown_parent == 0 and not n.needs_rebuild


def test_a_reset_while_a_long_chain_is_folded_ends_the_folding() -> None:
    """The endpoint probe may find the stream another engine's while a long chain's folding is
    paused: the shim's reset withdraws what it published, and the rest of the chain and of its
    batch is neither folded into the cleared set nor said after the Cleared."""
    engine, tokens = _prompt(3)
    n = Normaliser(B)
    out: list[KvEvent] = []
    other = EngineStored(hashes=[7], parent=None, token_ids=list(range(B)), block_size=B)
    folding = n.folding([EngineStored(hashes=engine, parent=None, token_ids=tokens, block_size=B), other], out)
    next(folding)  # paused after the first FOLD_BLOCKS blocks, which the owner publishes
    (first,) = out
    assert isinstance(first, Stored) and len(unpack_hashes(first.hashes)) == FOLD_BLOCKS == len(n)
    out.clear()
    assert n.reset(exact=False) == [Cleared()]
    assert list(folding) == [] and out == []
    assert len(n) == 0 and n.dump() == [] and n.canonical_hashes() == set()
    # nor did the engine map take the rest: a child of the chain's last block has no known parent
    tail = EngineStored(hashes=[8], parent=engine[-1], token_ids=list(range(B)), block_size=B)
    assert n.apply([tail]) == [] and n.stats.unknown_parent == 1 and not n.needs_rebuild
