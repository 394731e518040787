"""What the log says when a model's fleet goes out of routing, and back: once per episode, per model.

A worker's exclusion (router.eligibility) is computed when read: by /ready, /debug/workers and each
request's planning, none of which logs it. So a whole fleet going silent (its load reports stopped)
or reporting `events_ok` false took a model from 1,000 routable workers to none, and /ready to 503,
with no line at INFO or above, and its recovery too (log-volume audit, 2026-12-06). RouterService
hands `FleetNews.check` the statuses of the workers /ready counts every CHECK_S (O(workers), not per
request):

- A model with decode or agg workers registered of which none takes requests (none routable, none
  excluded softly: /ready's rule) is a WARNING naming the model and counting its workers by reason
  (the first NAMED_AT_MOST named with theirs, as /ready does: `name_few`), once per episode; an
  INFO when one takes requests again, or when its last decode or agg worker has left. A model of
  prefill workers only is /ready's warning, not this.
- Startup: while every decode or agg worker of such a model is `bootstrapping` (a fresh router, a
  model's first workers, each fetching its shim's KV state), the WARNING waits until the model has
  had none for BOOTSTRAP_GRACE_S: a fleet of 1,000 was routable 2.6-8.7 s after registering (scale
  audit of 2026-12-06), and an operator starting a router learns within 30 s that nothing became
  routable. Any other reason is said at the first check that finds it.
- More than half of a model's decode or agg workers routable at the last check and excluded for
  one same reason at this one (a fleet-wide cause: NATS, the network, a setting pushed everywhere)
  is a WARNING too, once per episode, which ends (an INFO) when no more than half are left out for
  that reason. A model that no longer has any worker taking requests says so instead.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from router.eligibility import Exclusion, WorkerStatus, name_few

__all__ = ["BOOTSTRAP_GRACE_S", "CHECK_S", "FleetNews"]

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often RouterService checks
BOOTSTRAP_GRACE_S = 30.0  # a model's workers all bootstrapping: how long before that is said


@dataclass(slots=True)
class _Model:
    """What the last check saw of one model's decode and agg workers."""

    routable: set[str] = field(default_factory=set)
    down_since: float | None = None  # when it was first found with none taking requests
    said_down: bool = False
    fleet_wide: set[Exclusion] = field(default_factory=set)  # reasons said to hold more than half


class FleetNews:
    """The episodes said so far, by model."""

    def __init__(self) -> None:
        self._models: dict[str, _Model] = {}
        self._last: float | None = None  # when the last check ran

    def check(self, statuses: Iterable[WorkerStatus], now: float) -> None:
        """Say what began or ended since the last check, of the models in `statuses` (the workers
        /ready counts, as `Eligibility.statuses` reads them at monotonic `now`)."""
        pools: dict[str, list[WorkerStatus]] = {}
        for st in statuses:
            if st.role != "prefill":
                pools.setdefault(st.model, []).append(st)
        for model in sorted(self._models.keys() - pools.keys()):
            if (gone := self._models.pop(model)).said_down:
                log.info(
                    "model %s has no decode or agg worker registered any more (none took requests for %.0f s)",
                    model,
                    now - (gone.down_since or now),
                )
        since, self._last = now - (self._last if self._last is not None else now), now
        for model, pool in sorted(pools.items()):
            self._check(model, pool, self._models.setdefault(model, _Model()), now, since)

    def _check(self, model: str, pool: list[WorkerStatus], seen: _Model, now: float, since: float) -> None:
        routable = {st.worker for st in pool if st.routable}
        out = [st for st in pool if st.exclusion is not None]
        by_reason = Counter(st.exclusion for st in out if st.exclusion is not None)
        taking = len(routable) + sum(st.soft for st in out)  # a soft one takes requests while none is routable
        if not taking:
            if seen.down_since is None:
                seen.down_since = now
            waits = set(by_reason) == {Exclusion.BOOTSTRAPPING} and now - seen.down_since < BOOTSTRAP_GRACE_S
            if not seen.said_down and not waits:
                seen.said_down = True
                named, more = name_few(out, lambda st: str(st.exclusion))
                log.warning(
                    "model %s: none of its %d decode or agg workers can take requests (%s), so every request for "
                    "it is refused (503) until one can: %s%s (logged once until one can; /debug/workers has each "
                    "with why)",
                    model,
                    len(pool),
                    _counts(by_reason),
                    ", ".join(f"{st.worker} ({st.exclusion})" for st in named),
                    f" and {more.total()} more" if more else "",
                )
            seen.routable = routable
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
        went = Counter(st.exclusion for st in out if st.worker in seen.routable and st.exclusion is not None)
        for reason, n in sorted(went.items()):
            if 2 * n > len(pool) and reason not in seen.fleet_wide:
                seen.fleet_wide.add(reason)
                log.warning(
                    "model %s: %d of its %d decode or agg workers went from routable to %s within %.1f s, a cause "
                    "common to the fleet (NATS, the network, a setting pushed to every worker), not each "
                    "worker's; %d take requests (logged once until no more than half are %s)",
                    model, n, len(pool), reason, since, taking, reason,
                )  # fmt: skip
        seen.routable = routable


def _counts(by_reason: Counter[Exclusion]) -> str:
    """`by_reason` for a message, the most common first."""
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])))
