"""Workers whose shims run another kvswitch build than this router.

Each registered worker's record names its shim's build (WorkerInfo.version, protocol.version.BUILD:
the release and a digest of the wire). One that differs from this router's is a rolling upgrade in
progress, or a worker left behind by one: the two may read some of each other's messages otherwise
(docs/deployment.md, "Upgrades", lists what each order breaks). Routing goes on; each such worker
is a WARNING once per worker and build, and `others()` (the gauge
kvswitch_router_workers_other_version) counts them while they last. A record without a version is
counted as another build ("unknown"): every shim has written one.
"""

from __future__ import annotations

import logging

from protocol import WorkerInfo

__all__ = ["WorkerVersions"]

log = logging.getLogger(__name__)


class WorkerVersions:
    def __init__(self, mine: str) -> None:
        self.mine = mine
        self._others: dict[str, str] = {}  # worker -> its build, while it differs from ours

    def check(self, info: WorkerInfo) -> None:
        """`info` registered or changed."""
        theirs = info.version
        if theirs == self.mine:
            if self._others.pop(info.worker, None) is not None:
                log.info("worker %s runs kvswitch %s, as this router does, again", info.worker, theirs)
            return
        if self._others.get(info.worker) == theirs:
            return
        self._others[info.worker] = theirs
        log.warning(
            "worker %s runs kvswitch %s, this router %s: a rolling upgrade is in progress, or %s was left "
            "behind; docs/deployment.md, Upgrades",
            info.worker,
            theirs or "unknown (its record names none)",
            self.mine,
            info.worker,
        )

    def forget(self, worker: str) -> None:
        """`worker`'s key is gone: a worker back under its name is said again."""
        self._others.pop(worker, None)

    def others(self) -> dict[str, str]:
        """The registered workers of another build, each with its build, by id."""
        return dict(sorted(self._others.items()))
