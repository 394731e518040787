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
ends an entry only where no other claim holds it: one in flight or settled, made on the entry since
it was made; a renewal by another request on the same prefix stays. A KV event ends the entry for
every claim made before it: a claim in flight then holds nothing there, and a renewal booked after
the event is withdrawn with its own claim (the index speaks for the block: the worker stored it, or
dropped it, and the claim in flight's prefill stores it again with an event of its own).

Layout: per worker, a dict hash -> expiry, so that booking, confirming and matching a prompt run
their per-block loops in C (a full trace books millions of blocks). A claim's expiry is its stamp:
a float of its own (`_Stamp`, equal in value to the expiry of a claim booked in the same instant but
not the same object), so an entry's value names the claim that made or renewed it last; the claim
keeps the values it overwrote (`prev`, one C pass at booking). Settling is O(1). Withdrawing, a
failed attempt's only per-block loop in Python, ends or restores only the entries still carrying
its stamp, back to the value before it, past claims withdrawn meanwhile: a claim withdrawn under a
later renewal leaves there its `prev` already followed past the claims withdrawn by then
(`_Worker.withdrawn`, until its stamp expires; only the values still live), so withdrawals in any
order leave what the claims still standing made, and claims failing one after another on a shared
prefix (a hung worker: each attempt times out) cost each withdrawal one step per block, not one per
claim withdrawn before it. Synchronous, one event loop, injected clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat

from protocol import unpack_hashes

__all__ = ["Claim", "PendingPrefixes"]

_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator in C
_ABSENT = float("-inf")


class _Stamp(float):
    """A claim's expiry, told from another claim's equal one by identity (`is`): claims booked in the
    same instant expire together, ttl_s after it, yet each withdraws only what it set."""

    __slots__ = ()


class _Worker:
    """One worker's entries, and what its claims withdrawn under a later renewal overwrote."""

    __slots__ = ("held", "withdrawn")

    def __init__(self) -> None:
        self.held: dict[int, float] = {}  # hash -> expiry: the stamp of the claim that set it last
        # id of the stamp of a claim withdrawn while a later claim held some of its hashes -> the
        # stamp (kept alive: its id names it alone) and, of those hashes, the ones that had a live
        # value under it once past the claims withdrawn then (a hash left out had none), for that
        # later claim's withdrawal to restore past it
        self.withdrawn: dict[int, tuple[_Stamp, dict[int, float]]] = {}


class Claim:
    """One booking's entries on one worker (`PendingPrefixes.add`), to settle or withdraw once."""

    __slots__ = ("_table", "hashes", "prev", "stamp", "worker")

    def __init__(
        self, worker: str, hashes: Sequence[int], stamp: _Stamp, prev: list[float | None], table: _Worker
    ) -> None:
        self.worker = worker
        self.hashes = hashes
        self.stamp = stamp  # its entries' expiry, no other claim's object
        self.prev = prev  # per hash, the entry's expiry before this claim (None: no entry)
        self._table: _Worker | None = table  # None once settled or withdrawn

    def take(self, current: _Worker | None) -> _Worker | None:
        """The worker's table, once, while it is the one this claim was made in (not after the
        worker was forgotten, or all its entries were pruned)."""
        table, self._table = self._table, None
        return table if table is not None and table is current else None


class PendingPrefixes:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_worker: dict[str, _Worker] = {}
        self._next_prune = float("-inf")

    def __len__(self) -> int:
        """(hash, worker) entries held, expired ones not yet pruned included."""
        return sum(len(t.held) for t in self._by_worker.values())

    def add(self, worker: str, hashes: Sequence[int]) -> Claim | None:
        """`worker` will hold `hashes` (a prompt's block hashes, in order): the booking's claim on
        them, None when nothing was added."""
        if self.ttl_s <= 0 or not hashes:
            return None
        now = self._clock()
        stamp = _Stamp(now + self.ttl_s)
        table = self._by_worker.get(worker)
        if table is None:
            table = self._by_worker[worker] = _Worker()
        held = table.held
        prev = list(map(held.get, hashes))
        held.update(dict.fromkeys(hashes, stamp))
        if now >= self._next_prune:
            self.prune()
        return Claim(worker, hashes, stamp, prev, table)

    def settle(self, claim: Claim) -> None:
        """The claim's worker prefilled its prompt: its entries stay until events confirm them or
        they expire, whatever becomes of the other claims on them."""
        claim.take(None)  # done: withdrawing it does nothing now

    def withdraw(self, claim: Claim) -> None:
        """The claim's attempt ended before its worker prefilled the prompt: its entries end, or go
        back to the claim standing under it, but for those a later claim renewed."""
        table = claim.take(self._by_worker.get(claim.worker))
        if table is None:
            return
        held, withdrawn, stamp, now = table.held, table.withdrawn, claim.stamp, self._clock()
        renewed: dict[int, float] = {}
        under_renewal = False
        for h, before in zip(claim.hashes, claim.prev, strict=True):
            p = before
            while p is not None and p > now and (under := withdrawn.get(id(p))) is not None:
                p = under[1].get(h)  # that claim was withdrawn too
            expiry = held.get(h)
            if expiry is stamp:
                if p is None or p <= now:
                    del held[h]
                else:
                    held[h] = p
            elif expiry is not None:  # a later claim's: its withdrawal restores past this one
                under_renewal = True
                if p is not None and p > now:
                    renewed[h] = p  # resolved: a later walk skips the claims withdrawn by now
        if under_renewal and stamp > now:  # its record says it is withdrawn, even naming no hash
            withdrawn[id(stamp)] = (stamp, renewed)

    def confirm(self, worker: str, hashes: Iterable[int] | bytes) -> None:
        """A KV event stored or removed `hashes` (either wire form) on `worker`: the index speaks
        for them now."""
        table = self._by_worker.get(worker)
        if table is not None and table.held:
            if isinstance(hashes, bytes):
                hashes = unpack_hashes(hashes)
            _consume(map(table.held.pop, hashes, repeat(None)))

    def holds(self, worker: str, key: int) -> bool:
        """Whether `worker` has a live entry for `key`."""
        table = self._by_worker.get(worker)
        return table is not None and table.held.get(key, _ABSENT) > self._clock()

    def forget_worker(self, worker: str) -> None:
        """`worker` left: its entries end, its claims with them (settling or withdrawing one later
        does nothing, even where the worker came back)."""
        self._by_worker.pop(worker, None)

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
        for worker, table in self._by_worker.items():
            start = after.get(worker, 0) if after else 0
            if start >= len(hashes):
                continue
            held = table.held
            expiry = held.get(hashes[start])
            if expiry is None or expiry <= now:
                continue
            out[worker] = start + _leading_live(held, hashes[start:] if start else hashes, now)
        return out

    def prune(self) -> None:
        """Drop entries whose time is up, and a worker with none left: its claims in flight end
        nothing then (none of their entries is left, and the claims made since see a new table)."""
        now = self._clock()
        self._next_prune = now + self.ttl_s / 2
        for worker in list(self._by_worker):
            table = self._by_worker[worker]
            live = {h: e for h, e in table.held.items() if e > now}
            if not live:
                del self._by_worker[worker]
                continue
            table.held = live
            if table.withdrawn:
                table.withdrawn = {k: under for k, under in table.withdrawn.items() if under[0] > now}


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
