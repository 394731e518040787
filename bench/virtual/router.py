"""One router replica on the virtual clock: the router's own planner (prefix index, pending prefixes,
load view, eligibility, selection, policy, decode guard, booking ledger) behind the live replica's
admission and dispatch rules, with the hops between the parts modelled as delays.

- KV ingest: each KvEventBatch is applied to this replica's BlockIndex and confirms or ends its
  pending prefixes, as router.service's ingest does (batches of one worker arrive in order, so
  there is never a gap to repair).
- Load: each LoadReport goes to the load view and eligibility (and the calibration when one is
  kept), then waiting requests are offered capacity, as router.service does.
- Replica sync: bookings go to this view at once and to every peer's `sync_s` later, under this
  replica's name (router.replica_sync's semantics, without its batching, and without its snapshots:
  nothing is lost on the virtual clock, so they would heal nothing).
- Admission (router.admission's rules): a request is planned at once when nobody waits and a
  worker has room; else it waits in FIFO order, offered capacity on every report and completion
  (the live quiet time after a failed offer scales with that plan's CPU, which takes no
  virtual time, so here it is zero);
  beyond the bound (the fleet's completion rate times half the TTFT SLO, at least 8, or
  `max_queue`) or after waiting half the TTFT SLO it is refused with 429.
- Dispatch (router.dispatch's rules): a remote plan runs a one-token prefill leg, then the decode
  leg with its kv_transfer_params; a prefill leg that has not finished within
  `prefill_timeout_s` is cancelled and the request falls back to a local prefill on its decode
  worker (`fallback_prefill_failed`, rebooked as a bypass). Bookings: prefill done at the first
  token (or the prefill leg's end), freed when the request ends. A leg its engine refuses ends
  the request with that refusal. router.dispatch asks the decode engine on the bypass path after
  a prefill engine's refusal, and passes on its answer; here the one refusal is a prompt at or
  over max_model_len (VirtualShim.leg), which the decode engine refuses too, as workers whose
  max_model_len is not their model's are routed to no request (router.eligibility,
  `context_conflict`), so the prefill engine's refusal stands for both. That decode leg, refused
  at once with no prefill, is not run: a refused request ends one leg's round trip sooner than
  live, and no engine's load differs.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.virtual.clock import VirtualClock
from bench.virtual.delays import Delays
from bench.virtual.shim import VirtualShim
from engine_sim.scheduler import StepOutput
from protocol import Cleared, KvEventBatch, LoadReport, Removed, Stored, WorkerInfo
from protocol.config import RouterSettings
from router.admission import Throughput
from router.block_index import BlockIndex
from router.calibration import Calibration
from router.disagg import RoutePlan
from router.load_view import LoadView
from router.planner import PlanError, Planner, standalone_planner
from router.policies import Outcome, Path
from router.request_context import RequestContext
from worker_shim.request_service import COALESCE_S

__all__ = ["MIN_QUEUE", "VirtualRequest", "VirtualRouter"]

MIN_QUEUE = 8  # router.admission.Admission's default min_queue


@dataclass(eq=False, slots=True)
class VirtualRequest:
    """One client request and what the client saw of it (virtual seconds)."""

    index: int
    tag: str
    due: float
    token_ids: list[int]  # emptied when the request ends
    output_len: int
    url: str = ""
    prompt_tokens: int = 0
    status: int = 0
    error: str | None = None
    first_at: float | None = None  # when the client got the first token
    last_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    ended_at: float | None = None
    decode_worker: str | None = None
    prefill: str | None = None
    outcome: str | None = None

    @property
    def request_id(self) -> str:
        return f"bench-{self.index}"


@dataclass(eq=False, slots=True)
class _Waiter:
    req: VirtualRequest
    ctx: RequestContext
    done: bool = False


@dataclass(eq=False, slots=True)
class _Job:
    req: VirtualRequest
    ctx: RequestContext
    plan: RoutePlan
    prefill_pending: bool = False
    chunks: list[float] = field(default_factory=list)  # when the decode shim sent each token chunk
    held: bool = False  # the last chunk waits for the shim's coalescing mark


class VirtualRouter:
    def __init__(
        self,
        name: str,
        clock: VirtualClock,
        settings: RouterSettings,
        workers: Sequence[WorkerInfo],
        shims: Mapping[str, VirtualShim],
        delays: Delays,
        *,
        rng: random.Random,
        calibration: Calibration | None = None,
        calibrate: bool = False,
        on_done: Callable[[VirtualRequest], None] = lambda req: None,
    ) -> None:
        """`calibration`: the timing the planner reads (None: the workers' profiles as they
        stand); `calibrate`: feed it every load report (else its starting factors stay)."""
        self.name = name
        self.clock = clock
        self.settings = settings
        self.shims = shims
        self.delays = delays
        self.on_done = on_done
        self.peers: list[VirtualRouter] = []
        self.index = BlockIndex()
        self.view = LoadView(clock=clock.time)
        self.calibration = calibration if calibrate else None
        infos = list(workers)
        self.infos = {i.worker: i for i in infos}
        self.planner: Planner = standalone_planner(
            settings,
            lambda: infos,
            index=self.index,
            view=self.view,
            sink=self,
            clock=clock.time,
            rng=rng,
            calibration=calibration,
            timer=clock.time,
        )
        self.throughput = Throughput(clock.time)
        self.waiters: deque[_Waiter] = deque()
        self.refused = 0
        self.timed_out = 0
        self.fallbacks = 0

    # --- BookingSink: this view now, the peers' after the sync delay -------------------------------

    def add(self, key: str, worker: str, tokens: int, blocks: int) -> None:
        self.view.book(key, worker, tokens, blocks)
        for peer in self.peers:
            self.clock.after(self.delays.sync_s, peer._peer_add, self.name, key, worker, tokens, blocks)

    def prefill_done(self, key: str, worker: str | None = None) -> None:
        self.view.prefill_done(key, worker=worker)
        for peer in self.peers:
            self.clock.after(self.delays.sync_s, peer._peer_prefill_done, self.name, key, worker)

    def free(self, key: str) -> None:
        self.view.free(key)
        for peer in self.peers:
            self.clock.after(self.delays.sync_s, peer._peer_free, self.name, key)

    def _peer_add(self, peer: str, key: str, worker: str, tokens: int, blocks: int) -> None:
        self.view.book(key, worker, tokens, blocks, router=peer)

    def _peer_prefill_done(self, peer: str, key: str, worker: str | None) -> None:
        self.view.prefill_done(key, router=peer, worker=worker)

    def _peer_free(self, peer: str, key: str) -> None:
        self.view.free(key, router=peer)

    # --- what the workers publish --------------------------------------------------------------------

    def on_kv_batch(self, batch: KvEventBatch) -> None:
        worker = batch.worker
        self.index.apply(worker, batch.events)
        pending = self.planner.pending
        for ev in batch.events:
            if isinstance(ev, Stored | Removed):
                pending.confirm(worker, ev.hashes)
            elif isinstance(ev, Cleared):
                pending.forget_worker(worker)

    def on_load(self, report: LoadReport) -> None:
        self.view.update(report)
        self.planner.eligibility.reported(report.worker)
        if self.calibration is not None:
            self.calibration.observe(self.infos.get(report.worker), report)
        self.notify()

    # --- admission ---------------------------------------------------------------------------------

    def receive(self, req: VirtualRequest) -> None:
        """The request reached this replica (`client_s` after it was sent)."""
        try:
            ctx = self.planner.context(req.request_id, self._model(), req.token_ids, req.output_len)
        except PlanError as exc:
            self._fail(req, exc.code, exc.message)
            return
        if not self.waiters:
            plan = self._take(req, ctx)
            if plan is not None:
                self._dispatch(req, ctx, plan)
                return
            if req.ended_at is not None:
                return
        if len(self.waiters) >= self._bound():
            self.refused += 1
            self.planner.finished(ctx)
            self._fail(req, 429, f"every worker is at capacity and {len(self.waiters)} requests are already waiting")
            return
        waiter = _Waiter(req, ctx)
        self.waiters.append(waiter)
        self.clock.after(self.settings.slo_ttft_s / 2, self._wait_over, waiter)

    def _model(self) -> str:
        return next(iter(self.infos.values())).model

    def _bound(self) -> int:
        if self.settings.max_queue is not None:
            return self.settings.max_queue
        return max(MIN_QUEUE, math.ceil(self.throughput.rate() * self.settings.slo_ttft_s / 2))

    def _take(self, req: VirtualRequest, ctx: RequestContext) -> RoutePlan | None:
        try:
            return self.planner.take(ctx)
        except PlanError as exc:
            self.planner.finished(ctx)
            self._fail(req, exc.code, exc.message)
            return None

    def _wait_over(self, waiter: _Waiter) -> None:
        if waiter.done:
            return
        waiter.done = True
        self.waiters.remove(waiter)
        self.timed_out += 1
        self.planner.finished(waiter.ctx)
        self._fail(waiter.req, 429, f"no worker had room within {self.settings.slo_ttft_s / 2:g}s")
        self.notify()

    def notify(self) -> None:
        """Capacity may have freed: grant plans to waiters in arrival order while they come."""
        waiters = self.waiters
        while waiters:
            head = waiters[0]
            plan = self._take(head.req, head.ctx)
            if plan is None and head.req.ended_at is None:
                return
            waiters.popleft()
            head.done = True
            if plan is not None:
                self._dispatch(head.req, head.ctx, plan)

    def _fail(self, req: VirtualRequest, status: int, error: str) -> None:
        req.status = status
        req.error = error
        self._end(req)

    def _end(self, req: VirtualRequest) -> None:
        req.ended_at = self.clock.now + self.delays.client_s
        req.token_ids = []
        self.on_done(req)

    # --- dispatch ----------------------------------------------------------------------------------

    def _dispatch(self, req: VirtualRequest, ctx: RequestContext, plan: RoutePlan) -> None:
        job = _Job(req, ctx, plan)
        req.decode_worker = plan.decode.worker
        req.prefill, req.outcome = str(plan.path), str(plan.outcome)
        if plan.path is Path.REMOTE and plan.prefill is not None:
            job.prefill_pending = True
            shim = self.shims[plan.prefill.worker]
            self.clock.after(
                self.delays.leg_s,
                shim.leg,
                req.request_id,
                ctx.token_ids,
                ctx.hashes,
                1,
                self._prefill_sink(job),
                self._refused(job),
                True,
            )
            self.clock.after(self.settings.prefill_timeout_s, self._prefill_timeout, job)
        else:
            self._decode_leg(job, None)

    def _prefill_sink(self, job: _Job) -> Callable[[StepOutput, float], None]:
        def on_output(out: StepOutput, at: float) -> None:
            if out.finish_reason is not None:
                self.clock.at(at + self.delays.token_s, self._prefill_finished, job, out.kv_transfer_params)

        return on_output

    def _prefill_finished(self, job: _Job, params: dict[str, Any] | None) -> None:
        if not job.prefill_pending:
            return  # timed out already: the request went the bypass way
        job.prefill_pending = False
        assert job.plan.prefill is not None
        worker = job.plan.prefill.worker
        if params is None:
            # As the live dispatcher reports each prefill leg to eligibility (router.dispatch
            # _prefill_fault): a worker that gives no transfer handle is left out for a cooldown.
            self.planner.eligibility.prefill_leg(worker, "its prefill legs return no transfer handle", True)
            self._fall_back(job)
            return
        self.planner.eligibility.prefill_leg(worker, None, True)
        # The prefill worker's part only, as router.dispatch: the decode worker's at its first token.
        self.planner.ledger.prefill_done(job.plan.key, job.plan.prefill.worker)
        self._decode_leg(job, params)

    def _prefill_timeout(self, job: _Job) -> None:
        if not job.prefill_pending:
            return
        job.prefill_pending = False
        plan = job.plan
        assert plan.prefill is not None
        timeout = self.settings.prefill_timeout_s
        self.planner.eligibility.prefill_leg(
            plan.prefill.worker, f"no prefill answer within prefill_timeout_s ({timeout:g}s)", False
        )
        self.clock.after(self.delays.leg_s, self.shims[plan.prefill.worker].cancel, job.req.request_id)
        self._fall_back(job)

    def _fall_back(self, job: _Job) -> None:
        self.fallbacks += 1
        self.planner.ledger.rebook_bypass(job.plan.key, job.plan)
        self.planner.record(Outcome.FALLBACK_PREFILL_FAILED)
        job.req.prefill, job.req.outcome = str(Path.BYPASS), str(Outcome.FALLBACK_PREFILL_FAILED)
        self._decode_leg(job, None)

    def _decode_leg(self, job: _Job, transfer: dict[str, Any] | None) -> None:
        shim = self.shims[job.plan.decode.worker]
        req = job.req
        self.clock.after(
            self.delays.leg_s,
            shim.leg,
            req.request_id,
            job.ctx.token_ids,
            job.ctx.hashes,
            req.output_len,
            self._decode_sink(job),
            self._refused(job),
            False,
            transfer,
        )

    def _refused(self, job: _Job) -> Callable[[int, str], None]:
        """The engine refused the prompt: no other worker would take it. A prefill engine's
        refusal is the client's answer here, where live router.dispatch asks the decode engine
        first: a prompt at or over max_model_len, the one refusal, is refused by every routed
        engine of the model (module docstring)."""

        def on_error(status: int, message: str) -> None:
            job.prefill_pending = False
            self.planner.ledger.free(job.plan.key)
            self.planner.finished(job.ctx)
            self._fail(job.req, status, message)
            self.notify()

        return on_error

    def _decode_sink(self, job: _Job) -> Callable[[StepOutput, float], None]:
        """Tokens as the decode shim sends them (worker_shim.request_service's coalescing: a token
        within COALESCE_S of the previous chunk waits for that mark and joins what else comes by
        then; the final chunk goes at once)."""
        req = job.req
        chunks = job.chunks

        def on_output(out: StepOutput, at: float) -> None:
            final = out.finish_reason is not None
            req.output_tokens += len(out.new_token_ids)
            if job.held and chunks[-1] >= at:
                if final:
                    chunks[-1] = at
            else:
                job.held = False
                if not chunks:
                    chunks.append(at)
                    self.clock.at(at + self.delays.token_s, self._first_token, job)
                elif final or at >= chunks[-1] + COALESCE_S:
                    chunks.append(at)
                else:
                    chunks.append(chunks[-1] + COALESCE_S)
                    job.held = True
            if final:
                self.clock.at(at + self.delays.token_s, self._finished, job)

        return on_output

    def _first_token(self, job: _Job) -> None:
        self.planner.ledger.prefill_done(job.plan.key)

    def _finished(self, job: _Job) -> None:
        req, chunks = job.req, job.chunks
        shift = self.delays.token_s + self.delays.client_s
        req.first_at = chunks[0] + shift
        req.last_at = chunks[-1] + shift
        req.gaps = [b - a for a, b in itertools.pairwise(chunks)]
        self.planner.ledger.free(job.plan.key, served=True)
        self.planner.finished(job.ctx)
        self.throughput.completed()
        job.req.status = 200
        self._end(job.req)
        self.notify()
