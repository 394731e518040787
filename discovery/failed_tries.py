"""FailedTries: the tries etcd failed since the last that worked (an episode), for a line that
says it as it starts, at most every SAID_EVERY_S while it lasts, and as it ends, and for what
/health says meanwhile. The wording is the caller's (a registration's re-put; a shim's register)."""

from __future__ import annotations

import time
from collections.abc import Callable

from discovery.advice import advice
from discovery.session import DiscoveryError
from runtime import Throttle, clipped

__all__ = ["SAID_EVERY_S", "FailedTries"]

SAID_EVERY_S = 30.0


class FailedTries:
    def __init__(self, clock: Callable[[], float] = time.monotonic, every_s: float = SAID_EVERY_S) -> None:
        self.tries = 0  # failed tries of the episode under way; 0: none
        self.why = ""  # the last one's error, with what to do (discovery.advice)
        self._since = 0.0
        self._clock = clock
        self._throttle = Throttle(every_s, clock)

    def count(self, exc: DiscoveryError) -> bool:
        """A try failed: counted; whether to say it now (the episode's first, or SAID_EVERY_S on)."""
        if not self.tries:
            self._since = self._clock()
        self.tries += 1
        hint = advice(exc)
        self.why = clipped(f"{exc}: {hint}" if hint else str(exc))
        return self._throttle(None) is not None

    def lasted(self) -> float:
        """Seconds since the episode's first failed try."""
        return self._clock() - self._since

    def end(self) -> None:
        """The episode ends (said by the caller): the next failed try starts one, said at once."""
        self.tries, self.why = 0, ""
        self._throttle.forget(None)
