"""The global prefix index: canonical block hash -> the workers that hold it.

Two layers (docs/router_index.md gives the memory per entry):

- `BlockIndex` names workers: each worker holding at least one block owns a slot. A slot is freed
  when its worker holds nothing any more and is reused lowest-first, which keeps slot ids (and
  the bitsets of widely held hashes) as small as the live worker count allows. At most
  MAX_WORKERS hold blocks at once; a store of one more raises IndexFullError and changes nothing.
- A core keeps hash -> the slots holding it, and per slot what it holds and its digest.
  `router._blockindex.Core` (C: an open-addressed table of u64 keys with up to four holders inline
  and a bitset row past that, and a log per slot) when it was built, `PyCore` (dicts of int
  masks and a set per slot: the reference) otherwise. `NATIVE` says which a default `BlockIndex()`
  uses; both give identical answers (the tests run both).

Invariant: slot `s` is among hash h's holders (inline, or its bit in h's row or mask) iff the worker
in slot `s` holds h.

`match` walks the prompt's hashes intersecting their holders: a worker's count is the depth at
which it drops out of the running intersection, i.e. the number of LEADING prompt blocks it holds. A block held
without its predecessors (possible after an out-of-order eviction) does not count, as no engine can
reuse it without them.

Synchronous and free of I/O (STYLE.md #8): the NATS shell (router.kv_ingest) decodes and calls it.
"""

from __future__ import annotations

import heapq
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import reduce
from itertools import compress, islice, repeat
from operator import and_, itemgetter, ne, not_, or_, xor
from typing import Protocol

import numpy as np

from protocol import unpack_hashes
from protocol.messages import Cleared, KvEvent, Removed, Stored

__all__ = ["MAX_WORKERS", "NATIVE", "BlockIndex", "IndexFullError", "Overlap", "PyCore"]

MAX_WORKERS = 65_534
"""Workers one index holds blocks of at once: the C core keeps slot ids in u16s (both cores keep it)."""

# Bits to worker names: below this many set bits a find() loop wins, above it numpy does.
_FEW_BITS = 16
_LOOKUP_CHUNK = 16
_MAX_HASH = 2**64 - 1
_INT_BYTES = -(-sys.getsizeof(_MAX_HASH) // 16) * 16  # a 64-bit int object as pymalloc rounds it
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator to its end in C

Cuts = list[tuple[int, int]]


class IndexFullError(ValueError):
    """A worker holding nothing stored blocks while MAX_WORKERS others hold some: it gets no slot,
    and the index is as before."""


class Core(Protocol):
    """What `BlockIndex` needs of a core; slots are small ints handed out by the index."""

    def store(self, slot: int, hashes: Iterable[int], /) -> int: ...  # newly held
    def remove(self, slot: int, hashes: Iterable[int], /) -> int: ...  # no longer held
    def clear(self, slot: int, /) -> int: ...  # all of the slot's; how many
    def count(self, slot: int, /) -> int: ...
    def digest(self, slot: int, /) -> tuple[int, int]: ...  # (count, XOR of the slot's hashes)
    def dump(self, nslots: int, /) -> list[list[int]]: ...  # per slot, its hashes
    def hashes(self, slot: int, /) -> list[int]: ...
    def match(self, hashes: Sequence[int], /) -> tuple[int, Cuts] | None: ...
    def memory(self) -> int: ...  # bytes held by the core
    @property
    def entries(self) -> int: ...  # (slot, hash) pairs
    def __len__(self) -> int: ...


NameBits = Callable[[list[str | None], int, int, dict[str, int]], None]

_Native: Callable[[], Core] | None
_native_name_bits: NameBits | None
try:
    from router._blockindex import Core as _Native
    from router._blockindex import name_bits as _native_name_bits
except ImportError:  # built only where a C compiler was present; see setup.py
    _Native = _native_name_bits = None

NATIVE = _Native is not None
"""Whether `BlockIndex()` keeps its table in the C extension (same answers, faster) or in Python."""


class BlockIndex:
    """Which worker holds which canonical block. Not thread-safe; one event loop owns it.

    `native`: None (default) uses the C core where it was built; False forces the Python reference.
    """

    __slots__ = ("_bits", "_core", "_free_slots", "_name_bits", "_names", "_slot_of")

    def __init__(self, *, native: bool | None = None) -> None:
        self._core: Core
        self._name_bits: NameBits
        if native is False or _Native is None or _native_name_bits is None:
            if native:
                raise RuntimeError("router._blockindex was not built (no C compiler at install time)")
            self._core, self._name_bits = PyCore(), _name_bits
        else:
            self._core, self._name_bits = _Native(), _native_name_bits
        self._slot_of: dict[str, int] = {}
        self._names: list[str | None] = []  # slot -> worker; None while free
        self._free_slots: list[int] = []  # heap of freed slots below len(_names)
        self._bits: list[int] = []  # slot -> 1 << slot, one shared object per slot

    @property
    def native(self) -> bool:
        """Whether this index runs the C core."""
        return not isinstance(self._core, PyCore)

    # --- mutation ------------------------------------------------------------------------------

    def store(self, worker: str, hashes: Iterable[int]) -> None:
        """`worker` now holds `hashes`, ints or packed (protocol.packed; the C core reads those
        without creating ints). Storing a held hash again changes nothing.

        Raises ValueError, changing nothing, if a hash is not an int in [0, 2**64), and
        IndexFullError if `worker` is new and MAX_WORKERS others hold blocks."""
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._core.store(slot, hashes)
            return
        if self.full:
            if isinstance(hashes, Sequence) and not hashes:
                return  # holding nothing takes no slot
            raise IndexFullError(
                f"worker {worker} refused: the prefix index holds blocks of {MAX_WORKERS:,} workers, its most"
            )
        slot = self._take_slot(worker)
        try:
            self._core.store(slot, hashes)
        finally:
            if not self._core.count(slot):  # nothing stored (empty, or refused): no slot
                self._free_slot(worker)

    def remove(self, worker: str, hashes: Iterable[int]) -> None:
        """`worker` no longer holds `hashes`, ints or packed (hashes it does not hold are ignored).

        Raises ValueError, changing nothing, if a hash is not an int in [0, 2**64)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        self._core.remove(slot, hashes)
        if not self._core.count(slot):
            self._free_slot(worker)

    def clear(self, worker: str) -> None:
        """Every entry of `worker` goes at once (a `Cleared` event, or the worker left)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        self._core.clear(slot)
        self._free_slot(worker)

    def apply(self, worker: str, events: Iterable[KvEvent]) -> None:
        """Apply one batch's events in order."""
        for event in events:
            # isinstance, not a class-pattern `match`: that cost ~110 ns more an event.
            if isinstance(event, Stored):
                slot = self._slot_of.get(worker)
                if slot is None:
                    self.store(worker, event.hashes)
                else:  # store() for a known worker, inlined: this is the ingest's hot path
                    self._core.store(slot, event.hashes)
            elif isinstance(event, Removed):
                self.remove(worker, event.hashes)
            elif isinstance(event, Cleared):
                self.clear(worker)

    def _take_slot(self, worker: str) -> int:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._names[slot] = worker
        else:
            slot = len(self._names)
            self._names.append(worker)
            self._bits.append(1 << slot)
        self._slot_of[worker] = slot
        return slot

    def _free_slot(self, worker: str) -> None:
        slot = self._slot_of.pop(worker)
        self._names[slot] = None
        heapq.heappush(self._free_slots, slot)

    # --- queries -------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> Overlap:
        """Per worker, the number of leading `hashes` it holds, as a lazy mapping (what routing
        reads); valid until the index next changes, so read it in the same synchronous step.
        A hash that is not an int in [0, 2**64) is held by nobody: the walk ends there."""
        got = self._core.match(hashes) if hashes else None
        if got is None:
            return Overlap((), 0, self._slot_of, self._bits, self._names, self._name_bits)
        return Overlap(got[1], got[0], self._slot_of, self._bits, self._names, self._name_bits)

    def holds(self, worker: str, key: int) -> bool:
        """Whether `worker` holds `key` (a block, or a hybrid model's hit end)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return False
        got = self._core.match([key])
        return got is not None and bool(got[0] & self._bits[slot])

    def find_matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """`match` as a plain dict; workers with no leading block are left out."""
        return self.match(hashes).to_dict()

    def digest(self, worker: str) -> tuple[int, int]:
        """(count, xor): how many distinct hashes `worker` holds and their XOR as u64s, kept as
        blocks come and go; (0, 0) for a worker holding nothing. Compared with the shim's
        LoadReport.kv_blocks/kv_xor, it shows a lost batch."""
        slot = self._slot_of.get(worker)
        return (0, 0) if slot is None else self._core.digest(slot)

    def count(self, worker: str) -> int:
        """How many distinct hashes `worker` holds (0 for a worker holding nothing), in O(1): the
        ingest bounds each worker's entries by it after every batch."""
        slot = self._slot_of.get(worker)
        return 0 if slot is None else self._core.count(slot)

    def worker_hashes(self, worker: str) -> set[int]:
        """A copy of the hashes `worker` holds (empty for an unknown worker)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return set()
        return set(self._core.hashes(slot))

    def workers(self) -> list[str]:
        """Workers holding at least one block, sorted."""
        return sorted(self._slot_of)

    def dump(self) -> dict[str, list[int]]:
        """worker -> its hashes, sorted: storing each rebuilds an identical index, and two replicas
        that agree compare equal."""
        per_slot = self._core.dump(len(self._names))
        return {w: sorted(per_slot[s]) for w, s in sorted(self._slot_of.items())}

    def __len__(self) -> int:
        """Distinct hashes held by anyone."""
        return len(self._core)

    @property
    def entries(self) -> int:
        """(hash, worker) pairs."""
        return self._core.entries

    def memory_bytes(self) -> int:
        """Bytes the index holds: the core's tables (the C core counts what it allocated; PyCore
        estimates its containers and key objects) and the worker-name tables."""
        return (
            self._core.memory()
            + sys.getsizeof(self._slot_of)
            + sys.getsizeof(self._names)
            + sys.getsizeof(self._free_slots)
            + sys.getsizeof(self._bits)
        )

    @property
    def bytes_per_entry(self) -> float:
        """memory_bytes() per (hash, worker) pair; 0.0 for an empty index."""
        entries = self._core.entries
        return self.memory_bytes() / entries if entries else 0.0

    @property
    def full(self) -> bool:
        """Whether MAX_WORKERS workers hold blocks: one holding none yet can store none."""
        return not self._free_slots and len(self._names) >= MAX_WORKERS

    @property
    def slots(self) -> int:
        """Slots allocated (live workers plus freed slots awaiting reuse): the bitset width in bits."""
        return len(self._names)


def _checked(hashes: Iterable[int]) -> set[int]:
    """`hashes` (either wire form) as a set, or ValueError naming the first that is not an int in
    [0, 2**64)."""
    if isinstance(hashes, bytes):
        return set(unpack_hashes(hashes))
    items = hashes if isinstance(hashes, Sequence) else list(hashes)  # read twice on error
    try:
        out = set(map(int.__index__, items))  # TypeError for anything but an int
        if not out or (min(out) >= 0 and max(out) <= _MAX_HASH):
            return out
    except TypeError:
        pass
    bad = next(h for h in items if not isinstance(h, int) or not 0 <= h <= _MAX_HASH)
    raise ValueError(f"block hashes must be integers in [0, 2**64): got {bad!r}")


class PyCore:
    """The pure-Python core and the reference for the C one: hash -> int mask over slots, and per
    slot the set of its hashes and their XOR. A block nobody else holds gets the slot's own bit
    object (shared, no allocation); the per-block loops run in C through map/zip/dict.update."""

    __slots__ = ("_bits", "_entries", "_masks", "_owned", "_xor")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._owned: list[set[int]] = []
        self._xor: list[int] = []
        self._bits: list[int] = []
        self._entries = 0

    def store(self, slot: int, hashes: Iterable[int], /) -> int:
        new = _checked(hashes)
        while len(self._owned) <= slot:
            self._bits.append(1 << len(self._owned))
            self._owned.append(set())
            self._xor.append(0)
        owned = self._owned[slot]
        new -= owned
        if not new:
            return 0
        owned |= new
        self._xor[slot] ^= reduce(xor, new, 0)
        self._entries += len(new)
        masks = self._masks
        bit = self._bits[slot]
        fresh = new.difference(masks)
        if len(fresh) != len(new):
            held = new - fresh
            masks.update(zip(held, map(or_, map(masks.__getitem__, held), repeat(bit)), strict=False))
        masks.update(dict.fromkeys(fresh, bit))
        return len(new)

    def remove(self, slot: int, hashes: Iterable[int], /) -> int:
        gone = _checked(hashes)
        if slot >= len(self._owned):
            return 0
        gone &= self._owned[slot]
        self._owned[slot] -= gone
        self._xor[slot] ^= reduce(xor, gone, 0)
        self._entries -= len(gone)
        self._drop_bits(slot, gone)
        return len(gone)

    def clear(self, slot: int, /) -> int:
        if slot >= len(self._owned):
            return 0
        gone, self._owned[slot] = self._owned[slot], set()
        self._xor[slot] = 0
        self._entries -= len(gone)
        self._drop_bits(slot, gone)
        return len(gone)

    def count(self, slot: int, /) -> int:
        return len(self._owned[slot]) if slot < len(self._owned) else 0

    def digest(self, slot: int, /) -> tuple[int, int]:
        return (len(self._owned[slot]), self._xor[slot]) if slot < len(self._owned) else (0, 0)

    @property
    def entries(self) -> int:
        return self._entries

    def memory(self) -> int:
        """An estimate in O(slots): the dict and sets as allocated and one 64-bit int object per
        distinct hash (the sets share the dict's); the mask ints of shared hashes are left out."""
        return sys.getsizeof(self._masks) + sum(map(sys.getsizeof, self._owned)) + len(self._masks) * _INT_BYTES

    def dump(self, nslots: int, /) -> list[list[int]]:
        return [self.hashes(s) for s in range(nslots)]

    def hashes(self, slot: int, /) -> list[int]:
        return list(self._owned[slot]) if slot < len(self._owned) else []

    def __len__(self) -> int:
        return len(self._masks)

    def _drop_bits(self, slot: int, hashes: set[int]) -> None:
        if not hashes:
            return
        masks = self._masks
        bit = self._bits[slot]
        order = list(hashes)
        current = list(map(masks.__getitem__, order))
        sole = list(map(bit.__eq__, current))  # blocks only this slot held: they go entirely
        _consume(map(masks.__delitem__, compress(order, sole)))
        if not all(sole):
            shared = list(compress(order, map(not_, sole)))
            keep = ~bit
            masks.update(zip(shared, map(and_, compress(current, map(not_, sole)), repeat(keep)), strict=False))

    def match(self, hashes: Sequence[int], /) -> tuple[int, Cuts] | None:
        masks = self._masks
        if not hashes or not masks.get(hashes[0]):
            return None
        # The running AND of the masks only loses bits, and where it loses some, those workers'
        # prefixes end. It can only change where a block's mask differs from the one before, and a
        # prompt's masks come in long equal runs (a conversation held by the same workers), so
        # compare neighbours in C and AND only at the few places they differ.
        got = self._leading_masks(hashes)
        running: int = got[0]
        matched = running
        cuts: Cuts = []
        for depth in compress(range(1, len(got)), map(ne, got, islice(got, 1, None))):
            cut = running & got[depth]
            if cut != running:
                cuts.append((running ^ cut, depth))
                if not cut:
                    return matched, cuts
                running = cut
        cuts.append((running, len(got)))
        return matched, cuts

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


class Overlap(Mapping[str, int]):
    """`BlockIndex.match`'s answer: worker -> leading prompt blocks it holds (absent: none).

    Kept as the few `(workers' bits, depth)` cuts where the prompt's running mask lost bits, so
    answering costs nothing per matching worker until someone asks: `get(worker)` is a slot lookup
    and an AND per cut, which is what routing does for each candidate. A prompt that many workers
    share (a system prompt held by hundreds) thus costs no dict of hundreds of names. It reads the
    index's slot tables, so it is valid only until the index next changes.
    """

    __slots__ = ("_bits", "_cuts", "_matched", "_name_bits", "_names", "_slot_of")

    def __init__(
        self,
        cuts: Sequence[tuple[int, int]],
        matched: int,
        slot_of: Mapping[str, int],
        bits: Sequence[int],
        names: list[str | None],
        name_bits: NameBits,
    ) -> None:
        self._cuts = cuts
        self._matched = matched  # the union of the cuts: workers holding at least the first block
        self._slot_of = slot_of
        self._bits = bits
        self._names = names
        self._name_bits = name_bits  # the C extension's where built, else _name_bits

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
            self._name_bits(self._names, bits, depth, out)
        return out


def _name_bits(names: list[str | None], bits: int, depth: int, out: dict[str, int]) -> None:
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
