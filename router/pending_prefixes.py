"""Prefixes a worker is about to cache: what the router routed there and no KV event confirmed yet.

A request's blocks reach the index only after its prefill (seconds later under load), so a burst of
requests on one new prefix would all look uncached and spread over the fleet. When a request is
booked, its prompt's block hashes become pending entries on the workers that will hold them (the
decode worker; the prefill worker too on the remote path). The planner matches prompts against the
index and these entries together.

An entry ends when a KV event from its worker stores the block (the index has it now), when the
worker removes that block or leaves, when it expires `ttl_s` after it was made (the request was
preempted before caching, or its events were lost), or when it is withdrawn; booking the same block
on the same worker again renews it. Expiry is lazy: `match` ignores expired entries and `prune` (run
at most every `ttl_s / 2` by `add`) drops them.

Each `add` is one booking's `Claim` (router.ledger keeps them per attempt). A claim is settled when
its worker has prefilled the prompt (its events will confirm the entries), or withdrawn when the
attempt ended before that (a client gone during its remote prefill, a failed leg): a retry comes at
once, and an entry left to its TTL would credit a worker with a prompt it never cached. Withdrawing
ends an entry only where no other claim holds it: none in flight (a count per hash), none settled
since the entry was made (`kept`); a renewal by another request on the same prefix stays.

Layout: per worker, a dict hash -> expiry, and for the claims a dict hash -> claims in flight and the
set of hashes a settled claim keeps, so that booking, settling, confirming and matching a prompt run
their per-block loops in C (a full trace books millions of blocks); only a withdrawal (a failed
attempt) loops in Python. Synchronous, one event loop, injected clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from operator import add, sub

from protocol import unpack_hashes

__all__ = ["Claim", "PendingPrefixes"]

_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator in C
_ABSENT = float("-inf")


class _Claims:
    """One worker's claims on its entries. A count of 0 is as good as none (`settle` leaves it for
    `prune`); `kept` holds only hashes with an entry."""

    __slots__ = ("inflight", "kept")

    def __init__(self) -> None:
        self.inflight: dict[int, int] = {}  # hash -> claims neither settled nor withdrawn
        self.kept: set[int] = set()  # hashes a claim settled since their entry was made


class Claim:
    """One booking's entries on one worker (`PendingPrefixes.add`), to settle or withdraw once."""

    __slots__ = ("_table", "hashes", "worker")

    def __init__(self, worker: str, hashes: Sequence[int], table: _Claims) -> None:
        self.worker = worker
        self.hashes = hashes
        self._table: _Claims | None = table  # None once settled or withdrawn

    def take(self, current: _Claims | None) -> _Claims | None:
        """The worker's claims table, once, while it is the one this claim was made in (not after
        the worker was forgotten)."""
        table, self._table = self._table, None
        return table if table is not None and table is current else None


class PendingPrefixes:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_worker: dict[str, dict[int, float]] = {}  # worker -> hash -> expiry
        self._claims: dict[str, _Claims] = {}
        self._next_prune = float("-inf")

    def __len__(self) -> int:
        """(hash, worker) entries held, expired ones not yet pruned included."""
        return sum(len(d) for d in self._by_worker.values())

    def add(self, worker: str, hashes: Sequence[int]) -> Claim | None:
        """`worker` will hold `hashes` (a prompt's block hashes, in order): the booking's claim on
        them, None when nothing was added."""
        if self.ttl_s <= 0 or not hashes:
            return None
        now = self._clock()
        held = self._by_worker.get(worker)
        if held is None:
            held = self._by_worker[worker] = {}
        held.update(dict.fromkeys(hashes, now + self.ttl_s))
        table = self._claims.get(worker)
        if table is None:
            table = self._claims[worker] = _Claims()
        counts = table.inflight
        counts.update(zip(hashes, map(add, map(counts.get, hashes, repeat(0)), repeat(1)), strict=True))
        if now >= self._next_prune:
            self.prune()
        return Claim(worker, hashes, table)

    def settle(self, claim: Claim) -> None:
        """The claim's worker prefilled its prompt: its entries stay until events confirm them or
        they expire, whatever becomes of the other claims on them."""
        table = claim.take(self._claims.get(claim.worker))
        if table is None:
            return
        counts, hashes = table.inflight, claim.hashes
        counts.update(zip(hashes, map(sub, map(counts.__getitem__, hashes), repeat(1)), strict=True))
        held = self._by_worker.get(claim.worker)
        if held:
            table.kept.update(filter(held.__contains__, hashes))

    def withdraw(self, claim: Claim) -> None:
        """The claim's attempt ended before its worker prefilled the prompt: its entries end, but
        for those another claim holds (in flight, or settled since the entry was made)."""
        table = claim.take(self._claims.get(claim.worker))
        if table is None:
            return
        counts, kept = table.inflight, table.kept
        held = self._by_worker.get(claim.worker, {})
        for h in claim.hashes:
            left = counts.pop(h) - 1
            if left > 0:
                counts[h] = left
            elif h not in kept:
                held.pop(h, None)

    def confirm(self, worker: str, hashes: Iterable[int] | bytes) -> None:
        """A KV event stored or removed `hashes` (either wire form) on `worker`: the index speaks
        for them now."""
        held = self._by_worker.get(worker)
        if held:
            if isinstance(hashes, bytes):
                hashes = unpack_hashes(hashes)
            table = self._claims.get(worker)
            if table is not None and table.kept:  # a settled claim keeps the entry no more
                hashes = list(hashes)
                table.kept.difference_update(hashes)
            _consume(map(held.pop, hashes, repeat(None)))

    def holds(self, worker: str, key: int) -> bool:
        """Whether `worker` has a live entry for `key`."""
        held = self._by_worker.get(worker)
        return held is not None and held.get(key, _ABSENT) > self._clock()

    def forget_worker(self, worker: str) -> None:
        """`worker` left: its entries end, its claims with them (settling or withdrawing one later
        does nothing, even where the worker came back)."""
        self._by_worker.pop(worker, None)
        self._claims.pop(worker, None)

    def match(self, hashes: Sequence[int], after: Mapping[str, int] | None = None) -> dict[str, int]:
        """Per worker, how many leading `hashes` it will hold: the first `after[worker]` (what the
        index already has there), then those pending there (live entries only). A worker appears
        only when at least one block past `after` is pending on it.

        `after` matters for prompts longer than one prefill chunk: the engine stores (and the
        events confirm, ending their entries) the first chunk's blocks while the rest are still
        pending, so the pending run starts where the index's ends, not at the first block."""
        if not hashes or not self._by_worker:
            return {}
        now = self._clock()
        out: dict[str, int] = {}
        for worker, held in self._by_worker.items():
            start = after.get(worker, 0) if after else 0
            if start >= len(hashes):
                continue
            expiry = held.get(hashes[start])
            if expiry is None or expiry <= now:
                continue
            out[worker] = start + _leading_live(held, hashes[start:] if start else hashes, now)
        return out

    def prune(self) -> None:
        """Drop entries whose time is up, and the claims counted out. A claim in flight outlives
        its entries' expiry: its count holds a later renewal's entry against its withdrawal."""
        now = self._clock()
        self._next_prune = now + self.ttl_s / 2
        for worker in list(self._by_worker):
            held = self._by_worker[worker]
            live = {h: e for h, e in held.items() if e > now}
            if live:
                self._by_worker[worker] = live
            else:
                del self._by_worker[worker]
        for worker in list(self._claims):
            table = self._claims[worker]
            table.inflight = {h: n for h, n in table.inflight.items() if n}
            table.kept.intersection_update(self._by_worker.get(worker, ()))
            if not table.inflight and not table.kept:  # no claim in flight refers to it
                del self._claims[worker]


def _leading_live(held: dict[int, float], hashes: Sequence[int], now: float) -> int:
    """How many leading `hashes` have a live entry in `held` (the first one has)."""
    expiries = list(map(held.get, hashes, repeat(_ABSENT)))
    try:
        depth = expiries.index(_ABSENT)
    except ValueError:
        depth = len(expiries)
    if min(expiries[:depth]) > now:
        return depth
    return next(i for i, e in enumerate(expiries) if e <= now)
