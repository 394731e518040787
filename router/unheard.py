"""Workers registered in etcd that this router never hears over NATS: its --nats-servers may not be theirs.

A router given another NATS than its shims' (a second nats-server, another cluster's) reads every
worker's record from etcd and nothing else of it: no load report, no KV event, and no subscriber
to any `{ns}.kvstate.<worker>` it asks. Each such worker stayed `bootstrapping` with its kvstate
failures counted, the gap repair's ERROR said to see the shim's log, which had nothing to say, and
no message named --nats-servers (ops review of 2026-12-06).

A worker is unheard when this router has had its record for UNHEARD_S or more, has heard nothing
of it since (no load report taken, its shim's KV state never read: `heard`), and its last kvstate
request found nobody subscribed to its subject on this router's NATS (FailureKind.NO_RESPONDERS:
the server's own answer, not a timeout). None of that holds for a shim that is starting (it
subscribes before it creates its key, and either way its record is young to this router), for a
router that just started (every record is young to it), for a shim on this NATS with a large state
to send (its dump is no failure, and its reports come), or for this router's NATS down (a NATS
error, not no responders).

`check` (RouterService's fleet check, every CHECK_S) says each worker found unheard once, a
WARNING naming this router's --nats-servers, until it is heard or its key goes, capped for the
fleet (router.fleet_lines: a fleet on another NATS names eight and counts the rest). `problem` is
/ready's when every worker routed is unheard: then it is this router's NATS, not a worker's. Both
judge the routed workers only (WorkerRegistry.workers()): one left out for its max_model_len is
registered but judged by neither. /ready names the flag and leaves the URLs to the log: it carries
no key, and docs/security.md keeps infrastructure addresses for operators.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from router.fleet_lines import FleetLines, FleetLog

__all__ = ["UNHEARD_S", "Unheard"]

log = logging.getLogger(__name__)

UNHEARD_S = 10.0  # ten default load periods; a shim on this NATS answers kvstate within one


class Unheard:
    def __init__(
        self,
        servers: Sequence[str],
        *,
        heard: Callable[[str], bool],
        nobody_subscribes: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
        fleet_log: FleetLog | None = None,
    ) -> None:
        """`servers`: this router's --nats-servers as logs may name them. `heard(worker)`: a load
        report of it was taken, or its shim's KV state read, since it registered.
        `nobody_subscribes(worker)`: its last kvstate request found no subscriber on this router's
        NATS. `clock`: monotonic seconds."""
        self.servers = ", ".join(servers)
        self._heard = heard
        self._nobody_subscribes = nobody_subscribes
        self._clock = clock
        self._since: dict[str, float] = {}  # worker -> when its record was added
        self._said: set[str] = set()  # unheard workers said so, until heard or gone
        self._lines = FleetLines(
            log,
            logging.WARNING,
            f"registered in etcd but silent on NATS (one cause for many workers at once: this router's "
            f"--nats-servers ({self.servers}) is not the NATS their shims use)",
            clock=clock,
            fleet_log=fleet_log,
        )

    def added(self, worker: str) -> None:
        self._since.setdefault(worker, self._clock())

    def removed(self, worker: str) -> None:
        self._since.pop(worker, None)
        self._said.discard(worker)

    def _unheard_for(self, worker: str, now: float) -> float | None:
        """How long `worker` has been registered unheard, once that is UNHEARD_S or more; else None."""
        since = self._since.get(worker)
        if since is None or now - since < UNHEARD_S or not self._nobody_subscribes(worker) or self._heard(worker):
            return None
        return now - since

    def check(self, workers: Sequence[str]) -> None:
        """Say each of the routed `workers` found unheard, once until it is heard or gone."""
        now = self._clock()
        self._said = {w for w in self._said if w in self._since and not self._heard(w)}
        for worker in workers:
            if worker in self._said or (unheard := self._unheard_for(worker, now)) is None:
                continue
            self._said.add(worker)
            self._lines.say(
                worker,
                "worker %s has been registered in etcd for %.0f s, and nothing of it reaches this router over NATS: "
                "no load report, and no subscriber to its kvstate subject on this router's NATS (%s). This router's "
                "--nats-servers may not be the NATS its shim uses (another server or cluster), or its shim lost NATS "
                "(its /health says which); it stays out of routing meanwhile (logged once until it is heard)",
                worker,
                unheard,
                self.servers,
            )

    def problem(self, workers: Sequence[str]) -> str | None:
        """/ready's problem when every one of the routed `workers` (some) is unheard; else None. It
        names the flag, not the servers: /ready carries no key, and infrastructure addresses are
        for operators (docs/security.md); the WARNING in the log names them."""
        now = self._clock()
        if not workers or any(self._unheard_for(w, now) is None for w in workers):
            return None
        who = "the one worker" if len(workers) == 1 else f"none of the {len(workers)} workers"
        return (
            f"{who} this router routes {'has not' if len(workers) == 1 else 'has'} been heard over NATS in the "
            f"{UNHEARD_S:g} s or more since this router read its record (no load report; nobody subscribes to its "
            "kvstate subject on this router's NATS): this router's --nats-servers may not be the shims' NATS (its "
            "log names the URLs)"
        )
