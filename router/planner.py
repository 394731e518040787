"""The request planner: synchronous, no I/O, with an injected clock.

A request goes through four steps, each reading only what the producers made:

1. context: the prompt's canonical block hashes, once per request (a waiter at admission or a
   retry never re-hashes);
2. candidates: the model's workers, filtered (router.eligibility: bootstrapping, repairing,
   events down, block size, silent, unreachable, unhealthy; for a text prompt, the tokenizer), each
   with its prefix overlap (the index and the pending prefixes) and load (the load view);
3. choice: selection ranks the decode and prefill pools by cost and the disaggregation framework
   (policy and decode guard) picks the path (router.disagg);
4. booking: the plan is booked in the ledger at once, so the next request sees it.

`take()` runs all four when some worker has room (admission: its predicted prefill backlog is
under half the TTFT SLO), or, with spill_to_prefill on, books the whole request on a prefill
worker with room, and returns None otherwise; `plan_again()` serves a retry that must avoid
the workers already tried. The HTTP service, the dispatcher and the virtual-clock replay all drive
this same object.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from protocol import BlockHasher, WorkerInfo, adapter_named, serving
from protocol.config import RouterSettings
from protocol.hashing import chain_salt, endpoint_key
from protocol.messages import ENGINE_UTILITY_ENDPOINTS
from router.calibration import Calibration
from router.disagg import Disaggregator, RoutePlan
from router.eligibility import Eligibility, Exclusion, WorkerStatus, name_few
from router.fingerprint_days import FingerprintDays
from router.fleet_lines import FleetLog
from router.ledger import BookingSink, Ledger, LocalSink
from router.load_view import LoadView
from router.pending_prefixes import PendingPrefixes
from router.policies import Outcome, Path
from router.request_context import Candidate, RequestContext, RequestShape
from router.selection import Selector, over_queue_threshold
from router.served_names import clash_message, served_as
from router.tokenization import shim_predates_probes, unprobed
from router.transfer_health import TransferHealth

# Workers a utility call (/tokenize) skips: their engine cannot answer now, or answered garbage lately.
_NO_UTILITY = frozenset(
    {
        Exclusion.SILENT,
        Exclusion.UNREACHABLE,
        Exclusion.MALFORMED,
        Exclusion.PREFILL_FAILING,
        Exclusion.ENGINE_UNHEALTHY,
    }
)
# What a request with no prefill worker of its model gets (router.disagg): said once where the
# settings ask for remote prefills (Disaggregator.unpaired).
_UNPAIRED = frozenset({Outcome.NO_PREFILL_POOL, Outcome.AGGREGATED})

__all__ = ["PlanError", "Planner", "PrefixIndex", "PrefixReach", "standalone_planner"]


class PrefixIndex(Protocol):
    def match(self, hashes: Sequence[int], /) -> Mapping[str, int]: ...
    def holds(self, worker: str, key: int, /) -> bool: ...


class PlanError(Exception):
    """No worker can take the request; `code` is the HTTP status to answer with. `transient`: what
    stops it may pass within seconds (a worker excluded for a while, one not registered yet), so a
    503 says Retry-After; not where only reconfiguring the fleet or the router ends it."""

    def __init__(self, code: int, message: str, *, transient: bool = True) -> None:
        self.code = code
        self.message = message
        self.transient = transient
        super().__init__(message)


@dataclasses.dataclass(slots=True)
class PrefixReach:
    """Prompt tokens of the requests this planner routed (first attempts), and how many of them
    were cached, as the index and pending prefixes saw it: on the decode candidate holding the
    longest prefix, on the best one with room, and on the one chosen. The differences say where a
    prefix hit rate goes: `held - with_room` to admission's room rule, `with_room - chosen` to the
    cost's trade of a hit against load."""

    prompt: int = 0
    held: int = 0
    with_room: int = 0
    chosen: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def summed(cls, reaches: Sequence[PrefixReach]) -> PrefixReach:
        """Several planners' counts added up (the replicas of one fleet)."""
        return cls(**{f.name: sum(getattr(r, f.name) for r in reaches) for f in dataclasses.fields(cls)})


class Planner:
    def __init__(
        self,
        settings: RouterSettings,
        *,
        workers: Callable[[], Sequence[WorkerInfo]],
        index: PrefixIndex,
        pending: PendingPrefixes,
        view: LoadView,
        eligibility: Eligibility,
        ledger: Ledger,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
        calibration: Calibration | None = None,
        timer: Callable[[], float] = time.perf_counter,
        fingerprints: FingerprintDays | None = None,
        fleet_log: FleetLog | None = None,
        unrouted: Callable[[str], Sequence[WorkerStatus]] = lambda model: (),
        caveat: str | None = None,
    ) -> None:
        """`calibration`: when given, candidates carry each worker's fitted timing (the owner feeds
        it every load report) and admission reads prefill rates from it. `timer` times the policy
        at DEBUG (a virtual-clock replay passes its own clock: it reads no wall time).
        `fingerprints`: the router's tokenizer's by day (router.fingerprint_days), for what a worker
        refused text is told: one advertising its fingerprint under the probes of before
        protocol.fingerprint.PROBES_SINCE, to upgrade its shim, not to change the router's tokenizer;
        one of a template that writes the date, that the date may be why. `fleet_log`: its router's, for the
        lines of the parts it makes (router.fleet_lines). `unrouted(name)`: the registered workers a
        request naming it would run on that `workers` leaves out (router.worker_registry: a
        max_model_len not their model's), which a 503 for want of a worker names with why.
        `caveat`: why no --tokenizer makes this router's ids the engines' (HfPromptTokenizer.caveat),
        told a refused client in place of that advice, as router.tokenization.FingerprintWatch tells it."""
        self.caveat = caveat
        self.disagg = Disaggregator(
            settings, Selector(rng or random.Random()), TransferHealth(clock=clock, fleet_log=fleet_log), timer=timer
        )
        self._workers = workers
        self._unrouted = unrouted
        self.index = index
        self.pending = pending
        self.view = view
        self.eligibility = eligibility
        self.ledger = ledger
        self.clock = clock
        self.calibration = calibration
        self.fingerprints = fingerprints
        self._hashers: dict[int, BlockHasher] = {}
        self._attempts: dict[str, int] = {}
        self.reach = PrefixReach()

    @property
    def settings(self) -> RouterSettings:
        return self.disagg.settings

    def configure(self, settings: RouterSettings) -> None:
        """Swap in validated settings; raises (keeping the old ones) if no policy can be built."""
        self.disagg.configure(settings)
        self.pending.ttl_s = settings.pending_ttl_s

    # --- 1. context ----------------------------------------------------------------------------

    def context(
        self,
        request_id: str,
        model: str,
        token_ids: list[int],
        max_tokens: int | None = 16,
        *,
        text: bool = False,
        shape: RequestShape = RequestShape(),
    ) -> RequestContext:
        workers = self._workers()  # a copy of every routed worker's record: taken once per request
        infos = self._serving(model, workers)
        if not infos:
            if left_out := [st.explain() for st in self._unrouted(model)]:
                raise PlanError(503, f"no worker of model {model} can take the request now: {_reasons(left_out)}")
            raise PlanError(503, f"no worker is registered for model {model}")
        base = infos[0].model
        # Voted over the model's whole fleet: an adapter's or an alias's workers are part of it, and
        # a vote of theirs would settle the model's size for every request (router.fleet_vote).
        fleet = infos if model == base else [i for i in workers if i.model == base]
        block_size = self.eligibility.block_sizes(fleet).get(base, infos[0].block_size)
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(block_size)
        # A LoRA adapter's blocks are its own (vLLM keys each by the adapter's name and path; the
        # shims withdraw an adapter's chains when its path changes, so the name is enough here), as
        # are a cache_salt's: a chain of its own, since salts are clients' values, as many as they like.
        salt = chain_salt(adapter_named(model, base, infos[0].aliases), shape.cache_salt or "")
        if salt:
            hasher = BlockHasher(block_size, salt)
        return RequestContext(
            request_id=request_id,
            model=model,
            token_ids=token_ids,
            block_size=block_size,
            hashes=hasher(token_ids),
            max_tokens=max_tokens,
            text=text,
            shape=shape,
        )

    # --- 2. candidates -------------------------------------------------------------------------

    def refresh(self, ctx: RequestContext, exclude: frozenset[str] = frozenset()) -> list[Candidate]:
        """Fill the context's pools with the workers that may take it now. Returns the prefill
        workers left out as `prefill_failing` (listed in `ctx.excluded` too): the plan's outcome
        names them, and those that still serve whole requests may take a spill."""
        infos = self._serving(ctx.model)
        # judged at the block size the prompt was hashed at: the request's vote, not a second one
        statuses = self.eligibility.statuses(infos, {infos[0].model: ctx.block_size} if infos else None)
        overlap = self.index.match(ctx.hashes) if ctx.hashes else {}
        pending = self.pending.match(ctx.hashes, after=overlap) if ctx.hashes else {}
        pools: dict[bool, list[Candidate]] = {True: [], False: []}  # prefill role?
        soft: dict[bool, list[tuple[Candidate, dict[str, Any]]]] = {True: [], False: []}
        excluded: list[dict[str, Any]] = []
        failing: list[Candidate] = []
        for info, status in zip(infos, statuses, strict=True):
            w = info.worker
            if w in exclude:
                excluded.append({**status.explain(), "routable": False, "excluded": "tried", "why": "tried already"})
                continue
            if ctx.text and not status.tokenizer_ok:
                excluded.append(
                    {**status.explain(), "routable": False, "excluded": "tokenizer", "why": self._tokenizer_why(info)}
                )
                continue
            failing_prefill = status.exclusion is Exclusion.PREFILL_FAILING and info.role == "prefill"
            if not status.routable and not status.soft and not failing_prefill:
                excluded.append(status.explain())
                continue
            indexed, routed = overlap.get(w, 0), pending.get(w, 0) if info.prefix_caching else 0
            if info.sliding_window:
                indexed, routed = self._window_end(ctx, w, indexed), self._window_end(ctx, w, routed, pending=True)
            c = Candidate.of(info, max(indexed, routed), self.view.load(w))
            c.pending_blocks = max(routed - indexed, 0)
            if self.calibration is not None:
                c.timing = self.calibration.timing(info)
            is_prefill = info.role == "prefill"
            if failing_prefill:
                excluded.append(status.explain())
                failing.append(c)
            elif status.routable:
                pools[is_prefill].append(c)
            else:
                soft[is_prefill].append((c, status.explain()))
        for is_prefill, held in soft.items():
            if pools[is_prefill]:
                excluded += [why for _, why in held]
            else:  # nothing better in this pool: the soft-excluded serve
                pools[is_prefill] = [c for c, _ in held]
        decode, prefill = pools[False], pools[True]
        ctx.decode_pool, ctx.prefill_pool, ctx.excluded = decode, prefill, excluded
        if not decode:
            raise self._no_decode_worker(ctx, infos)
        return failing

    def _serving(self, name: str, workers: Sequence[WorkerInfo] | None = None) -> list[WorkerInfo]:
        """The workers a request naming `name` runs on (protocol.serving); PlanError 503 while the
        name resolves to workers of several models, or of one model as itself and as a LoRA adapter
        (router.served_names), checked on every plan so a clash that appears while a request waits
        stops it too, and one that clears ends."""
        infos = serving(self._workers() if workers is None else workers, name)
        ways = served_as(name, infos)
        if len(ways) > 1:
            raise PlanError(503, clash_message(name, ways))
        return infos

    def _window_end(self, ctx: RequestContext, worker: str, held: int, *, pending: bool = False) -> int:
        """A hybrid model's worker reuses `held` leading blocks only up to a block where its
        sliding window is cached too, and never the prompt's last token (vLLM recomputes it):
        the deepest such end its shim published (worker_shim.window_endpoints), or, with
        `pending`, that a prompt routed there will leave (router.ledger)."""
        hashes = ctx.hashes
        for n in range(min(held, (ctx.isl - 1) // ctx.block_size), 0, -1):
            key = endpoint_key(hashes[n - 1])
            if self.index.holds(worker, key) or (pending and self.pending.holds(worker, key)):
                return n
        return 0

    def utility_workers(self, model: str, endpoint: str) -> list[WorkerInfo]:
        """The workers of `model` that can answer a utility call to `endpoint` (/tokenize) now: those
        whose engine serves the route (ENGINE_UTILITY_ENDPOINTS), whatever their role; what keeps a
        worker from routing prompts (its index not in sync, its KV events down) does not keep its
        engine from tokenizing; a silent, unreachable or unhealthy one can; one that sent a
        malformed reply is left out for its cooldown, as from routing. Decode and agg workers
        first, as prefill workers run long prompts. PlanError 404 when workers serve `model` and
        none of their engines serves the route: no wait ends that, and a call sent to one was a
        404 from its shim, a failure handed on or logged per call (until 2026-12-07). An engine
        not in the table (a newer shim's) is left out as one without the route, as every engine
        but vLLM is where the router judges by engine, and the 404 says the router does not know it."""
        infos = self._serving(model)
        able = [i for i in infos if endpoint in ENGINE_UTILITY_ENDPOINTS.get(i.engine, ())]
        if infos and not able:
            raise PlanError(404, _no_utility_route(model, endpoint, {i.engine for i in infos}), transient=False)
        # No block-size vote (`{}`): a utility call hashes no prompt, and `able`, part of the model's
        # fleet, would settle the model's size for every request (router.fleet_vote).
        statuses = self.eligibility.statuses(able, {})
        ok = [i for i, st in zip(able, statuses, strict=True) if st.exclusion not in _NO_UTILITY]
        return [i for i in ok if i.role != "prefill"] + [i for i in ok if i.role == "prefill"]

    def _stale_shim(self, info: WorkerInfo) -> bool:
        """Whether `info`'s shim advertises this router's tokenizer under the old probes."""
        return self.fingerprints is not None and self.fingerprints.is_legacy(info.tokenizer)

    def _tokenizer_why(self, info: WorkerInfo) -> str:
        if self._stale_shim(info):
            return shim_predates_probes([info.worker])
        if not info.tokenizer:
            return unprobed(info)
        mine, theirs = self.eligibility.tokenizer, info.tokenizer
        if mine is None:
            return f"text prompts need the served model's tokenizer (the worker's is {theirs}): give --tokenizer"
        need = self.caveat or (
            f"its text prompts need a router with its tokenizer (one router per tokenizer: --model {info.model} "
            "--tokenizer)"
        )
        return f"its tokenizer is {theirs}, the router's is {mine}{self._dated()}: {need}"

    def _dated(self) -> str:
        """Why a worker of the router's own tokenizer may differ: its template writes the date."""
        note = self.fingerprints.note() if self.fingerprints is not None else ""
        return f" ({note}; else)" if note else ""

    def text_refusal(self, model: str, infos: Iterable[WorkerInfo]) -> str:
        """Why no decode or agg worker of `model` (`infos`) takes a text prompt from this router, and
        what does: a router tokenizes with one tokenizer, so waiting ends nothing, and giving it
        this model's would refuse the models it tokenizes for now."""
        group = list(infos)
        stale = [i.worker for i in group if self._stale_shim(i)]
        if stale and len(stale) == len(group):  # the tokenizer may well be the same: the shims are old
            return f"no decode or agg worker of model {model} takes text prompts: {shim_predates_probes(stale)}"
        also = f" Of them, {shim_predates_probes(stale)}" if stale else ""
        theirs = sorted({i.tokenizer or "unknown (its shim could not read the engine's)" for i in group})
        if not any(i.tokenizer for i in group):  # no router's tokenizer matches one never read
            return (
                f"no decode or agg worker of model {model} takes text prompts: their shims could not read "
                "the engine's tokenizer (SGLang and TensorRT-LLM do not say it; a vLLM probe that failed, which "
                "each shim tries again: its log says why), so no router tokenizes for them: send token ids (a "
                "completion's `prompt` as a list of ids)"
            )
        own = (
            f"{self.caveat}. Send"
            if self.caveat
            else f"A router tokenizes with one tokenizer: send {model}'s text requests to a router of its own "
            f"(`kvswitch router --model {model} --tokenizer` naming {model}'s tokenizer), or send"
        )
        return (
            f"no decode or agg worker of model {model} takes text prompts from this router: it tokenizes "
            f"with {self.eligibility.tokenizer or 'no tokenizer'}, model {model}'s workers with "
            f"{', '.join(theirs)}{self._dated()}. {own} token ids (a completion's `prompt` as a list of ids) to "
            f"this one.{also}"
        )

    def text_refusals(self, model: str | None = None) -> list[str]:
        """`text_refusal` for each model (with `model`, the one it names) that has decode or agg
        workers and none of them takes text prompts from this router (/ready's warnings)."""
        infos = self._workers() if model is None else serving(self._workers(), model)
        by_model: dict[str, list[WorkerInfo]] = {}
        for info in infos:
            if info.role != "prefill":
                by_model.setdefault(info.model, []).append(info)
        return [
            self.text_refusal(m, group)
            for m, group in sorted(by_model.items())
            if not any(self.eligibility.takes_text(i) for i in group)
        ]

    def _no_decode_worker(self, ctx: RequestContext, infos: Sequence[WorkerInfo]) -> PlanError:
        # The registry's unrouted workers are registered too: "none is registered" would be false
        # and hide the fix (a max_model_len not the model's, until 2026-12-07).
        unrouted = [st.explain() for st in self._unrouted(ctx.model) if st.role != "prefill"]
        left_out = [e for e in ctx.excluded if e["role"] != "prefill"] + unrouted
        if not left_out:
            return PlanError(503, f"no decode or agg worker is registered for model {ctx.model}")
        if all(e["excluded"] == "tokenizer" for e in left_out):  # no retry takes it
            decode = [i for i in infos if i.role != "prefill"]
            return PlanError(503, self.text_refusal(decode[0].model, decode), transient=False)
        return PlanError(
            503, f"no decode or agg worker of model {ctx.model} can take the request now: {_reasons(left_out)}"
        )

    # --- admission ------------------------------------------------------------------------------

    def admissible(self, ctx: RequestContext) -> bool:
        """Some decode (or agg) worker has room: its predicted prefill backlog is under half the TTFT
        SLO (with `queue_threshold` set, its queue under that multiple of max_num_batched_tokens).
        Where the policy has a room rule of its own (slo_aware: TPOT), it must agree too. Every
        request needs a decode worker; prefill workers without room only change the path."""
        return any(self._decode_room(ctx, c) for c in ctx.decode_pool)

    def _keep_room(self, ctx: RequestContext, *, record: bool = False) -> list[Candidate]:
        """Narrow both pools to the workers with room, so the choice never lands on a full one, and
        return the prefill workers left out (router.disagg: with every one of its engine full, a
        decode worker prefills the request, one the policy lets prefill it when the policy judges
        room). `record`: add each worker left out to `ctx.excluded` with why (/debug/route; the
        request path skips the formatting)."""
        decode: list[Candidate] = []
        prefill: list[Candidate] = []
        no_room: list[Candidate] = []
        prefill_full: list[Candidate] = []
        for c in ctx.decode_pool:
            (decode if self._decode_room(ctx, c) else no_room).append(c)
        for c in ctx.prefill_pool:
            (prefill if self._prefill_room(ctx, c) else prefill_full).append(c)
        if record:
            ctx.excluded += [self._no_room(ctx, c) for c in (*no_room, *prefill_full)]
        local_only = ctx.shape.local_prefill_only and bool(ctx.prefill_pool)  # prefilled locally (router.disagg)
        full_engines = {c.info.engine for c in prefill_full} - {c.info.engine for c in prefill}
        if full_engines or local_only:
            local = [
                c
                for c in decode
                if not (local_only or c.info.engine in full_engines) or self.disagg.has_room(ctx, c, local=True)
            ]
            if record and len(local) < len(decode):
                cause = (
                    "no transfer handle can serve the request"
                    if local_only
                    else "every prefill worker of its engine is full"
                )
                why = f"{cause} and the {self.disagg.policy.name} policy's room rule refuses a local prefill here"
                kept = {id(c) for c in local}
                ctx.excluded += [{**c.explain(), "excluded": "room", "why": why} for c in decode if id(c) not in kept]
            decode = local
        ctx.decode_pool, ctx.prefill_pool = decode, prefill
        return prefill_full

    def _no_room(self, ctx: RequestContext, c: Candidate) -> dict[str, Any]:
        s = self.settings
        qt = s.conditional.queue_threshold
        backlog = self._backlog_s(c)
        if qt is not None and over_queue_threshold(c, qt):
            why = (
                f"queued prefill {c.queued_prefill_tokens} tokens over queue_threshold {qt} x "
                f"max_num_batched_tokens {c.info.max_num_batched_tokens}"
            )
        elif qt is None and backlog is not None and backlog > s.slo_ttft_s / 2:
            why = f"predicted prefill backlog {backlog:.2f} s over half the TTFT SLO ({s.slo_ttft_s / 2:g} s)"
            rule = self.disagg.prefill_rule if c.info.role == "prefill" else None
            if rule is not None:
                why += f", and {rule}"
        else:
            why = f"the {self.disagg.policy.name} policy's room rule: its running requests would miss their TPOT budget"
        return {**c.explain(), "excluded": "room", "why": why}

    def _decode_room(self, ctx: RequestContext, c: Candidate) -> bool:
        """Its predicted prefill backlog fits, and the policy's own room rule lets it decode one more."""
        return self._has_room(c) and self.disagg.has_room(ctx, c, local=False)

    def _prefill_room(self, ctx: RequestContext, c: Candidate) -> bool:
        """Room for a remote prefill: under the backlog bound, or past it where the policy predicts
        this request's answer in time (router.policies.PrefillRoom: slo_aware's slo_prefill_fit).
        Where the policy decides, queue_threshold leaves a prefill worker in the pool, as the seed
        does (selection ranks it last): the policy judges the one it would pick (prefill_load calls
        it busy by the same threshold when it inherits it), then the decode guard. Pre-empting them
        here would count its bypass as `prefill_pool_full`, take a worker under a larger
        prefill_busy_threshold off the remote path, and skip the guard. A seed policy (DESIGN.md:
        bypass iff its rule says so) is never pre-empted: the backlog limit too would have bypassed
        long uncached prompts isl_bounding sends remote, and capped prefill_load's threshold at half
        the TTFT SLO."""
        if self.disagg.seed_decides:
            return True
        if self.settings.conditional.queue_threshold is not None and self.disagg.policy_decides:
            return True
        return self._has_room(c) or self.disagg.prefill_fits(ctx, c)

    def _backlog_s(self, c: Candidate) -> float | None:
        """Seconds of prefill queued on `c` at its full-batch rate; None when its rate is unknown."""
        rate = c.prefill_rate()
        return None if rate is None else c.queued_prefill_tokens / rate

    def _has_room(self, c: Candidate) -> bool:
        s = self.settings
        qt = s.conditional.queue_threshold
        if qt is not None:
            return not over_queue_threshold(c, qt)
        backlog = self._backlog_s(c)
        return backlog is None or backlog <= s.slo_ttft_s / 2

    # --- 3 and 4: choose and book -------------------------------------------------------------------

    def take(self, ctx: RequestContext) -> RoutePlan | None:
        """The booked plan for the request's first attempt, or None while no worker has room."""
        failing = self.refresh(ctx)
        held = _longest(ctx)
        if not self.admissible(ctx):
            plan = self._spill_plan(ctx, failing)
            if plan is None:
                return None
            # past its `engine_failing` cooldown, this spill is the trial of its worker's engine
            self.eligibility.engine_probe(plan.decode.worker, self.settings.prefill_timeout_s)
            self.disagg.record(plan.outcome)
            self._reached(ctx, held, ctx.cached_tokens(plan.decode), plan)
        else:
            pools = ctx.decode_pool, ctx.prefill_pool  # references: _keep_room puts new lists on ctx
            prefill_full = self._keep_room(ctx)
            if not ctx.decode_pool:
                return None  # room to decode, but no decode worker the policy lets prefill it
            plan = self._choose(ctx, prefill_full, failing, before_room=pools)
            self._reached(ctx, held, _longest(ctx), plan)
        self.disagg.admitted(plan)
        return self._book(ctx, plan)

    def _reached(self, ctx: RequestContext, held: int, with_room: int, plan: RoutePlan) -> None:
        r = self.reach
        r.prompt += ctx.isl
        r.held += held
        r.with_room += with_room
        r.chosen += ctx.cached_tokens(plan.decode)

    def _spill_plan(self, ctx: RequestContext, failing: Sequence[Candidate] = ()) -> RoutePlan | None:
        """With spill_to_prefill on and no decode worker with room: a prefill worker with room
        (backlog, and the policy's room rule counting its own prefill of the prompt) serves the
        whole request, rather than it waiting while prefill capacity idles. Of the `failing` ones
        (`prefill_failing`), those whose legs only gave no transfer handle serve it too: a whole
        request needs none, where a hung or failing engine would fail it. Not one whose
        `engine_failing` episode leaves it out, though soft and its pool's last (a spill can wait for
        decode room): past the cooldown, one spill is its trial."""
        if not self.settings.conditional.spill_to_prefill:
            return None
        el = self.eligibility
        pool = [
            *(c for c in ctx.prefill_pool if not el.engine_out(c.worker)),
            *(c for c in failing if el.serves_whole(c.worker)),
        ]
        room = [c for c in pool if self._has_room(c) and self.disagg.has_room(ctx, c, local=True)]
        return self.disagg.spill(ctx, room)

    def plan_again(self, ctx: RequestContext, exclude: frozenset[str]) -> RoutePlan | None:
        """A booked plan avoiding `exclude` (workers already tried), or None when none is left."""
        try:
            failing = self.refresh(ctx, exclude)
            plan = self._choose(ctx, prefill_failing=failing)
        except PlanError:
            return None
        return self._book(ctx, plan)

    def _choose(
        self,
        ctx: RequestContext,
        prefill_full: Sequence[Candidate] = (),
        prefill_failing: Sequence[Candidate] = (),
        *,
        before_room: tuple[Sequence[Candidate], Sequence[Candidate]] = ((), ()),
    ) -> RoutePlan:
        """`before_room`: both pools before `_keep_room` narrowed them; the 503 says whether a
        decode worker it left out for room would serve the request."""
        plan = self.disagg.plan(ctx, prefill_full=prefill_full, prefill_failing=prefill_failing)
        if plan is None:
            raise _no_remote_prefill(ctx, before_room[0], (*before_room[1], *prefill_failing))
        self.disagg.chosen(plan)
        if (
            plan.outcome in _UNPAIRED
            and self.disagg.asks_prefill  # else unpaired() says nothing: no scan of the exclusions per request
            and not (ctx.prefill_pool or prefill_full or prefill_failing)
            and not any(e.get("role") == "prefill" for e in ctx.excluded)  # none registered at all
        ):
            self.disagg.unpaired(plan)
        if plan.path is Path.REMOTE and plan.prefill is not None:
            # past a cooldown, this request probes a prefill worker whose legs failed (router.eligibility)
            self.eligibility.prefill_probe(plan.prefill.worker, self.settings.prefill_timeout_s)
        # ... and its decode worker, one whose engine failed its requests: for as long as a prefill may take
        self.eligibility.engine_probe(plan.decode.worker, self.settings.prefill_timeout_s)
        return plan

    def _book(self, ctx: RequestContext, plan: RoutePlan) -> RoutePlan:
        attempt = self._attempts.get(ctx.request_id, 0) + 1
        self._attempts[ctx.request_id] = attempt
        plan.key = f"{ctx.request_id}#{attempt}"
        self.ledger.book(plan.key, plan)
        return plan

    def finished(self, ctx: RequestContext) -> None:
        """The request is over: forget its attempt count (its bookings are freed by their owner)."""
        self._attempts.pop(ctx.request_id, None)

    def record(self, outcome: Outcome) -> None:
        self.disagg.record(outcome)

    # --- explain -------------------------------------------------------------------------------------

    def explain(self, ctx: RequestContext) -> dict[str, Any]:
        """/debug/route: the decision the request would get now; books and counts nothing."""
        failing = self.refresh(ctx)
        admissible = self.admissible(ctx)
        plan = None
        if admissible:
            decode, prefill = ctx.decode_pool, [*ctx.prefill_pool, *failing]
            prefill_full = self._keep_room(ctx, record=True)
            if ctx.decode_pool:
                plan = self.disagg.plan(ctx, prefill_full=prefill_full, prefill_failing=failing)
                if plan is None:  # take() is refused here, not left to wait
                    raise _no_remote_prefill(ctx, decode, prefill)
            if plan is not None:
                # Where the decode guard vetoes a full pool's local prefill, the plan ranks those
                # full workers after all (router.disagg): a candidate was not left out for room.
                ranked = {c.worker for c in plan.prefill_ranked}
                ctx.excluded = [e for e in ctx.excluded if e["excluded"] != "room" or e["worker"] not in ranked]
        else:
            plan = self._spill_plan(ctx, failing)
        waits = plan is None
        if plan is None:  # it would wait at admission: show the choice over every candidate (or none)
            excluded = ctx.excluded  # with the room exclusions recorded above
            failing = self.refresh(ctx)
            ctx.excluded = excluded
            plan = self.disagg.plan(ctx, prefill_failing=failing)
        return {
            "model": ctx.model,
            "isl": ctx.isl,
            "block_size": ctx.block_size,
            "prompt_blocks": len(ctx.hashes),
            "settings": msgspec.to_builtins(self.settings),
            "policy": self.disagg.policy.name,
            "admissible": admissible,
            "waits": waits,
            **(plan.explain() if plan is not None else _no_plan()),
            "excluded": ctx.excluded,
        }


def standalone_planner(
    settings: RouterSettings,
    workers: Callable[[], Sequence[WorkerInfo]],
    *,
    index: PrefixIndex,
    view: LoadView,
    sink: BookingSink | None = None,
    clock: Callable[[], float] = time.time,
    rng: random.Random | None = None,
    sync_state: Callable[[str], tuple[str, str] | None] = lambda worker: None,
    tokenizer: str | None = None,
    calibration: Calibration | None = None,
    timer: Callable[[], float] = time.perf_counter,
    legacy_tokenizer: str | None = None,
    unrouted: Callable[[str], Sequence[WorkerStatus]] = lambda model: (),
) -> Planner:
    """A planner with its own pending prefixes, eligibility and ledger, for callers without a
    replica around it (benchmarks, the virtual-clock replay, tests). By default every worker is
    taken as synced and bookings go to `view` alone."""
    pending = PendingPrefixes(settings.pending_ttl_s, clock)
    eligibility = Eligibility(clock=clock, sync_state=sync_state, liveness=view.liveness, tokenizer=tokenizer)
    for info in workers():
        eligibility.added(info.worker)
    return Planner(
        settings,
        workers=workers,
        index=index,
        pending=pending,
        view=view,
        eligibility=eligibility,
        ledger=Ledger(sink or LocalSink(view), pending),
        rng=rng,
        clock=clock,
        calibration=calibration,
        timer=timer,
        fingerprints=FingerprintDays.fixed(tokenizer, legacy_tokenizer) if tokenizer is not None else None,
        unrouted=unrouted,
    )


def _no_plan() -> dict[str, Any]:
    """explain()'s plan fields where the request would wait and no candidate is planned it: take()
    leaves it to wait all the same (a worker left out for now, or a prefill worker with room to take
    a spill, may serve it), so /debug/route says it waits rather than answer a 503 it does not get."""
    return {
        "decode_worker": None,
        "prefill_worker": None,
        "path": None,
        "outcome": None,
        "bypass": None,
        "reason": (
            "no candidate would be planned the request now (none prefills locally and no prefill worker of its "
            "engine serves it); it waits at admission for room or for a worker that serves it"
        ),
        "decode_candidates": [],
        "prefill_candidates": [],
    }


def _longest(ctx: RequestContext) -> int:
    """Prompt tokens cached (or pending) on the decode candidate that holds the most of them."""
    return max(map(ctx.cached_tokens, ctx.decode_pool), default=0)


def _no_remote_prefill(
    ctx: RequestContext, decode: Sequence[Candidate] = (), prefill: Sequence[Candidate] = ()
) -> PlanError:
    """refresh() left decode candidates, but router.disagg plans none of them: none prefills a
    bypass (WorkerInfo.local_prefill false) and no prefill worker of its engine serves the request
    (none left, or one no transfer handle serves: n > 1, prompt logprobs). A prefill worker back or
    a decode worker that prefills may come within seconds: transient. `decode` and `prefill`: the
    pools before Planner._keep_room; where it set aside a decode worker that would serve the request,
    those are full, which the message says (until 2026-12-08 it said none could serve it). The
    request is refused rather than left to wait: at the head of its model's line it would hold up
    every request behind it that a worker with room serves."""
    kept = {id(c) for c in ctx.decode_pool}
    engines = {c.info.engine for c in prefill}  # the pool before _keep_room and the failing
    if any(
        c.info.role == "agg" or c.info.local_prefill or (not ctx.shape.local_prefill_only and c.info.engine in engines)
        for c in decode
        if id(c) not in kept
    ):
        why = (
            "the decode workers that could serve it are full (those with room cannot prefill locally and no "
            "prefill worker of their engine can serve it); it may be retried"
        )
    else:
        why = "its decode workers cannot prefill locally and no prefill worker of their engine can serve it"
    return PlanError(503, f"no worker of model {ctx.model} can take the request now: {why}")


def _reasons(left_out: Sequence[Mapping[str, Any]]) -> str:
    """Why each worker in `left_out` (WorkerStatus.explain()s) takes no request, for a 503: the first
    NAMED_AT_MOST named with theirs, the rest counted by reason."""
    named, rest = name_few(left_out)
    reasons = "; ".join(f"{e['worker']}: {e['excluded']} ({e['why']})" for e in named)
    if rest:
        by_reason = sorted(Counter(str(e["excluded"]) for e in rest).items())
        reasons += f"; and {len(rest)} more ({', '.join(f'{k}: {n}' for k, n in by_reason)})"
    return reasons


def _no_utility_route(model: str, endpoint: str, engines: set[str]) -> str:
    """Why no worker of `model`, of `engines`, is sent a utility call to `endpoint`: engines this
    router knows serve no such route; one it does not know (a newer shim's) it cannot say of."""
    known = sorted(e for e in engines if e in ENGINE_UTILITY_ENDPOINTS)
    unknown = sorted(engines - set(known))
    why = [f"its engines ({', '.join(known)}) have no such route"] if known else []
    if unknown:
        names = ", ".join(unknown)
        newer = "shims newer than the router" if len(unknown) > 1 else "a shim newer than the router"
        engine = "engines" if len(unknown) > 1 else "engine"
        why.append(f"this router knows no utility routes for {engine} {names} ({newer}?)")
    serve = " or ".join(sorted(e for e, routes in ENGINE_UTILITY_ENDPOINTS.items() if endpoint in routes))
    where = f"send it for a model that {serve} engines serve" if serve else "no engine's shim forwards it"
    return f"no worker of model {model} serves /{endpoint}: {', and '.join(why)}; {where}"
