"""A budget of messages (and bytes) per sender, checked before a message is decoded: load reports
on `{ns}.load.NAME` and KV event batches on `{ns}.kv.NAME`.

Anyone allowed a worker's subject can send far more than its shim does: one worker flooding its
own load subject at 50,000 reports a second (isolation audit of 2026-12-06) took a router's loop,
and one flooding its own KV subject with 469 KB batches at 100 MB/s, or empty ones at 57,000 a
second (isolation audit of 2026-12-07), queued every other worker's batches and kvstate replies
behind it: every worker `repairing`, every request 503. Past its budget a sender's messages are
dropped for the cost of a dict lookup, before decoding, and counted; the router also quarantines
such a sender (router.sender_subscriptions), as dropping is not enough.

Each sender has a token bucket of `burst` messages refilled at `rate_per_s`, and one of
`bytes_burst` bytes refilled at `bytes_per_s` (none by default: a load report's size is bounded by
its decoding). The KV defaults (protocol.kv_budget) are derived from what a shim can send
(docs/router.md, "Flooded subjects"), with room for a loop stalled for a few seconds (messages
queued behind it, then read at once); a shim paces its KV sends at half of them. Senders are
keyed on the subject's last token, which is all that is known before decoding; a bucket left to
refill to the full is the same as none, so those are forgotten once there are more than
`max_senders` (anyone may publish on any name). Every sender has the same burst, a registered
worker's too: a bigger one let a flood on its own subject cut the router's KV connection
(docs/router.md, "Flooded subjects").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.config import MIN_LOAD_PERIOD_S
from protocol.errors import ConfigError
from protocol.kv_budget import (
    KV_BATCH_BURST,
    KV_BATCHES_PER_S,
    KV_MIB_BURST,
    KV_MIB_PER_S,
    KV_PACE_BATCHES_PER_S,
    KV_PACE_MIB_PER_S,
)

__all__ = [
    "LOAD_BURST",
    "LOAD_RATE_PER_S",
    "MAX_SENDERS",
    "KvBudget",
    "SenderBudget",
]

# Load reports: a shim sends one at most every MIN_LOAD_PERIOD_S (20 a second); twice that.
LOAD_RATE_PER_S = 2 / MIN_LOAD_PERIOD_S
LOAD_BURST = 120.0
# KV batches and bytes: protocol.kv_budget (a shim paces its sends under these defaults).
MAX_SENDERS = 65536
_MIB = 1 << 20
# The allowed --kv-budget-* ranges: below the least, the pace an honest shim keeps (protocol.kv_budget:
# its registration's snapshot, a ring of batches after a NATS stall) is dropped and the worker
# quarantined; below the default, a router loop stalled mid-snapshot for less than the 2 s the
# default holds may do the same. The most is as good as none.
_KV_LEAST_BATCHES_PER_S = KV_PACE_BATCHES_PER_S
_KV_MOST_BATCHES_PER_S = 1e6
_KV_LEAST_MIB_PER_S = KV_PACE_MIB_PER_S
_KV_MOST_MIB_PER_S = 4096.0


class SenderBudget:
    def __init__(
        self,
        rate_per_s: float = LOAD_RATE_PER_S,
        burst: float = LOAD_BURST,
        *,
        bytes_per_s: float = math.inf,
        bytes_burst: float = math.inf,
        max_senders: int = MAX_SENDERS,
    ) -> None:
        if not (rate_per_s > 0 and burst >= 1 and bytes_per_s > 0 and bytes_burst >= 1 and max_senders >= 1):
            raise ValueError(
                "a sender budget needs rate_per_s > 0, burst >= 1, bytes_per_s > 0, bytes_burst >= 1, "
                f"max_senders >= 1: {rate_per_s=}, {burst=}, {bytes_per_s=}, {bytes_burst=}, {max_senders=}"
            )
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.bytes_per_s = bytes_per_s
        self.bytes_burst = bytes_burst
        self.max_senders = max_senders
        self._buckets: dict[str, tuple[float, float, float]] = {}  # sender: (messages, bytes, when counted)
        self.over = 0  # messages dropped past their sender's budget

    def admit(self, sender: str, now: float, size: int = 0) -> bool:
        """Whether a message of `sender` of `size` bytes at `now` (a monotonic clock) is within its
        budget; one past it is counted in `over`."""
        tokens, room, then = self._buckets.get(sender, (self.burst, self.bytes_burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate_per_s)
        if self.bytes_per_s < math.inf:  # (inf * 0 is NaN)
            room = min(self.bytes_burst, room + (now - then) * self.bytes_per_s)
        if tokens < 1 or room < size:
            self._buckets[sender] = (tokens, room, now)
            self.over += 1
            return False
        if sender not in self._buckets and len(self._buckets) >= self.max_senders:
            self._forget_full(now)
        self._buckets[sender] = (tokens - 1, room - size, now)
        return True

    def _forget_full(self, now: float) -> None:
        full_after = self.burst / self.rate_per_s
        if self.bytes_per_s < math.inf:
            full_after = max(full_after, self.bytes_burst / self.bytes_per_s)
        self._buckets = {s: b for s, b in self._buckets.items() if now - b[2] < full_after}
        if len(self._buckets) >= self.max_senders:  # as many within a refill: the half seen first goes
            self._buckets = dict(list(self._buckets.items())[len(self._buckets) // 2 :])


@dataclass(frozen=True)
class KvBudget:
    """The router's --kv-budget-* flags: each KV event sender's budget."""

    batches_per_s: float = KV_BATCHES_PER_S
    batch_burst: float = KV_BATCH_BURST
    mib_per_s: float = KV_MIB_PER_S
    mib_burst: float = KV_MIB_BURST

    def validate(self) -> KvBudget:
        """ConfigError naming the first flag out of its range (a NaN is out of every one)."""
        ranges = {
            "kv_budget_batches_per_s": (self.batches_per_s, _KV_LEAST_BATCHES_PER_S, _KV_MOST_BATCHES_PER_S),
            "kv_budget_batch_burst": (self.batch_burst, self.batches_per_s, 10 * _KV_MOST_BATCHES_PER_S),
            "kv_budget_mib_per_s": (self.mib_per_s, _KV_LEAST_MIB_PER_S, _KV_MOST_MIB_PER_S),
            "kv_budget_mib_burst": (self.mib_burst, self.mib_per_s, 10 * _KV_MOST_MIB_PER_S),
        }
        for name, (value, least, most) in ranges.items():
            if not least <= value <= most:
                raise ConfigError(
                    name,
                    value,
                    f"must be in [{least:g}, {most:g}] (a burst holds at least a second of its rate; below the "
                    "least the pace of an honest shim's registration snapshot is dropped, and below the default "
                    'a router loop stalled during one may drop it: docs/router.md, "Flooded subjects")',
                )
        return self

    def budget(self) -> SenderBudget:
        return SenderBudget(
            self.batches_per_s, self.batch_burst, bytes_per_s=self.mib_per_s * _MIB, bytes_burst=self.mib_burst * _MIB
        )
