"""RouterService: one router replica, wired (docs/router.md, "Architecture").

    NATS ── {ns}.kv.*   ─▶ KvIngest ─▶ BlockIndex ─┐
         ── {ns}.load.* ─▶ LoadView ◀─ ReplicaSync ◀─▶ {ns}.router.sync
    etcd ── /{ns}/workers/ ─▶ WorkerRegistry ─▶ (ingest add/remove, load view, dispatch)
         ── /{ns}/config/router ─▶ ConfigWatcher ─▶ Disaggregator, Dispatcher, Admission
    HTTP ─▶ tokenise ─▶ ContextBuilder ─▶ Disaggregator.plan ─▶ book ─▶ Dispatcher ─▶ {ns}.gen.*

Start order: settings (a bad one fails here), NATS, etcd, HTTP (to know its URL), the RouterInfo
lease (its id is the router id), replica sync, ingest, registry, live config. `/ready` answers 200
once the registry has its first snapshot and the index is synced with every worker. `stop()` is
idempotent and drains in reverse: HTTP first (in-flight requests get `drain_s`), then the
subscriptions and tasks, the lease, etcd and NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import msgspec
import nats
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import Span, TracerProvider

from discovery import ConfigWatcher, Discovery, Lease
from protocol import (
    GenerateRequest,
    LoadReport,
    ProtocolError,
    RouterInfo,
    SamplingParams,
    WorkerInfo,
    decode_msg,
    subjects,
)
from protocol.config import EtcdSettings, NatsSettings, RouterSettings, resolve
from protocol.messages import ANNOTATION_BYPASS
from protocol.version import __version__
from router.admission import Admission, QueueFull, QueueTimeout
from router.block_index import BlockIndex
from router.disagg import Disaggregator, RoutePlan
from router.dispatch import Dispatcher, Job
from router.http_api import ApiError, make_app
from router.kv_ingest import KvIngest
from router.load_view import LoadView
from router.metrics import RouterMetrics, StateFigures
from router.policies import Outcome, Path
from router.replica_sync import ReplicaSync
from router.request_context import ContextBuilder, RequestContext
from router.selection import Selector, over_queue_threshold
from router.tokenization import PromptTokenizer, load_tokenizer
from router.tracing import RequestTracer
from router.worker_registry import WorkerRegistry

__all__ = ["RouterConfig", "RouterService", "RouterStatus"]

log = logging.getLogger(__name__)


class RouterStatus(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Process-level settings (not live-tunable) plus the layers RouterSettings resolve from.

    `overrides` are flat RouterSettings names as flags give them (e.g. {"conditional_disagg": True,
    "eff_isl_threshold": 1024}); `file_settings` the config file's mapping. Environment variables
    KVSWITCH_* sit between the two, as for every setting.
    """

    ns: str = subjects.DEFAULT_NAMESPACE
    nats: NatsSettings = field(default_factory=NatsSettings)
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    http_host: str = "127.0.0.1"
    http_port: int = 0
    tokenizer: str | None = None
    model: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    file_settings: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    queue_timeout_s: float = 30.0
    drain_s: float = 10.0
    lease_ttl_s: int = 10
    seed: int | None = None
    tracer_provider: TracerProvider | None = None


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.ns = subjects.validate_namespace(config.ns)
        self.settings: RouterSettings = resolve(RouterSettings, cli=config.overrides, file=config.file_settings)
        self.tokenizer: PromptTokenizer = load_tokenizer(config.tokenizer)
        self.status = RouterStatus.NEW
        self.started_at = time.time()
        self.router_id = ""
        self.url = ""
        self.index = BlockIndex()
        self.view = LoadView()
        self.disagg = Disaggregator(self.settings, Selector(random.Random(config.seed)))
        self.admission = Admission(self.settings.max_queue)
        self.metrics = RouterMetrics(self._figures)
        self.tracer = RequestTracer(config.tracer_provider)
        self._refused_live = 0  # live configs the watcher accepted but no policy could be built from
        self._inflight = 0
        self._nc: Client | None = None
        self._discovery: Discovery | None = None
        self._lease: Lease | None = None
        self._runner: web.AppRunner | None = None
        self._load_sub: Subscription | None = None
        self._load_malformed = 0
        self._ingest: KvIngest | None = None
        self._sync: ReplicaSync | None = None
        self._registry: WorkerRegistry | None = None
        self._dispatcher: Dispatcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._registry_ready = False
        self._watcher: ConfigWatcher | None = None
        self._contexts = ContextBuilder(self._model_workers, self.index.match, self.view.load)

    # --- parts, once started -------------------------------------------------------------------

    @property
    def ingest(self) -> KvIngest:
        assert self._ingest is not None, "RouterService not started"
        return self._ingest

    @property
    def registry(self) -> WorkerRegistry:
        assert self._registry is not None, "RouterService not started"
        return self._registry

    @property
    def dispatcher(self) -> Dispatcher:
        assert self._dispatcher is not None, "RouterService not started"
        return self._dispatcher

    @property
    def sync(self) -> ReplicaSync:
        assert self._sync is not None, "RouterService not started"
        return self._sync

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> Self:
        if self.status is not RouterStatus.NEW:
            raise RuntimeError(f"RouterService.start() called while {self.status.value}")
        self.status = RouterStatus.STARTING
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        self.status = RouterStatus.RUNNING
        log.info("router %s serving %s (namespace %s)", self.router_id, self.url, self.ns)
        return self

    async def _start(self) -> None:
        self._nc = nc = await nats.connect(**self.config.nats.connect_options(f"kvswitch-router-{self.ns}"))
        self._discovery = await Discovery(self.config.etcd, self.ns).connect()
        self._dispatcher = Dispatcher(
            nc,
            self.ns,
            self,
            prefill_timeout_s=self.settings.prefill_timeout_s,
            on_fallback=lambda job: self.disagg.record(Outcome.FALLBACK_PREFILL_FAILED),
        )
        await self._dispatcher.start()
        self._load_sub = await nc.subscribe(subjects.load_all(self.ns), cb=self._on_load)
        # No per-request access log: /metrics counts requests, and a log line per request costs more
        # than routing it.
        self._runner = web.AppRunner(
            make_app(self), handler_cancellation=True, shutdown_timeout=self.config.drain_s, access_log=None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.http_host, self.config.http_port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._lease = await self._discovery.register_router(
            lambda rid: RouterInfo(router=rid, http_url=self.url, started_at=self.started_at, version=__version__),
            ttl=self.config.lease_ttl_s,
        )
        self.router_id = self._lease.hex_id
        self._sync = ReplicaSync(nc, self.ns, self.router_id, self.view, discovery=self._discovery)
        await self._sync.start()
        self._ingest = KvIngest(nc, self.ns, self.index)
        await self._ingest.start()
        self._registry = WorkerRegistry(self._discovery, self._on_worker_add, self._on_worker_remove)
        await self._registry.start()
        self._tasks.append(asyncio.create_task(self._await_registry(), name="router-registry-ready"))
        self._watcher = ConfigWatcher(self._discovery, dict(self.config.overrides), dict(self.config.file_settings))
        self._tasks.append(asyncio.create_task(self._follow_config(self._watcher), name="router-config"))

    async def stop(self) -> None:
        if self.status in (RouterStatus.STOPPING, RouterStatus.STOPPED):
            return
        self.status = RouterStatus.STOPPING
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()  # stops accepting, lets in-flight handlers finish within drain_s
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for part in (self._registry, self._ingest, self._sync, self._dispatcher):
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.stop()
        sub, self._load_sub = self._load_sub, None
        if sub is not None and self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        discovery, self._discovery = self._discovery, None
        if discovery is not None:
            with contextlib.suppress(Exception):
                await discovery.close()  # revokes the RouterInfo lease: peers forget our bookings
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.drain()
        self.status = RouterStatus.STOPPED

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- readiness -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        if self.status is not RouterStatus.RUNNING or self._registry is None or self._ingest is None:
            return False
        return self._registry_ready and self._ingest.synced

    def readiness(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "workers": len(self._registry.workers()) if self._registry is not None else 0,
            "index_synced": self._ingest.synced if self._ingest is not None else False,
        }

    async def wait_ready(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        if not await self.registry.wait_ready(timeout):
            return False
        return await self.ingest.wait_synced(max(deadline - time.monotonic(), 0.0))

    @property
    def config_rejected(self) -> int:
        """Live config changes refused so far (the old settings were kept each time)."""
        return (self._watcher.rejected if self._watcher is not None else 0) + self._refused_live

    # --- events from the parts -----------------------------------------------------------------

    async def _await_registry(self) -> None:
        while not await self.registry.wait_ready(3600.0):
            pass
        self._registry_ready = True

    def _on_worker_add(self, info: WorkerInfo) -> None:
        self.ingest.add_worker(info.worker, info.epoch)
        self.admission.notify()

    def _on_worker_remove(self, worker: str) -> None:
        self.ingest.remove_worker(worker)
        self.view.remove_worker(worker)
        self.dispatcher.worker_gone(worker)

    async def _on_load(self, msg: Msg) -> None:
        try:
            self.view.update(decode_msg(msg.data, LoadReport))
        except ProtocolError as exc:
            self._load_malformed += 1
            if self._load_malformed == 1:
                log.warning("malformed load report on %s dropped (later ones only counted): %s", msg.subject, exc)
            return
        self.admission.notify()

    async def _follow_config(self, watcher: ConfigWatcher) -> None:
        async for settings in watcher:
            if settings == self.settings:
                continue
            try:
                self.disagg.configure(settings)
            except ValueError as exc:
                self._refused_live += 1
                log.error("live config refused, keeping the previous one: %s", exc)
                continue
            self.settings = settings
            self.dispatcher.prefill_timeout_s = settings.prefill_timeout_s
            self.admission.max_queue = settings.max_queue
            log.info("live config applied: %s", msgspec.to_builtins(settings))

    # --- routing -------------------------------------------------------------------------------

    def _model_workers(self, model: str) -> list[WorkerInfo]:
        return self.registry.workers(model=model)

    def models(self) -> list[str]:
        return self.registry.models() if self._registry is not None else []

    def resolve_model(self, model: str | None) -> str:
        """The model a request names (the router's --model when it names none); 404 if unknown."""
        name = model or self.config.model
        if name is None:
            raise ApiError(400, "'model' is required", "model")
        if self.config.model is not None and name != self.config.model:
            raise ApiError(404, f"The model `{name}` does not exist. This router serves `{self.config.model}`", "model")
        known = self.models()
        if name not in known:
            raise ApiError(404, f"The model `{name}` does not exist. Registered: {', '.join(known) or 'none'}", "model")
        return name

    def context(self, request_id: str, model: str, tokens: list[int], max_tokens: int = 16) -> RequestContext:
        if self.registry.block_size_conflicts.get(model):
            sizes = sorted(self.registry.block_size_conflicts[model])
            raise ApiError(503, f"workers of model {model} disagree on block size {sizes}: a configuration error")
        ctx = self._contexts.build(request_id, model, tokens, max_tokens)
        if ctx is None or not ctx.decode_pool:
            raise ApiError(503, f"no decode or agg worker is registered for model {model}")
        return ctx

    def explain(self, model: str, tokens: list[int]) -> dict[str, Any]:
        """/debug/route: the decision a request would get now; books and counts nothing."""
        ctx = self.context("debug", model, tokens)
        plan = self.disagg.plan(ctx)
        assert plan is not None
        return {
            "model": model,
            "isl": ctx.isl,
            "block_size": ctx.block_size,
            "prompt_blocks": len(ctx.hashes),
            "settings": msgspec.to_builtins(self.settings),
            "policy": self.disagg.policy.name,
            **plan.explain(),
        }

    async def prepare(
        self,
        request_id: str,
        model: str,
        tokens: list[int],
        sampling: SamplingParams,
        annotations: list[str],
        span: Span,
    ) -> Job:
        """Admit, plan and count one request; the Job is ready for `dispatcher.run`."""
        if not self.ready:
            raise ApiError(503, "the router is not ready: its index is still syncing with the workers")
        started = time.perf_counter()
        ctx = self.context(request_id, model, tokens, sampling.max_tokens)
        if not self._pool_open(ctx):
            try:
                await self.admission.admit(lambda: self._pool_open(self.context(request_id, model, tokens)),
                                           self.config.queue_timeout_s)  # fmt: skip
            except QueueFull as exc:
                raise ApiError(429, str(exc), retry_after_s=exc.retry_after_s) from exc
            except QueueTimeout as exc:
                raise ApiError(503, str(exc)) from exc
            ctx = self.context(request_id, model, tokens, sampling.max_tokens)
            started = time.perf_counter()
        plan = self.disagg.plan(ctx)
        if plan is None:
            raise ApiError(503, f"no worker can take a request for model {model}")
        self.metrics.route.observe(time.perf_counter() - started)
        self.disagg.record(plan.outcome)
        self.tracer.decision(span, plan, ctx.isl, ctx.cached_tokens(plan.decode))
        req = GenerateRequest(
            request_id=request_id,
            model=model,
            token_ids=tokens,
            sampling=sampling,
            annotations=[a for a in annotations if a != ANNOTATION_BYPASS],  # the router's alone
            deadline=time.time() + self.config.request_timeout_s,
            trace=self.tracer.carrier(span),
        )

        def replan(exclude: frozenset[str]) -> RoutePlan | None:
            again = self.disagg.plan(self.context(request_id, model, tokens, sampling.max_tokens), exclude)
            if again is not None:
                self.disagg.record(again.outcome)
            return again

        return Job(request=req, plan=plan, replan=replan, deadline=req.deadline or math.inf)

    def _pool_open(self, ctx: RequestContext) -> bool:
        qt = self.settings.conditional.queue_threshold
        return any(not over_queue_threshold(c, qt) for c in ctx.decode_pool)

    @contextlib.asynccontextmanager
    async def serving(self, job: Job) -> AsyncIterator[None]:
        self._inflight += 1
        try:
            yield
        finally:
            self._inflight -= 1
            self.admission.notify()

    # --- Booker (router.dispatch) --------------------------------------------------------------

    def book(self, request_id: str, plan: RoutePlan, job: Job) -> None:
        tokens = job.request.token_ids
        bs = plan.decode.info.block_size
        isl = len(tokens)
        d = plan.decode
        new_blocks = max(-(-isl // bs) - d.overlap_blocks, 0)
        if plan.path is Path.REMOTE and plan.prefill is not None:
            p = plan.prefill
            self.sync.add(request_id, p.worker, isl - min(p.overlap_blocks * bs, isl), 0)
            self.sync.add(request_id, d.worker, 0, new_blocks)
        else:
            self.sync.add(request_id, d.worker, isl - min(d.overlap_blocks * bs, isl), new_blocks)

    def rebook_bypass(self, request_id: str, plan: RoutePlan, job: Job) -> None:
        """A remote prefill fell back: the prompt's prefill moves to the decode worker."""
        if plan.prefill is not None:
            self.sync.add(request_id, plan.prefill.worker, 0, 0)
        self.book(request_id, _as_bypass(plan), job)

    def prefill_done(self, request_id: str) -> None:
        self.sync.prefill_done(request_id)

    def free(self, request_id: str) -> None:
        self.sync.free(request_id)

    # --- metrics -------------------------------------------------------------------------------

    def _figures(self) -> StateFigures:
        stats = self._ingest.stats if self._ingest is not None else None
        return StateFigures(
            decisions={str(k): v for k, v in self.disagg.counts.items()},
            index_blocks=len(self.index),
            index_entries=self.index.entries,
            event_lag_s=stats.last_lag_s if stats else 0.0,
            kv_batches=stats.batches_applied if stats else 0,
            kv_malformed=stats.malformed if stats else 0,
            kv_gaps=stats.gaps if stats else 0,
            kv_repairs=(stats.repairs_batches + stats.repairs_dumps) if stats else 0,
            queue_depth=self.admission.depth,
            inflight=self._inflight,
            workers=len(self._registry.workers()) if self._registry is not None else 0,
        )


def _as_bypass(plan: RoutePlan) -> RoutePlan:
    return RoutePlan(plan.decode, None, Path.BYPASS, plan.outcome, plan.reason, plan.decode_ranked, [])
