"""What the log says when a model's fleet goes out of routing, and back: once per episode, per model.

A worker's exclusion (router.eligibility) is computed when read: by /ready, /debug/workers and each
request's planning, none of which logs it. So a whole fleet going silent (its load reports stopped)
or reporting `events_ok` false took a model from 1,000 routable workers to none, and /ready to 503,
with no line at INFO or above, and its recovery too (log-volume audit, 2026-12-06). RouterService
hands `FleetNews.check` the statuses of the workers /ready counts every CHECK_S (O(workers), not per
request), with the longest report period among them:

- A model with decode or agg workers registered of which none takes requests (none routable, none
  excluded softly: /ready's rule, `taking_requests`) is a WARNING naming the model and counting its workers by reason
  (the first NAMED_AT_MOST named with theirs, as /ready does: `name_few`), once per episode; an
  INFO when one takes requests again. A model of prefill workers only is /ready's warning, not this.
- A model that had decode or agg workers and has none registered any more (they left: scaled away,
  or crashed shims whose leases expired, often after going silent) is /ready's 503 too: it opens
  that episode with a WARNING saying so, or keeps the one already said, and its INFO comes only
  when one of its workers takes requests again. Such a model is followed until then, or until more
  than DEPARTED_AT_MOST models are (a model name may never come back): the one that left longest
  ago is then forgotten with an INFO saying so, and a worker of it that registers later starts
  afresh.
- Startup: while every decode or agg worker of such a model is `bootstrapping` (a fresh router, a
  model's first workers, each fetching its shim's KV state), the WARNING waits until the model has
  had none for BOOTSTRAP_GRACE_S: a fleet of 1,000 was routable 2.6-8.7 s after registering (scale
  audit of 2026-12-06), and an operator starting a router learns within 30 s that nothing became
  routable. Any other reason is said at the first check that finds it.
- Workers left out of routing for their max_model_len (`context_conflict`: WorkerRegistry.unrouted,
  a configuration error the registry logs) count in the figures below, but no rule judges them: they
  are no part of the pool a model's workers are counted from ("none of its N"), so a fresh router
  with one keeps its startup grace, and they never dilute the half below (review of 2026-12-06: a
  pool of 3 routed and 2 such workers, 2 of the 3 gone silent, was not more than half).
- More than half of a model's decode or agg workers excluded for one same reason that were
  routable at a check within the window (the longer of SILENT_PERIODS times the longest report
  period and WINDOW_CHECKS checks) is a WARNING too: a fleet-wide cause (NATS, the network, a
  setting pushed everywhere), once per episode, which ends (an INFO) when no more than half are left
  out for that reason. A window, not the last check: a cut reaches the workers over one report
  period (each goes `silent` when its own last report ages past SILENT_PERIODS periods, and reports
  are spread across the period), so between two checks half or fewer went out, and 90% of a fleet
  of 2 s reporters cut at once was never said (review of 2026-12-06). A model that no longer has
  any worker taking requests says so instead.

Silence in bulk: a hung NATS (SIGSTOP) stops every load report, and the router, whose own
connection notices only at nats-py's next unanswered PING (5 s), read its fleet as `silent` and said
so, its clients' 503s too (log-quality audit of 2026-12-07). So when more than half of the decode or
agg workers are silent or unreachable (`mostly_silent`), RouterService first asks its own NATS
connection for a round trip (runtime.nats_flush.nats_answers, NATS_PROBE_S at most) and passes a failed one to
`check`, whose lines for silent or unreachable workers then name NATS as the likely cause.

Each check also keeps its figures by model, for /metrics (`routable`, `excluded`: a scrape reads
them, it computes no status): the decode and agg workers taking requests, and those left out by
reason, only the reasons present. A model gone from the check is gone from them, but one whose
decode and agg workers all left reads 0 taking requests while it is followed (above).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from router.eligibility import DEFAULT_PERIOD_S, SILENT_PERIODS, Exclusion, WorkerStatus, name_few, taking_requests
from router.request_path import RECENT_S

__all__ = [
    "BOOTSTRAP_GRACE_S",
    "CHECK_S",
    "DEPARTED_AT_MOST",
    "NATS_PROBE_S",
    "WINDOW_CHECKS",
    "FleetNews",
    "mostly_silent",
]

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often RouterService checks
BOOTSTRAP_GRACE_S = 30.0  # a model's workers all bootstrapping: how long before that is said
WINDOW_CHECKS = 3  # the fleet-wide window is at least this many checks
DEPARTED_AT_MOST = 64  # models with no decode or agg worker left that are followed until one returns
NATS_PROBE_S = 1  # how long the router's own NATS round trip may take when its fleet goes silent
_UNHEARD = (Exclusion.SILENT, Exclusion.UNREACHABLE)


def mostly_silent(statuses: Iterable[WorkerStatus]) -> bool:
    """More than half of the decode and agg workers in `statuses` are silent or unreachable."""
    pool = [st for st in statuses if st.role != "prefill" and st.exclusion is not Exclusion.CONTEXT_CONFLICT]
    return 2 * sum(st.exclusion in _UNHEARD for st in pool) > len(pool)


@dataclass(slots=True)
class _Model:
    """What the checks saw of one model's decode and agg workers."""

    routable_at: dict[str, float] = field(default_factory=dict)  # worker -> the last check it was routable at
    down_since: float | None = None  # when it was first found with none taking requests
    said_down: bool = False
    fleet_wide: set[Exclusion] = field(default_factory=set)  # reasons said to hold more than half
    left_at: float | None = None  # when its last decode or agg worker left


class FleetNews:
    """The episodes said so far, by model."""

    def __init__(self) -> None:
        self._models: dict[str, _Model] = {}
        # The last check's figures, for /metrics (kvswitch_router_workers_*): a scrape reads them,
        # never the statuses, and a model or reason gone since is gone from them.
        self.routable: dict[str, int] = {}  # model -> its decode or agg workers taking requests
        self.excluded: dict[str, Counter[Exclusion]] = {}  # model -> its decode or agg workers left out, by reason
        self._nats_unanswered = False  # the check's: the router's NATS did not answer (nats_answers)

    def check(
        self,
        statuses: Iterable[WorkerStatus],
        now: float,
        period_s: float = DEFAULT_PERIOD_S,
        *,
        nats_unanswered: bool = False,
    ) -> None:
        """Say what began or ended since the last check, of the models in `statuses` (the workers
        /ready counts, as `Eligibility.statuses` reads them at monotonic `now`). `period_s`: the
        longest report period among them; `nats_unanswered`: the router's own NATS connection did
        not answer a round trip just now (runtime.nats_flush.nats_answers)."""
        self._nats_unanswered = nats_unanswered
        pools: dict[str, list[WorkerStatus]] = {}
        prefill: Counter[str] = Counter()
        unrouted: Counter[str] = Counter()  # model -> its context_conflict workers: in the figures, not the rules
        for st in statuses:
            if st.role == "prefill":
                prefill[st.model] += 1
            elif st.exclusion is Exclusion.CONTEXT_CONFLICT:
                unrouted[st.model] += 1
            else:
                pools.setdefault(st.model, []).append(st)
        for model in sorted(self._models.keys() - pools.keys() - unrouted.keys()):
            self._left(model, self._models[model], prefill[model], now)
        departed = sorted((m.left_at, name) for name, m in self._models.items() if m.left_at is not None)
        for left_at, model in departed[: max(0, len(departed) - DEPARTED_AT_MOST)]:
            del self._models[model]
            log.info(
                "model %s has had no decode or agg worker for %.0f s; no longer followed (%d models without one "
                "are), so a worker of it that registers later starts afresh",
                model,
                now - left_at,
                DEPARTED_AT_MOST,
            )
        window = max(SILENT_PERIODS * period_s, WINDOW_CHECKS * CHECK_S)
        # A model whose workers all left reads 0 while it is followed: crashed shims' leases expire,
        # and its figures must not vanish as if it had recovered.
        self.routable, self.excluded = dict.fromkeys(self._models, 0), {}
        for model, pool in sorted(pools.items()):
            self._check(model, pool, self._models.setdefault(model, _Model()), now, window)
        for model, n in unrouted.items():
            self.routable.setdefault(model, 0)
            self.excluded.setdefault(model, Counter())[Exclusion.CONTEXT_CONFLICT] = n

    def _left(self, model: str, seen: _Model, prefill: int, now: float) -> None:
        if seen.left_at is not None:
            return
        seen.left_at, seen.routable_at = now, {}
        if seen.down_since is None:
            seen.down_since = now
        if seen.said_down:
            return  # the episode said goes on: /ready's 503 now says they left
        seen.said_down = True
        log.warning(
            "model %s: no decode or agg worker registered any more (%s), so every request for it is refused "
            "(a 503; without --model, a 404 once %g min have passed since they left and since a request named it) "
            "until one registers and can take requests (logged once until one can)",
            model,
            f"{prefill} prefill workers remain" if prefill else "nor any prefill worker",
            RECENT_S / 60,
        )

    def _check(self, model: str, pool: list[WorkerStatus], seen: _Model, now: float, window: float) -> None:
        seen.left_at = None
        last = seen.routable_at
        recent = {st.worker: at for st in pool if (at := last.get(st.worker)) is not None and now - at <= window}
        seen.routable_at = recent | {st.worker: now for st in pool if st.routable}
        out = [st for st in pool if st.exclusion is not None]
        by_reason = Counter(st.exclusion for st in out if st.exclusion is not None)
        taking = self.routable[model] = taking_requests(pool)
        self.excluded[model] = by_reason
        if not taking:
            if seen.down_since is None:
                seen.down_since = now
            waits = set(by_reason) == {Exclusion.BOOTSTRAPPING} and now - seen.down_since < BOOTSTRAP_GRACE_S
            if not seen.said_down and not waits:
                seen.said_down = True
                named, more = name_few(out)
                log.warning(
                    "model %s: none of its %d decode or agg workers can take requests (%s)%s, so every request for "
                    "it is refused (503) until one can: %s%s (logged once until one can; /debug/workers has each "
                    "with why)",
                    model,
                    len(pool),
                    _counts(by_reason),
                    self._nats_said(by_reason),
                    ", ".join(f"{st.worker} ({st.exclusion})" for st in named),
                    f" and {len(more)} more" if more else "",
                )
            return  # which reasons hold more than half is said above
        if seen.down_since is not None:
            if seen.said_down:
                log.info(
                    "model %s: %d of its %d decode or agg workers take requests again (none did for %.0f s)",
                    model,
                    taking,
                    len(pool),
                    now - seen.down_since,
                )
            seen.down_since, seen.said_down = None, False
        for reason in sorted(seen.fleet_wide - {r for r, n in by_reason.items() if 2 * n > len(pool)}):
            seen.fleet_wide.discard(reason)
            log.info("model %s: no more than half of its decode or agg workers are left out as %s now", model, reason)
        went: dict[Exclusion, list[float]] = {}
        for st in out:
            if st.exclusion is not None and (at := recent.get(st.worker)) is not None:
                went.setdefault(st.exclusion, []).append(at)
        for reason, ats in sorted(went.items()):
            if 2 * len(ats) > len(pool) and reason not in seen.fleet_wide:
                seen.fleet_wide.add(reason)
                log.warning(
                    "model %s: %d of its %d decode or agg workers went from routable to %s within %.1f s, a cause "
                    "common to the fleet (%s)%s, not each worker's; %s (logged once until no more than half are %s)",
                    model, len(ats), len(pool), reason, now - min(ats), _CAUSES.get(reason, _CAUSE),
                    self._nats_said({reason: 1}), _taking(pool, taking), reason,
                )  # fmt: skip

    def _nats_said(self, by_reason: dict[Exclusion, int]) -> str:
        """What a line on workers left out for `by_reason` adds when the router's NATS did not answer."""
        if not self._nats_unanswered or not any(r in _UNHEARD for r in by_reason):
            return ""
        return (
            f"; this router's own NATS connection did not answer a round trip within {NATS_PROBE_S}s either: "
            "NATS (hung, or the network to it), not the workers, is the likely cause"
        )


# What more than half of a fleet going out for one reason at once points to, by reason; the others
# are a setting or build every worker shares. Until 2026-12-07 every reason listed NATS first, an
# engine_unhealthy fleet too, whose shims' reports NATS had just carried (log-quality audit).
_CAUSE = "NATS, the network, a setting pushed to every worker"
_CAUSES = {
    Exclusion.SILENT: "NATS, the network, or this router's own host",
    Exclusion.UNREACHABLE: "NATS or the network",
    Exclusion.ENGINE_UNHEALTHY: "their engines or the hosts they run on: a shared GPU driver or model store, a "
    "request that crashes every engine; not NATS, which carried their shims' word of it",
    Exclusion.ENGINE_FAILING: "their engines, failing every request with server errors: a build, model or "
    "dependency they share",
    Exclusion.EVENTS_DOWN: "their engines' KV event streams (a setting pushed to every engine, the network)",
    Exclusion.DRAINING: "a fleet restart or scale-down",
}


def _taking(pool: list[WorkerStatus], taking: int) -> str:
    """How many of `pool` take requests, for a message: those left out softly take them only
    while none is routable (`taking_requests`)."""
    if taking and not any(st.routable for st in pool):
        soft = " or ".join(sorted({str(st.exclusion) for st in pool if st.soft}))
        return f"none is routable: the {taking} {soft} ones take requests only because no other can"
    return f"{taking} take requests"


def _counts(by_reason: Counter[Exclusion]) -> str:
    """`by_reason` for a message, the most common first."""
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])))
