"""The KV block pool with prefix caching, as vLLM v1's BlockPool behaves.

Invariants:
- A block is either in use (ref_cnt > 0) or free (ref_cnt == 0), never both. Free blocks that
  were never used are not materialised (a pool of 50k blocks costs nothing until used); they sit,
  as in vLLM's initial free queue, ahead of every block freed since.
- A free block keeps its hash and stays findable in the prefix cache until it is handed out again
  (eviction); only then does it leave the cache, and a `BlockRemoved` event names its hash.
- Block 0 is the null block, as vLLM's: never handed out, so `num_gpu_blocks - 1` blocks hold
  KV, and usage is over those (vLLM's `get_usage`). The 0.32 captures need exactly that many: with
  one more, the sim evicted nothing where vLLM evicted a block.
- The free queue is least-recently-used first: allocation pops the head; freeing appends a cached
  block at the tail. Callers free a request's blocks tail-first, so a prefix's last blocks are
  evicted before its first ones, as in vLLM. A freed block that caches nothing (a request's last,
  partial block) goes to the head instead, ahead of even the never-used blocks, as vLLM does since
  its "LRU only for proper cache entries" change: no cached block is evicted while one is free.
  Before, such blocks queued behind cached ones, and the sim evicted prefixes vLLM keeps (on the
  0.32 captures, six blocks where vLLM evicted one).
- Blocks become cached (hashed, `BlockStored`) when they are full and their tokens are about to
  be computed. A `BlockStored` names the LoRA adapter of the request whose blocks it stores
  (`lora_id`, `lora_name`), as vLLM's does. Two requests computing the same block at once make two
  physical blocks with one hash: both are cached and reported, and each eviction is reported (the
  vLLM 0.32 captures show exactly this), so consumers must count references.

Events are appended to `events`; the engine hands them to the publisher after each step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from engine_sim.block_hash import HashedBlock
from engine_sim.lora import LoraRequest
from protocol.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["Block", "BlockPool"]


class Block:
    __slots__ = ("block_id", "hashed", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hashed: HashedBlock | None = None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, emit_events: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.emit_events = emit_events
        if num_blocks < 2:
            raise ValueError(f"a pool needs 2 blocks or more (one is the null block), got {num_blocks}")
        self.blocks: list[Block] = [Block(0)]  # materialised so far, by block id; block 0 is the null block
        self._head: OrderedDict[int, Block] = OrderedDict()  # freed caching nothing: reused first
        self._free: OrderedDict[int, Block] = OrderedDict()  # freed at least once, LRU first
        # digest -> {block_id: block}: every physical block holding that hash.
        self._cached: dict[bytes, dict[int, Block]] = {}
        self.events: list[KVEvent] = []

    # --- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._head) + len(self._free) + self.num_blocks - len(self.blocks)

    @property
    def num_used(self) -> int:
        """Blocks held by requests (the null block is not one)."""
        return len(self.blocks) - 1 - len(self._head) - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / (self.num_blocks - 1)

    def longest_hit(self, chain: Sequence[HashedBlock], max_blocks: int) -> list[Block]:
        """The cached blocks for the longest prefix of `chain` (at most `max_blocks`)."""
        out: list[Block] = []
        cached = self._cached
        for hb in chain[:max_blocks]:
            holders = cached.get(hb.digest)
            if not holders:
                break
            out.append(next(iter(holders.values())))
        return out

    def cached_blocks(self) -> list[Block]:
        return [b for holders in self._cached.values() for b in holders.values()]

    # --- mutations -------------------------------------------------------------------------------

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits; a free one leaves the free queue (it is in use again)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """`n` blocks from the head of the free queue, evicting whatever they cached. The caller
        checks `num_free` first; running out is a bug."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        out: list[Block] = []
        blocks = self.blocks
        for _ in range(n):
            if self._head:
                _, b = self._head.popitem(last=False)
            elif len(blocks) < self.num_blocks:
                b = Block(len(blocks))
                blocks.append(b)
            else:
                _, b = self._free.popitem(last=False)
                if b.hashed is not None:
                    self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        hb = b.hashed
        assert hb is not None
        holders = self._cached.get(hb.digest)
        if holders is not None:
            holders.pop(b.block_id, None)
            if not holders:
                del self._cached[hb.digest]
        b.hashed = None
        if self.emit_events:
            self.events.append(BlockRemoved(block_hashes=[hb.ext]))

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block, tail first (so tails are evicted first); those that
        cache nothing go ahead of every free block, in the order freed."""
        uncached: list[Block] = []
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.hashed is None:
                    uncached.append(b)
                else:
                    self._free[b.block_id] = b
        for b in reversed(uncached):
            self._head[b.block_id] = b
            self._head.move_to_end(b.block_id, last=False)

    def cache(
        self,
        blocks: Sequence[Block],
        chain: Sequence[HashedBlock],
        start: int,
        end: int,
        lora: LoraRequest | None = None,
    ) -> None:
        """Mark blocks[start:end] cached with hashes chain[start:end]; one `BlockStored` for them,
        naming `lora`, the adapter of the request they belong to (as vLLM's cache_full_blocks)."""
        if end <= start:
            return
        hashes: list[int] = []
        tokens: list[int] = []
        for i in range(start, end):
            b, hb = blocks[i], chain[i]
            b.hashed = hb
            self._cached.setdefault(hb.digest, {})[b.block_id] = b
            hashes.append(hb.ext)
            tokens.extend(hb.tokens)
        if self.emit_events:
            parent = chain[start].parent
            self.events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent.ext if parent is not None else None,
                    token_ids=tokens,
                    block_size=self.block_size,
                    lora_id=lora.int_id if lora is not None else None,
                    lora_name=lora.name if lora is not None else None,
                    extra_keys=[hb.extra for hb in chain[start:end]],
                )
            )

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache). Refused while any block is in use,
        as vLLM refuses; on success emits `AllBlocksCleared` and no `BlockRemoved`."""
        if self.num_used:
            return False
        for b in self.blocks:
            b.hashed = None
        self._cached.clear()
        if self.emit_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
