"""`KvDigest`: what a subscriber holds after applying a shim's batches 1..seq, as (count, XOR).

A subscriber (a router's index) applies each batch to a plain set: Stored adds its hashes, Removed
discards them, Cleared empties it. The digest applies the same rules to its own set at seal time, so
it is exactly the subscriber's set as of the sealed seq: `blocks` distinct canonical hashes whose
XOR (unsigned 64-bit) is `xor`. An order-free checksum: equal sets give equal digests whatever the
order the hashes came in. Synchronous and single-owner (the EventLog that seals). An event's hashes
may come in either form (protocol.packed): packed ones are unpacked, never read as bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol import Cleared, KvEvent, Removed, Stored, unpack_hashes

__all__ = ["KvDigest"]


class KvDigest:
    __slots__ = ("_held", "xor")

    def __init__(self) -> None:
        self._held: set[int] = set()
        self.xor = 0

    @property
    def blocks(self) -> int:
        return len(self._held)

    def apply(self, events: Iterable[KvEvent]) -> None:
        held, add, discard = self._held, self._held.add, self._held.discard
        x = self.xor
        for ev in events:
            hs = ev.hashes if isinstance(ev, Stored | Removed) else ()
            if type(hs) is bytes:  # packed (the wire form): iterating it would yield its bytes, 0-255, not hashes
                hs = unpack_hashes(hs)
            if isinstance(ev, Stored):
                for h in hs:
                    if h not in held:
                        add(h)
                        x ^= h
            elif isinstance(ev, Removed):
                for h in hs:
                    if h in held:
                        discard(h)
                        x ^= h
            elif isinstance(ev, Cleared):
                held.clear()
                x = 0
        self.xor = x
