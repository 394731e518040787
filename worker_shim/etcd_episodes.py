"""What a shim says of etcd failing it: a WARNING as an episode starts, the count at most every
SAID_EVERY_S while it lasts, an INFO as it ends; /health's `etcd_why` while it lasts.

Two episodes, each of one session: it ends with the session (WorkerShim._end_session), so what
/health says is never of an earlier one (until a review of 2026-12-07 it said "registering with
etcd fails for 49 s" while etcd was up and the engine down, the episode begun in a session since
ended). `RegisterFailures`: registering fails for etcd (not answering, refusing a write), retried
every health_interval_s within the session, or with backoff to register anew after the lease's loss
(Registration's on_failing; its on_answered ends the episode); until 2026-12-07 each try was a
WARNING (about 3,000 lines an hour of etcd down per shim, a re-registration's every 5 s) that named
no end, and a first registration's try a new session, which asked the engine for a full replay of
its KV events each time. What to do is discovery.advice's: --etcd-endpoints only where etcd did not
answer (it was named for a full etcd too). `CutOff`: etcd has not renewed the lease for longer than
its TTL, so where routers still reach etcd (the shim alone cut off from it) the key is gone and no
new request comes; the shim serves on what it is sent, the legs in flight included. It said
"serving" and nothing else (the router says as much of itself on /ready). Where this process stood
still for most of that time (runtime.loop_watch: awake for less than two renewal intervals of it, so
no more than one renewal came due while it ran), the stall is named instead of etcd and the network
(an audit of 2026-12-07: a shim stopped 10 s woke to "check the network to --etcd-endpoints").
`stale_key`: the registered key's re-put that etcd keeps failing (Registration.put_trouble), its
value stale meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from discovery import SAID_EVERY_S, DiscoveryError, FailedTries, Registration, RegistrationState, renewal_interval
from runtime import clipped

__all__ = ["CutOff", "RegisterFailures", "stale_key"]

log = logging.getLogger(__name__)


class RegisterFailures(FailedTries):
    """The tries to register that etcd failed in this session, from the first since it registered."""

    def failed(self, exc: DiscoveryError, retry_s: float) -> None:
        """A try failed; the next comes in `retry_s`."""
        if not self.count(exc):
            return
        if self.tries == 1:
            log.warning(
                "registering with etcd failed (%s): retrying in %gs, said again every %.0fs while it fails and "
                "once it works or the session ends", self.why, retry_s, SAID_EVERY_S,
            )  # fmt: skip
        else:
            log.warning("registering with etcd still fails after %.0fs (%d tries; the last: %s)",
                        self.lasted(), self.tries, self.why)  # fmt: skip

    def registered(self) -> None:
        if self.tries:
            log.info("registered after %.1fs of etcd failing (%d tries)", self.lasted(), self.tries)
            self.end()

    def session_ended(self, stopping: bool) -> None:
        """The session ends, registered or not: an episode under way ends with it, said, and the
        next session's first failing try starts one anew; `stopping`: the shim stops, no session
        comes next (it said "the next one tries anew" at a SIGTERM; review of 2026-12-07)."""
        self._end("the shim stopped" if stopping else "the session ended: the next one tries anew")

    def answered(self, holder: str = "another lease") -> None:
        """etcd answered a try: the key is held by `holder`, waited out (WorkerShim._held_may_free;
        re-registering, the lost lease: Registration's on_answered). The episode ends, said: /health
        said "registering with etcd fails for N s" after etcd answered, for as long as the wait
        lasted (reviews of 2026-12-07)."""
        self._end(f"etcd answered: the key is held by {holder}, waited out")

    def _end(self, end: str) -> None:
        if self.tries:
            log.info("registering with etcd failed for %.1fs (%d tries; the last: %s) until %s",
                     self.lasted(), self.tries, self.why, end)  # fmt: skip
            self.end()

    def trouble(self) -> str:
        """What /health says of the episode under way; "" when none is."""
        if not self.tries:
            return ""
        return f"registering with etcd fails for {self.lasted():.0f} s ({self.tries} tries): {self.why}"


def stale_key(reg: Registration | None) -> str:
    """What /health says while etcd keeps failing the re-put of the registered key; "" otherwise.
    The worker stays registered, its key holding the last value put (until 2026-12-07 only the
    log said it: /health read serving, etcd alive and nothing wrong, for as long as it lasted)."""
    trouble = reg.put_trouble if reg is not None else None
    if trouble is None:
        return ""
    return clipped(
        f"re-putting this worker's key fails for {trouble.failing_s:.0f} s ({trouble.tries} tries; routers read "
        f"the value last put): {trouble.why}"
    )


class CutOff:
    """The lease unrenewed for longer than its TTL: said once, and its end. `stalled_within(s)`: how
    long this process stood still in the last s seconds (runtime.loop_watch; never, when None)."""

    def __init__(self, stalled_within: Callable[[float], float] | None = None) -> None:
        self._lease = ""  # the lease unrenewed, while the episode lasts
        self._stalled_within = stalled_within

    def trouble(self, reg: Registration | None) -> str:
        """What /health says while etcd has not renewed the lease for longer than its TTL; ""
        otherwise (etcd renewing it, or not for that long)."""
        return self._read(reg)[0]

    def _read(self, reg: Registration | None) -> tuple[str, bool]:
        """The trouble, and whether a stall of this process, not etcd, kept the lease unrenewed."""
        unrenewed = reg.unrenewed_s if reg is not None else None
        if reg is None or unrenewed is None or unrenewed <= reg.ttl:
            return "", False
        gone = "where routers still reach etcd its key is gone and no new request comes here; the legs in flight run on"
        stalled = self._stalled_within(unrenewed) if self._stalled_within is not None else 0.0
        if stalled and unrenewed - stalled < 2 * renewal_interval(reg.ttl):
            return (
                f"this process stalled {stalled:.1f} s of the {unrenewed:.0f} s etcd has not renewed this worker's "
                f"lease (TTL {reg.ttl} s), not etcd or the network: its renewals waited unsent; {gone}"
            ), True
        return f"etcd has not renewed this worker's lease for {unrenewed:.0f} s (TTL {reg.ttl} s): {gone}", False

    def session_ended(self) -> None:
        """The session ends: its lease goes with it (revoked, or expiring), so an episode under way
        ends unsaid, and the next session's lease is not compared with it."""
        self._lease = ""

    def check(self, reg: Registration | None) -> None:
        """Say an episode's start and end (each health check: WorkerShim._monitor)."""
        if reg is None:
            return
        why, stalled = self._read(reg)
        if not self._lease and why:
            assert reg.lease is not None  # unrenewed_s reads it
            self._lease = reg.lease.hex_id
            log.warning(
                "%s (%s)",
                why,
                "its event loop's WARNING says so" if stalled else "check the network to --etcd-endpoints",
            )
        elif self._lease and reg.state is RegistrationState.REGISTERED and reg.lease is not None:
            if reg.lease.hex_id == self._lease:
                log.info("etcd renews this worker's lease %s again: its key was kept", self._lease)
            else:
                log.info("etcd answers this worker again: lease %s was gone, registered anew as %s",
                         self._lease, reg.id)  # fmt: skip
            self._lease = ""
