"""Block hashes the way vLLM computes them (prefix_caching_hash_algo `sha256_cbor`).

    root     = sha256(cbor(PYTHONHASHSEED))   when PYTHONHASHSEED is set (and not "random"),
               32 random bytes                 otherwise, chosen once per engine start;
    block[i] = sha256(cbor((block[i-1] or root, tuple(block tokens), extra_keys)))

`extra_keys` is vLLM 0.32's `lora_extra_keys + mm_extra_keys + cache_salt_keys`, None when empty,
each key tagged with what it is (`generate_block_hash_extra_keys`): a LoRA request's
`("lora", name, path)` on every block, then its `cache_salt` (vLLM's per-tenant cache isolation) as
`("cache_salt", salt)` on the first block. So each chain shares no block with any other: not a
salted one with an adapter whose name is the salt, nor an adapter's with the same name re-pointed at
another path (vLLM keys the path "so that re-pointing a LoRA name at a different adapter does not
reuse KV"). The KV events carry the keys untagged, as vLLM publishes them (`to_event_extra_keys`):
`(name,)` on an adapter's every block, `(name, salt)` first when salted, `(salt,)` on a salted base
chain's first block.

KV events carry the low 64 bits (the digest's last 8 bytes, big-endian) as an unsigned integer.
Like a real engine's, these hashes are opaque: a consumer cannot reproduce them without the seed,
which is why kvswitch hashes canonically from token ids (protocol.hashing).
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import cbor2

if TYPE_CHECKING:
    from engine_sim.lora import LoraRequest

__all__ = ["HashChains", "HashedBlock", "external_hash", "hash_block", "root_hash"]


def root_hash(seed: str | None = None) -> bytes:
    """The chain's parent for the first block. `seed` defaults to PYTHONHASHSEED."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return os.urandom(32)
    return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()


def hash_block(parent: bytes, tokens: Sequence[int], extra_keys: object = None) -> bytes:
    return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extra_keys), canonical=True)).digest()


def external_hash(digest: bytes) -> int:
    """What KV events carry: the low 64 bits as an unsigned integer."""
    return int.from_bytes(digest[-8:], "big")


class HashedBlock:
    """One full block's identity: its digest, the 64-bit hash events carry, its tokens and the
    block before it. Immutable once made; a chain of these is a prefix, so a cached block can name
    every token before it even after its parent block was evicted."""

    __slots__ = ("__weakref__", "children", "digest", "ext", "extra", "lora", "parent", "salt", "tokens")
    children: weakref.WeakValueDictionary[tuple[int, ...], HashedBlock] | None
    digest: bytes
    ext: int
    extra: tuple[str, ...] | None  # the block's extra_keys as events carry them (untagged)
    lora: LoraRequest | None  # the chain's adapter (its HashChains')
    parent: HashedBlock | None
    salt: str | None  # the chain's cache_salt
    tokens: tuple[int, ...]

    def __init__(
        self,
        parent: HashedBlock | None,
        tokens: tuple[int, ...],
        root: bytes,
        salt: str | None = None,
        lora: LoraRequest | None = None,
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.children = None
        self.salt = parent.salt if parent is not None else salt
        self.lora = lora
        keys: tuple[tuple[str, ...], ...] = (("lora", lora.name, lora.path),) if lora is not None else ()
        if parent is None and salt:
            keys += (("cache_salt", salt),)
        self.extra = tuple(key[1] for key in keys) or None
        self.digest = hash_block(parent.digest if parent is not None else root, tokens, keys or None)
        self.ext = external_hash(self.digest)

    def prefix(self) -> list[int]:
        """All token ids from the start of the sequence through this block."""
        chain: list[tuple[int, ...]] = []
        node: HashedBlock | None = self
        while node is not None:
            chain.append(node.tokens)
            node = node.parent
        out: list[int] = []
        for toks in reversed(chain):
            out.extend(toks)
        return out


class HashChains:
    """Memoises HashedBlocks as a trie keyed by block tokens, so requests sharing a prefix share
    its hash chain instead of rehashing it (SHA-256 over CBOR costs microseconds per block, which
    adds up at thousands of requests per second). Nodes are weakly held: one lives exactly as long
    as a request or a cached block refers to it. Hashes are identical to computing them afresh.

    One instance holds the chains of the base model (`lora` None) or of one LoRA adapter at one
    path: an adapter's blocks carry its name and path in their extra keys, so they share no node
    with any other."""

    def __init__(self, root: bytes, lora: LoraRequest | None = None) -> None:
        self.root = root
        self.lora = lora
        # First blocks by (cache_salt, tokens) in one weak table: a table per salt outlived its blocks,
        # one entry for every salt a client ever sent.
        self._first: weakref.WeakValueDictionary[tuple[str | None, tuple[int, ...]], HashedBlock] = (
            weakref.WeakValueDictionary()
        )

    def child(self, parent: HashedBlock | None, tokens: tuple[int, ...], salt: str | None = None) -> HashedBlock:
        """The block after `parent` holding `tokens`; `salt` (a request's cache_salt) starts a chain."""
        if parent is None:
            first = self._first.get((salt, tokens))
            if first is None:
                first = self._first[salt, tokens] = HashedBlock(None, tokens, self.root, salt, self.lora)
            return first
        if parent.children is None:
            parent.children = weakref.WeakValueDictionary()
        node = parent.children.get(tokens)
        if node is None:
            node = parent.children[tokens] = HashedBlock(parent, tokens, self.root, salt, self.lora)
        return node
