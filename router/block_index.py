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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import compress, islice, repeat
from operator import and_, itemgetter, ne, not_, or_

import numpy as np

from protocol.messages import Cleared, KvEvent, Removed, Stored

__all__ = ["BlockIndex", "Overlap"]

# Bits to worker names: below this many set bits a find() loop wins, above it numpy does.
_FEW_BITS = 16
_LOOKUP_CHUNK = 16
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator to its end in C


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
            masks.update(zip(held, map(or_, map(masks.__getitem__, held), repeat(bit)), strict=False))
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
            masks.update(zip(shared, map(and_, compress(current, map(not_, sole)), repeat(keep)), strict=False))
        self._entries -= len(order)

    # --- queries -------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> Overlap:
        """Per worker, the number of leading `hashes` it holds, as a lazy mapping (what routing
        reads); valid until the index next changes, so read it in the same synchronous step."""
        masks = self._masks
        if not hashes or not masks.get(hashes[0]):
            return Overlap((), 0, self._slot_of, self._bits, self._names)
        # The running AND of the masks only loses bits, and where it loses some, those workers'
        # prefixes end. It can only change where a block's mask differs from the one before, and a
        # prompt's masks come in long equal runs (a conversation held by the same workers), so
        # compare neighbours in C and AND only at the few places they differ.
        got = self._leading_masks(hashes)
        running: int = got[0]
        matched = running
        cuts: list[tuple[int, int]] = []
        for depth in compress(range(1, len(got)), map(ne, got, islice(got, 1, None))):
            cut = running & got[depth]
            if cut != running:
                cuts.append((running ^ cut, depth))
                if not cut:
                    return Overlap(cuts, matched, self._slot_of, self._bits, self._names)
                running = cut
        cuts.append((running, len(got)))
        return Overlap(cuts, matched, self._slot_of, self._bits, self._names)

    def find_matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """`match` as a plain dict; workers with no leading block are left out."""
        return self.match(hashes).to_dict()

    def _leading_masks(self, hashes: Sequence[int]) -> list[int]:
        """The masks of the prompt's blocks up to the first one nobody holds, looked up in chunks
        so a prompt that leaves every cached prefix early costs few lookups."""
        get = self._masks.get
        got: list[int] = []
        for start in range(0, len(hashes), _LOOKUP_CHUNK):
            part = list(map(get, hashes[start : start + _LOOKUP_CHUNK], repeat(0)))
            if 0 in part:
                got += part[: part.index(0)]
                break
            got += part
        return got

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


class Overlap(Mapping[str, int]):
    """`BlockIndex.match`'s answer: worker -> leading prompt blocks it holds (absent: none).

    Kept as the few `(workers' bits, depth)` cuts where the prompt's running mask lost bits, so
    answering costs nothing per matching worker until someone asks: `get(worker)` is a slot lookup
    and an AND per cut, which is what routing does for each candidate. A prompt that many workers
    share (a system prompt held by hundreds) thus costs no dict of hundreds of names. It reads the
    index's slot tables, so it is valid only until the index next changes.
    """

    __slots__ = ("_bits", "_cuts", "_matched", "_names", "_slot_of")

    def __init__(
        self,
        cuts: Sequence[tuple[int, int]],
        matched: int,
        slot_of: Mapping[str, int],
        bits: Sequence[int],
        names: Sequence[str | None],
    ) -> None:
        self._cuts = cuts
        self._matched = matched  # the union of the cuts: workers holding at least the first block
        self._slot_of = slot_of
        self._bits = bits
        self._names = names

    def get(self, worker: str, default: int = 0) -> int:  # type: ignore[override]  # int default only
        slot = self._slot_of.get(worker)
        if slot is None:
            return default
        bit = self._bits[slot]
        if not self._matched & bit:
            return default
        for bits, depth in self._cuts:
            if bits & bit:
                return depth
        return default

    def __getitem__(self, worker: str) -> int:
        depth = self.get(worker, 0)
        if not depth:
            raise KeyError(worker)
        return depth

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return self._matched.bit_count()

    def to_dict(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for bits, depth in self._cuts:
            _name_bits(self._names, bits, depth, out)
        return out


def _name_bits(names: Sequence[str | None], bits: int, depth: int, out: dict[str, int]) -> None:
    """out[worker] = depth for every worker whose slot bit is set in `bits`."""
    if not bits & (bits - 1):  # one worker: the usual case for a conversation's own tail
        out[names[bits.bit_length() - 1]] = depth  # type: ignore[index]  # set bits name workers
    elif bits.bit_count() <= _FEW_BITS:
        flags = bin(bits)[:1:-1]  # least significant bit first: position i is slot i
        i = flags.find("1")
        while i >= 0:
            out[names[i]] = depth  # type: ignore[index]
            i = flags.find("1", i + 1)
    else:  # many workers (a shared system prompt): find the set bits in numpy, name them in C
        raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), np.uint8)
        slots = np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
        out.update(dict.fromkeys(itemgetter(*slots)(names), depth))
