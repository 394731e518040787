"""The canonical block hash (DESIGN.md, "The canonical block hash").

    h[-1] = xxh3_64(salt bytes, seed=SEED)
    h[i]  = xxh3_64(u64le(h[i-1]) + u32le(tokens[i*B:(i+1)*B]), seed=SEED)

Only full blocks are hashed: a trailing partial block has no hash, as no engine caches it. The shim
computes this for every block an engine reports cached and the router for every prompt, so equal
prefixes meet in the index whatever engine holds them. Engine hashes stay opaque.

The C extension (protocol/_fasthash.c) and block_hashes_py take the same arguments, errors included:
token ids are ints, or objects with `__index__` (numpy integers), in [0, 2**32); `parent` likewise
in [0, 2**64); anything else is a ValueError naming it, never a value wrapped into range. A
`block_size` must be positive; one past the tokens' length gives [] whatever its size.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Sequence

import xxhash

__all__ = [
    "NATIVE",
    "ROOT_SALT",
    "SEED",
    "BlockHasher",
    "block_hashes",
    "block_hashes_py",
    "chain_salt",
    "endpoint_key",
    "root_hash",
]

SEED = 0x6B76_7377_6974_6368  # "kvswitch" in ASCII; fixed forever, the hash is a wire format.
ROOT_SALT = b""

_xxh3 = xxhash.xxh3_64_intdigest
_u64 = struct.Struct("<Q")
_MAX_TOKEN = 0xFFFF_FFFF
_MAX_HASH = 0xFFFF_FFFF_FFFF_FFFF


def chain_salt(lora: str = "", cache_salt: str = "") -> str:
    """The salt a chain starts from: its LoRA adapter's name, and a request's `cache_salt` (vLLM's
    per-tenant cache isolation) after a NUL, so that neither can pass for the other. Neither set:
    "", the unsalted root."""
    return f"{lora}\x00{cache_salt}" if cache_salt else lora


def root_hash(salt: str | bytes = ROOT_SALT) -> int:
    """The chain's starting value for `salt` (empty by default; a LoRA name or cache salt else)."""
    raw = salt.encode() if isinstance(salt, str) else salt
    return _xxh3(raw, seed=SEED)


_ENDPOINT = b"window-end"


def endpoint_key(canonical: int) -> int:
    """The key a hybrid model's worker publishes for a block where a cached prefix may end (its
    sliding-window groups hold the window before it; worker_shim.window_endpoints): xxh3_64 of the
    block's canonical hash (u64le) and b"window-end". Another domain than the chain's, so it
    never names a block."""
    return _xxh3(_u64.pack(canonical) + _ENDPOINT, seed=SEED)


def _in_range(value: object, most: int) -> bool:
    """An int, or an object with `__index__` as struct.pack takes it, in [0, most]."""
    try:
        return 0 <= operator.index(value) <= most  # type: ignore[arg-type]
    except TypeError:
        return False


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        bad = next((t for t in tokens if not _in_range(t, _MAX_TOKEN)), None)
        raise ValueError(f"token ids must be integers in [0, 2**32): got {bad!r}") from exc


def block_hashes_py(
    tokens: Sequence[int],
    block_size: int,
    *,
    salt: str | bytes = ROOT_SALT,
    parent: int | None = None,
) -> list[int]:
    """The pure-Python reference of block_hashes: the definition, spelled out."""
    size = operator.index(block_size)
    if size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size!r}")
    if parent is not None and not _in_range(parent, _MAX_HASH):
        raise ValueError(f"parent must be an integer in [0, 2**64): got {parent!r}")
    n_full = len(tokens) // size
    if n_full == 0:
        return []
    raw = _pack_tokens(tokens[: n_full * size])
    stride = 4 * size
    prev = root_hash(salt) if parent is None else operator.index(parent)
    out: list[int] = []
    append = out.append
    pack = _u64.pack
    for off in range(0, n_full * stride, stride):
        prev = _xxh3(pack(prev) + raw[off : off + stride], seed=SEED)
        append(prev)
    return out


_native: Callable[[Sequence[int], int, int, int], list[int]] | None
try:
    from protocol._fasthash import block_hashes as _native
except ImportError:  # built only where xxhash.h was present; see setup.py
    _native = None

NATIVE = _native is not None
"""Whether block_hashes runs the C extension (same results, ~10x faster) or pure Python."""


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    salt: str | bytes = ROOT_SALT,
    parent: int | None = None,
) -> list[int]:
    """Canonical hashes of every full block of `tokens` (see block_hashes_py, the reference).

    `parent` continues a chain (the hash of the block before `tokens[0]`); by default the chain
    starts at the root for `salt`.
    """
    if _native is None:
        return block_hashes_py(tokens, block_size, salt=salt, parent=parent)
    return _native(tokens, block_size, root_hash(salt) if parent is None else parent, SEED)


class BlockHasher:
    """Hashes prompts for one block size and salt; keeps the root so it is computed once."""

    __slots__ = ("block_size", "root", "salt")

    def __init__(self, block_size: int, salt: str | bytes = ROOT_SALT) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.salt = salt
        self.root = root_hash(salt)

    def __call__(self, tokens: Sequence[int]) -> list[int]:
        return block_hashes(tokens, self.block_size, parent=self.root)

    def extend(self, parent: int | None, block_tokens: Sequence[int]) -> list[int]:
        """Hashes of full blocks in `block_tokens`, chained after `parent` (None: the root)."""
        return block_hashes(block_tokens, self.block_size, parent=self.root if parent is None else parent)
