"""A request's way through one replica, from token ids to the engine's chunks.

    tokens -> Planner.context (hash once) -> Admission.admit (Planner.take: candidates, choice,
    booking; or wait in line) -> Dispatcher.run (legs over NATS, retries, fallback) -> chunks

The HTTP front door (router.http_api) parses and formats around it and knows nothing else of the
replica; the parts it drives are given, not looked up, so each can be tested alone.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from opentelemetry.trace import Span

from protocol import GenerateRequest, WorkerInfo, subjects
from protocol.messages import ANNOTATION_BYPASS, ResponseChunk
from router.admission import Admission
from router.disagg import RoutePlan
from router.dispatch import Dispatcher, Job
from router.leg import NATS_LOST_WHY, LegError, time_up
from router.leg_failures import LegFailures
from router.metrics import RouterMetrics
from router.planner import PlanError, Planner
from router.request_context import RequestContext, RequestShape
from router.tracing import RequestTracer
from router.worker_registry import Departed, engines_serving

__all__ = ["NO_WORKER_RETRY_S", "RECENT_S", "RequestPath", "Unknown", "refused_records", "starting"]

log = logging.getLogger(__name__)


# The router's --model, or a name no worker serves now because its workers left within RECENT_S
# (a crash, a hung engine, a rolling restart) or a request resolved it here within RECENT_S and no
# worker serves its model now, is a 503, not a 404. The departures are the registry's, which every
# replica sees: a replica that served no request for the name answers as the one that did (until
# 2026-12-07 it answered 404). A router started after they left never saw them: a 404. (A LoRA
# adapter unloaded from workers still serving its model is a 404, as vLLM answers it.)
RECENT_S = 600.0
_RECENT_MAX = 256  # names remembered; the oldest goes first
NO_WORKER_RETRY_S = 5  # Retry-After: a shim that restarts registers again within seconds


def starting(waiting: str) -> str:
    """What a request is told while the router starts (router.start_door, then RequestPath until
    it has read its workers), `waiting` for what ("" for nothing in particular)."""
    return f"the router is starting: {waiting}" if waiting else "the router is starting"


class Unknown(LookupError):
    """The request names a model this router does not serve (`code` 400 or 404), or one no worker
    serves right now (503, with `retry_after_s`)."""

    def __init__(self, code: int, message: str, retry_after_s: int | None = None) -> None:
        self.code = code
        self.retry_after_s = retry_after_s
        super().__init__(message)


@dataclass
class RequestPath:
    planner: Planner
    admission: Admission
    dispatcher: Dispatcher
    metrics: RouterMetrics
    tracer: RequestTracer
    models: Callable[[], Sequence[str]]
    max_model_len: Callable[[str], int | None] = lambda _model: None
    adapters: Callable[[], Mapping[str, str]] = dict  # LoRA adapter -> its base model
    aliases: Callable[[], Mapping[str, str]] = dict  # another name a model is served under -> the model
    # names that resolve to several models (router.served_names): not listed, and refused when planned
    clashes: Callable[[], Mapping[str, Mapping[str, Sequence[str]]]] = dict
    default_model: str | None = None
    workers: Callable[[], Sequence[WorkerInfo]] = tuple  # the routed ones (WorkerRegistry.workers)
    # the engines of the workers serving a name (None: the fleet), WorkerRegistry.engines; None:
    # read from `workers` on every call
    engines: Callable[[str | None], frozenset[str]] | None = None
    ns: str = subjects.DEFAULT_NAMESPACE  # where the workers register: named when none has
    # worker records refused in etcd (key, why), of a model (None: all): named when they explain a 404
    refused: Callable[[str | None], Sequence[tuple[str, str]]] = lambda _model: ()
    # the names (model, alias, adapter) workers left with, each with when and their model
    # (WorkerRegistry.departed)
    departed: Callable[[], Mapping[str, Departed]] = dict
    request_timeout_s: float = 600.0
    # what the router still waits for before it can tell which names its workers serve ("" once it
    # can): the first read of the workers from etcd
    waiting: Callable[[], str] = lambda: ""
    inflight: int = 0  # requests admitted whose answers are not written yet (serving)
    calls: int = 0  # utility calls so far: the next one starts at the next worker
    clock: Callable[[], float] = time.monotonic
    # names requests resolved, with when and their model (oldest first); whether any request found a worker
    _recent: dict[str, tuple[float, str]] = field(default_factory=dict, init=False, repr=False)
    seen_workers: bool = field(default=False, init=False, repr=False)
    _handed_on: LegFailures = field(init=False, repr=False)  # utility calls a worker failed, tried on another

    def __post_init__(self) -> None:
        self._handed_on = self.dispatcher.leg_failures(log, utility=True)

    def resolve_model(self, model: str | None) -> str:
        """The model, one of its other names, or a LoRA adapter, a request names. One that names
        none gets the router's --model, else the one model registered, as vLLM serves it with its
        own; with several it is a 400 naming them. The --model, or a name whose workers left within
        RECENT_S (or that a request resolved here within it, whose model no worker serves now), is
        a 503 with Retry-After: its workers may be back. Before the first read of the workers, a 503
        saying so, as the start door says it: none read is no namespace mistake, nor a name none
        serves."""
        if waiting := self.waiting():
            raise Unknown(503, f"{starting(waiting)}: send the request again", retry_after_s=1)
        name = model or self.default_model
        if name is None:
            models = list(self.models())
            if not models and self.gone_lately():
                raise self._no_worker(None)
            if len(models) != 1:
                served = ", ".join(models) or self._none_registered(None)
                raise Unknown(400, f"'model' is required: this router serves {served}")
            name = models[0]
        base = name if name in self.models() else self.aliases().get(name) or self.adapters().get(name)
        if base is None and (name == self.default_model or self._model_gone(name)):
            raise self._no_worker(name)
        if self.default_model is not None and self.default_model not in (name, base):
            raise Unknown(
                404,
                f"The model `{name}` does not exist. This router serves `{self.default_model}`"
                + _and_adapters(self.default_model, self.adapters()),
            )
        if base is None:
            names = ", ".join([*self.models(), *self.aliases(), *self.adapters()])
            served = names or self._none_registered(name)
            refused = self.refused(name) if names else ()
            raise Unknown(
                404,
                f"The model `{name}` does not exist. Registered: {served}"
                + (f"; {refused_records(self.ns, refused)}" if refused else ""),
            )
        self.seen_workers = True
        self._recent.pop(name, None)  # to the end: the newest
        self._recent[name] = (self.clock(), base)
        if len(self._recent) > _RECENT_MAX:
            del self._recent[next(iter(self._recent))]
        return name

    def vllm_only(self, name: Any) -> bool:
        """Whether every worker a request naming `name` (its body's `model`, as sent) may run on is
        a vLLM engine, so that the router may refuse what vLLM's model validators refuse
        (request_parsing.parse_request): the workers serving that name (or the --model), else, for
        no name or one none serves, the whole fleet. True with no worker: it answers as vLLM. False
        where resolve_model answers 503 (the workers not read yet, the --model, or a name served
        lately, with no worker now): the workers that come (back) may be of any engine, and a 400
        would end a client's retries."""
        if self.waiting():
            return False
        named = name if isinstance(name, str) and name else self.default_model
        theirs = self._engines(named) if named is not None else frozenset()
        if not theirs:
            if named is not None and (named == self.default_model or self._model_gone(named)):
                return False
            if named is None and not self.models() and self.gone_lately():
                return False
            theirs = self._engines(None)
        return theirs <= {"vllm"}

    def _engines(self, name: str | None) -> frozenset[str]:
        if self.engines is not None:
            return self.engines(name)
        return engines_serving(self.workers(), name)

    def served_lately(self) -> dict[str, str]:
        """The names requests resolved within RECENT_S, oldest first, each with its model."""
        since = self.clock() - RECENT_S
        while self._recent and next(iter(self._recent.values()))[0] < since:
            del self._recent[next(iter(self._recent))]
        return {name: model for name, (_, model) in self._recent.items()}

    def _left_lately(self) -> dict[str, str]:
        """The names workers left with within RECENT_S, oldest first, each with its model: of
        another model than the --model, none (this router would not serve them)."""
        since = self.clock() - RECENT_S
        return {
            name: left.model
            for name, left in self.departed().items()
            if left.at >= since and self.default_model in (None, left.model)
        }

    def gone_lately(self) -> dict[str, str]:
        """The names requests resolved here, or workers left with, within RECENT_S, each with its
        model: those whose requests are a 503 while no worker serves them."""
        return {**self.served_lately(), **self._left_lately()}

    def _model_gone(self, name: str) -> bool:
        """No worker serves `name` now, and the workers that served it (its model's, an adapter's,
        an alias's) left within RECENT_S, or a request resolved it here within RECENT_S and none
        serves its model now. One unloaded from workers still serving its model is not gone but
        unknown, a 404 as vLLM answers it."""
        left = self.departed().get(name)
        if left is not None and left.at >= self.clock() - RECENT_S and self.default_model in (None, left.model):
            return True
        model = self.served_lately().get(name)
        return model is not None and model not in self.models()

    def _no_worker(self, name: str | None) -> Unknown:
        """No worker serves `name` (None: any model served within RECENT_S) right now."""
        names = ", ".join([*self.models(), *self.aliases(), *self.adapters()])
        refused = self.refused(name) if names else ()
        registered = (names or self._none_registered(name)) + (
            f"; {refused_records(self.ns, refused)}" if refused else ""
        )
        what = f"the model `{name}`" if name else f"any model (served lately: {', '.join(self.gone_lately())})"
        return Unknown(
            503,
            f"no worker serves {what} right now (workers left, or have not registered yet): send the request "
            f"again later. Registered: {registered}",
            retry_after_s=NO_WORKER_RETRY_S,
        )

    def _none_registered(self, model: str | None) -> str:
        # Records there but refused are no namespace mismatch: name them instead; nor is a fleet
        # this router served requests from.
        if refused := self.refused(model) or self.refused(None):
            return f"none ({refused_records(self.ns, refused)})"
        if self.seen_workers:
            return "none (every worker this router has served requests from left)"
        if self.departed():
            return "none (every worker left)"
        return (
            f"none (no worker is registered under {subjects.workers_prefix(self.ns)}: this router's "
            f"--namespace is {self.ns})"
        )

    def explain(
        self, model: str, tokens: list[int], *, text: bool, shape: RequestShape = RequestShape()
    ) -> dict[str, Any]:
        return self.planner.explain(self.planner.context("debug", model, tokens, text=text, shape=shape))

    async def open(
        self,
        request: GenerateRequest,
        span: Span,
        *,
        text: bool,
        shape: RequestShape = RequestShape(),
        max_tokens: int | None = 16,
    ) -> Job:
        """Admit and plan one request (its first attempt booked); PlanError or Overloaded if not.
        `request` is its leg as the client asked for it, routed by its `token_ids`; `text`: the
        prompt came as text, so only workers sharing the router's tokenizer may take it;
        `shape`: what the engine computes for it besides the next tokens; `max_tokens`: the
        client's output limit, None when it set none."""
        await self._check_connected()
        started = time.perf_counter()
        ctx = self.planner.context(
            request.request_id,
            request.model,
            request.token_ids,
            max_tokens,
            text=text,
            shape=shape,
        )
        planning = time.perf_counter() - started  # the hashing, then every offer's plan

        def take(ctx: RequestContext) -> RoutePlan | None:
            nonlocal planning
            offered = time.perf_counter()
            try:
                return self.planner.take(ctx)
            finally:
                planning += time.perf_counter() - offered

        try:
            plan = await self.admission.admit(ctx, take)
        except BaseException:
            self.planner.finished(ctx)
            raise
        # Two figures: a request waiting for room read as slow routing when one held both.
        self.metrics.route.observe(planning)
        self.metrics.queue_wait.observe(max(0.0, time.perf_counter() - started - planning))
        self.tracer.decision(span, plan, ctx.isl, ctx.cached_tokens(plan.decode))
        req = msgspec.structs.replace(
            request,
            annotations=[a for a in request.annotations if a != ANNOTATION_BYPASS],  # the router's alone
            trace=self.tracer.carrier(span),
        )
        return Job(
            request=req,
            plan=plan,
            replan=lambda exclude: self.planner.plan_again(ctx, exclude),
            deadline=time.monotonic() + self.request_timeout_s,
            sequences=shape.sequences,
        )

    async def call(self, model: str, endpoint: str, params: dict[str, Any], *, request_id: str | None = None) -> bytes:
        """A utility call (`endpoint` one of UTILITY_ENDPOINTS) on a worker of `model`: the engine's
        whole answer. Calls take the workers in turn; one that fails before answering (silent, gone,
        a 5xx) hands the call to the next, said once per episode of its worker and failure kind
        (router.leg_failures; until 2026-12-07 a WARNING per call, a line per poll of a client while
        a dead engine's worker stayed registered). PlanError when no worker can take it, LegError
        when the call failed. `request_id`: the call's (its caller logs its failure by it), a new
        one if None."""
        await self._check_connected()
        workers = self.planner.utility_workers(model, endpoint)
        if not workers:
            raise PlanError(503, f"no worker of model {model} can take the request now")
        first = self.calls % len(workers)
        self.calls += 1
        req = GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            model=model,
            token_ids=[],
            stream=False,
            endpoint=endpoint,
            params=params,
        )
        deadline = time.monotonic() + self.request_timeout_s
        *before, last = (workers[first:] + workers[:first])[:2]
        for info in before:
            try:
                return await self.dispatcher.call(info.worker, info.role, req, deadline)
            except LegError as exc:
                if not exc.retryable or time_up(deadline):  # past it, the next try is not sent
                    raise
                self._handed_on.failed(
                    info.worker,
                    exc.kind,
                    req.request_id,
                    "%s call %s: %s; trying %s",
                    endpoint,
                    req.request_id,
                    exc,
                    last.worker,
                )
        return await self.dispatcher.call(last.worker, last.role, req, deadline)

    async def _check_connected(self) -> None:
        # A leg sent while NATS stays down waits in the client's buffer until its worker looks
        # silent, and the client hears only that no worker could serve it: name the cause.
        if not await self.dispatcher.connected():
            raise PlanError(503, NATS_LOST_WHY)

    def release(self, job: Job) -> None:
        """End the job's bookkeeping unless its stream did: the handler calls it whatever happened
        after `open` (a failure before streaming would otherwise leak the booking)."""
        if job.released:
            return
        job.released = True
        if job.attempts == 0:  # the dispatcher never ran, so it freed nothing
            self.planner.ledger.free(job.plan.key)
        self.planner.finished(job.plan.ctx)
        self.admission.completed(job.plan.ctx.model)
        self.admission.notify()

    async def stream(self, job: Job, arrived: float) -> AsyncGenerator[ResponseChunk, None]:
        """The request's chunks; whatever way it ends, its bookkeeping ends with it. `arrived`: the
        time.perf_counter() the request arrived at, where the TTFT its client sees starts."""
        metrics = self.metrics
        start = time.perf_counter()
        last: float | None = None
        streamed = job.request.stream  # a whole answer has no first token to time
        try:
            # Closed here, not when collected: a client that leaves frees the attempt's booking
            # before release() offers its room to the admission queue.
            async with contextlib.aclosing(self.dispatcher.run(job)) as chunks:
                async for chunk in chunks:
                    n = len(chunk.token_ids) + chunk.tokens
                    if n and streamed:
                        now = time.perf_counter()
                        if last is None:
                            metrics.observe_ttft(job.path, now - arrived, now - start)
                        else:
                            # A chunk carries a token of each sequence (n > 1, a batch) per step: the
                            # gap is each sequence's, over its share of the tokens.
                            steps = max(n // job.sequences, 1)
                            metrics.observe_itl((now - last) / steps, steps)
                        last = now
                    yield chunk
        finally:
            self.release(job)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """A request counted in `inflight` while its handler serves it, from its admission until its
        answer is written: until 2026-12-07 it was counted until its worker's stream ended, and
        answers still held for clients slow to take them read as none in flight."""
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1


def refused_records(ns: str, refused: Sequence[tuple[str, str]], shown: int = 5) -> str:
    """What to tell of the worker records refused in etcd (router.worker_registry): the first
    `shown` keys, each with why."""
    listed = "; ".join(f"{name}: {why}" for name, why in refused[:shown])
    more = f"; and {len(refused) - shown} more" if len(refused) > shown else ""
    return (
        f"{len(refused)} worker record(s) under {subjects.workers_prefix(ns)} refused ({listed}{more}); "
        "bad_record on /ready and /debug/workers"
    )


def _and_adapters(model: str, adapters: Mapping[str, str]) -> str:
    names = sorted(a for a, base in adapters.items() if base == model)
    return f" and its LoRA adapters {', '.join(names)}" if names else ""
