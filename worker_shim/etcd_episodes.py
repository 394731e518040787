"""What a shim says of etcd failing it: a WARNING as an episode starts, the count at most every
SAID_EVERY_S while it lasts, an INFO as it ends; /health's `etcd_why` while it lasts.

Two episodes. `RegisterFailures`: registering fails for etcd (not answering, refusing a write),
retried every health_interval_s within the session; until 2026-12-07 each try was a WARNING (about
3,000 lines an hour of etcd down per shim) that named no flag and no end, and a new session, which
asked the engine for a full replay of its KV events each time. `CutOff`: etcd has not renewed the
lease for longer than its TTL, so where routers still reach etcd (the shim alone cut off from it)
the key is gone and no new request comes; the shim serves on what it is sent, the legs in flight
included. It said "serving" and nothing else (the router says as much of itself on /ready).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from discovery import DiscoveryError, Registration, RegistrationState
from runtime import Throttle, clipped

__all__ = ["SAID_EVERY_S", "CutOff", "RegisterFailures"]

log = logging.getLogger(__name__)
SAID_EVERY_S = 30.0
_FLAG = "check --etcd-endpoints and the server"


class RegisterFailures:
    """The tries to register that etcd failed, from the first since the shim last registered."""

    def __init__(self, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s = retry_s
        self.tries = 0  # failed tries of the episode under way; 0: none
        self.why = ""  # the last one's error
        self._since = 0.0
        self._clock = clock
        self._throttle = Throttle(SAID_EVERY_S, clock)

    def failed(self, exc: DiscoveryError) -> None:
        now = self._clock()
        if not self.tries:
            self._since = now
        self.tries += 1
        self.why = clipped(str(exc))
        if self._throttle(None) is None:
            return
        if self.tries == 1:
            log.warning(
                "registering with etcd failed (%s): retrying every %gs, said again every %.0fs while it fails and "
                "once it works (%s)", self.why, self.retry_s, SAID_EVERY_S, _FLAG,
            )  # fmt: skip
        else:
            log.warning("registering with etcd still fails after %.0fs (%d tries; the last: %s; %s)",
                        now - self._since, self.tries, self.why, _FLAG)  # fmt: skip

    def registered(self) -> None:
        if self.tries:
            log.info("registered after %.1fs of etcd failing (%d tries)", self._clock() - self._since, self.tries)
            self.tries, self.why = 0, ""
            self._throttle.forget(None)

    def trouble(self) -> str:
        """What /health says of the episode under way; "" when none is."""
        if not self.tries:
            return ""
        return f"registering with etcd fails for {self._clock() - self._since:.0f} s ({self.tries} tries): {self.why}"


class CutOff:
    """The lease unrenewed for longer than its TTL: said once, and its end."""

    def __init__(self) -> None:
        self._lease = ""  # the lease unrenewed, while the episode lasts

    @staticmethod
    def trouble(reg: Registration | None) -> str:
        """What /health says while etcd has not renewed the lease for longer than its TTL; ""
        otherwise (etcd renewing it, or not for that long)."""
        unrenewed = reg.unrenewed_s if reg is not None else None
        if reg is None or unrenewed is None or unrenewed <= reg.ttl:
            return ""
        return (
            f"etcd has not renewed this worker's lease for {unrenewed:.0f} s (TTL {reg.ttl} s): where routers "
            "still reach etcd its key is gone and no new request comes here; the legs in flight run on"
        )

    def check(self, reg: Registration | None) -> None:
        """Say an episode's start and end (each health check: WorkerShim._monitor)."""
        if reg is None:
            return
        if not self._lease and (why := self.trouble(reg)):
            assert reg.lease is not None  # unrenewed_s reads it
            self._lease = reg.lease.hex_id
            log.warning("%s (check the network to --etcd-endpoints)", why)
        elif self._lease and reg.state is RegistrationState.REGISTERED and reg.lease is not None:
            if reg.lease.hex_id == self._lease:
                log.info("etcd renews this worker's lease %s again: its key was kept", self._lease)
            else:
                log.info("etcd answers this worker again: lease %s was gone, registered anew as %s",
                         self._lease, reg.id)  # fmt: skip
            self._lease = ""
