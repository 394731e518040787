"""The decision framework: pick the decode worker, the prefill worker it would pair with, then ask
the configured policy and the decode guard whether to bypass the remote prefill.

Modes (RouterSettings.disagg):
- `never`: every request is aggregated: its decode worker prefills locally (`aggregated`).
- `always`: every request prefills remotely when the model has a prefill pool (`remote_prefill`).
- `conditional`: with `conditional_disagg` on, the policy decides per request (`bypass_*`,
  `declined_policy`, `vetoed_decode_busy`); with it off, this behaves as `always`, the seed's
  behaviour for a disaggregated deployment whose operator has not switched the policy on.
Without a prefill pool a request is aggregated whatever the mode (`no_prefill_pool`; `aggregated`
when disagg is `never`), and an `agg`-role worker always serves aggregated (`aggregated`).

A decode worker is paired only with prefill workers of its own engine kind (WorkerInfo.engine: a
transfer handle feeds no other), and with none whose KV pulls into it failed lately. With no prefill
worker of its kind it prefills itself (`no_prefill_pool`); with none whose pulls work, or none of
its kind left but those whose prefill legs fail (router.eligibility's `prefill_failing`), it is
bypassed, in `always` and `conditional` alike (`bypass_transfer_failing`, router.transfer_health),
unless the request's shape bypasses it already (`bypass_sequences` and the like).

With every prefill worker of its kind past the planner's room limit (router.planner) it prefills
itself too (`prefill_pool_full`, decided per engine). Where the policy decides, that local prefill
is a bypass like the policy's: the decode guard may veto it, and the best of the full prefill
workers prefills the request (`vetoed_decode_busy`).

`plan()` decides without side effects (it backs the dry run at /debug/route); `record()` counts an
outcome once a request is really routed. Settings swap atomically with `configure()`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from protocol.config import RouterSettings
from router.policies import (
    LOAD_POLICIES,
    SEED_POLICIES,
    Decision,
    DecodeGuard,
    DecodeRoom,
    Outcome,
    Path,
    Policy,
    PrefillRoom,
    make_policy,
)
from router.request_context import Candidate, RequestContext
from router.selection import Selector
from router.transfer_health import TransferHealth

__all__ = ["Disaggregator", "Learns", "RoutePlan"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RoutePlan:
    """Where a request goes and why. `decode_ranked`/`prefill_ranked` are the pools, best first
    (the first is the choice; the rest are retry candidates)."""

    ctx: RequestContext
    decode: Candidate
    prefill: Candidate | None
    path: Path
    outcome: Outcome
    reason: str
    decode_ranked: list[Candidate] = field(default_factory=list)
    prefill_ranked: list[Candidate] = field(default_factory=list)
    key: str = ""  # its booking in the ledger, once booked

    def explain(self) -> dict[str, Any]:
        return {
            "decode_worker": self.decode.worker,
            "prefill_worker": self.prefill.worker if self.prefill is not None and self.path is Path.REMOTE else None,
            "path": str(self.path),
            "outcome": str(self.outcome),
            "bypass": self.path is Path.BYPASS,
            "reason": self.reason,
            "decode_candidates": [c.explain() for c in self.decode_ranked],
            "prefill_candidates": [c.explain() for c in self.prefill_ranked],
        }


@runtime_checkable
class Learns(Protocol):
    """A policy that learns from the requests admitted (slo_aware: their mean lengths), once each.
    `max_model_len`: the chosen worker's, None when it does not say."""

    def admitted(self, ctx: RequestContext, max_model_len: int | None, /) -> None: ...


class Disaggregator:
    """Owns the current settings, policy and guard, and the outcome counts."""

    def __init__(
        self,
        settings: RouterSettings,
        selector: Selector | None = None,
        transfers: TransferHealth | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`timer` times the policy at DEBUG: the planner's clock, so a virtual-clock run reads no
        wall time even with DEBUG logging on."""
        self.selector = selector or Selector()
        self._timer = timer
        self.transfers = transfers or TransferHealth()
        # decode workers in the fleet whose overridden bypasses were said (forget: one that left)
        self._no_local_said: set[str] = set()
        # prefill workers the load rule cannot judge, said (forget: one that left)
        self._unjudged_said: set[str] = set()
        self.counts: Counter[Outcome] = Counter()
        self._unpaired: set[str] = set()  # models said to have no prefill worker while one was asked for
        self._install(settings, make_policy(settings.conditional, settings))

    def configure(self, settings: RouterSettings) -> None:
        """Swap in new (already validated) settings; a policy that cannot be built raises and
        leaves the old settings in place."""
        self._install(settings, make_policy(settings.conditional, settings))

    def _install(self, settings: RouterSettings, policy: Policy) -> None:
        self.guard = DecodeGuard.from_settings(settings.conditional)
        self.settings, self.policy = settings, policy
        # Asked per candidate and request: an isinstance against a runtime Protocol costs 5-13 us.
        self._room: DecodeRoom | None = policy if self.policy_decides and isinstance(policy, DecodeRoom) else None
        self._fits: PrefillRoom | None = policy if self.policy_decides and isinstance(policy, PrefillRoom) else None
        self._learns: Learns | None = policy if isinstance(policy, Learns) else None

    def forget(self, worker: str) -> None:
        """`worker` left the fleet: what is kept of it goes (one that comes back is said anew)."""
        self._no_local_said.discard(worker)
        self._unjudged_said.discard(worker)
        self.transfers.forget(worker)

    def record(self, outcome: Outcome) -> None:
        self.counts[outcome] += 1

    def chosen(self, plan: RoutePlan) -> None:
        """`plan` is really routed: its outcome counts, and a remote prefill over a pair past its
        cooldown is that pair's probe (router.transfer_health). Not in plan(): a dry run would
        take the probe."""
        self.record(plan.outcome)
        if plan.path is Path.REMOTE and self._unpaired:
            self._unpaired.discard(plan.ctx.model)  # it has one again: a later loss is said anew
        if plan.outcome is Outcome.REMOTE_NO_LOCAL_PREFILL and plan.decode.worker not in self._no_local_said:
            self._no_local_said.add(plan.decode.worker)
            log.info(
                "decode worker %s cannot prefill locally (its registration's local_prefill is false: an SGLang "
                "decode server): the bypasses planned for it prefill remotely instead (%s; said once per worker, "
                "counted as outcome remote_no_local_prefill)",
                plan.decode.worker,
                plan.reason,
            )
        if plan.path is Path.REMOTE and plan.prefill is not None and self.transfers.any:
            self.transfers.probing(plan.decode.worker, plan.prefill.worker)
        p = plan.prefill
        if (
            p is not None
            and not p.info.max_num_batched_tokens
            and p.worker not in self._unjudged_said
            and self.policy_decides
            and self.policy.name in LOAD_POLICIES
        ):
            # Else only /debug/route's per-request reason shows that the load rule never acts there.
            self._unjudged_said.add(p.worker)
            log.warning(
                "prefill worker %s registered no max_num_batched_tokens: policy %s's load rule cannot judge it "
                "busy, so no request is bypassed for its load; start its shim with --max-num-batched-tokens "
                "(the engine's value: vLLM does not export it). Said once per worker",
                p.worker,
                self.policy.name,
            )

    def admitted(self, plan: RoutePlan) -> None:
        """`plan`'s request was admitted (its first attempt booked): the policy learns from it and
        round robin moves on in each pool it took a worker from. Not in plan(): a waiter offered
        again, a retry and a dry run would count it again."""
        if self._learns is not None:
            self._learns.admitted(plan.ctx, plan.decode.info.max_model_len)
        self.selector.advance("spill" if plan.outcome is Outcome.SPILLED_TO_PREFILL else "decode")
        if plan.path is Path.REMOTE and plan.prefill is not None:
            self.selector.advance("prefill")

    def unpaired(self, plan: RoutePlan) -> None:
        """`plan`'s model has no prefill worker registered: where the settings ask for remote
        prefills (`asks_prefill`), a WARNING the first time, and again only after one of its
        requests was prefilled remotely. Its requests are counted as ever (`no_prefill_pool` on a
        decode worker, `aggregated` on an agg one), which was all that told an operator their
        `--disagg always` or `--conditional-disagg` did nothing."""
        model = plan.ctx.model
        if not self.asks_prefill or model in self._unpaired:
            return
        self._unpaired.add(model)
        s = self.settings
        asked = f"disagg={s.disagg}" + (" with conditional_disagg on" if self.policy_decides else "")
        log.warning(
            "model %s: %s asks for remote prefills, but no prefill worker of it is registered: its requests are "
            "prefilled where they decode (outcome %s in kvswitch_router_decisions_total) until one registers",
            model, asked, plan.outcome,
        )  # fmt: skip

    @property
    def asks_prefill(self) -> bool:
        """The settings ask for remote prefills: disagg=always, or the policy deciding. Not the
        default (disagg=conditional, the policy off), which prefills remotely where a model has
        prefill workers, and serves a fleet without any aggregated, as asked."""
        return self.settings.disagg == "always" or self.policy_decides

    @property
    def seed_decides(self) -> bool:
        """One of DESIGN.md's seed policies chooses the path, by its rule alone."""
        return self.policy_decides and self.policy.name in SEED_POLICIES

    @property
    def policy_decides(self) -> bool:
        """The policy chooses the path: disagg=conditional with conditional_disagg on."""
        s = self.settings
        return s.disagg == "conditional" and s.conditional.conditional_disagg

    def has_room(self, ctx: RequestContext, c: Candidate, *, local: bool) -> bool:
        """Whether `c` may decode the request now by the policy's own room rule
        (router.policies.DecodeRoom): a decode worker, or a prefill worker it would spill to. True
        where the policy has none or does not decide."""
        room = self._room
        if room is None or c.info.role == "agg":
            return True
        return room.has_room(ctx, c, local=local)

    def prefill_fits(self, ctx: RequestContext, c: Candidate) -> bool:
        """Whether prefill worker `c`, past the router's backlog bound, may still take the request's
        remote prefill by the policy's rule (router.policies.PrefillRoom). False where the policy
        has none or does not decide."""
        return self._fits is not None and self._fits.prefill_fits(ctx, c)

    @property
    def prefill_rule(self) -> str | None:
        """What a prefill worker past the backlog bound misses by the policy's PrefillRoom rule;
        None where no such rule is on."""
        return None if self._fits is None else self._fits.prefill_rule

    def spill(self, ctx: RequestContext, pool: list[Candidate]) -> RoutePlan | None:
        """The whole request on the best of `pool` (prefill workers with room, while no decode
        worker has any); None when the pool is empty."""
        ranked = self.selector.rank(ctx, pool, self.settings, "spill")
        if not ranked:
            return None
        ctx.decode, ctx.prefill = ranked[0], None
        reason = f"no decode worker has room; {ranked[0].worker} prefills and decodes it"
        return RoutePlan(ctx, ranked[0], None, Path.AGG, Outcome.SPILLED_TO_PREFILL, reason, ranked, [])

    def plan(
        self,
        ctx: RequestContext,
        exclude: frozenset[str] = frozenset(),
        prefill_full: Sequence[Candidate] = (),
        prefill_failing: Sequence[Candidate] = (),
    ) -> RoutePlan | None:
        """None when no decode/agg worker (outside `exclude`) can take the request. `prefill_full`: the
        prefill workers the planner left out of `ctx.prefill_pool` for room; `prefill_failing`: those
        it left out for failing their prefill legs (router.eligibility).

        A decode worker that cannot prefill locally (WorkerInfo.local_prefill false: an SGLang decode
        server waits for a prefill peer's KV) is planned no bypass: one the policy or a rule chose
        goes remote on the best prefill worker of its engine, even a full or failing one
        (`remote_no_local_prefill`); a request no transfer handle serves (n > 1, prompt logprobs,
        beam search), or with no prefill worker of its engine, goes to the next decode worker."""
        while True:
            plan = self._plan(ctx, exclude, prefill_full, prefill_failing)
            if plan is None or plan.path is Path.REMOTE or plan.decode.info.role != "decode":
                return plan
            if plan.decode.info.local_prefill:
                return plan
            remote = self._no_local_prefill(ctx, plan, exclude, prefill_full, prefill_failing)
            if remote is not None:
                return remote
            exclude = exclude | {plan.decode.worker}

    def _no_local_prefill(
        self,
        ctx: RequestContext,
        plan: RoutePlan,
        exclude: frozenset[str],
        prefill_full: Sequence[Candidate],
        prefill_failing: Sequence[Candidate],
    ) -> RoutePlan | None:
        """`plan`, a bypass on a decode worker that cannot prefill locally, made remote; None where
        no remote prefill can serve the request there."""
        d = plan.decode
        if ctx.shape.local_prefill_only:
            # No transfer handle serves it, whatever the bypass: `prefill_pool_full` is planned before
            # the shape is looked at (until 2026-12-08 it went remote here, on a full prefill worker)
            return None
        engine = d.info.engine
        pool = [
            c
            for c in (*ctx.prefill_pool, *prefill_full, *prefill_failing)
            if c.worker not in exclude and c.info.engine == engine
        ]
        ranked = self.selector.rank(ctx, pool, self.settings, "prefill")
        if not ranked:
            return None
        ctx.decode, ctx.prefill = d, ranked[0]
        p = ranked[0].worker
        reason = f"{d.worker} cannot prefill locally, so not {plan.outcome} ({plan.reason}): {p} prefills"
        return RoutePlan(
            ctx, d, ranked[0], Path.REMOTE, Outcome.REMOTE_NO_LOCAL_PREFILL, reason, plan.decode_ranked, ranked
        )

    def _plan(
        self,
        ctx: RequestContext,
        exclude: frozenset[str],
        prefill_full: Sequence[Candidate],
        prefill_failing: Sequence[Candidate],
    ) -> RoutePlan | None:
        s = self.settings
        decode_ranked = self.selector.rank(ctx, [c for c in ctx.decode_pool if c.worker not in exclude], s)
        if not decode_ranked:
            return None
        ctx.decode = d = decode_ranked[0]
        # A transfer handle feeds only an engine of the kind that made it (the decode shim refuses
        # any other with a 400): pair d with prefill workers of its own engine, or with none.
        engine = d.info.engine
        pool = [c for c in ctx.prefill_pool if c.worker not in exclude and c.info.engine == engine]
        busy = [] if pool else [c for c in prefill_full if c.worker not in exclude and c.info.engine == engine]
        prefill_ranked = self.selector.rank(ctx, pool, s, "prefill")
        ctx.prefill = p = prefill_ranked[0] if prefill_ranked else None

        def done(path: Path, outcome: Outcome, reason: str) -> RoutePlan:
            return RoutePlan(ctx, d, p, path, outcome, reason, decode_ranked, prefill_ranked)

        if d.info.role == "agg":
            return done(Path.AGG, Outcome.AGGREGATED, f"{d.worker} is an aggregated worker")
        if s.disagg == "never":
            return done(Path.AGG, Outcome.AGGREGATED, "disagg=never")
        veto: str | None = None
        if busy:
            # Every prefill worker of d's engine is past its room limit: d prefills, a bypass the
            # decode guard may veto where the policy decides; then the best of them prefills.
            veto = self.guard.veto(ctx) if self.policy_decides else None
            if veto is None:
                return done(Path.BYPASS, Outcome.PREFILL_POOL_FULL, self._full(engine))
            prefill_ranked = self.selector.rank(ctx, busy, s, "prefill")
            ctx.prefill = p = prefill_ranked[0]
        # d's engine has prefill workers, but every one left is failing its prefill legs
        failing = (
            [c.worker for c in prefill_failing if c.worker not in exclude and c.info.engine == engine]
            if p is None
            else []
        )
        if (
            p is None
            and not failing
            and (others := [*ctx.prefill_pool, *prefill_full, *prefill_failing])
            and all(c.info.engine != engine for c in others)
        ):
            return done(
                Path.AGG,
                Outcome.NO_PREFILL_POOL,
                f"no prefill worker for model {ctx.model} runs {engine}, as {d.worker} does: it prefills itself",
            )
        if p is None and not failing:
            return done(Path.AGG, Outcome.NO_PREFILL_POOL, f"no prefill worker for model {ctx.model}")
        if ctx.shape.sequences > 1:
            # A prefill leg's transfer handle names one sequence's blocks; an engine given it for a
            # batch or for n samples would load one prompt's KV for another (vLLM's P/D supports no
            # parallel sampling: vllm#38900).
            return done(
                Path.BYPASS,
                Outcome.BYPASS_SEQUENCES,
                f"{ctx.shape.sequences} sequences (a batch or n > 1): one transfer handle carries one sequence's KV",
            )
        if ctx.shape.prompt_logprobs:
            # Given transferred KV the decode engine skips the prompt's forward pass, so it has no
            # logits for it; vLLM crashes there (vllm#50792).
            return done(
                Path.BYPASS,
                Outcome.BYPASS_PROMPT_LOGPROBS,
                "prompt logprobs need the prompt's forward pass, which transferred KV skips",
            )
        if ctx.shape.beam_search:
            # vLLM 0.32's beam search builds its own sampling params, which carry no kv_transfer_params:
            # a prefill leg would return no handle, and the decode leg would load none.
            return done(
                Path.BYPASS,
                Outcome.BYPASS_BEAM_SEARCH,
                "beam search passes no transfer handle between the legs",
            )
        if p is None:
            # Its prefill workers are left out for failing their legs (router.eligibility): d
            # prefills, rather than each request paying a failed leg first; the guard has no say.
            return done(
                Path.BYPASS,
                Outcome.BYPASS_TRANSFER_FAILING,
                f"every {engine} prefill worker of model {ctx.model} left is failing its prefill legs "
                f"({', '.join(failing)}): {d.worker} prefills",
            )
        if self.transfers.any:
            # A pull that failed lately would fail again, its prefill thrown away and the prompt
            # prefilled on d anyway (router.transfer_health): pair d with a prefill worker whose
            # pulls into it work, or, whatever the mode or the policy, with none.
            open_to_d = [c for c in prefill_ranked if not self.transfers.failing(d.worker, c.worker)]
            if not open_to_d:
                return done(
                    Path.BYPASS,
                    Outcome.BYPASS_TRANSFER_FAILING,
                    f"{d.worker} failed to load KV from every prefill worker in the last "
                    f"{self.transfers.cooldown_s:.0f}s",
                )
            ctx.prefill = p = open_to_d[0]
        if not self.policy_decides:
            return done(Path.REMOTE, Outcome.REMOTE_PREFILL, f"disagg={s.disagg}, conditional_disagg off")
        if veto is not None:
            return done(Path.REMOTE, Outcome.VETOED_DECODE_BUSY, f"{self._full(engine)}; vetoed: {veto}")
        decision = self._decide(ctx)
        if not decision.bypass:
            return done(Path.REMOTE, decision.outcome, decision.reason)
        veto = self.guard.veto(ctx)
        if veto is not None:
            return done(Path.REMOTE, Outcome.VETOED_DECODE_BUSY, f"{decision.reason}; vetoed: {veto}")
        return done(Path.BYPASS, decision.outcome, decision.reason)

    def _decide(self, ctx: RequestContext) -> Decision:
        """The policy's answer; timed and logged at DEBUG."""
        if not log.isEnabledFor(logging.DEBUG):
            return self.policy.decide(ctx)
        start = self._timer()
        decision = self.policy.decide(ctx)
        log.debug(
            "policy %s: %s (%s) in %.1f us",
            self.policy.name,
            decision.outcome,
            decision.reason,
            (self._timer() - start) * 1e6,
            extra={"request_id": ctx.request_id},
        )
        return decision

    def _full(self, engine: str) -> str:
        """Why every prefill worker of `engine` is full: the planner's room limit (planner._has_room)."""
        s = self.settings
        qt = s.conditional.queue_threshold
        if qt is not None:
            limit = f"queue is over queue_threshold {qt} x max_num_batched_tokens"
        else:
            limit = f"predicted prefill backlog is past half the TTFT SLO ({s.slo_ttft_s / 2:g} s)"
            if self.prefill_rule is not None:
                limit += f", and {self.prefill_rule}"
        return f"every {engine} prefill worker's {limit}"
