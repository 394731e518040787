"""`TransferHealth`: the decode workers whose KV pulls fail, which the remote path must avoid.

When a decode engine cannot load the KV a prefill worker computed for it (a NIXL link down, a
prefill engine whose pins expire or that restarted), vLLM fails the request (its default
`kv_load_failure_policy`) and the dispatcher has the decode worker prefill the prompt itself
(`fallback_transfer_failed`). Every later remote prefill into that worker would pay the same: a
prefill leg whose work is thrown away, a failed pull, then the local prefill, so well over twice
a bypass's TTFT. So after a failed pull into a worker, routing takes the bypass path for it
(`bypass_transfer_failing`) until `cooldown_s` after its last failure. Then the next request
tries the remote path again: a pull that works then ends the episode (one that worked during
the cooldown was planned before the failure and says nothing), another failure starts a new
cooldown. Each router replica learns from its own requests, and all of them from the worker's
load reports: LoadReport.kv_transfers_failed counts the pulls its engine failed, which under
vLLM's `kv_load_failure_policy: "recompute"` is the only sign (the request succeeds, late). One
WARNING per episode names the worker and, when known, the prefill worker it failed to load from,
and an INFO its recovery.

Synchronous, with the planner's clock, which it reads only while some worker is failing (a
virtual-clock replay, where no pull fails, reads no clock here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["TRANSFER_COOLDOWN_S", "TransferHealth"]

log = logging.getLogger(__name__)
TRANSFER_COOLDOWN_S = 30.0


class TransferHealth:
    def __init__(self, cooldown_s: float = TRANSFER_COOLDOWN_S, clock: Callable[[], float] = time.time) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._last_failure: dict[str, float] = {}  # worker -> when its last pull failed, while in an episode
        self._reported: dict[str, int] = {}  # worker -> its last LoadReport.kv_transfers_failed
        self.failures = 0

    def failed(self, worker: str, prefill_worker: str = "") -> None:
        """A pull into `worker` of KV computed on `prefill_worker` ("": not known) failed."""
        self.failures += 1
        if worker not in self._last_failure:
            log.warning(
                "decode worker %s failed to load KV prefilled on %s: requests for it prefill there for the next "
                "%.0fs (bypass_transfer_failing), then the remote path is tried again. Check the KV connector "
                "(NIXL) between them and the prefill engines' kv pin timeout",
                worker,
                prefill_worker or "a prefill worker (its engine's count)",
                self.cooldown_s,
            )
        self._last_failure[worker] = self._clock()

    def reported(self, worker: str, failed_total: int) -> None:
        """A load report's count of the pulls `worker`'s engine failed: a rise is a failure. The
        first report sets the baseline, and a count that goes down (the shim restarted) another."""
        last = self._reported.get(worker)
        self._reported[worker] = failed_total
        if last is not None and failed_total > last:
            self.failed(worker)

    def succeeded(self, worker: str) -> None:
        """A pull into `worker` worked."""
        if worker in self._last_failure and not self.failing(worker):
            del self._last_failure[worker]
            log.info("decode worker %s loads transferred KV again: the remote path is open to it", worker)

    def failing(self, worker: str) -> bool:
        """Whether the remote path into `worker` is closed now."""
        last = self._last_failure.get(worker)
        return last is not None and self._clock() - last < self.cooldown_s

    def workers(self) -> list[str]:
        """The workers whose remote path is closed now."""
        return sorted(w for w in self._last_failure if self.failing(w))

    def forget(self, worker: str) -> None:
        """`worker` left the fleet."""
        self._last_failure.pop(worker, None)
        self._reported.pop(worker, None)
