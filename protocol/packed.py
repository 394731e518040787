"""Block hashes packed for the wire: little-endian u64s in one msgpack bin.

A list of ints costs a router ~28 ns a hash to decode (msgpack builds a Python int for each), which
was most of what separated its ingest from 5x Dynamo's. Shims therefore send `Stored`, `Removed`
and dump chunks with their hashes packed; the router's index reads the bytes without creating an
int. A `hashes` field holds either form (docs/decisions.md, "Packed hashes on the wire"); code that
needs ints calls `unpack_hashes`, since iterating bytes would yield bytes, not hashes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import msgspec

from protocol.messages import KvEvent, KvEventBatch, KvStateChunk, Removed, Stored

__all__ = ["check_hashes", "hash_count", "pack_batch", "pack_chunk", "pack_events", "pack_hashes", "unpack_hashes"]

_BIG_ENDIAN = sys.byteorder == "big"
if array("Q").itemsize != 8:  # pragma: no cover - every platform CPython supports today
    raise ImportError("protocol.packed needs an 8-byte array('Q')")


def pack_hashes(hashes: Sequence[int] | bytes) -> bytes:
    """`hashes` as little-endian u64s; packed input is returned as it is.

    Raises ValueError naming the offending value if a hash is not an int in [0, 2**64)."""
    if isinstance(hashes, bytes):
        return hashes
    try:
        packed = array("Q", hashes)
    except (OverflowError, TypeError) as exc:
        bad = next((h for h in hashes if not isinstance(h, int) or not 0 <= h < 1 << 64), None)
        raise ValueError(f"block hashes must be ints in [0, 2**64): got {bad!r}") from exc
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def unpack_hashes(hashes: Sequence[int] | bytes) -> list[int]:
    """The hashes as ints, whichever form they came in.

    Raises ValueError if packed bytes are not a whole number of u64s."""
    if not isinstance(hashes, bytes):
        return list(hashes)
    check_hashes(hashes)
    out = array("Q", hashes)
    if _BIG_ENDIAN:  # pragma: no cover
        out.byteswap()
    return out.tolist()


def check_hashes(hashes: Sequence[int] | bytes) -> None:
    """Raise ValueError unless `hashes` are whole u64s (packed) or ints in [0, 2**64) (a list)."""
    if isinstance(hashes, bytes):
        if len(hashes) % 8:
            raise ValueError(f"packed block hashes must be a multiple of 8 bytes, got {len(hashes)}")
    elif hashes and (min(hashes) < 0 or max(hashes) >= 1 << 64):
        raise ValueError(f"block hashes must be ints in [0, 2**64): got {min(hashes)}..{max(hashes)}")


def hash_count(hashes: Sequence[int] | bytes) -> int:
    """How many hashes `hashes` holds, in either form."""
    return len(hashes) >> 3 if isinstance(hashes, bytes) else len(hashes)


def pack_events(events: Sequence[KvEvent]) -> list[KvEvent]:
    """`events` with the hashes of each Stored and Removed packed (a copy of those not packed yet)."""
    return [
        msgspec.structs.replace(ev, hashes=pack_hashes(ev.hashes))
        if isinstance(ev, Stored | Removed) and not isinstance(ev.hashes, bytes)
        else ev
        for ev in events
    ]


def pack_batch(batch: KvEventBatch) -> KvEventBatch:
    """A copy of `batch` whose Stored and Removed events carry packed hashes (what shims publish)."""
    return msgspec.structs.replace(batch, events=pack_events(batch.events))


def pack_chunk(chunk: KvStateChunk) -> KvStateChunk:
    """A copy of a kvstate reply chunk with its dump hashes and replayed batches packed."""
    return msgspec.structs.replace(
        chunk, hashes=pack_hashes(chunk.hashes), batches=[pack_batch(b) for b in chunk.batches]
    )
