"""`TransferHealth`: the pulls that fail, by decode worker and the prefill worker it pulls from.

When a decode engine cannot load the KV a prefill worker computed for it (a NIXL link down, a
prefill engine whose pins expire or that restarted), vLLM fails the request (its default
`kv_load_failure_policy`) and the dispatcher has the decode worker prefill the prompt itself
(`fallback_transfer_failed`). Every later remote prefill over that pair would pay the same: a
prefill leg whose work is thrown away, a failed pull, then the local prefill, so well over twice
a bypass's TTFT. So after a failed pull from P into D, the planner pairs D with another prefill
worker, and takes the bypass path for D only when every prefill worker's pulls into it failed
(`bypass_transfer_failing`), until `cooldown_s` after each pair's last failure. One broken
prefill worker thus costs the fleet that prefill worker, not disaggregation: a fault in one
worker stays in that worker. Then one request, the probe, tries the pair again while the others
keep avoiding it: a pull that works ends its episode (one that worked during the cooldown was
planned before the failure and says nothing), another failure starts a new cooldown. A probe that
never reports (cancelled, or sent elsewhere after planning) lets the next request probe after
`PROBE_TIMEOUT_S`. So a fault that persists costs one lost prefill leg per cooldown, not a burst.

Each router replica learns from its own requests, and all of them from the workers' load
reports: LoadReport.kv_transfers_failed counts the pulls a decode engine failed, which under
vLLM's `kv_load_failure_policy: "recompute"` is the only sign (the request succeeds, late). That
count does not say from which prefill worker, so it closes the remote path into D whatever the
prefill worker. Nor does a probe's first token end such an episode: under `recompute` a failed pull
gives one too. It ends when a load report sent `CONFIRM_S` after that token shows no new failure
(the shim forwards a failure within a second of the engine counting it). One WARNING per episode
names the pair, and an INFO its recovery, however long the fault lasts.

Synchronous, with the planner's clock, which it reads only while some pull is failing (a
virtual-clock replay, where no pull fails, reads no clock here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["CONFIRM_S", "PROBE_TIMEOUT_S", "TRANSFER_COOLDOWN_S", "TransferHealth"]

log = logging.getLogger(__name__)
TRANSFER_COOLDOWN_S = 30.0
PROBE_TIMEOUT_S = 10.0  # a probe's claim on its pair, past which another request may probe
# A report this long after a probe's first token has the probe's pull in it: the shim reads the
# engine's count every 0.25 s, judges a rise one reading later, and reports a change within 50 ms.
CONFIRM_S = 2.0


ANY = ""  # a pair's prefill side when the failure does not say which prefill worker


class TransferHealth:
    def __init__(self, cooldown_s: float = TRANSFER_COOLDOWN_S, clock: Callable[[], float] = time.time) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        # (decode, prefill or ANY) -> when its last pull failed, while in an episode
        self._last_failure: dict[tuple[str, str], float] = {}
        self._probes: dict[tuple[str, str], float] = {}  # pair in an episode -> when its probe was planned
        self._confirming: dict[str, float] = {}  # decode worker -> when a probe's pull ended its (D, ANY) cooldown
        self._reported: dict[str, int] = {}  # worker -> its last LoadReport.kv_transfers_failed
        self.failures = 0

    def failed(self, worker: str, prefill_worker: str = ANY) -> None:
        """A pull into `worker` of KV computed on `prefill_worker` (ANY: not known) failed."""
        self.failures += 1
        key = (worker, prefill_worker)
        if key not in self._last_failure:
            log.warning(
                "decode worker %s failed to load KV prefilled on %s: for the next %.0fs its requests %s "
                "(bypass_transfer_failing when no prefill worker is left), then it is tried again. Check the KV "
                "connector (NIXL) between them and the prefill engine's kv pin timeout",
                worker,
                prefill_worker or "a prefill worker (its engine's count)",
                self.cooldown_s,
                f"pair with other prefill workers than {prefill_worker}" if prefill_worker else "prefill there",
            )
        self._last_failure[key] = self._clock()
        self._probes.pop(key, None)
        if prefill_worker == ANY:
            self._confirming.pop(worker, None)

    def reported(self, worker: str, failed_total: int) -> None:
        """A load report's count of the pulls `worker`'s engine failed: a rise is a failure. The
        first report sets the baseline, and a count that goes down (the shim restarted) another.
        A report with no rise, `CONFIRM_S` after a probe's pull, ends the worker's episode."""
        last = self._reported.get(worker)
        self._reported[worker] = failed_total
        if last is not None and failed_total > last:
            self.failed(worker)
        elif (since := self._confirming.get(worker)) is not None and self._clock() - since >= CONFIRM_S:
            self._end((worker, ANY))

    def succeeded(self, worker: str, prefill_worker: str) -> None:
        """A pull into `worker` from `prefill_worker` gave a first token: out of cooldown, that
        pair's episode ends, and one of `worker` with no prefill worker named (its engine's count)
        waits for a report that confirms it."""
        now = None
        for key in ((worker, prefill_worker), (worker, ANY)):
            last = self._last_failure.get(key)
            if last is None:
                continue
            now = self._clock() if now is None else now
            if now - last < self.cooldown_s:
                continue
            if key[1] == ANY:
                self._confirming.setdefault(worker, now)
            else:
                self._end(key)

    def _end(self, key: tuple[str, str]) -> None:
        del self._last_failure[key]
        self._probes.pop(key, None)
        if key[1] == ANY:
            del self._confirming[key[0]]
        log.info("decode worker %s loads KV from %s again", key[0], key[1] or "its prefill workers")

    def probing(self, worker: str, prefill_worker: str) -> None:
        """A request was planned to pull into `worker` from `prefill_worker`: past a cooldown, it is
        the probe of that pair's episode (and of `worker`'s with no prefill worker named)."""
        now = None
        for key in ((worker, prefill_worker), (worker, ANY)):
            if key in self._last_failure:
                now = self._clock() if now is None else now
                if now - self._last_failure[key] >= self.cooldown_s:
                    self._probes[key] = now

    def failing(self, worker: str, prefill_worker: str = ANY) -> bool:
        """Whether pulls into `worker` from `prefill_worker` are to be avoided now: that pair's, or
        any pull into `worker` (ANY) failed within the cooldown, or is being probed."""
        if not self._last_failure:
            return False
        now = None
        for key in ((worker, ANY), (worker, prefill_worker)):
            last = self._last_failure.get(key)
            if last is None:
                continue
            now = self._clock() if now is None else now
            if now - last < self.cooldown_s:
                return True
            if key[1] == ANY and worker in self._confirming:
                return True
            probe = self._probes.get(key)
            if probe is not None and now - probe < PROBE_TIMEOUT_S:
                return True
        return False

    @property
    def any(self) -> bool:
        """Some pull failed and its episode has not ended (the planner looks closer only then)."""
        return bool(self._last_failure)

    def workers(self) -> list[str]:
        """The decode workers with a pair (or every pair) closed now."""
        return sorted({d for d, p in self._last_failure if self.failing(d, p)})

    def forget(self, worker: str) -> None:
        """`worker` left the fleet (as a decode or a prefill worker)."""
        for key in [k for k in self._last_failure if worker in k]:
            del self._last_failure[key]
            self._probes.pop(key, None)
        self._confirming.pop(worker, None)
        self._reported.pop(worker, None)
