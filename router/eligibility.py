"""Which registered workers may take a request now, and why each other one may not.

One worker's fault never stops the fleet: a worker that cannot be trusted is left out of the
candidates, its reason is shown on `/ready` (counted, the first eight named: `name_few`),
`/debug/workers` and `/debug/route`, and every other worker routes as usual. A worker is excluded
while (first reason wins):

- `bootstrapping`: the index has not yet received its first state from the shim;
- `repairing`: a gap, an unknown epoch, an impossible seq or a digest mismatch is being repaired;
- `events_down`: its shim sees no KV events it should (wrong endpoint or topic, silent engine), so
  its index entries say nothing about its cache (WorkerInfo.events_ok or LoadReport.events_ok);
- `block_size`: its block size is not its model's (router.fleet_vote: the size most of the
  model's decode and agg workers fit to serve have, `fit`; ties: the size more of its fit workers
  have, then the size it is served with, then its longest-registered worker's), so prefill workers
  at odds are left out, never their decode pool, and a newcomer that cannot serve (a record with no
  shim behind it, silent, no KV events) never outvotes the workers that do: prefix hashes of two
  block sizes never match. `fit` takes a worker's vote away for the lasting exclusions alone
  (`bootstrapping`, `events_down`, `silent`) and counts one `engine_unhealthy` only for the size
  the model is served with; a request's mark, `repairing` and `draining` leave it its vote;
- `silent`: no load report for 3 of its report periods (reports double as heartbeats), or none
  within 3 default periods of registering, counted only while this router's loop was awake to read
  one: the stalls of its own loop within that time (runtime.loop_watch) are taken off, as they
  left the reports unread in its socket (a paused router woke to every worker silent, 2026-12-07),
  and a loop that stalls again and again still finds a dead worker, its waking times adding up;
- `unreachable`: a request to it found no responder or its stream stopped; it ends with the next
  load report received after the mark;
- `malformed`: it answered a request with a reply that breaks the protocol (a ResponseChunk that
  does not decode, an event cut across chunks that never ends); it ends `MALFORMED_COOLDOWN_S`
  after the last such reply, not with a load report, as a broken shim's reports go on;
- `prefill_failing`: a prefill worker whose prefill legs failed through its own fault (no answer
  within `prefill_timeout_s`, no transfer handle: an engine without a KV connector, one no decode
  engine would pull with, a server error); it ends `PREFILL_COOLDOWN_S` after the last such
  failure, when one request, the probe, tries it again: a leg that works ends the episode, another
  failure starts a new cooldown. Its requests prefill on the other prefill workers, or, with none
  left, on their decode worker. One whose legs only lacked a usable transfer handle still serves
  whole requests (`serves_whole`): the planner may spill to it (spill_to_prefill); a hung or
  failing one takes none, nor one whose spills fail with its engine's server errors (its
  `engine_failing` episode, hidden by this exclusion). An episode's start is a WARNING naming the
  worker, its end an INFO; a prefill fleet misconfigured alike fails every worker's legs (and,
  fixed, serves again all at once), so in a window of 10 s the first eight are named, the rest counted in one line
  (router.fleet_lines), for the failures and the ends alike;
- `draining`: its shim got SIGTERM (LoadReport.draining): its requests in flight finish, a new one
  would be refused, so none is sent (a rolling restart costs no retry);
- `engine_failing`: a decode or agg worker whose last ENGINE_FAILING_AFTER requests (within
  ENGINE_FAILING_WINDOW_S) failed before their first output with its engine's own server error (an
  `engine_error` 5xx but 503, which is load; not a client's 4xx, nor a busy 429): an engine whose
  /health answers while every completion fails, which nothing else here sees (2026-12-07: one such
  worker of three drew a sixth of the requests for good, each a failed leg and a retry, two such
  gave clients errors). It ends ENGINE_COOLDOWN_S after its last such failure, when one request
  tries it again: a leg with output ends the episode, a failure doubles the wait up to
  ENGINE_COOLDOWN_MAX_S. Soft, as `engine_unhealthy`: with no other worker of its pool routable it
  serves, but no spill (`engine_out`: one can wait for decode room). Its start is a WARNING naming
  the worker, the count, the engine's last error and the wait, its end an INFO (capped for the
  fleet as `prefill_failing`'s). `prefill_failing` and this are one mechanism
  (router.failing_workers);
- `engine_unhealthy`: its shim reports the engine failing its load polls (down, or too loaded to
  answer in time). Soft: such a worker is left out only while a healthy one of its pool remains,
  since a whole fleet too busy to answer its probes must still serve rather than refuse everything.

`bad_record` is shown, never decided here: its etcd record was refused (router.worker_registry),
so the worker is not registered at all. So is `context_conflict`: the worker is registered, but
its max_model_len is not its model's (router.fleet_vote's rule, as for the block size), and the
registry routes it to no request (`WorkerRegistry.unrouted`).

`tokenizer` is not an exclusion but a per-request check: a text prompt needs the router's tokenizer
to be the worker's (fingerprints equal); a token-id prompt needs no tokenizer.

Synchronous, with an injected clock; the service feeds it registrations, reports and marks.
Exclusions are computed when read and never logged here, one worker at a time: a model's whole
fleet going out of routing (all `silent`, all `events_down`...) and back is router.fleet_news's one
line, from the service's check every second.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import msgspec

from protocol.messages import WorkerInfo
from router.failing_workers import FailingWorkers
from router.fleet_lines import NAMED_AT_MOST, FleetEpisodes, FleetLines, FleetLog
from router.fleet_vote import Ballot, Fit, Standing, model_value, votes
from router.load_view import Liveness

__all__ = [
    "DEFAULT_PERIOD_S",
    "ENGINE_COOLDOWN_MAX_S",
    "ENGINE_COOLDOWN_S",
    "ENGINE_FAILING_AFTER",
    "ENGINE_FAILING_WINDOW_S",
    "MALFORMED_COOLDOWN_S",
    "NAMED_AT_MOST",
    "PREFILL_COOLDOWN_S",
    "SILENT_PERIODS",
    "Eligibility",
    "Exclusion",
    "WorkerStatus",
    "few_ids",
    "name_few",
    "taking_requests",
]

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 1.0
SILENT_PERIODS = 3
MALFORMED_COOLDOWN_S = 30.0  # one request retried elsewhere per this, per worker sending garbage
PREFILL_COOLDOWN_S = 30.0  # one prefill leg lost per this, per prefill worker failing them
ENGINE_FAILING_AFTER = 3  # requests failed in a row with engine server errors ...
ENGINE_FAILING_WINDOW_S = 60.0  # ... within this, to leave a worker out
ENGINE_COOLDOWN_S = 10.0  # one request tries it again this long after its last failure ...
ENGINE_COOLDOWN_MAX_S = 300.0  # ... the wait doubled by each such try that fails, up to this

_T = TypeVar("_T")


def name_few(items: Sequence[_T]) -> tuple[Sequence[_T], Sequence[_T]]:
    """The first NAMED_AT_MOST of `items`, to name, and the rest, to count: what a no-worker 503,
    /ready and router.fleet_news say of the workers left out, so that a whole fleet down makes
    none as long as the fleet. Each counts the rest as it says them (the 503 by reason)."""
    return items[:NAMED_AT_MOST], items[NAMED_AT_MOST:]


def few_ids(ids: Sequence[str]) -> str:
    """`ids` joined for a message, the first NAMED_AT_MOST named and the rest counted: a warning or
    a 503 about a whole fleet of 1,000 names no more than one about a few."""
    named = ", ".join(ids[:NAMED_AT_MOST])
    return named if len(ids) <= NAMED_AT_MOST else f"{named} and {len(ids) - NAMED_AT_MOST} more"


class Exclusion(enum.StrEnum):
    BOOTSTRAPPING = "bootstrapping"
    REPAIRING = "repairing"
    EVENTS_DOWN = "events_down"
    BLOCK_SIZE = "block_size"
    SILENT = "silent"
    UNREACHABLE = "unreachable"
    MALFORMED = "malformed"
    PREFILL_FAILING = "prefill_failing"
    DRAINING = "draining"
    ENGINE_FAILING = "engine_failing"
    ENGINE_UNHEALTHY = "engine_unhealthy"
    BAD_RECORD = "bad_record"
    CONTEXT_CONFLICT = "context_conflict"


# Left out only while another worker of its pool is routable (WorkerStatus.soft)
_SOFT = frozenset({Exclusion.ENGINE_FAILING, Exclusion.ENGINE_UNHEALTHY})
# The exclusions _status finds before the block size's: statuses() leaves them in its place.
_BEFORE_BLOCK_SIZE = (Exclusion.BOOTSTRAPPING, Exclusion.REPAIRING, Exclusion.EVENTS_DOWN)


class WorkerStatus(msgspec.Struct, frozen=True):
    worker: str
    model: str
    role: str
    exclusion: Exclusion | None
    detail: str
    tokenizer_ok: bool

    @property
    def routable(self) -> bool:
        return self.exclusion is None

    @property
    def soft(self) -> bool:
        """Left out only while another worker of its pool is routable."""
        return self.exclusion in _SOFT

    def explain(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "model": self.model,
            "role": self.role,
            "routable": self.routable,
            "excluded": str(self.exclusion) if self.exclusion is not None else None,
            "why": self.detail,
            "text_prompts": self.tokenizer_ok,
        }


def taking_requests(pool: Iterable[WorkerStatus]) -> int:
    """How many of `pool` (one model's decode and agg workers) the planner sends requests to: its
    routable ones or, while none is, those excluded softly (`engine_unhealthy`), which it then
    uses. A model takes requests iff this is not 0: /ready's rule, router.fleet_news's, and
    kvswitch_router_workers_routable's."""
    routable = soft = 0
    for st in pool:  # `exclusion` read, not `routable`: 0.2 ms less a check of 1,000 workers
        if st.exclusion is None:
            routable += 1
        elif st.exclusion in _SOFT:
            soft += 1
    return routable or soft


class StalledWithin(Protocol):
    """runtime.loop_watch.LoopWatch.stalled_within's form: the seconds of the last `seconds` this
    router's loop stood still, the latest and the longest stall in full and the others
    `older_at_most` at most."""

    def __call__(self, seconds: float, *, older_at_most: float = ...) -> float: ...


def _never_stalled(seconds: float, *, older_at_most: float = 0.0) -> float:
    return 0.0


class Eligibility:
    """Holds what is not derivable from the parts: registration times, unreachable marks and the
    router's tokenizer fingerprint. Everything else is read when asked."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        sync_state: Callable[[str], tuple[str, str] | None],
        liveness: Callable[[str], Liveness | None],
        tokenizer: str | None,
        same_tokenizer: Callable[[str], bool] | None = None,
        stalled_within: StalledWithin | None = None,
        quarantined_for: Callable[[str], float | None] = lambda _worker: None,
        fleet_log: FleetLog | None = None,
        created: Callable[[str], int] = lambda _worker: 0,
    ) -> None:
        """`sync_state(worker)`: None when the index is synced with it, else (state, why).
        `liveness(worker)`: None before its first report. `tokenizer`: the router's fingerprint,
        None when it has no tokenizer (text prompts are then refused for every worker).
        `same_tokenizer(fingerprint)`: whether a worker's fingerprint is the router's tokenizer's on
        some day (router.fingerprint_days.FingerprintDays.accepts); by default, equal to `tokenizer`.
        `stalled_within`: how long this router's loop stood still (runtime.loop_watch; never, when
        None): a worker is silent for no longer than the router was awake to hear it.
        `quarantined_for(worker)`: the seconds its load reports are unheard for yet, sent past their
        budget (router.sender_subscriptions), None when they are heard. `fleet_log`: its router's
        (router.fleet_lines). `created(worker)`: its key's etcd create_revision
        (WorkerRegistry.created), which breaks a tie of the block-size vote alike on every replica
        where the model has no standing size (router.fleet_vote)."""
        self._clock = clock
        self._created = created
        self._standing = Standing(clock)  # each model's block size as last decided: a tie goes to it
        self._stalled_within = stalled_within or _never_stalled
        self._sync_state = sync_state
        self._liveness = liveness
        self._quarantined_for = quarantined_for
        self.tokenizer = tokenizer
        self._same_tokenizer = same_tokenizer or (lambda fp: fp == tokenizer)
        self._added: dict[str, float] = {}
        # The router's own NATS did not answer a round trip at the last fleet check (router.fleet_news):
        # a silent worker's why says so, a hung NATS being the likelier cause
        self.nats_unanswered = False
        self._unreachable: dict[str, tuple[float, str]] = {}  # worker -> (marked at, why)
        self._malformed: dict[str, tuple[float, str]] = {}  # worker -> (last malformed reply at, why)
        self._prefill_failing = FailingWorkers(clock=clock, cooldown_s=PREFILL_COOLDOWN_S)
        self._engine_failing = FailingWorkers(
            clock=clock,
            cooldown_s=ENGINE_COOLDOWN_S,
            after=ENGINE_FAILING_AFTER,
            window_s=ENGINE_FAILING_WINDOW_S,
            max_cooldown_s=ENGINE_COOLDOWN_MAX_S,
        )
        # A prefill fleet misconfigured alike (no KV connector, one bad flag) fails every worker's legs
        self._prefill_lines = FleetLines(
            log,
            logging.WARNING,
            "failed prefill legs through their own fault (one cause for many prefill workers at once: a "
            "configuration they share, such as no --kv-transfer-config; the named workers' lines say what failed). "
            f"Their requests prefill elsewhere for {PREFILL_COOLDOWN_S:g}s after each such failure",
            clock=clock,
            fleet_log=fleet_log,
        )
        # and, that configuration fixed, every one serves again: as capped, but for those named failing
        self._prefill_again_lines = FleetLines(
            log, logging.INFO, "prefill workers serve prefill legs again", clock=clock, fleet_log=fleet_log
        )
        self._prefill_episodes = FleetEpisodes(self._prefill_lines, self._prefill_again_lines)
        # A fleet's engines failing alike (one bad image, a shared dependency down) are one cause too
        self._engine_episodes = FleetEpisodes(
            FleetLines(
                log,
                logging.WARNING,
                "failed their requests with engine server errors, left out of routing while other workers of "
                "their model serve (one cause for many workers at once: a build or dependency they share; the "
                "named workers' lines say what failed)",
                clock=clock,
                fleet_log=fleet_log,
            ),
            FleetLines(log, logging.INFO, "workers serve requests again", clock=clock, fleet_log=fleet_log),
        )

    # --- what the service tells it ---------------------------------------------------------------

    def added(self, worker: str) -> None:
        self._added.setdefault(worker, self._clock())

    def removed(self, worker: str) -> None:
        self._added.pop(worker, None)
        self._unreachable.pop(worker, None)
        self._malformed.pop(worker, None)
        self._prefill_failing.forget(worker)
        self._prefill_episodes.forget(worker)
        self._engine_failing.forget(worker)
        self._engine_episodes.forget(worker)

    def mark_unreachable(self, worker: str, why: str) -> None:
        self._unreachable[worker] = (self._clock(), why)

    def mark_malformed(self, worker: str, why: str) -> None:
        self._malformed[worker] = (self._clock(), why)

    def prefill_leg(self, worker: str, fault: str | None, serves_whole: bool = False, ago_s: float = 0.0) -> None:
        """A prefill leg on `worker` ended: `fault` says why it failed through the worker's own
        fault (with the likely fix), None when it gave a transfer handle; `ago_s` before now (an
        engine's 5xx is judged only once the fallback gave output). A failure leaves the worker out
        for PREFILL_COOLDOWN_S (a WARNING at an episode's start); a leg that works past the
        cooldown, the probe, ends the episode (one within it was planned before the failure), and a
        failure of a leg from before the probe leaves the probe's verdict standing.
        `serves_whole`: its engine answered but gave no usable transfer handle, so it still serves a
        whole request (its last failure's say)."""
        if fault is None:
            if self._prefill_failing.worked(worker) is not None:
                self._prefill_episodes.ended(worker, "prefill worker %s serves prefill legs again", worker)
            return
        if self._prefill_failing.failed(worker, fault, serves_whole, ago_s) is not None:
            self._prefill_episodes.began(
                worker,
                "prefill worker %s failed a prefill leg through its own fault: %s. Its requests prefill on other "
                "prefill workers (or on their decode worker when none is left) for %gs after each such failure, "
                "then one request tries it again (logged once per episode)",
                worker,
                fault,
                PREFILL_COOLDOWN_S,
            )

    def prefill_probe(self, worker: str, for_s: float) -> None:
        """A prefill leg on `worker` was planned: past its cooldown, it is the probe, and no other
        request goes there for `for_s` (the leg's time limit) unless it reports first."""
        self._prefill_failing.trial(worker, for_s)

    def engine_leg(self, worker: str, fault: str | None, ago_s: float = 0.0) -> None:
        """A decode or agg leg on `worker` gave its first output (`fault` None) or failed before it
        with its engine's own server error (`fault`: what the engine said, `ago_s` before now: judged
        once the request's retry gave output). ENGINE_FAILING_AFTER such failures in a row leave the
        worker out (`engine_failing`, a WARNING), for ENGINE_COOLDOWN_S from the last, then one
        request tries it again: its failure doubles the cooldown (up to ENGINE_COOLDOWN_MAX_S), its
        leg that works ends the episode (an INFO)."""
        failing = self._engine_failing
        if fault is None:
            if (ended := failing.worked(worker)) is not None:
                self._engine_episodes.ended(
                    worker,
                    "worker %s serves requests again after %d failed with engine server errors",
                    worker,
                    ended.failures,
                )
            return
        if (began := failing.failed(worker, fault, ago_s=ago_s)) is not None:
            self._engine_episodes.began(
                worker,
                "worker %s failed %d requests in a row with engine server errors before their first output, the "
                "last: %s. It is left out of routing while another worker of its model serves, for %gs, then one "
                "request tries it again (each failure of that doubles the wait, up to %gs; logged once per episode, "
                "counted in kvswitch_router_worker_legs_failed_total)",
                worker,
                began.failures,
                fault,
                began.cooldown_s,
                failing.max_cooldown_s,
            )

    def engine_probe(self, worker: str, for_s: float) -> None:
        """A decode or agg leg on `worker` was planned: past its `engine_failing` cooldown, it is the
        trial, and no other request goes there for `for_s` unless it reports first."""
        self._engine_failing.trial(worker, for_s)

    def serves_whole(self, worker: str) -> bool:
        """`worker`, left out as `prefill_failing`, failed its legs only by giving no transfer
        handle: its engine still serves a whole request (spill_to_prefill), unless what that
        exclusion hides keeps it from one too (draining, engine unhealthy, or `engine_failing`: the
        spills themselves, agg legs, failing with its engine's server errors)."""
        held = self._prefill_failing.get(worker)
        if held is None or not held.serves_whole:
            return False
        live = self._liveness(worker)
        if live is not None and (not live.healthy or live.draining):
            return False
        return not self.engine_out(worker)

    def engine_out(self, worker: str) -> bool:
        """`worker`'s `engine_failing` episode leaves it out now (cooling down, or its trial under
        way), whatever its status shows: a soft one a pool with no other still takes, or one hidden
        by an earlier exclusion."""
        engine = self._engine_failing.get(worker)
        return engine is not None and engine.out(self._clock())

    def reported(self, worker: str) -> None:
        """A load report from `worker` arrived: it is alive, whatever was marked before."""
        self._unreachable.pop(worker, None)

    # --- reads ------------------------------------------------------------------------------------

    def block_sizes(self, infos: Iterable[WorkerInfo]) -> dict[str, int]:
        """Each model's block size (`model_block_sizes`), voted by the workers fit to serve."""
        return self._block_sizes(infos, self._clock())

    def _block_sizes(self, infos: Iterable[WorkerInfo], now: float) -> dict[str, int]:
        return model_block_sizes(infos, lambda info: self._fit(info, now), self._created, self._standing)

    def fit(self, info: WorkerInfo) -> Fit:
        """How `info`'s worker takes part in its model's votes (router.fleet_vote's `Ballot.fit`)."""
        return self._fit(info, self._clock())

    def _fit(self, info: WorkerInfo, now: float) -> Fit:
        # Lasting states only (the module's docstring), read without a whole _status: a model at
        # odds is voted over all its workers on every request.
        w = info.worker
        if (sync := self._sync_state(w)) is not None and sync[0] == "bootstrapping":
            return Fit.OUT
        live = self._liveness(w)
        if not info.events_ok or (live is not None and not live.events_ok) or self._silent_now(w, live, now):
            return Fit.OUT
        return Fit.FAILING if live is not None and not live.healthy else Fit.SERVES

    def takes_text(self, info: WorkerInfo) -> bool:
        """This router's tokenizer is the worker's: text prompts may go to it."""
        return self.tokenizer is not None and self._same_tokenizer(info.tokenizer)

    def statuses(self, infos: Iterable[WorkerInfo], sizes: Mapping[str, int] | None = None) -> list[WorkerStatus]:
        """Each worker's status. `sizes`: its model's block size as already decided (a request's, as
        hashed), else voted here. One `_status` per worker: the block size, voted apart (`fit`),
        applies where no exclusion before it in the order does; before, each worker's status was
        read once more per vote, and a request voted twice (1,500 reads of 500 workers)."""
        infos = list(infos)
        now = self._clock()
        out = [self._status(info, now) for info in infos]
        if sizes is None:
            sizes = self._block_sizes(infos, now)
        for n, info in enumerate(infos):
            size = sizes.get(info.model, info.block_size)
            if info.block_size != size and (st := out[n]).exclusion not in _BEFORE_BLOCK_SIZE:
                why = f"block size {info.block_size}, but model {st.model} is served with {size}: a configuration error"
                out[n] = WorkerStatus(st.worker, st.model, st.role, Exclusion.BLOCK_SIZE, why, st.tokenizer_ok)
        return out

    def _quarantine(self, worker: str) -> str:
        """Why a silent worker is unheard, where it is quarantined (else it reads as a shim dead or cut off)."""
        if (left := self._quarantined_for(worker)) is None:
            return ""
        return (
            f"; its reports are quarantined for {left:.1f}s more, sent faster than their budget (the router's "
            "WARNING names the subject)"
        )

    def _silent_now(self, w: str, live: Liveness | None, now: float) -> bool:
        """Nothing heard for SILENT_PERIODS of its period (DEFAULT_PERIOD_S before its first report),
        counted while this router was awake to hear it: the stalls of its own loop within the time
        are taken off, the latest and the longest in full (either may hold reports still unread:
        one just woken reads none silent before it read its socket, nor one busy on waking past a
        tick), the others one limit at most. A loop that stalls again and again (overload) still
        finds a dead worker within twice the limit plus its latest and longest stalls; crediting
        them all, a loop stalled 0.9 s in each second kept a dead worker routable for 30 s at a
        3 s limit (reviews of 2026-12-07)."""
        if live is None:
            age, limit = now - self._added.get(w, now), SILENT_PERIODS * DEFAULT_PERIOD_S
        else:
            age, limit = live.age_s, SILENT_PERIODS * live.period_s
        return age > limit and age - self._stalled_within(age, older_at_most=limit) > limit

    def _status(self, info: WorkerInfo, now: float) -> WorkerStatus:
        # Runs for every worker on every request: the routable case allocates nothing but the result.
        # All but the block size, which statuses() judges after.
        w = info.worker
        tok_ok = self.takes_text(info)
        sync = self._sync_state(w)
        if sync is not None:
            state, why = sync
            kind = Exclusion.BOOTSTRAPPING if state == "bootstrapping" else Exclusion.REPAIRING
            return WorkerStatus(w, info.model, info.role, kind, why, tok_ok)
        live = self._liveness(w)
        if not info.events_ok or (live is not None and not live.events_ok):
            why = "its shim sees no KV events (see the shim's log and /health)"
            return WorkerStatus(w, info.model, info.role, Exclusion.EVENTS_DOWN, why, tok_ok)
        if self._silent_now(w, live, now):
            if live is None:
                why = f"no load report in {now - self._added.get(w, now):.1f}s since it registered{self._quarantine(w)}"
            else:
                why = f"last load report {live.age_s:.1f}s ago (period {live.period_s:g}s){self._quarantine(w)}"
            if self.nats_unanswered:
                why += "; this router's own NATS connection does not answer either"
            return WorkerStatus(w, info.model, info.role, Exclusion.SILENT, why, tok_ok)
        mark = self._unreachable.get(w)
        if mark is not None:
            why = f"{mark[1]} ({now - mark[0]:.1f}s ago)"
            return WorkerStatus(w, info.model, info.role, Exclusion.UNREACHABLE, why, tok_ok)
        mark = self._malformed.get(w)
        if mark is not None and now - mark[0] < MALFORMED_COOLDOWN_S:
            why = f"{mark[1]} ({now - mark[0]:.1f}s ago; routed again {MALFORMED_COOLDOWN_S:g}s after it)"
            return WorkerStatus(w, info.model, info.role, Exclusion.MALFORMED, why, tok_ok)
        held = self._prefill_failing.get(w)
        if held is not None and held.out(now):
            why = held.explain(now)
            if held.serves_whole:
                why += "; it still serves whole requests spilled to it"
            return WorkerStatus(w, info.model, info.role, Exclusion.PREFILL_FAILING, why, tok_ok)
        if live is not None and live.draining:
            why = "its shim is shutting down (SIGTERM): requests in flight finish, new ones go elsewhere"
            return WorkerStatus(w, info.model, info.role, Exclusion.DRAINING, why, tok_ok)
        held = self._engine_failing.get(w)
        if held is not None and held.out(now):
            why = f"{held.failures} requests failed in a row with its engine's server errors, the last: "
            why += held.explain(now)
            return WorkerStatus(w, info.model, info.role, Exclusion.ENGINE_FAILING, why, tok_ok)
        if live is not None and not live.healthy:
            why = "its shim reports the engine failing"
            return WorkerStatus(w, info.model, info.role, Exclusion.ENGINE_UNHEALTHY, why, tok_ok)
        return WorkerStatus(w, info.model, info.role, None, "", tok_ok)


def model_block_sizes(
    infos: Iterable[WorkerInfo],
    fit: Callable[[WorkerInfo], Fit] = lambda info: Fit.SERVES,
    created: Callable[[str], int] = lambda worker: 0,
    standing: Standing | None = None,
) -> dict[str, int]:
    """Each model's block size by router.fleet_vote's rule, `fit(info)` saying how each worker votes,
    `created(worker)` its key's create_revision and `standing` the sizes the models are served with
    (None: none, a vote of its own): the size its prompts must be hashed at to match the workers
    that route."""
    by_model: dict[str, list[WorkerInfo]] = {}
    for info in infos:
        by_model.setdefault(info.model, []).append(info)
    out: dict[str, int] = {}
    for model, group in by_model.items():
        sizes = {i.block_size for i in group}
        if len(sizes) == 1:  # the usual case, and asked on every request
            out[model] = size = sizes.pop()
            if standing is not None:
                standing.agreed(model, size)
            continue
        ballots = [Ballot(i.block_size, votes(i.role), fit(i), created(i.worker)) for i in group]
        out[model] = standing.decide(model, ballots) if standing is not None else model_value(ballots)
    return out
