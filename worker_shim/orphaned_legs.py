"""OrphanedLegs: a router that died leaves no legs running here.

A router stopped by SIGTERM drains and cancels what it still runs. One killed (kill -9, OOM, its
node lost) cancels nothing: heartbeats go from shim to router only, and NATS drops a chunk sent to a
dead inbox without a word, so its legs ran on, prefilling and decoding for nobody, until they ended
or reached their deadline. Each leg names its router process (GenerateRequest.origin, the
RouterInfo.instance it registers under /{ns}/routers/, kept when it registers anew after a lost
lease). The shim follows those keys; the legs of an instance it has seen registered and that no key
has named for `grace_s` are cancelled as the router's own cancel would, counted and logged once per
instance.

Never on less: an instance never seen registered (a router that started while this watch was down,
a client without one) is not judged, and while etcd is unreachable no key goes, so nothing is. A
router's key goes `--lease-ttl` after it died, so its legs end within that and `grace_s`; a router
alive but cut from etcd for longer than both loses its legs here, as it loses its workers' keys.

A record under /{ns}/routers/ that does not decode names no instance: its key reads as absent.
It is counted (`records_refused`, kvswitch_shim_router_records_refused_total) and said once per key
while its reason stands (discovery.refused_records), and these lines are at most one per
RECORD_LINES_S, with how many were held back (until 2026-12-07 the watch logged a WARNING per bad
put, uncapped, in every shim). A change of a key's reason held for its window's end as the watch
ends (the shim stops) is said then by `flush`, in one line whatever RECORD_LINES_S: its timer
said it after the stop, or never once the loop closed.

`follow_routers` is the watch itself: it feeds an OrphanedLegs the routers' keys and checks their
legs every ORPHAN_CHECK_S, for as long as the shim runs; a RouterPresence (a namespace with no
router said) is fed and checked with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from discovery import Deleted, Discovery, DiscoveryError, Put, Snapshot, WatchEvent
from discovery.refused_records import RefusedRecords
from discovery.watch import keep_following, read_retried
from protocol import RouterInfo, subjects
from runtime import Throttle, TickErrors, cancel_and_wait
from worker_shim.router_presence import RouterPresence

__all__ = ["OrphanedLegs", "follow_routers"]

log = logging.getLogger(__name__)
RECORD_LINES_S = 10.0  # at most one line of refused router records this often
ORPHAN_CHECK_S = 1.0  # how often the legs of routers gone from etcd are looked for
ORPHAN_ERROR_SAID_S = 60.0  # a check that keeps failing with one kind of error is said at most this often


class OrphanedLegs:
    """`update` with each event of a /{ns}/routers/ watch, `check` now and then. `origins()` are the
    instances with legs in flight, `cancel(origin)` cancels those legs and says how many."""

    def __init__(
        self,
        origins: Callable[[], set[str]],
        cancel: Callable[[str], int],
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._origins = origins
        self._cancel = cancel
        self.grace_s = grace_s
        self._clock = clock
        self._routers: dict[str, str] = {}  # key name -> instance
        self._seen: set[str] = set()  # instances seen registered, while they have legs here or a key
        self._missing: dict[str, float] = {}  # instance with legs and no key -> since when
        self.cancelled = 0  # legs cancelled so (kvswitch_shim_legs_orphaned_total)
        self.records_refused = 0  # router records that did not decode (kvswitch_shim_router_records_refused_total)
        self._record_lines = Throttle(RECORD_LINES_S, clock)
        self._records = RefusedRecords(
            self._say_record,
            "router record under key %r ignored (no instance is read from it: its router's legs here are judged "
            "as if its key were gone): %s",
            clock=clock,
        )
        self._at_stop: list[tuple[str, tuple[object, ...]]] | None = None  # lines `flush` says as one

    def live(self) -> set[str]:
        """The router instances some key names now."""
        return set(self._routers.values())

    def update(self, event: WatchEvent[RouterInfo]) -> None:
        if isinstance(event, Snapshot):
            self._routers = {name: info.instance for name, info in event.items.items()}
            for name in self._records.names() - event.skipped.keys():
                self._records.accepted(name)
            for name, why in event.skipped.items():
                self._refused(name, why)
        elif isinstance(event, Put):
            self._routers[event.name] = event.value.instance
            self._records.accepted(event.name)
        elif isinstance(event, Deleted):
            self._routers.pop(event.name, None)
            if event.why:
                self._refused(event.name, event.why)
            else:
                self._records.accepted(event.name)
        self._seen.update(i for i in self._routers.values() if i)

    def _refused(self, name: str, why: str) -> None:
        self.records_refused += 1
        self._records.refused(name, why)

    def flush(self) -> None:
        """The routers watch ended: the reason changes held for their window's end, which no timer
        will say now, are said at once, as one line (the first, with how many others) whatever
        RECORD_LINES_S: held back, it would never be said."""
        held: list[tuple[str, tuple[object, ...]]] = []
        self._at_stop = held
        try:
            self._records.flush()
        finally:
            self._at_stop = None
        if held:
            msg, args = held[0]
            more = f" ({len(held) - 1} more such lines as the watch ended)" if len(held) > 1 else ""
            log.warning(msg + "%s (counted in kvswitch_shim_router_records_refused_total)", *args, more)

    def _say_record(self, name: str, msg: str, *args: object) -> None:
        """One refused router record's line, unless one was said within RECORD_LINES_S."""
        if self._at_stop is not None:
            self._at_stop.append((msg, args))
            return
        said = self._record_lines(None)
        if said is None:
            return
        held = said[0]
        more = f" ({held} more such lines held back in the last {said[1]:.0f} s)" if held else ""
        log.warning(msg + "%s (counted in kvswitch_shim_router_records_refused_total)", *args, more, stacklevel=3)

    def check(self) -> None:
        now = self._clock()
        live = self.live()
        origins = self._origins()
        for origin in origins & self._seen:
            if origin in live:
                self._missing.pop(origin, None)
                continue
            since = self._missing.setdefault(origin, now)
            if now - since >= self.grace_s:
                cancelled = self._cancel(origin)
                self.cancelled += cancelled
                log.warning(
                    "router instance %s has had no key under /routers/ for %.0f s (it died without its drain): "
                    "cancelled its %d legs in flight here (kvswitch_shim_legs_orphaned_total)",
                    origin,
                    now - since,
                    cancelled,
                )
        for origin in set(self._missing) - origins:
            del self._missing[origin]
        self._seen &= live | origins


async def follow_routers(
    discovery: Discovery,
    ns: str,
    orphans: OrphanedLegs,
    on_check_failed: Callable[[], None],
    presence: RouterPresence | None = None,
    worker: Callable[[], str | None] = lambda: None,
) -> None:
    """The routers' keys, and their legs here checked against them every ORPHAN_CHECK_S;
    `on_check_failed()` for each check that raised (kvswitch_shim_task_failures_total). `presence`
    is fed the same keys and checked as often, with `worker()`, the worker id while registered."""
    prefix = subjects.routers_prefix(ns)

    async def follow() -> None:
        # etcd gone since connect is retried, said once: raised, it was a crash in keep_following,
        # an ERROR with its traceback every 30 s for the whole outage (review of 2026-12-07).
        may = await read_retried(
            lambda: discovery.readable(prefix), f"watch {prefix}", errors=(DiscoveryError,), advise=True
        )
        if not may:
            log.error(
                "this worker's etcd user may not read %s: the legs of a router that dies without its drain "
                "run on here until they end. Grant it read there (kvswitch secrets --etcd-endpoint does, "
                "from 2026-12-06; or etcdctl role grant-permission <role> --prefix=true read %s)",
                prefix,
                prefix,
            )
            return
        async for event in discovery.watch_routers():
            orphans.update(event)
            if presence is not None:
                presence.update(event)

    watch = asyncio.create_task(keep_following(follow, "the routers' watch"), name="shim-routers-watch")
    errors = TickErrors(log, "checking the legs of routers gone from etcd", every_s=ORPHAN_ERROR_SAID_S, per_kind=True)
    try:
        while True:
            await asyncio.sleep(ORPHAN_CHECK_S)
            try:
                orphans.check()
                if presence is not None:
                    await presence.check(worker())
            except Exception as exc:
                # One check's bug must not end the watchdog for good (it did, without a word).
                on_check_failed()
                errors(exc)
    finally:
        try:
            await cancel_and_wait(watch)
        finally:  # cancelled meanwhile (the shim's stop, again): raised after
            orphans.flush()  # a reason change held for its window's end, which no timer would say now
