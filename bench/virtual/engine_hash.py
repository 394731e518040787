"""A cheaper engine block hash for the virtual engines, and requests that hash their prompt at once.

engine_sim hashes blocks as vLLM does (SHA-256 over CBOR, memoised in a trie of weak references)
so that its ZMQ events are byte-faithful. On the virtual clock no event crosses a wire, and an
engine hash is opaque to everything downstream (the shim's Normaliser maps it to the canonical
hash by the block's tokens; only equality matters), so the virtual engines chain xxh3 instead:
the same identity, block for block, at a fraction of the cost (hashing was the replay's largest
cost: a full trace hashes millions of blocks per engine).

The chain's root depends on the engine, so engine hashes differ from canonical ones and between
engines, as vLLM's differ between engines seeded apart. `ChainedRequest` is a SimRequest whose
`extend_chain` hashes all its new full blocks in one call (the same chain engine_sim's loop builds
block by block).
"""

from __future__ import annotations

from engine_sim.block_hash import HashChains, HashedBlock
from engine_sim.request import SimRequest
from protocol.hashing import block_hashes, root_hash

__all__ = ["ChainedRequest", "XxhChains"]


class _XxhBlock(HashedBlock):
    __slots__ = ()

    def __init__(
        self, parent: HashedBlock | None, tokens: tuple[int, ...], value: int, salt: str | None = None
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.children = None
        self.salt = parent.salt if parent is not None else salt
        self.extra = (salt,) if parent is None and salt else None
        self.lora = None  # the virtual clock's engines serve no LoRA adapter
        self.ext = value
        self.digest = value.to_bytes(8, "little")


class XxhChains(HashChains):
    """What `Scheduler.chains` must provide (`child`), without memoisation: an xxh3 chain step
    costs less than a memo lookup."""

    def __init__(self, engine: str) -> None:
        super().__init__(b"")
        self._engine = f"engine:{engine}"
        self._root = root_hash(self._engine)

    def child(self, parent: HashedBlock | None, tokens: tuple[int, ...], salt: str | None = None) -> HashedBlock:
        start = parent.ext if parent is not None else self._root_for(salt)
        return _XxhBlock(parent, tokens, block_hashes(tokens, len(tokens), parent=start)[0], salt)

    def _root_for(self, salt: str | None) -> int:
        return root_hash(f"{self._engine}\x00{salt}") if salt else self._root

    def extend(self, chain: list[HashedBlock], tokens: list[int], block_size: int) -> None:
        """Append to `chain` a block for every full block of `tokens` beyond it."""
        have, full = len(chain), len(tokens) // block_size
        if full <= have:
            return
        parent = chain[-1] if chain else None
        start = have * block_size
        values = block_hashes(
            tokens[start : full * block_size], block_size, parent=parent.ext if parent else self._root
        )
        for value in values:
            parent = _XxhBlock(parent, tuple(tokens[start : start + block_size]), value)
            chain.append(parent)
            start += block_size


class ChainedRequest(SimRequest):
    __slots__ = ()

    def extend_chain(self, block_size: int, chains: HashChains) -> None:
        if isinstance(chains, XxhChains) and not self.cache_salt:
            chains.extend(self.chain, self.token_ids, block_size)
        else:
            super().extend_chain(block_size, chains)
