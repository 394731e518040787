"""Prefixes a worker is about to cache: what the router routed there and no KV event confirmed yet.

A request's blocks reach the index only after its prefill (seconds later under load), so a burst of
requests on one new prefix would all look uncached and spread over the fleet. When a request is
booked, its prompt's block hashes become pending entries on the workers that will hold them (the
decode worker; the prefill worker too on the remote path). The planner matches prompts against the
index and these entries together.

An entry ends when a KV event from its worker stores the block (the index has it now), when the
worker removes that block or leaves, or when it expires `ttl_s` after it was made (the request
failed, was preempted before caching, or its events were lost). Expiry is lazy: `match` ignores
expired entries and `prune` drops them, oldest first. Synchronous, one event loop, injected clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

__all__ = ["PendingPrefixes"]


class PendingPrefixes:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_hash: dict[int, dict[str, float]] = {}  # hash -> worker -> expiry
        self._expiries: deque[tuple[float, str, Sequence[int]]] = deque()  # made in expiry order

    def __len__(self) -> int:
        """(hash, worker) entries held, expired ones not yet pruned included."""
        return sum(len(w) for w in self._by_hash.values())

    def add(self, worker: str, hashes: Sequence[int]) -> None:
        """`worker` will hold `hashes` (a prompt's block hashes, in order)."""
        if self.ttl_s <= 0 or not hashes:
            return
        expiry = self._clock() + self.ttl_s
        for h in hashes:
            holders = self._by_hash.get(h)
            if holders is None:
                self._by_hash[h] = {worker: expiry}
            else:
                holders[worker] = expiry
        self._expiries.append((expiry, worker, hashes))
        self.prune()

    def confirm(self, worker: str, hashes: Iterable[int]) -> None:
        """A KV event stored or removed `hashes` on `worker`: the index speaks for them now."""
        by_hash = self._by_hash
        for h in hashes:
            holders = by_hash.get(h)
            if holders is not None and holders.pop(worker, None) is not None and not holders:
                del by_hash[h]

    def forget_worker(self, worker: str) -> None:
        for h in [h for h, holders in self._by_hash.items() if worker in holders]:
            self.confirm(worker, (h,))

    def match(self, hashes: Sequence[int], workers: Iterable[str] | None = None) -> dict[str, int]:
        """Per worker, how many leading `hashes` are pending there (live entries only)."""
        by_hash = self._by_hash
        if not by_hash or not hashes:
            return {}
        first = by_hash.get(hashes[0])
        if not first:
            return {}
        now = self._clock()
        alive = {w for w, exp in first.items() if exp > now}
        if workers is not None:
            alive &= set(workers)
        out: dict[str, int] = {}
        depth = 1
        while alive and depth < len(hashes):
            holders = by_hash.get(hashes[depth])
            if holders is None:
                break
            gone = {w for w in alive if holders.get(w, 0.0) <= now}
            for w in gone:
                out[w] = depth
            alive -= gone
            depth += 1
        for w in alive:
            out[w] = depth
        return out

    def prune(self) -> None:
        """Drop entries whose time is up."""
        now = self._clock()
        expiries, by_hash = self._expiries, self._by_hash
        while expiries and expiries[0][0] <= now:
            expiry, worker, hashes = expiries.popleft()
            for h in hashes:
                holders = by_hash.get(h)
                # A later booking of the same block on the same worker renewed it: keep that one.
                if holders is not None and holders.get(worker, expiry + 1) <= expiry:
                    del holders[worker]
                    if not holders:
                        del by_hash[h]
