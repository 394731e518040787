"""`TransferHealth`: the pulls that fail, by decode worker and the prefill worker it pulls from.

When a decode engine cannot load the KV a prefill worker computed for it (a NIXL link down, a
prefill engine that freed the KV before the pull or that restarted), vLLM fails the request (its
default `kv_load_failure_policy`) and the dispatcher has the decode worker prefill the prompt itself
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
count names no prefill worker, but the replica knows the pulls it sent into D (`pulling`): a rise
closes (D, P) for each prefill worker P whose pull into D was under way in the window the rise
covers (from `CONFIRM_S` before D's previous report until now), and of those, when some pair was
already failing (its probe, most often), only those: a fault seen before is the likelier cause
than a pair that worked. A replica that sent no pull into D in that window closes nothing: the
replica that sent them closes its pairs. That holds from a replica's start (`attribute`, called
where a dispatcher is wired), before its own first pull; only a planner with no dispatcher (a
replay, a benchmark), told of no pull at all, closes every pair into D (ANY). Nor does a probe's
first token end such an episode: under `recompute` a failed pull gives one too. It ends when a
load report sent `CONFIRM_S` after that token shows no new failure (the shim forwards a failure
within a second of the engine counting it); and D's pairs closed by its count probe one at a
time, so that one probe's failure is not put down to another's. One WARNING per episode names
the pair, and an INFO its recovery, however long the fault lasts. A KV connector misconfigured
across the fleet fails every pair at once, and its fix ends every episode at once: in a window of
10 s, the first eight decode workers are named (each for its pairs), the rest counted in one line
(router.fleet_lines), for the failures and for the recoveries alike; but a pair named failing is
always named recovering (its recovery would otherwise be counted whenever eight others recovered
first: a fleet's probes need not end in the order its failures began).

Synchronous, with the planner's clock, which it reads only while some pull is failing or is
followed (a virtual-clock replay, where no pull fails, reads no clock here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.fleet_lines import FleetEpisodes, FleetLines, FleetLog

__all__ = ["CONFIRM_S", "PROBE_TIMEOUT_S", "TRANSFER_COOLDOWN_S", "TransferHealth"]

log = logging.getLogger(__name__)
TRANSFER_COOLDOWN_S = 30.0
PROBE_TIMEOUT_S = 10.0  # a probe's claim on its pair, past which another request may probe
# A report this long after a probe's first token has the probe's pull in it: the shim reads the
# engine's count every 0.25 s, judges a rise one reading later, and reports a change within 50 ms.
CONFIRM_S = 2.0


ANY = ""  # a pair's prefill side when the failure does not say which prefill worker


@dataclass(slots=True)
class _Pulls:
    """This replica's pulls into one decode worker from one prefill worker."""

    running: int = 0  # under way: sent, no first token yet
    ended: float = float("-inf")  # when the last one ended


class TransferHealth:
    def __init__(
        self,
        cooldown_s: float = TRANSFER_COOLDOWN_S,
        clock: Callable[[], float] = time.time,
        fleet_log: FleetLog | None = None,
    ) -> None:
        """`fleet_log`: its router's (router.fleet_lines)."""
        self.cooldown_s = cooldown_s
        self._clock = clock
        # (decode, prefill or ANY) -> when its last pull failed, while in an episode
        self._last_failure: dict[tuple[str, str], float] = {}
        self._probes: dict[tuple[str, str], float] = {}  # pair in an episode -> when its probe was planned
        self._counted: set[tuple[str, str]] = set()  # pairs closed by a report's count: a report ends them
        self._confirming: dict[tuple[str, str], float] = {}  # counted pair -> when its probe's pull gave a token
        self._reported: dict[str, int] = {}  # worker -> its last LoadReport.kv_transfers_failed
        self._pulls: dict[str, dict[str, _Pulls]] = {}  # decode -> prefill -> this replica's pulls
        self._heard: dict[str, float] = {}  # decode worker with pulls followed -> when its last report came
        self._attributes = False  # told of every pull (`attribute`, `pulling`): a count's rise is put down to them
        self.failures = 0
        # A KV connector misconfigured across the fleet fails every pair: the first decode workers named
        self._failed_lines = FleetLines(
            log,
            logging.WARNING,
            "decode workers failed to load KV prefilled for them, each pair avoided for its cooldown (one cause for "
            "many decode workers at once: a KV connector configured alike and wrongly, --kv-transfer-config or its "
            "NIXL link, or KV leases that run out before the pull; the engines' logs say which)",
            clock=clock,
            fleet_log=fleet_log,
        )
        # and, that cause fixed, every pair recovers: as capped, but for the pairs named failing
        self._recovered_lines = FleetLines(
            log,
            logging.INFO,
            "decode workers load KV from their prefill workers again",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._episodes = FleetEpisodes(self._failed_lines, self._recovered_lines)

    def failed(self, worker: str, prefill_worker: str = ANY, *, counted: bool = False) -> None:
        """A pull into `worker` of KV computed on `prefill_worker` (ANY: not known) failed.
        `counted`: known from the engine's count (a load report), so only a report ends it."""
        self.failures += 1
        key = (worker, prefill_worker)
        if key not in self._last_failure:
            self._episodes.began(
                key,
                "decode worker %s failed to load KV prefilled on %s: for the next %.0fs its requests %s "
                "(bypass_transfer_failing when no prefill worker is left), then it is tried again. The engines' "
                "logs say why: a failed NIXL read, or a KV lease that ran out (vLLM 0.32: a prefill engine frees "
                "unpulled KV after --kv-transfer-config's kv_connector_extra_config.kv_lease_duration, 30 s by "
                "default, unless the decode engine's heartbeats renew it)",
                worker,
                prefill_worker or "a prefill worker (its engine's count)",
                self.cooldown_s,
                f"pair with other prefill workers than {prefill_worker}" if prefill_worker else "prefill there",
            )
        self._last_failure[key] = self._clock()
        self._probes.pop(key, None)
        self._confirming.pop(key, None)
        if counted:
            self._counted.add(key)

    def attribute(self) -> None:
        """Every pull this replica sends will be told (`pulling`: a dispatcher is wired): a rise in
        a decode worker's count is put down to them alone, so one with none under way closes
        nothing, from the start, not from the replica's first pull."""
        self._attributes = True

    def pulling(self, worker: str, prefill_worker: str) -> Callable[[], None]:
        """A pull into `worker` of KV prefilled on `prefill_worker` starts (a decode leg fed by a
        transfer handle was sent); call what this returns once it is over (its first token, or
        the leg's end), so that a rise in `worker`'s count can be put down to its pulls."""
        self._attributes = True
        pulls = self._pulls.setdefault(worker, {}).setdefault(prefill_worker, _Pulls())
        pulls.running += 1

        def ended() -> None:
            pulls.running -= 1
            pulls.ended = self._clock()

        return ended

    def reported(self, worker: str, failed_total: int) -> None:
        """A load report's count of the pulls `worker`'s engine failed: a rise is a failure, put
        down to the pairs that can have caused it. The first report sets the baseline, and a count
        that goes down (the shim restarted) another. A report with no rise, `CONFIRM_S` after a
        probe's pull, ends that pair's episode."""
        last = self._reported.get(worker)
        self._reported[worker] = failed_total
        suspects = self._suspects(worker)
        if last is not None and failed_total > last:
            if suspects is None:  # told of no pull at all: it cannot say which
                self.failed(worker, counted=True)
            for prefill in suspects or ():
                self.failed(worker, prefill, counted=True)
        elif self._confirming:
            now = self._clock()
            for key in [k for k, since in self._confirming.items() if k[0] == worker and now - since >= CONFIRM_S]:
                self._end(key)

    def _suspects(self, worker: str) -> list[str] | None:
        """The prefill workers whose pulls into `worker` were under way in the window a report from
        it now covers (from CONFIRM_S before its previous report), those already failing first;
        None when this replica is told of no pull. Reads the clock only while it follows some."""
        if not self._attributes:
            return None
        pulls = self._pulls.get(worker)
        if not pulls:
            self._heard.pop(worker, None)
            return []
        now = self._clock()
        since = self._heard.get(worker, float("-inf")) - CONFIRM_S
        self._heard[worker] = now
        suspects = [p for p, s in pulls.items() if s.running or s.ended >= since]
        for p in [p for p, s in pulls.items() if not s.running and s.ended < now - CONFIRM_S]:
            del pulls[p]  # out of any later report's window
        if not pulls:
            del self._pulls[worker]
        failing = [p for p in suspects if (worker, p) in self._last_failure]
        return failing or suspects

    def succeeded(self, worker: str, prefill_worker: str) -> None:
        """A pull into `worker` from `prefill_worker` gave a first token: out of cooldown, that
        pair's episode ends, and one known from the engine's count (its own, or `worker`'s with no
        prefill worker named) waits for a report that confirms it."""
        now = None
        for key in ((worker, prefill_worker), (worker, ANY)):
            last = self._last_failure.get(key)
            if last is None:
                continue
            now = self._clock() if now is None else now
            if now - last < self.cooldown_s:
                continue
            if key in self._counted:
                self._confirming.setdefault(key, now)
            else:
                self._end(key)

    def _end(self, key: tuple[str, str]) -> None:
        del self._last_failure[key]
        self._probes.pop(key, None)
        self._confirming.pop(key, None)
        self._counted.discard(key)
        self._episodes.ended(key, "decode worker %s loads KV from %s again", key[0], key[1] or "its prefill workers")

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
        any pull into `worker` (ANY) failed within the cooldown, or is being probed, or waits for
        another pair into `worker` closed by its count to finish its probe."""
        if not self._last_failure:
            return False
        now = None
        for key in ((worker, ANY), (worker, prefill_worker)):
            last = self._last_failure.get(key)
            if last is None:
                continue
            now = self._clock() if now is None else now
            if now - last < self.cooldown_s or key in self._confirming:
                return True
            probe = self._probes.get(key)
            if probe is not None and now - probe < PROBE_TIMEOUT_S:
                return True
            if key in self._counted and self._probed_beside(key, now):
                return True
        return False

    def _probed_beside(self, key: tuple[str, str], now: float) -> bool:
        """Another pair into the same decode worker, closed by its count, is being probed: a rise
        now could not tell the two probes apart."""
        for k in self._counted:
            if k[0] != key[0] or k == key:
                continue
            probe = self._probes.get(k)
            if k in self._confirming or (probe is not None and now - probe < PROBE_TIMEOUT_S):
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
            self._confirming.pop(key, None)
            self._counted.discard(key)
            self._episodes.forget(key)
        self._pulls.pop(worker, None)
        for pulls in self._pulls.values():
            pulls.pop(worker, None)
        self._heard.pop(worker, None)
        self._reported.pop(worker, None)
