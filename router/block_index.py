"""The global prefix index: canonical block hash -> the workers that hold it.

Layout (docs/router_index.md gives the memory per entry):

- `_masks`: hash -> int bitmask over worker slots. A hash is present iff some worker holds it, so
  the mask is never 0.
- `_owned`: worker -> set of the hashes it holds, so a worker's entries go in one step (`clear`).
- slots: each worker holding at least one block owns one bit. A slot is freed when its worker holds
  nothing any more and is reused lowest-first, which keeps the masks as short as the live worker
  count allows.

Invariant: bit `s` is set in `_masks[h]` iff `h in _owned[_names[s]]`.

`find_matches` walks the prompt's hashes AND-ing masks: a worker's count is the depth at which its
bit drops out of the running AND, i.e. the number of LEADING prompt blocks it holds. A block held
without its predecessors (possible after an out-of-order eviction) does not count, as no engine can
reuse it without them.

Synchronous and free of I/O (STYLE.md #8): the NATS shell (router.kv_ingest) decodes and calls it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import accumulate, compress, islice, repeat
from operator import and_, ne, not_, or_

from protocol.messages import Cleared, KvEvent, Removed, Stored

__all__ = ["BlockIndex"]

# Bits to worker names: below this many set bits a find() loop wins, above it the all-C path does.
_FEW_BITS = 16
_BIN_TO_FLAGS = bytes.maketrans(b"01", b"\x00\x01")
_consume = deque(maxlen=0).extend  # runs an iterator to its end in C


class BlockIndex:
    """Which worker holds which canonical block. Not thread-safe; one event loop owns it."""

    __slots__ = ("_bits", "_entries", "_free_slots", "_masks", "_names", "_owned", "_slot_of")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._owned: dict[str, set[int]] = {}
        self._slot_of: dict[str, int] = {}
        self._names: list[str | None] = []  # slot -> worker; None while free
        self._free_slots: list[int] = []  # heap of freed slots below len(_names)
        self._bits: list[int] = []  # slot -> 1 << slot, one shared object per slot
        self._entries = 0

    # --- mutation ------------------------------------------------------------------------------

    def store(self, worker: str, hashes: Iterable[int]) -> None:
        """`worker` now holds `hashes` (storing a held hash again changes nothing)."""
        owned = self._owned.get(worker)
        new = set(hashes)
        if owned is None:
            if not new:
                return
            owned = self._owned[worker] = set()
            self._slot_of[worker] = self._take_slot(worker)
        else:
            new -= owned
            if not new:
                return
        owned |= new
        masks = self._masks
        bit = self._bits[self._slot_of[worker]]
        # A block nobody held gets the slot's own bit object (shared, no allocation); a block others
        # hold gets its mask OR-ed. Both run in C.
        fresh = new.difference(masks)
        if len(fresh) != len(new):
            held = new - fresh
            masks.update(zip(held, map(or_, map(masks.__getitem__, held), repeat(bit))))
        masks.update(dict.fromkeys(fresh, bit))
        self._entries += len(new)

    def remove(self, worker: str, hashes: Iterable[int]) -> None:
        """`worker` no longer holds `hashes` (hashes it does not hold are ignored)."""
        owned = self._owned.get(worker)
        if owned is None:
            return
        gone = owned.intersection(hashes)
        if not gone:
            return
        if len(gone) == len(owned):
            self.clear(worker)
            return
        owned -= gone
        self._drop_bits(worker, gone)

    def clear(self, worker: str) -> None:
        """Every entry of `worker` goes at once (a `Cleared` event, or the worker left)."""
        owned = self._owned.pop(worker, None)
        if owned is None:
            return
        self._drop_bits(worker, owned)
        slot = self._slot_of.pop(worker)
        self._names[slot] = None
        heapq.heappush(self._free_slots, slot)

    def apply(self, worker: str, events: Iterable[KvEvent]) -> None:
        """Apply one batch's events in order."""
        for event in events:
            match event:
                case Stored(hashes=hashes):
                    self.store(worker, hashes)
                case Removed(hashes=hashes):
                    self.remove(worker, hashes)
                case Cleared():
                    self.clear(worker)

    def _take_slot(self, worker: str) -> int:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._names[slot] = worker
        else:
            slot = len(self._names)
            self._names.append(worker)
            self._bits.append(1 << slot)
        return slot

    def _drop_bits(self, worker: str, hashes: set[int]) -> None:
        masks = self._masks
        bit = self._bits[self._slot_of[worker]]
        order = list(hashes)
        current = list(map(masks.__getitem__, order))
        sole = list(map(bit.__eq__, current))  # blocks only this worker held: they go entirely
        _consume(map(masks.__delitem__, compress(order, sole)))
        if not all(sole):
            shared = list(compress(order, map(not_, sole)))
            keep = ~bit
            masks.update(zip(shared, map(and_, compress(current, map(not_, sole)), repeat(keep))))
        self._entries -= len(order)

    # --- queries -------------------------------------------------------------------------------

    def find_matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, the number of leading `hashes` it holds; workers with none are left out."""
        masks = self._masks
        if not hashes or not masks.get(hashes[0]):
            return {}
        # Running AND over the prompt: it only loses bits, and where it loses some, those workers'
        # prefixes end. accumulate/map keep the per-block work in C.
        running = list(accumulate(map(masks.get, hashes, repeat(0)), and_))
        out: dict[str, int] = {}
        last = running[-1]
        if last != running[0]:
            # Depths where the running AND changes: workers in running[d - 1] but not running[d]
            # hold exactly d leading blocks.
            for depth in compress(range(1, len(running)), map(ne, running, islice(running, 1, None))):
                cur = running[depth]
                self._name_bits(running[depth - 1] ^ cur, depth, out)
                if not cur:
                    return out
        self._name_bits(last, len(hashes), out)
        return out

    def _name_bits(self, bits: int, depth: int, out: dict[str, int]) -> None:
        names = self._names
        # The binary string, least significant bit first: position i is slot i.
        flags = bin(bits)[:1:-1]
        if bits.bit_count() <= _FEW_BITS:
            i = flags.find("1")
            while i >= 0:
                out[names[i]] = depth  # type: ignore[index]  # a set bit always names a worker
                i = flags.find("1", i + 1)
        else:
            chosen = compress(names, flags.encode().translate(_BIN_TO_FLAGS))
            out.update(zip(chosen, repeat(depth)))  # type: ignore[arg-type]

    def worker_hashes(self, worker: str) -> set[int]:
        """A copy of the hashes `worker` holds (empty for an unknown worker)."""
        return set(self._owned.get(worker, ()))

    def workers(self) -> list[str]:
        """Workers holding at least one block, sorted."""
        return sorted(self._owned)

    def dump(self) -> dict[str, list[int]]:
        """worker -> its hashes, sorted: storing each rebuilds an identical index, and two replicas
        that agree compare equal."""
        return {w: sorted(hs) for w, hs in sorted(self._owned.items())}

    def __len__(self) -> int:
        """Distinct hashes held by anyone."""
        return len(self._masks)

    @property
    def entries(self) -> int:
        """(hash, worker) pairs."""
        return self._entries

    @property
    def slots(self) -> int:
        """Slots allocated (live workers plus freed slots awaiting reuse): the mask width in bits."""
        return len(self._names)
