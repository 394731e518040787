"""A budget of load reports per sender, checked before a report is decoded.

A shim sends a report on every change and at least every period, at most every
protocol.config.MIN_LOAD_PERIOD_S (20 a second: it refuses a shorter --load-period-s, and waits as
long after a change). Anyone allowed a `{ns}.load.NAME` can send far more: one worker
flooding its own subject at 50,000 reports a second (isolation audit of 2026-12-06) took a router's
loop (13.5 µs a report, decoded and folded), so the other workers' reports were read seconds late
(silent, a false clock skew) and their replies too (unreachable): 503s for a fault of one worker.
Past its budget a sender's reports are dropped for the cost of a dict lookup, before decoding, and
counted; the next one within budget supersedes them, as every report does its sender's last. The
router also quarantines such a sender (router.load_subscriptions), as dropping is not enough.

Each sender has a token bucket of BURST reports refilled at RATE_PER_S: twice a shim's most, and
a burst that a loop stalled for a few seconds (reports queued behind it, then read at once) fits.
Senders are keyed on the subject's last token, which is all that is known before decoding; a
bucket left to refill to the full is the same as none, so those are forgotten once there are
more than MAX_SENDERS (anyone may publish on any name).
"""

from __future__ import annotations

from protocol.config import MIN_LOAD_PERIOD_S

__all__ = ["BURST", "MAX_SENDERS", "RATE_PER_S", "LoadBudget"]

RATE_PER_S = 2 / MIN_LOAD_PERIOD_S
BURST = 120.0
MAX_SENDERS = 65536


class LoadBudget:
    def __init__(self, rate_per_s: float = RATE_PER_S, burst: float = BURST, max_senders: int = MAX_SENDERS) -> None:
        if rate_per_s <= 0 or burst < 1 or max_senders < 1:
            raise ValueError(
                f"a load budget needs rate_per_s > 0, burst >= 1, max_senders >= 1: {rate_per_s=}, {burst=}, "
                f"{max_senders=}"
            )
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_senders = max_senders
        self._buckets: dict[str, tuple[float, float]] = {}  # sender: (tokens, when counted)
        self.over = 0  # reports dropped past their sender's budget

    def admit(self, sender: str, now: float) -> bool:
        """Whether a report of `sender` at `now` (a monotonic clock) is within its budget; one past
        it is counted in `over`."""
        tokens, then = self._buckets.get(sender, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate_per_s)
        if tokens < 1:
            self._buckets[sender] = (tokens, now)
            self.over += 1
            return False
        if sender not in self._buckets and len(self._buckets) >= self.max_senders:
            self._forget_full(now)
        self._buckets[sender] = (tokens - 1, now)
        return True

    def _forget_full(self, now: float) -> None:
        full_after = self.burst / self.rate_per_s
        self._buckets = {s: b for s, b in self._buckets.items() if now - b[1] < full_after}
        if len(self._buckets) >= self.max_senders:  # as many within a refill: the half seen first goes
            self._buckets = dict(list(self._buckets.items())[len(self._buckets) // 2 :])
