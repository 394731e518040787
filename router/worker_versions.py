"""Workers whose shims run another kvswitch build than this router.

Each registered worker's record names its shim's build (WorkerInfo.version, protocol.version.BUILD:
the release and a digest of the wire). One that differs from this router's is a rolling upgrade in
progress, or a worker left behind by one: the two may read some of each other's messages otherwise
(docs/deployment.md, "Upgrades", lists what each order breaks). Routing goes on; each such worker
is a WARNING once per worker and build (a worker back under its name after a restart, of the same
build, is not said again), and `others()` (the gauge kvswitch_router_workers_other_version) counts
them while they last. A record without a version is counted as another build ("unknown"): every
shim has written one. At most NAMED_AT_MOST workers are named per window, the rest counted in one
summary (router.fleet_lines); when more than half of the registered workers run one build and this
router another, the summary says once that the router differs from most of the fleet, and what
that means in the documented upgrade order (routers first) and outside it.
"""

from __future__ import annotations

import logging
from collections import Counter

from protocol import WorkerInfo
from router.fleet_lines import FleetLines, FleetLog, LastSaid

__all__ = ["WorkerVersions"]

log = logging.getLogger(__name__)


class WorkerVersions:
    def __init__(self, mine: str, fleet_log: FleetLog | None = None) -> None:
        self.mine = mine
        self._others: dict[str, str] = {}  # worker -> its build, while it differs from ours
        self._builds: dict[str, str] = {}  # every registered worker's build
        self._said = LastSaid()
        self._odd_said: str | None = None  # the fleet's build this router was said to differ from
        self._lines = FleetLines(log, logging.WARNING, self._verdict, fleet_log=fleet_log)
        self._again_lines = FleetLines(
            log, logging.INFO, f"run kvswitch {mine}, as this router does, again", fleet_log=fleet_log
        )

    def check(self, info: WorkerInfo) -> None:
        """`info` registered or changed."""
        theirs = info.version
        self._builds[info.worker] = theirs
        if theirs == self.mine:
            self._said.clear(info.worker)
            if self._others.pop(info.worker, None) is not None:
                self._again_lines.say(
                    info.worker, "worker %s runs kvswitch %s, as this router does, again", info.worker, theirs
                )
            return
        self._others[info.worker] = theirs
        if not self._said.news(info.worker, theirs):
            return
        self._lines.say(
            info.worker,
            "worker %s runs kvswitch %s, this router %s: a rolling upgrade is in progress, or %s was left "
            "behind; docs/deployment.md, Upgrades",
            info.worker,
            theirs or "unknown (its record names none)",
            self.mine,
            info.worker,
        )

    def forget(self, worker: str) -> None:
        """`worker`'s key is gone: a worker back under its name is said again if its build changed."""
        self._others.pop(worker, None)
        self._builds.pop(worker, None)

    def _verdict(self, held: int) -> str:
        """The summary's cause: when most registered workers run one build and this router another,
        it is the router that differs, said once per such build. Not that the router is the one to
        change: the documented upgrade order has a new router before old shims."""
        cause = f"run another kvswitch build than this router's {self.mine}; docs/deployment.md, Upgrades"
        if not self._builds:
            return cause
        theirs, count = Counter(self._builds.values()).most_common(1)[0]
        if theirs == self.mine or count * 2 <= len(self._builds):
            self._odd_said = None
            return cause
        if self._odd_said == theirs:
            return cause
        self._odd_said = theirs
        return (
            f"{cause}. {count} of the {len(self._builds)} registered workers run kvswitch "
            f"{theirs or 'unknown (their records name none)'}: this router differs from most of the fleet. "
            "Routers are upgraded first, then shims (docs/deployment.md, Upgrades): in an upgrade, go on with "
            "the shims; otherwise this router was deployed alone or left behind: give it the fleet's build"
        )

    def others(self) -> dict[str, str]:
        """The registered workers of another build, each with its build, by id."""
        return dict(sorted(self._others.items()))
