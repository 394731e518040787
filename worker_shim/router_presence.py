"""RouterPresence: a namespace no router serves is said.

A shim with a mistyped --namespace (`kvswich`) registered and said only INFO "registered worker
... at /kvswich/workers/...": no router reads that namespace, so no request ever came, and neither
side said why (operator walkthrough of 2026-12-07). The shim follows /{ns}/routers/ already
(worker_shim.orphaned_legs); while its worker is registered and that watch has read no router key
for NO_ROUTER_GRACE_S, one WARNING names --namespace and the namespaces where routers are
registered (Discovery.router_namespaces, a few keys' names a namespace, bounded; a user that may
read only its own namespace, as kvswitch secrets makes them, gets the flag alone). Once per
stretch without a router: when one appears after it, an INFO says so, and a later stretch is said
anew. Nothing is judged before the watch's first read (etcd down since the start).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from discovery import Deleted, Discovery, DiscoveryError, Put, Snapshot, WatchEvent
from protocol import RouterInfo

__all__ = ["NO_ROUTER_GRACE_S", "RouterPresence"]

log = logging.getLogger(__name__)
NO_ROUTER_GRACE_S = 30.0  # a registered worker with no router in its namespace this long is said


class RouterPresence:
    """`update` with each event of the /{ns}/routers/ watch, `check` now and then with the worker
    id while registered (None otherwise)."""

    def __init__(
        self,
        discovery: Discovery,
        ns: str,
        grace_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._discovery = discovery
        self._ns = ns
        self.grace_s = NO_ROUTER_GRACE_S if grace_s is None else grace_s  # read now: tests set it
        self._clock = clock
        self._routers: set[str] = set()  # the router keys' names now
        self._read = False  # the watch has read the prefix once
        self._since: float | None = None  # registered with no router since
        self.said = False  # this stretch without a router was said

    def update(self, event: WatchEvent[RouterInfo]) -> None:
        if isinstance(event, Snapshot):
            self._read, self._routers = True, set(event.items)
        elif isinstance(event, Put):
            self._routers.add(event.name)
        elif isinstance(event, Deleted):
            self._routers.discard(event.name)

    async def check(self, worker: str | None) -> None:
        if self._routers:
            self._since = None
            if self.said:
                self.said = False
                log.info("a router is registered in namespace %s now (%s)", self._ns, ", ".join(sorted(self._routers)))
            return
        if worker is None or not self._read:
            self._since = None
            return
        now = self._clock()
        if self._since is None:
            self._since = now
        if self.said or now - self._since < self.grace_s:
            return
        self.said = True
        try:
            namespaces = await self._discovery.router_namespaces()
        except DiscoveryError as exc:
            where = f"; which namespaces have one is unread ({exc})"
        else:
            if namespaces is None:
                where = "; this etcd user may not read other namespaces to say which have one"
            elif namespaces.found:
                where = f"; routers are registered in namespace(s) {', '.join(namespaces.found)}"
            else:
                where = f"; none is registered in any namespace{' read' if namespaces.cut else ''} either"
            if namespaces is not None and namespaces.cut:
                where += f" ({namespaces.cut})"
        log.warning(
            "no router is registered in namespace %s (no key under /%s/routers/ for %.0fs while worker %s is "
            "registered): no request comes to it; check --namespace, which must be the routers'%s",
            self._ns,
            self._ns,
            now - self._since,
            worker,
            where,
        )
