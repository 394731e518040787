"""What a fleet of workers holds: deterministic block hashes per worker for the index's fleet-scale
benches (memory, event lag, bootstrap), computed per worker on demand so that no bench holds the
whole fleet's hashes at once.

Two sharings, 16,384 blocks per worker by default (the sizing point of issue 12; an H200 serving
an 8B model at block size 16 has room for ~53 k):

- `low`: one of 8 system prompts (256 blocks, so each is held by ~125 of 1,000 workers), the rest
  private.
- `high`: 16 of 64 popular prefixes (128 blocks each, picked with Zipf(1.1) popularity, so the top
  ones sit on most workers), 2,048 blocks shared with the next worker and 2,049 with the next two
  (conversations that moved or were replicated), the rest private: 62.5% of a worker's blocks are
  its own, 25% are held by 2-3 workers, 12.5% are popular.

Hashes are splitmix64 of (kind, group, index): uniform 64-bit values as canonical hashes are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SHARINGS", "FleetWorkload"]

SHARINGS = ("low", "high")

_PRIVATE, _SYSTEM, _POPULAR, _PAIR, _TRIPLE, _FRESH = range(6)
_SYSTEM_PROMPTS, _SYSTEM_BLOCKS = 8, 256
_POPULAR_PREFIXES, _POPULAR_BLOCKS, _POPULAR_PER_WORKER = 64, 128, 16
_PAIR_BLOCKS, _TRIPLE_BLOCKS = 1024, 683  # per group: a worker is in 2 pair and 3 triple groups


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each u64."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def _ids(kind: int, group: int, start: int, n: int) -> np.ndarray:
    base = np.uint64((kind << 56) | (group << 28))
    return _mix(base + np.arange(start, start + n, dtype=np.uint64))


@dataclass(frozen=True)
class FleetWorkload:
    workers: int = 1000
    blocks: int = 16_384  # per worker
    sharing: str = "low"

    def __post_init__(self) -> None:
        if self.sharing not in SHARINGS:
            raise ValueError(f"sharing must be one of {', '.join(SHARINGS)}, got {self.sharing!r}")
        shared = _SYSTEM_BLOCKS if self.sharing == "low" else self._high_shared()
        if self.blocks < shared:
            raise ValueError(f"blocks per worker must be at least {shared} for sharing={self.sharing}")

    def _high_shared(self) -> int:
        return _POPULAR_PER_WORKER * _POPULAR_BLOCKS + 2 * _PAIR_BLOCKS + 3 * _TRIPLE_BLOCKS

    def name(self, worker: int) -> str:
        return f"{worker + 1:x}"

    def hashes(self, worker: int) -> np.ndarray:
        """The blocks `worker` holds (u64, no repeats)."""
        if self.sharing == "low":
            system = _ids(_SYSTEM, worker % _SYSTEM_PROMPTS, 0, _SYSTEM_BLOCKS)
            return np.concatenate([system, _ids(_PRIVATE, worker, 0, self.blocks - _SYSTEM_BLOCKS)])
        n = self.workers
        rng = np.random.default_rng(worker)
        weights = 1.0 / np.arange(1, _POPULAR_PREFIXES + 1) ** 1.1
        prefixes = rng.choice(_POPULAR_PREFIXES, _POPULAR_PER_WORKER, replace=False, p=weights / weights.sum())
        parts = [_ids(_POPULAR, int(p), 0, _POPULAR_BLOCKS) for p in prefixes]
        parts += [_ids(_PAIR, (worker - k) % n, 0, _PAIR_BLOCKS) for k in range(2)]
        parts += [_ids(_TRIPLE, (worker - k) % n, 0, _TRIPLE_BLOCKS) for k in range(3)]
        parts.append(_ids(_PRIVATE, worker, 0, self.blocks - self._high_shared()))
        return np.concatenate(parts)

    def fresh(self, stream: int, start: int, n: int) -> np.ndarray:
        """`n` blocks nobody holds yet, numbered from `start` in `stream`: what workers cache next."""
        return _ids(_FRESH, stream, start, n)
