"""`RebuildGuard`: whether a KV event with an unknown parent has the shim ask the engine for its
whole state (a rebuild), or the rebuild is held because rebuilding does not cure that parent."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["REBUILD_BACKOFF_MAX_S", "REBUILD_BACKOFF_S", "REBUILD_REPEAT_S", "RebuildGuard"]

log = logging.getLogger(__name__)

# A rebuild an unknown parent asks for this soon after the last is a repeat.
REBUILD_REPEAT_S = 5.0
REBUILD_BACKOFF_S = 5.0
REBUILD_BACKOFF_MAX_S = 300.0


class RebuildGuard:
    """Holds the rebuilds unknown parents ask for while rebuilding does not cure them.

    An event the decoder cannot read is dropped, and its children name an unknown parent on every
    replay too: each rebuild's own replay asked for the next, at the adapter's poll rate, each one a
    Cleared to every router. So a parent that is unknown again within REBUILD_REPEAT_S of the
    rebuild it asked for is one rebuilding does not cure: rebuilds asked for by such parents alone
    are held (not made: counted) until REBUILD_BACKOFF_S after that rebuild, doubling per repeat up to
    REBUILD_BACKOFF_MAX_S, said at ERROR per step; that long without an unknown parent forgets them.
    Any other unknown parent rebuilds at once, and so does the first one after a hold.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.held = 0
        self._asked_at = float("-inf")
        self._asked_for: set[int] = set()
        self._seen_at = float("-inf")
        self._uncured: set[int] = set()
        self._backoff = 0.0
        self._hold_until = float("-inf")

    def ask(self, parents: set[int]) -> bool:
        """Whether the rebuild the unknown `parents` ask for now is made."""
        now = self.clock()
        if now - self._seen_at >= REBUILD_BACKOFF_MAX_S:
            self._backoff, self._uncured = 0.0, set()
        self._seen_at = now
        since = now - self._asked_at
        again = parents & self._asked_for if since < REBUILD_REPEAT_S else set()
        if again:
            self._uncured |= again
            self._asked_for = set()
            self._backoff = min(max(2 * self._backoff, REBUILD_BACKOFF_S), REBUILD_BACKOFF_MAX_S)
            self._hold_until = self._asked_at + self._backoff
            log.error(
                "KV event with an unknown parent again %.1fs after the rebuild it asked for: the engine's own "
                "replay names parents it never stored (an event the shim cannot read? see "
                "kvswitch_shim_kv_events_malformed_total and kvswitch_shim_kv_events_unknown_type_total); "
                "rebuilds for them are held for %.0fs "
                "(kvswitch_shim_kv_rebuilds_held_total)",
                since,
                self._backoff,
            )
        fresh = parents - self._uncured
        if not fresh and now < self._hold_until:
            self.held += 1
            return False
        self._asked_at, self._asked_for = now, fresh or parents
        return True
