"""Prefixes a worker is about to cache: what the router routed there and no KV event confirmed yet.

A request's blocks reach the index only after its prefill (seconds later under load), so a burst of
requests on one new prefix would all look uncached and spread over the fleet. When a request is
booked, its prompt's block hashes become pending entries on the workers that will hold them (the
decode worker; the prefill worker too on the remote path). The planner matches prompts against the
index and these entries together.

An entry ends when a KV event from its worker stores the block (the index has it now), when the
worker removes that block or leaves, or when it expires `ttl_s` after it was made (the request
failed, was preempted before caching, or its events were lost); booking the same block on the same
worker again renews it. Expiry is lazy: `match` ignores expired entries and `prune` (run at most
every `ttl_s / 2` by `add`) drops them.

Layout: per worker, a dict hash -> expiry, so that booking, confirming and matching a prompt run
their per-block loops in C (a full trace books millions of blocks). Synchronous, one event loop,
injected clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat

from protocol import unpack_hashes

__all__ = ["PendingPrefixes"]

_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator in C
_ABSENT = float("-inf")


class PendingPrefixes:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_worker: dict[str, dict[int, float]] = {}  # worker -> hash -> expiry
        self._next_prune = float("-inf")

    def __len__(self) -> int:
        """(hash, worker) entries held, expired ones not yet pruned included."""
        return sum(len(d) for d in self._by_worker.values())

    def add(self, worker: str, hashes: Sequence[int]) -> None:
        """`worker` will hold `hashes` (a prompt's block hashes, in order)."""
        if self.ttl_s <= 0 or not hashes:
            return
        now = self._clock()
        held = self._by_worker.get(worker)
        if held is None:
            held = self._by_worker[worker] = {}
        held.update(dict.fromkeys(hashes, now + self.ttl_s))
        if now >= self._next_prune:
            self.prune()

    def confirm(self, worker: str, hashes: Iterable[int] | bytes) -> None:
        """A KV event stored or removed `hashes` (either wire form) on `worker`: the index speaks
        for them now."""
        held = self._by_worker.get(worker)
        if held:
            if isinstance(hashes, bytes):
                hashes = unpack_hashes(hashes)
            _consume(map(held.pop, hashes, repeat(None)))

    def holds(self, worker: str, key: int) -> bool:
        """Whether `worker` has a live entry for `key`."""
        held = self._by_worker.get(worker)
        return held is not None and held.get(key, _ABSENT) > self._clock()

    def forget_worker(self, worker: str) -> None:
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
        """Drop entries whose time is up."""
        now = self._clock()
        self._next_prune = now + self.ttl_s / 2
        for worker in list(self._by_worker):
            held = self._by_worker[worker]
            live = {h: e for h, e in held.items() if e > now}
            if live:
                self._by_worker[worker] = live
            else:
                del self._by_worker[worker]


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
