"""RouterService: one router replica, wired (docs/router.md, "Architecture"). It only wires.

    NATS ── {ns}.kv.*   ─▶ SenderBudget ─▶ KvIngest ─▶ BlockIndex, PendingPrefixes   (a connection of its own;
            past its budget a sender goes unheard: SenderSubscriptions; GapRepair asks on one of its own)
         ── {ns}.load.* ─▶ SenderBudget ─▶ LoadView, Eligibility, KvIngest.check_digest, Admission.notify
            (a connection of its own; past its budget a sender goes unheard: SenderSubscriptions)
         ◀▶ {ns}.router.sync ── ReplicaSync (the Ledger's sink)         (the main connection, with the replies)
    etcd ── /{ns}/workers/ ─▶ WorkerRegistry ─▶ (ingest, eligibility, view, dispatcher)
         ── /{ns}/config/router ─▶ ConfigWatcher ─▶ Planner.configure
    HTTP ─▶ http_api ─▶ RequestPath: Planner (context, candidates, choice, booking) ─▶ Admission
                                     ─▶ Dispatcher ─▶ {ns}.gen.*

Start order: settings (a bad one fails here), the listener (router.start_door: /health answers, /ready
and requests a 503 naming what the start waits for; a host or port it cannot listen on fails here),
NATS, etcd, the HTTP app (taking over the listener's requests), the RouterInfo lease (its id is the router id),
replica sync, ingest, registry (and a check of each model's fleet every second: router.fleet_news),
live config. `stop()` is idempotent and drains in reverse: HTTP first (http_api.Drain: the listener
stays open, /ready and new requests answer 503, requests in flight get `drain_s` and are then cut
with a 503), then the subscriptions and tasks, the lease, etcd and NATS. A lost lease (etcd said it expired, e.g. after
this process stalled past its TTL) is replaced by a new registration under a new router id
(discovery.Registration); etcd merely unreachable changes nothing. A failed registration, or a loop
the router needs that ended, sets `broken`: `serve()` (`kvswitch router`) then stops it, exit status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import msgspec
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError
from opentelemetry.trace import TracerProvider

from discovery import ConfigWatcher, Discovery, Registration
from discovery.watch import keep_following
from protocol import ConfigError, LoadReport, ProtocolError, RouterInfo, WorkerInfo, decode_msg, serving, subjects
from protocol.config import MIN_LOAD_PERIOD_S, EtcdSettings, NatsSettings, RouterSettings, resolve
from protocol.messages import Cleared, KvEvent, Removed, Stored, load_report_problem
from protocol.version import BUILD
from router.admission import Admission
from router.api_keys import ApiKeys
from router.block_index import BlockIndex
from router.calibration import Calibration, unusable_profiles
from router.client_buffers import CLIENT_BUFFER_MIB
from router.clock_skew import ClockSkew, Skew, SkewNews, Verdict
from router.disagg import Disaggregator
from router.dispatch import Dispatcher
from router.eligibility import (
    DEFAULT_PERIOD_S,
    Eligibility,
    Exclusion,
    WorkerStatus,
    few_ids,
    name_few,
    taking_requests,
)
from router.fingerprint_days import FingerprintDays
from router.fleet_lines import NAMED_AT_MOST, FirstHeard, FirstSaid, FleetLines, FleetLog
from router.fleet_news import CHECK_S, NATS_PROBE_S, FleetNews, mostly_silent
from router.gap_repair import FailureKind
from router.http_api import Drain, HttpLimits, make_app
from router.ingest_stats import IngestStats
from router.kv_ingest import MIN_ENTRY_LIMIT, KvIngest
from router.ledger import Ledger
from router.load_view import MAX_CLOCK_SKEW_S, LoadView
from router.metrics import RouterMetrics, StateFigures
from router.peer_settings import PeerSettings, rendering_digest, rendering_fields, settings_digest, settings_fields
from router.pending_prefixes import PendingPrefixes
from router.planner import Planner
from router.replica_sync import SYNC_SNAPSHOT_S, ReplicaSync, SyncStats
from router.request_path import RECENT_S, RequestPath, refused_records
from router.sender_budget import KvBudget, SenderBudget
from router.sender_subscriptions import SenderSubscriptions
from router.served_names import clash_message, shadow_message
from router.start_door import StartDoor
from router.tokenization import (
    FingerprintWatch,
    PromptTokenizer,
    Tokenization,
    fingerprints_on,
    load_tokenizer,
    rendering_fingerprint,
)
from router.tracing import RequestTracer
from router.unheard import Unheard
from router.worker_registry import Departed, WorkerRegistry, context_message
from router.worker_versions import WorkerVersions
from runtime import RepeatedErrors, StopSteps, background, cancel_and_wait, ended, guarded
from runtime.loop_watch import LoopWatch
from runtime.nats_connect import connect as nats_connect
from runtime.nats_connect import error_reporter, refused_subscriptions
from runtime.nats_flush import flush, nats_answers
from runtime.turns import Turns

__all__ = ["RouterConfig", "RouterService", "RouterStatus"]

log = logging.getLogger(__name__)
# What /ready's warning says of the workers of a pool with none routable that take its requests (WorkerStatus.soft)
_SOFT_WHY = {
    Exclusion.ENGINE_UNHEALTHY: "engine_unhealthy ones (their shims report the engine failing its load polls)",
    Exclusion.ENGINE_FAILING: "engine_failing ones (their engines failed their last requests with server errors)",
}
BROKEN_CHECK_S = 1.0  # how often the router looks for a failed registration or a loop that ended


def _skew_harm(offset_s: float, *, many: bool) -> str:
    """What a worker clock `offset_s` ahead of this router's (behind if negative) breaks, for one or `many`."""
    its, it = ("their", "them") if many else ("its", "it")
    if offset_s > 0:
        harm = f"{its} load reports' stamps are clamped to this router's clock"
    else:
        harm = f"{its} requests' load is counted twice for that long"
    return f"{harm}; the deadlines this router sends {it} are moved by the offset as measured"


def _say_skew(skew: Skew) -> None:
    if not skew.skewed:
        log.info("worker %s's clock agrees with this router's again (%+.1f s)", skew.worker, skew.offset_s)
        return
    log.warning(
        "worker %s's clock is %.1f s %s this router's: %s; keep router and worker hosts on NTP",
        skew.worker, abs(skew.offset_s), "ahead of" if skew.offset_s > 0 else "behind",
        _skew_harm(skew.offset_s, many=False),
    )  # fmt: skip


def _say_skews(said: Verdict) -> None:
    """One judgement of router.clock_skew.SkewNews: the fleet once, then the workers off on their own."""
    if said.fleet_changed and (fleet := said.fleet) is not None:
        named = ", ".join(fleet.agreeing[:3]) + (", ..." if len(fleet.agreeing) > 3 else "")
        log.warning(
            "this router's clock is probably off, by about %.1f s %s the fleet's: %d of the %d workers whose "
            "offset is known agree (%s): %s; fix this router host's NTP (or the fleet's), not each "
            "worker's; only workers whose clocks disagree with the fleet are named on their own",
            abs(fleet.offset_s), "behind" if fleet.offset_s > 0 else "ahead of", len(fleet.agreeing), fleet.known,
            named, _skew_harm(fleet.offset_s, many=True),
        )  # fmt: skip
    elif said.fleet_changed:
        log.info("this router's clock agrees with most workers' again")
    for skew in said.off + said.back:
        _say_skew(skew)
    if said.off_more:
        log.warning(
            "and %d more workers' clocks are off from this router's, each on its own (not named: see "
            "kvswitch_router_worker_clock_offset_seconds); keep router and worker hosts on NTP",
            said.off_more,
        )
    if said.back_more:
        log.info("and %d more workers' clocks agree with this router's again", said.back_more)


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
    drain_s: float = 10.0
    lease_ttl_s: int = 10
    seed: int | None = None
    tracer_provider: TracerProvider | None = None
    api_keys_file: str | None = None
    debug_api_keys_file: str | None = None
    route_info: str | None = None  # who sees an answer's route (router.route_info); None: its default
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    calibrate: bool = True  # fit each worker's engine speed from its load reports (router.calibration)
    trust_request_chat_template: bool = False  # render clients' own chat templates (vLLM's flag of that name)
    chat_template_content_format: str = "auto"  # vLLM's flag of that name: auto, string or openai
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag of that name
    default_chat_template_kwargs: Any = None  # vLLM's flag of that name (a dict), as router.cli checked it
    index_limit_per_worker: int = MIN_ENTRY_LIMIT  # KV index entries any worker may have (kv_ingest's floor)
    kv_budget: KvBudget = field(default_factory=KvBudget)  # each KV event sender's (router.sender_budget)
    sync_snapshot_s: float = SYNC_SNAPSHOT_S  # how often peers get a snapshot of our bookings (router.replica_sync)
    client_buffer_bytes: int = CLIENT_BUFFER_MIB << 20  # the most held for clients at once (router.client_buffers)


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.ns = subjects.validate_namespace(config.ns)
        self.settings: RouterSettings = resolve(RouterSettings, cli=config.overrides, file=config.file_settings)
        self.tokenizer: PromptTokenizer = load_tokenizer(
            config.tokenizer, config.chat_template_content_format, config.default_chat_template_kwargs
        )
        self.fleet_log = FleetLog()  # its parts' per-worker lines, said as it stops (router.fleet_lines)
        # the first days' fingerprints now, as the router is built (router.fingerprint_days)
        self.fingerprint_days = FingerprintDays(functools.partial(fingerprints_on, self.tokenizer))
        self.fingerprints = FingerprintWatch(
            self.fingerprint_days, fleet_log=self.fleet_log, caveat=self.tokenizer.caveat
        )
        self.api_keys = ApiKeys(config.api_keys_file) if config.api_keys_file else None
        self.debug_keys = ApiKeys(config.debug_api_keys_file) if config.debug_api_keys_file else None
        self.status = RouterStatus.NEW
        self.started_at = time.time()
        self.router_id = ""
        self.instance = secrets.token_hex(8)  # kept across registrations: its legs name it (GenerateRequest.origin)
        self.url = ""
        self.index = BlockIndex()
        self.view = LoadView()
        self.clocks = ClockSkew(MAX_CLOCK_SKEW_S)
        self.skew_news = SkewNews(self.clocks, lambda: len(self._registry) if self._registry is not None else 0)
        self.calibration = Calibration(fleet_log=self.fleet_log) if config.calibrate else None
        self.pending = PendingPrefixes(self.settings.pending_ttl_s, time.monotonic)
        self.metrics = RouterMetrics(self._figures)
        calibrated = self.calibration is not None
        fingerprint = rendering_fingerprint(self.tokenizer)  # not `mine`: that one follows the calendar
        flags: dict[str, Any] = {
            "content_format": config.chat_template_content_format,
            "default_chat_template_kwargs": config.default_chat_template_kwargs,
            "exclude_tools_when_tool_choice_none": config.exclude_tools_when_tool_choice_none,
            "trust_request_chat_template": config.trust_request_chat_template,
        }
        self.peer_settings = PeerSettings(
            self.ns,
            settings_digest(self.settings, calibrated=calibrated),
            BUILD,
            rendering=rendering_digest(fingerprint, **flags),
            settings=settings_fields(self.settings, calibrated=calibrated),
            rendering_flags=rendering_fields(fingerprint, **flags),
        )
        self.worker_versions = WorkerVersions(BUILD, fleet_log=self.fleet_log)
        self.tracer = RequestTracer(config.tracer_provider)
        self.load_malformed = 0
        self.load_unknown = 0
        self.load_budget = SenderBudget()  # checked before decoding: one sender's flood costs a dict lookup a report
        self.load_over_budget: Counter[str] = Counter()  # by worker, while it is registered
        # The load reports logged: once per registered worker and kind, forgotten when it leaves;
        # senders with no record (anyone may publish on {ns}.load.<any name>; a shim that lost its
        # lease reports under its old id for a while) bounded and once in a while (FirstSaid).
        self._load_said = FirstSaid(
            lambda worker: self._registry is not None and self._registry.get(worker) is not None
        )
        self._first_heard = FirstHeard()  # a sender with no record: said once it has had none for a grace
        # A fleet restart sends every worker's reports before its record: the first few named, the rest counted
        self._unregistered_lines = FleetLines(
            log,
            logging.INFO,
            f"load reports dropped: no usable record under {subjects.workers_prefix(self.ns)} (counted in "
            "kvswitch_router_load_unknown_total)",
            fleet_log=self.fleet_log,
        )
        # Causes a whole fleet shares, capped alike: hosts stepped back by one NTP correction, a
        # fleet on a build whose reports this router cannot read
        self._clock_step_lines = FleetLines(
            log,
            logging.WARNING,
            "their clocks stepped back: load reports stamped before their last ones, taken in the order they come "
            "(one cause for many hosts at once: a step of their time source; keep worker hosts on NTP)",
            fleet_log=self.fleet_log,
        )
        self._malformed_lines = FleetLines(
            log,
            logging.WARNING,
            "malformed load reports dropped (one cause for many workers: shims of a build whose reports this router "
            "cannot read; every one counted in kvswitch_router_load_malformed_total)",
            fleet_log=self.fleet_log,
        )
        self._over_budget_lines = FleetLines(
            log,
            logging.WARNING,
            "load reports over their senders' budget dropped (one cause for many workers: something other than "
            "their shims publishing on their subjects; counted in kvswitch_router_load_over_budget_total)",
            fleet_log=self.fleet_log,
        )
        self.reregistrations = 0
        self.kv_disconnects = 0  # the KV event connection cut (a slow consumer), kvswitch_router_kv_disconnects_total
        self.load_disconnects = 0  # the load report connection cut, kvswitch_router_load_disconnects_total
        self.kvstate_disconnects = 0  # the kvstate connection cut, kvswitch_router_kvstate_disconnects_total
        # Messages nats-py dropped because a subscription's handler fell behind, by subscription (_nats_errors)
        self.slow_consumer_dropped: Counter[str] = Counter()
        self._slow_consumer_said: dict[str, RepeatedErrors] = {}
        self._nc: Client | None = None
        self._kv_nc: Client | None = None  # KV events alone (_start)
        self._load_nc: Client | None = None  # load reports alone (_start)
        self._kvstate_nc: Client | None = None  # gap repair's kvstate requests and replies alone (_start)
        self._discovery: Discovery | None = None
        self._registration: Registration | None = None
        self._deregistering: Registration | None = None  # the one stop() revokes, for revoke_now
        self._runner: web.AppRunner | None = None
        self._door: StartDoor | None = None  # the listener until the router's app takes it over
        self._connecting = ""  # what the start waits for, said by /ready and the start door's 503s
        self._drain = Drain()
        self._load_subs: SenderSubscriptions | None = None
        self._load_turns = Turns()
        self._ingest: KvIngest | None = None
        self._sync: ReplicaSync | None = None
        self._registry: WorkerRegistry | None = None
        self._dispatcher: Dispatcher | None = None
        self._planner: Planner | None = None
        self._path: RequestPath | None = None
        self._watcher: ConfigWatcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loops: list[asyncio.Task[None]] = []  # beside _tasks: loops meant to run until stop() (_ended_loops)
        # Set once the router is no longer correct (a failed registration, a loop it needs that ended),
        # with why: serve() then stops it, exit status 1; an owner running it in-process acts itself.
        self.broken = asyncio.Event()
        self.broken_by: list[str] = []
        self._registry_ready = False
        # After NATS comes back, workers count as reachable for readiness only once one of them has
        # reported over the new connection: a shim re-subscribes before it publishes again, and a
        # report older than the reconnect says nothing about whether its shim is back yet. Set when
        # the connection drops (and again when it is back), None once a decode or agg worker reported.
        self._reconnected_at: float | None = None
        self.loop_watch = LoopWatch("this router")
        self.fleet_news = FleetNews()
        self.eligibility = Eligibility(
            clock=time.monotonic,  # cooldowns no step of the host's wall clock stretches
            stalled_within=self.loop_watch.stalled_within,
            sync_state=self._sync_state,
            liveness=self.view.liveness,
            tokenizer=self.fingerprints.mine,
            same_tokenizer=self.fingerprint_days.accepts,
            quarantined_for=lambda w: self._load_subs.quarantined_for(w) if self._load_subs is not None else None,
            fleet_log=self.fleet_log,
            created=lambda w: self._registry.created(w) if self._registry is not None else 0,
        )
        self.unheard = Unheard(
            config.nats.shown_servers(),
            heard=self._heard,
            nobody_subscribes=lambda w: (
                self._ingest is not None and self._ingest.repairs.last_failure(w) is FailureKind.NO_RESPONDERS
            ),
            fleet_log=self.fleet_log,
        )

    # --- parts, once started -------------------------------------------------------------------

    def _part(self, part: Any, name: str) -> Any:
        if part is None:
            raise RuntimeError(f"RouterService not started ({name})")
        return part

    @property
    def ingest(self) -> KvIngest:
        return self._part(self._ingest, "ingest")  # type: ignore[no-any-return]

    @property
    def registry(self) -> WorkerRegistry:
        return self._part(self._registry, "registry")  # type: ignore[no-any-return]

    @property
    def dispatcher(self) -> Dispatcher:
        return self._part(self._dispatcher, "dispatcher")  # type: ignore[no-any-return]

    @property
    def sync(self) -> ReplicaSync:
        return self._part(self._sync, "sync")  # type: ignore[no-any-return]

    @property
    def planner(self) -> Planner:
        return self._part(self._planner, "planner")  # type: ignore[no-any-return]

    @property
    def path(self) -> RequestPath:
        return self._part(self._path, "request path")  # type: ignore[no-any-return]

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> Self:
        if self.status is not RouterStatus.NEW:
            raise RuntimeError(f"RouterService.start() called while {self.status.value}")
        self.status = RouterStatus.STARTING
        self.loop_watch.start()
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        self.status = RouterStatus.RUNNING
        log.info("router %s serving %s (namespace %s)", self.router_id, self.url, self.ns)
        return self

    async def _start(self) -> None:
        # The listener first: NATS may be down for minutes (it is retried for good) and etcd slow,
        # and meanwhile /health must answer, or a liveness probe kills a router rightly waiting
        # (router.start_door). A port it cannot have is refused now, naming the flag.
        self._door = door = StartDoor(
            self.config.http_host,
            self.config.http_port,
            health=self.health,
            readiness=self.readiness,
            waiting=lambda: self._connecting,
            metrics=self.metrics,
            idle_timeout_s=self.config.http_limits.idle_timeout_s,
        )
        self.url = await door.open()
        # The flags, not the URLs: /ready and these 503s carry no key, and infrastructure addresses
        # are for operators (docs/security.md); the connection WARNINGs in the log name them.
        self._connecting = "connecting to NATS (--nats-servers; the log names the servers and the error)"
        self._nc = nc = await nats_connect(
            log,
            **self.config.nats.connect_options(f"kvswitch-router-{self.ns}"),
            error_cb=self._nats_errors("main"),
            disconnected_cb=self._nats_disconnected,
            reconnected_cb=self._nats_reconnected,
        )
        # KV events on a connection of their own: a worker publishing more than this replica can
        # fold makes nats-server cut the connection it floods as a slow consumer (64 MiB pending),
        # and on the shared one that took every worker's load reports and every reply stream with it
        # (/ready 503, requests 503, for one worker's fault). Cut alone, the index falls behind and
        # each worker's next load report asks for what it missed (router.kv_ingest).
        # A worker flooding its own {ns}.kv.NAME (isolation audit of 2026-12-07) is dropped past its
        # budget before decoding and quarantined (router.kv_ingest), and kvstate requests and their
        # replies go on a connection of their own (below), never queued behind a flood on this one.
        self._kv_nc = await nats_connect(
            log,
            **self.config.nats.connect_options(f"kvswitch-router-{self.ns}-kv"),
            error_cb=self._nats_errors("kv"),
            disconnected_cb=self._kv_disconnected,
            reconnected_cb=self._kv_reconnected,
        )
        # Load reports on one of their own too: a worker flooding its own {ns}.load.NAME (isolation
        # audit of 2026-12-06) sent its bytes down the socket every reply stream came on, and its
        # reports into the queue the other workers' waited in. Past its budget (_on_load) its excess is
        # dropped before decoding and it is quarantined, so nats-server sends it no more
        # (router.sender_subscriptions); a flood faster than this replica reads meanwhile gets this
        # connection cut as a slow consumer, not the replies'.
        self._load_nc = await nats_connect(
            log,
            **self.config.nats.connect_options(f"kvswitch-router-{self.ns}-load"),
            error_cb=self._nats_errors("load"),
            disconnected_cb=self._load_disconnected,
            reconnected_cb=self._load_reconnected,
        )
        # Gap repair's kvstate on one of its own: shims stream their dumps without flow control and
        # up to 32 repairs are in flight, so a burst of big dumps can pass nats-server's pending bytes
        # (64 MiB). On the main connection (2026-12-07) that cut every request stream and replica
        # sync with it (bench_split: 32 workers of 500k blocks); cut here, the repairs in flight fail
        # and are retried. A cap on dumps in flight by their expected bytes would slow every bootstrap
        # to keep what a connection of its own keeps for one more socket.
        self._kvstate_nc = await nats_connect(
            log,
            **self.config.nats.connect_options(f"kvswitch-router-{self.ns}-kvstate"),
            error_cb=self._nats_errors("kvstate"),
            disconnected_cb=self._kvstate_disconnected,
        )
        self._connecting = "connecting to etcd (--etcd-endpoints)"
        self._discovery = await Discovery(self.config.etcd, self.ns).connect()
        self._connecting = ""
        # Replica sync learns its router id at registration, below; until then nothing is routed.
        self._sync = ReplicaSync(
            nc,
            self.ns,
            "",
            self.view,
            snapshot_s=self.config.sync_snapshot_s,
            discovery=self._discovery,
            peers=self.peer_settings,
            fleet_log=self.fleet_log,
        )
        ledger = Ledger(self._sync, self.pending)
        self._planner = planner = Planner(
            self.settings,
            workers=lambda: self._registry.workers() if self._registry is not None else [],
            index=self.index,
            pending=self.pending,
            view=self.view,
            eligibility=self.eligibility,
            ledger=ledger,
            rng=random.Random(self.config.seed),
            calibration=self.calibration,
            fingerprints=self.fingerprint_days,
            fleet_log=self.fleet_log,
            unrouted=self.unrouted,
            caveat=self.tokenizer.caveat,
        )
        self._ingest = KvIngest(
            self._kv_nc,
            self.ns,
            self.index,
            requests_nc=self._kvstate_nc,
            budget=self.config.kv_budget.budget(),
            min_entry_limit=self.config.index_limit_per_worker,
            on_events=self._on_kv_events,
            fleet_log=self.fleet_log,
        )
        planner.disagg.transfers.attribute()  # the dispatcher tells it of every pull, from the first
        self._dispatcher = Dispatcher(
            nc,
            self.ns,
            ledger,
            settings=lambda: self.settings,
            on_fallback=lambda job: planner.record(job.outcome),
            on_transfer=self._on_transfer,
            on_unreachable=self.eligibility.mark_unreachable,
            on_malformed=self.eligibility.mark_malformed,
            on_pull=self._on_pull,
            on_prefill=self._on_prefill,
            on_engine=self.eligibility.engine_leg,
            tracer=self.tracer,
            origin=self.instance,
            registered=self._registered,
            clock_offset=self.clocks.offset,
            awake_for=self.loop_watch.awake_for,
            fleet_log=self.fleet_log,
            client_buffer_bytes=self.config.client_buffer_bytes,
        )
        await self._dispatcher.start()
        admission = Admission(
            max_wait_s=lambda: self.settings.slo_ttft_s / 2,
            max_queue=lambda: self.settings.max_queue,
            on_abandon=lambda plan: ledger.free(plan.key),
        )
        self._path = path = RequestPath(
            planner=planner,
            admission=admission,
            dispatcher=self._dispatcher,
            metrics=self.metrics,
            tracer=self.tracer,
            models=self.models,
            adapters=self.adapters,
            aliases=self.aliases,
            clashes=self.name_clashes,
            max_model_len=self.max_model_len,
            default_model=self.config.model,
            engines=lambda name: self._registry.engines(name) if self._registry is not None else frozenset(),
            ns=self.ns,
            refused=self._refused,
            departed=self._departed,
            request_timeout_s=self.config.request_timeout_s,
            waiting=lambda: "" if self._registry_ready else "reading workers from etcd",
        )
        self._load_subs = SenderSubscriptions(
            self._load_nc,
            subjects.load_all(self.ns),
            functools.partial(subjects.load, self.ns),
            guarded(self._on_load, "the load report handler"),
            # every registered worker, routed or not: _on_load takes the reports of each
            lambda: self._registry.ids() if self._registry is not None else (),
            what="load report",
        )
        await self._load_subs.start()
        # No per-request access log: /metrics counts requests, and a log line per request costs more
        # than routing it.
        app = make_app(
            path,
            Tokenization(
                self.tokenizer,
                offload_chars=self.config.http_limits.offload_chars,
                trust_request_template=self.config.trust_request_chat_template,
                exclude_tools_when_tool_choice_none=self.config.exclude_tools_when_tool_choice_none,
            ),
            limits=self.config.http_limits,
            api_keys=self.api_keys,
            debug_keys=self.debug_keys,
            health=self.health,
            readiness=self.readiness,
            index_state=self.index_state,
            tokenizer_report=self.fingerprints.summary,
            worker_listing=self.worker_listing,
            started_at=self.started_at,
            unplanned=lambda model: [st.explain() for st in (*self.unrouted(model), *self.bad_records(model))],
            drain=self._drain,
            route_info=self.config.route_info,
        )
        self._runner = await door.hand_over(app)  # the same server: no connection cut
        self._registration = Registration(
            self._discovery,
            key=lambda rid: subjects.router_key(self.ns, rid),
            value=lambda rid: RouterInfo(
                router=rid,
                http_url=self.url,
                started_at=self.started_at,
                version=BUILD,
                settings_digest=self.peer_settings.digest,
                rendering_digest=self.peer_settings.rendering,
                settings=self.peer_settings.settings,
                rendering=self.peer_settings.rendering_flags,
                instance=self.instance,
            ),
            ttl=self.config.lease_ttl_s,
            ttl_setting=None,  # no flag: etcd's least TTL where it is longer (docs/router.md, "Lease TTL")
            on_registered=self._registered_anew,
        )
        self.router_id = await self._registration.start()
        self._tasks.append(
            background(
                self._watch_broken(),
                "router-broken-watch",
                "a failed registration or an ended loop no longer stops this router (/ready still names it)",
            )
        )
        self._sync.rename(self.router_id)
        await self._sync.start()
        await self._ingest.start()
        # The server refuses a subject of another identity only in an -ERR: such a router would
        # serve 503s for good, its workers' KV events and load reports never reaching it.
        conns = (nc, self._kv_nc, self._load_nc, self._kvstate_nc)
        for conn in conns:
            await flush(conn)
        if refused := sorted(set().union(*(refused_subscriptions(conn) for conn in conns))):
            more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
            raise ConfigError(
                "namespace",
                self.ns,
                f"NATS refuses this identity the subscription to {refused[0]}{more}: the seed in --nats-nkey-file "
                "(or --nats-creds-file) is not a router's, or --namespace differs from the one kvswitch secrets "
                "was given",
            )
        await self.fingerprint_days.backfill()  # before the workers are checked against them
        self._loops.append(
            background(
                self.fingerprint_days.follow(),
                "router-fingerprint-days",
                "a worker whose engine probed its tokenizer on a day after this router's last gets no text prompts "
                "from it, where its chat template writes the date, until the router restarts",
            )
        )
        self._registry = WorkerRegistry(
            self._discovery,
            self._on_worker_add,
            self._on_worker_remove,
            fleet_log=self.fleet_log,
            fit=self.eligibility.fit,
        )
        await self._registry.start()
        self._tasks.append(asyncio.create_task(self._await_registry(), name="router-registry-ready"))
        self._loops.append(
            background(  # a check that raises is an ERROR and runs again: its gauges must not freeze
                keep_following(self._check_fleet, "the fleet check (router.fleet_news)"),
                "router-fleet-news",
                "a model's fleet going out of routing, or back, is not logged until the router restarts",
            )
        )
        self._watcher = watcher = ConfigWatcher(
            self._discovery, dict(self.config.overrides), dict(self.config.file_settings)
        )
        self._loops.append(
            background(
                # A crash costs a backoff and a new watch (its Snapshot re-applied), not live config for good.
                keep_following(lambda: self._follow_config(watcher), "the live config watch"),
                "router-config",
                "live settings stay as they are until the router restarts",
            )
        )

    async def stop(self) -> None:
        """Drain, stop every part, revoke the lease, close the connections. A cancellation meanwhile
        cuts the step it comes in short, and the rest still run; raised at the end: a SIGTERM during
        start runs this in the start's cleanup, which runtime.start_or_stop cancels again every
        CANCEL_AGAIN_S, and the lease's revoke was skipped, kept to its TTL (a review of 2026-12-07)."""
        if self.status in (RouterStatus.STOPPING, RouterStatus.STOPPED):
            return
        self.status = RouterStatus.STOPPING
        steps = StopSteps()
        if self._door is not None:
            with steps:
                await self._door.close()  # a no-op once it handed over; before, nothing runs long there
        runner, self._runner = self._runner, None
        if runner is not None:
            # The listener stays open meanwhile: a client (or a load balancer that has not yet
            # dropped this router) gets a 503 to retry elsewhere, not a refused connection.
            with steps:
                began = time.monotonic()
                finished, cut = await self._drain.finish(self.config.drain_s)
                if cut:
                    log.warning(
                        "%d requests still running after the %gs drain: ended with a 503", cut, self.config.drain_s
                    )
                log.info(
                    "drained in %.1fs: %d requests finished, %d cut (answered 503, or an error event)",
                    time.monotonic() - began,
                    finished,
                    cut,
                )
            with steps:
                await runner.cleanup()
        with steps:
            await cancel_and_wait(*self._tasks, *self._loops)
        with steps:
            await self.loop_watch.stop()
        for part in (self._registry, self._ingest, self._sync, self._dispatcher):
            if part is not None:
                with steps:
                    try:
                        await part.stop()
                    except Exception:  # a bug: said with its traceback, and the rest of the stop goes on
                        log.exception("stopping the router's %s failed", type(part).__name__)
        subs, self._load_subs = self._load_subs, None
        if subs is not None:
            with steps:
                await subs.stop()
        registration, self._registration = self._registration, None
        if registration is not None:
            failure: Exception | None = None
            self._deregistering = registration
            with steps:
                try:
                    await registration.stop()  # revokes the RouterInfo lease: peers forget our bookings
                except Exception as exc:  # a bug: said with its traceback, and the rest of the stop goes on
                    failure = exc
                finally:
                    self._deregistering = None
            # read, not returned: a cancellation while its supervisor ended is raised after the revoke
            # went, and None is a revoke itself cut short (the cancellation raised at the end)
            revoked = False if failure is not None else registration.revoked
            if revoked is False:
                log.error(
                    "revoking router %s's lease failed (%s): peers keep its bookings, and workers its legs, until "
                    "its TTL (%d s) passes",
                    self.router_id,
                    "the traceback below" if failure is not None else "discovery.lease's WARNING says why",
                    registration.ttl,
                    exc_info=failure,
                )
            elif revoked is None:
                log.warning(
                    "router %s's stop was cancelled while it revoked its lease: peers may keep its bookings, and "
                    "workers its legs, until its TTL (%d s) passes",
                    self.router_id,
                    registration.ttl,
                )
        discovery, self._discovery = self._discovery, None
        if discovery is not None:
            with steps, contextlib.suppress(Exception):
                await discovery.close()
        for conn in (self._load_nc, self._kv_nc, self._kvstate_nc, self._nc):
            if conn is not None and not conn.is_closed:
                with steps, contextlib.suppress(Exception):
                    await conn.drain()
        self._load_nc = self._kv_nc = self._kvstate_nc = self._nc = None
        self.fleet_log.flush()  # its windows' timers never fire now
        self.status = RouterStatus.STOPPED
        # Its log's last line: until 2026-12-07 it ended at "draining", the stop's end unsaid. A router
        # that never registered (its start failed, said in one line naming the fix) says nothing more.
        if registration is not None and self.router_id:
            log.info("router %s stopped%s", self.router_id, " (a cancellation cut a step short)" if steps.cut else "")
        steps.end()

    async def serve(self, stop: asyncio.Event) -> int:
        """Run until `stop` is set, or until the router is `broken`, which sets `stop` (under
        runtime.run_service that starts the drain limit a SIGTERM starts); then stop() it (the drain,
        then the lease revoked). 0, or 1 when broken: its process's supervisor restarts it."""
        stopped = asyncio.ensure_future(stop.wait())
        broken = asyncio.ensure_future(self.broken.wait())
        try:
            await asyncio.wait({stopped, broken}, return_when=asyncio.FIRST_COMPLETED)
            stop.set()
            log.info("draining")
        finally:
            stopped.cancel()
            broken.cancel()
            await self.stop()
        return 1 if self.broken.is_set() else 0

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def revoke_now(self) -> None:
        """For a process about to exit at once (a second SIGTERM: runtime.run_service's on_abort):
        revoke the RouterInfo lease within about a second, off the event loop, so that peers drop
        this router's bookings now rather than when its TTL runs out."""
        registration = self._registration or self._deregistering  # a stop's revoke may be slow
        if registration is not None:
            registration.revoke_now()

    # --- registration ----------------------------------------------------------------------------

    async def _registered_anew(self, router_id: str) -> None:
        """etcd said our lease was gone (a stall past its TTL, a revocation): peers dropped our old
        id's bookings with its key and count the new id's from now on."""
        old, self.router_id = self.router_id, router_id
        self.sync.rename(router_id)
        self.reregistrations += 1
        log.warning("router %s lost its lease: registered anew as %s", old, router_id)

    async def _watch_broken(self) -> None:
        """Once the registration failed or a loop the router needs ended, say why as an ERROR and
        set `broken`, for serve() to stop the router: only a restart makes it correct again, and a
        /ready 503 restarts nothing (Kubernetes' liveness probe is /health; `kvswitch up` restarts a
        process that exited). Polled: the loops' tasks come and go with their parts."""
        while not (why := self._broken_by()):  # noqa: ASYNC110 (tasks, no event to wait on)
            await asyncio.sleep(BROKEN_CHECK_S)
        self.broken_by = why
        log.error(
            "router %s is no longer correct: %s; it stops (a drain, then its lease revoked) and exits with status 1, "
            "for its supervisor to restart it",
            self.router_id,
            "; ".join(why),
        )
        self.broken.set()

    def _broken_by(self) -> list[str]:
        """What leaves this router incorrect for as long as it runs: a failed registration, each
        loop it needs that ended."""
        why = self._ended_loops()
        if self._registration is not None and self._registration.failed.is_set():
            why.insert(0, self._registration_failed(self._registration))
        return why

    def _registration_failed(self, registration: Registration) -> str:
        return (
            f"router {self.router_id}'s registration in etcd failed ({registration.failure}): its key is no longer "
            "kept, so once it goes workers cancel this router's legs and peers drop its bookings"
        )

    # --- readiness -----------------------------------------------------------------------------

    def _ended_loops(self) -> list[str]:
        """Each loop this router needs for as long as it runs (its own, its parts', its etcd auth
        token's) that no longer runs, with what that stops: the router is no longer correct."""
        token = self._discovery.token if self._discovery is not None else None
        loops = [
            self.loop_watch.task,
            token.task if token is not None else None,
            *(self._sync.tasks if self._sync is not None else ()),
            self._registry.task if self._registry is not None else None,
            self._load_subs.task if self._load_subs is not None else None,
            self._ingest.subscriptions.task if self._ingest is not None else None,
            *self._loops,
        ]
        return [why for task in loops if (why := ended(task)) is not None]

    def health(self) -> dict[str, Any]:
        return {"status": self.status.value}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready while NATS is up, the worker set is known and some model has a decode or agg worker
        the planner would send a request to: a routable one or, when its pool has none, one excluded
        softly (`engine_unhealthy`, `engine_failing`: router.eligibility), which the planner then uses, said in
        `warnings`. With --model only the workers serving it count. A model no request can name
        (every name it is served under clashes: router.served_names) does not count either. The
        body counts the workers left out by reason (`excluded_by_reason`) and names the first of
        them, refused records first, with why (`worker_status`, `name_few`: as a no-worker 503
        does), never a routable one, so a probe stays small and cheap at any fleet size;
        `worker_listing` (/debug/workers) has every worker. `warnings` says what the fleet gets
        wrong without stopping this router (names that clash, pools that cannot pair, peers that
        route otherwise). A worker record refused in etcd is left out too, as `bad_record`: its
        shim may be up, and the router never routes to it; a worker the registry does not route
        (its max_model_len not its model's) is counted as `context_conflict`. Every routed worker
        (of any model; not a `context_conflict` one) unheard over NATS (router.unheard) is a problem
        naming --nats-servers. So is a failed registration (its RouterInfo key no longer kept) and
        each loop the router needs that no longer runs (`_ended_loops`, by task name): either leaves
        the router incorrect until it is restarted."""
        running = self.status is RouterStatus.RUNNING and self._registry is not None and self._ingest is not None
        nats_up = self._nc is not None and self._nc.is_connected
        served = self.config.model
        registered, infos = self._counted()
        statuses = self._statuses(registered, infos)
        bad = self.bad_records(served)
        left_out = [*bad]
        models: dict[str, dict[str, int]] = {}
        decode_pools: dict[str, list[WorkerStatus]] = {}
        soft_why: dict[tuple[str, str], set[str]] = {}  # (model, pool) -> why its soft ones are left out
        for st in statuses:
            m = models.setdefault(
                st.model,
                {"routable_decode": 0, "routable_prefill": 0, "soft_decode": 0, "soft_prefill": 0, "workers": 0},
            )
            m["workers"] += 1
            pool = "prefill" if st.role == "prefill" else "decode"
            if pool == "decode":
                decode_pools.setdefault(st.model, []).append(st)
            if st.routable:
                m[f"routable_{pool}"] += 1
                continue
            left_out.append(st)
            if st.soft and st.exclusion is not None:  # soft is an exclusion's
                m[f"soft_{pool}"] += 1
                soft_why.setdefault((st.model, pool), set()).add(_SOFT_WHY[st.exclusion])
        warnings = [
            f"model {model}: no {said} worker is routable; its {m[f'soft_{pool}']} "
            f"{' or '.join(sorted(soft_why[model, pool]))} take its requests until a healthy one is back"
            for model, m in models.items()
            for pool, said in (("decode", "decode or agg"), ("prefill", "prefill"))
            if m[f"soft_{pool}"] and not m[f"routable_{pool}"]
        ]
        warnings += self._fleet_warnings(infos)
        if self._load_subs is not None and (unheard := self._load_subs.quarantined()):
            named = sorted(unheard)
            warnings.append(
                f"load reports of {len(named)} senders unheard, quarantined for sending more than their budget "
                f"({', '.join(named[:NAMED_AT_MOST])}{', ...' if len(named) > NAMED_AT_MOST else ''}): they read "
                f"silent; something other than their shims publishes on their subjects (a shim sends at most "
                f"{1 / MIN_LOAD_PERIOD_S:g} a second; an older one given a --load-period-s under {MIN_LOAD_PERIOD_S:g} "
                "s sent more)"
            )
        if self._ingest is not None and (unheard := self._ingest.subscriptions.quarantined()):
            named = sorted(unheard)
            warnings.append(
                f"KV events of {len(named)} senders unheard, quarantined for sending more than their budget "
                f"({', '.join(named[:NAMED_AT_MOST])}{', ...' if len(named) > NAMED_AT_MOST else ''}): their "
                "indexes are repaired through kvstate; something other than their shims publishes on their subjects"
            )
        if nats_up and self._kvstate_nc is not None and not self._kvstate_nc.is_connected:
            warnings.append(  # the main connection up: NATS is there, this one was cut (a slow consumer)
                "the kvstate connection to NATS is down (kvswitch_router_kvstate_disconnects_total): a worker that "
                "needs a repair stays out of routing until it is back"
            )
        registration = self._registration
        unrenewed = registration.unrenewed_s if registration is not None else None
        if registration is not None and unrenewed is not None and unrenewed > registration.ttl:
            # Not a problem: with etcd down for every process too, no worker sees the key go and the
            # fleet routes on; only this router cut off from a live etcd loses its legs.
            warnings.append(
                f"etcd has not renewed this router's lease for {unrenewed:.0f} s (TTL {registration.ttl} s): "
                "where the workers still reach etcd, its key is gone, and they cancel its legs once their "
                "--orphan-grace-s passes (20 s by default); each such request ends in an error"
            )
        if self._registry_ready and (frozen := self.registry.reading.trouble()) is not None:
            warnings.append(  # not a 503: routing on the set last read beats the whole fleet out at once
                f"the worker set is as last read: the watch of {subjects.workers_prefix(self.ns)} was made again "
                f"and {frozen}; workers that registered or left since are not seen"
            )
        if self._watcher is not None and (unread := self._watcher.reading.trouble()) is not None:
            warnings.append(
                f"the live config at {subjects.config_key(self.ns)} is as last read (or the flags' alone): {unread}"
            )
        if self._watcher is not None and self._watcher.refused_now:
            warnings.append(
                f"the live config at {subjects.config_key(self.ns)} is refused, so the last good settings serve: "
                f"{self._watcher.last_error}"
            )
        problems = []
        if self.status is RouterStatus.STOPPING:
            problems.append("draining (SIGTERM): requests in flight finish, new ones are refused (503)")
        elif not running:
            waiting = f": {self._connecting}" if self._connecting else ""
            problems.append(f"the router is {self.status.value}{waiting}")
        if not nats_up:
            problems.append("NATS is not connected: requests cannot reach any worker")
        if running and not self._registry_ready:
            unread = self.registry.reading.trouble() if self._registry is not None else None
            problems.append("the worker set has not been read from etcd yet" + (f": {unread}" if unread else ""))
        refused = [(st.worker, st.detail) for st in bad]
        if self._registry_ready and not registered:
            if every := refused or self._refused(None):  # the records are there: no namespace mismatch
                problems.append(
                    "no decode or agg worker can take requests: no worker is registered, "
                    + refused_records(self.ns, every)
                )
            elif self._path is not None and (self._path.seen_workers or self._departed()):
                # they left (seen here, or on another replica): no namespace mismatch
                lately = ", ".join(self._path.gone_lately()) or f"none within {RECENT_S / 60:g} min"
                problems.append(
                    "no decode or agg worker can take requests: every worker has left (served lately: "
                    f"{lately}); requests for them are a 503 with Retry-After until one registers again"
                )
            else:  # most often shims and router in other namespaces
                problems.append(
                    f"no decode or agg worker can take requests: no worker is registered under "
                    f"{subjects.workers_prefix(self.ns)} in etcd (this router's --namespace is {self.ns}; "
                    "workers registered under another namespace are not seen)"
                )
        elif self._registry_ready and served is not None and not infos:
            names = [*self.models(), *self.aliases(), *self.adapters()]
            problems.append(
                f"no worker serves {served}, the only model this router serves (--model); registered: "
                + ", ".join(names)
                + (f"; {refused_records(self.ns, refused)}" if refused else "")
            )
        elif not any(taking_requests(pool) for pool in decode_pools.values()):
            problems.append(
                "no decode or agg worker can take requests"
                + (f"; {refused_records(self.ns, refused)}" if refused else "")
            )
        elif nats_up and self._reconnected_at is not None:
            ago = time.monotonic() - self._reconnected_at
            problems.append(
                f"NATS reconnected {ago:.1f} s ago and no decode or agg worker has reported since: "
                "their shims may not be back yet"
            )
        if self._registry_ready and (silent := self.unheard.problem([i.worker for i in registered])):
            problems.append(silent)
        problems += [
            f"{why}; this router stops and exits with status 1, for its supervisor to restart it"
            for why in self._broken_by()
        ]
        body = {
            "status": self.status.value,
            "router": self.router_id,
            "workers": len(statuses),
            "routable": sum(st.routable for st in statuses),
            "models": models,
            "problems": problems,
            "warnings": warnings,
            "excluded_by_reason": dict(sorted(Counter(str(st.exclusion) for st in left_out).items())),
            "worker_status": [st.explain() for st in name_few(left_out)[0]],
            "index_synced": self._ingest.synced if self._ingest is not None else False,
        }
        return not problems, body

    def worker_listing(self) -> dict[str, Any]:
        """Every worker /ready counts, routable or not, with why not, then each refused record
        (`worker_status`), and every worker that gets no text prompts from this router
        (`text_refused`): /debug/workers, what /ready names only the first of."""
        listed = [*self._statuses(*self._counted()), *self.bad_records(self.config.model)]
        return {
            "worker_status": [st.explain() for st in listed],
            "text_refused": self.fingerprints.report()["text_refused"],
        }

    def _counted(self) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
        """The registered workers, and those /ready counts (with --model, those serving it)."""
        registered = self._registry.workers() if self._registry is not None else []
        served = self.config.model
        return registered, registered if served is None else serving(registered, served)

    def _statuses(self, registered: list[WorkerInfo], infos: list[WorkerInfo]) -> list[WorkerStatus]:
        """Every registered worker /ready counts: `infos` (_counted's, routed) as eligibility reads
        them, then those the registry routes to no request (`unrouted`). Block sizes are voted over
        the whole fleet of each model of `infos` (`registered`): with --model naming an adapter or an
        alias, `infos` is part of its model's fleet, whose vote would settle the model's size for
        every request (router.fleet_vote)."""
        if infos is registered:
            sizes = None
        else:
            models = {i.model for i in infos}
            sizes = self.eligibility.block_sizes(i for i in registered if i.model in models)
        return [*self.eligibility.statuses(infos, sizes), *self.unrouted(self.config.model)]

    def unrouted(self, model: str | None = None) -> list[WorkerStatus]:
        """The registered workers the registry leaves out of routing (`WorkerRegistry.unrouted`: a
        max_model_len not their model's), as excluded workers; with `model`, those that serve it."""
        return [
            WorkerStatus(
                info.worker, info.model, info.role, Exclusion.CONTEXT_CONFLICT, why, self.eligibility.takes_text(info)
            )
            for info, why in (self._registry.unrouted(model) if self._registry is not None else [])
        ]

    def _refused(self, model: str | None) -> list[tuple[str, str]]:
        return [(st.worker, st.detail) for st in self.bad_records(model)]

    def bad_records(self, model: str | None = None) -> list[WorkerStatus]:
        """The worker records refused in etcd (router.worker_registry), as excluded workers; with
        `model`, those that serve it and those that do not decode far enough to say."""
        return [
            WorkerStatus(r.name, r.info.model, r.info.role, Exclusion.BAD_RECORD, r.why, False)
            if r.info is not None
            else WorkerStatus(r.name, "", "", Exclusion.BAD_RECORD, r.why, False)
            for r in (self._registry.refusing() if self._registry is not None else [])
            if model is None or r.info is None or serving([r.info], model)
        ]

    def _fleet_warnings(self, infos: list[WorkerInfo]) -> list[str]:
        """What the registered workers (and peer routers) get wrong that does not stop this router:
        names that resolve to several models, a model's own name another model's workers serve as
        an alias, workers of one model that disagree on max_model_len, prefill workers no decode
        worker can use, timing profiles this router cannot load, peers that route with other settings."""
        out: list[str] = []
        clashes = self._registry.name_clashes if self._registry is not None else {}
        mine = {i.model for i in infos}
        out += [clash_message(name, models) for name, models in sorted(clashes.items()) if mine.intersection(models)]
        if self._registry is not None:
            shadows, contexts = self._registry.shadowed_aliases, self._registry.context_conflicts
            out += [shadow_message(name, by) for name, by in sorted(shadows.items()) if mine & {name, *by}]
            out += [context_message(model, seen) for model, seen in sorted(contexts.items()) if model in mine]
        pools: dict[str, list[WorkerInfo]] = {}
        for info in infos:
            pools.setdefault(info.model, []).append(info)
        for model, pool in sorted(pools.items()):
            prefill = [i for i in pool if i.role == "prefill"]
            if not prefill:
                continue
            if all(i.role == "prefill" for i in pool):
                out.append(
                    f"model {model} has prefill workers ({few_ids([i.worker for i in prefill])}) but no decode or "
                    "agg worker: every request for it is refused (503) until one registers"
                )
                continue
            engines = {i.engine for i in pool if i.role == "decode"}
            idle = [i for i in prefill if i.engine not in engines]
            if idle and engines:
                out.append(
                    f"model {model}: no decode worker runs the engine of prefill workers "
                    f"{few_ids([f'{i.worker} ({i.engine})' for i in idle])} (its decode workers run "
                    f"{', '.join(sorted(engines))}), and a transfer handle feeds only its own engine kind: "
                    "they get no request"
                )
        return out + unusable_profiles(infos) + self.peer_settings.warnings()

    def index_state(self) -> dict[str, Any]:
        """Per registered worker: what the index holds of it (the chaos bench compares this with the
        engines' own caches)."""
        out: dict[str, Any] = {}
        for info in self._registry.workers() if self._registry is not None else []:
            sync = self.ingest.stats.workers.get(info.worker)
            blocks, xor = self.index.digest(info.worker)
            out[info.worker] = {
                "engine_url": info.engine_url,
                "role": info.role,
                "state": sync.state.value if sync is not None else "unknown",
                "epoch": sync.epoch if sync is not None else None,
                "seq": sync.last_seq if sync is not None else 0,
                "blocks": blocks,
                "xor": f"{xor:016x}",
            }
        return out

    @property
    def ready(self) -> bool:
        """Whether /ready says 200: the whole rule, a status per worker (tests poll it; nothing on
        the request or event path calls it)."""
        return self.readiness()[0]

    async def wait_ready(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        if not await self.registry.wait_ready(timeout):
            return False
        return await self.ingest.wait_synced(max(deadline - time.monotonic(), 0.0))

    @property
    def config_rejected(self) -> int:
        """Live config changes refused so far (the old settings were kept each time)."""
        return self._watcher.rejected if self._watcher is not None else 0

    # --- events from the parts -----------------------------------------------------------------

    def _heard(self, worker: str) -> bool:
        """Anything of `worker` reached this router over NATS: a load report, its shim's KV state."""
        sync = self._sync_state(worker)
        return self.view.liveness(worker) is not None or sync is None or sync[0] != "bootstrapping"

    def _sync_state(self, worker: str) -> tuple[str, str] | None:
        if self._ingest is None:
            return ("bootstrapping", "the KV ingest is not started")
        return self._ingest.sync_state(worker)

    async def _check_fleet(self) -> None:
        """Every CHECK_S, what the workers /ready counts say of each model (router.fleet_news):
        exclusions are computed only when read, and nothing else logs them for a whole fleet. Its
        figures are /metrics' kvswitch_router_workers_routable and _excluded. First, the models whose
        workers disagree on max_model_len are voted again (WorkerRegistry.revote)."""
        while True:
            await asyncio.sleep(CHECK_S)
            if self.status is RouterStatus.RUNNING and self._registry_ready:
                self.registry.revote()  # a model's context as its workers serve now (router.fleet_vote)
                registered, counted = self._counted()
                self.unheard.check([info.worker for info in registered])
                lives = [live for info in counted if (live := self.view.liveness(info.worker)) is not None]
                longest = max((live.period_s for live in lives), default=DEFAULT_PERIOD_S)
                statuses = self._statuses(registered, counted)
                # Workers silent in bulk may be NATS hung under this router: ask it before saying so.
                nc = self._load_nc or self._nc
                unanswered = mostly_silent(statuses) and nc is not None and not await nats_answers(nc, NATS_PROBE_S)
                self.eligibility.nats_unanswered = unanswered  # a silent worker's why says it (a 503's)
                self.fleet_news.check(statuses, time.monotonic(), longest, nats_unanswered=unanswered)

    async def _await_registry(self) -> None:
        while not await self.registry.wait_ready(3600.0):
            pass
        self._registry_ready = True
        self.ingest.fleet_listed()  # a worker leaving from now on is one it knew (router.kv_ingest)

    def _on_worker_add(self, info: WorkerInfo) -> None:
        self.fingerprints.check(info)
        self.worker_versions.check(info)
        self.ingest.add_worker(info.worker, info.epoch, info.kv_total_blocks)
        self.eligibility.added(info.worker)
        self._first_heard.forget(info.worker)
        if self._load_subs is not None:
            self._load_subs.workers_changed()
        self.unheard.added(info.worker)
        self.path.admission.notify()

    def _registered(self, *workers: str) -> bool:
        """Whether every one of `workers` is still registered. A leg's outcome can come after its
        worker left: forget() ended that worker's state, and nothing would end state made now."""
        reg = self._registry
        return reg is not None and all(reg.get(w) is not None for w in workers)

    def _on_transfer(self, decode: str, prefill: str, ok: bool) -> None:
        transfers = self.planner.disagg.transfers
        if ok:
            transfers.succeeded(decode, prefill)
        elif self._registered(decode, prefill):
            transfers.failed(decode, prefill)

    def _on_pull(self, decode: str, prefill: str) -> Callable[[], None]:
        if not self._registered(decode, prefill):
            return lambda: None
        return self.planner.disagg.transfers.pulling(decode, prefill)

    def _on_prefill(self, worker: str, fault: str | None, serves_whole: bool, ago_s: float) -> None:
        if self._registered(worker):  # its leg may end after it left (a held blame: Dispatcher._served_despite)
            self.eligibility.prefill_leg(worker, fault, serves_whole, ago_s)

    def _on_worker_remove(self, worker: str) -> None:
        self.planner.disagg.forget(worker)
        if self.calibration is not None:
            self.calibration.forget(worker)
        self.fingerprints.forget(worker)
        self.worker_versions.forget(worker)
        self.ingest.remove_worker(worker)
        self.view.remove_worker(worker)
        self.clocks.remove(worker)
        self.skew_news.remove(worker, time.monotonic())
        self.eligibility.removed(worker)
        self.unheard.removed(worker)
        self.dispatcher.worker_gone(worker)
        self._load_said.forget(worker)
        self._first_heard.forget(worker)
        self.load_over_budget.pop(worker, None)
        if self._load_subs is not None:
            self._load_subs.workers_changed()
        self.path.admission.notify()  # a model whose last worker left: its waiters get that 503 now

    def _on_kv_events(self, worker: str, events: list[KvEvent]) -> None:
        pending = self.pending
        for ev in events:
            if isinstance(ev, Stored | Removed):
                pending.confirm(worker, ev.hashes)
            elif isinstance(ev, Cleared):
                pending.forget_worker(worker)

    async def _nats_disconnected(self) -> None:
        # Marked here, not only on reconnect: nats-py reports the connection up before it runs the
        # reconnected callback, and /ready must not say 200 in between (no shim is back yet).
        self._reconnected_at = time.monotonic()
        if self._dispatcher is not None:
            self._dispatcher.nats_lost()

    async def _kv_disconnected(self) -> None:
        if self.status in (RouterStatus.STOPPING, RouterStatus.STOPPED):
            return  # our own drain at stop
        self.kv_disconnects += 1
        log.warning(
            "the KV event connection to NATS dropped: NATS is unreachable, or nats-server cut it as a slow consumer "
            "(a worker may publish more KV events than this replica folds); routing goes on, the index catches up "
            "from each worker once it is back"
        )

    async def _load_disconnected(self) -> None:
        if self.status in (RouterStatus.STOPPING, RouterStatus.STOPPED):
            return  # our own drain at stop
        self.load_disconnects += 1
        log.warning(
            "the load report connection to NATS dropped: NATS is unreachable, or nats-server cut it as a slow "
            "consumer (load reports coming faster than this replica reads them: a sender over its budget is named "
            "in a WARNING of its own); replies go on on the main connection, workers read silent until it is back"
        )

    async def _kvstate_disconnected(self) -> None:
        if self.status in (RouterStatus.STOPPING, RouterStatus.STOPPED):
            return  # our own drain at stop
        self.kvstate_disconnects += 1
        log.warning(
            "the kvstate connection to NATS dropped: NATS is unreachable, or nats-server cut it as a slow consumer "
            "(the shims' dumps in flight past its pending bytes); the repairs in flight fail and are retried once it "
            "is back, their workers out of routing meanwhile; requests and replica sync go on on the main connection"
        )

    async def _kv_reconnected(self) -> None:
        if self._ingest is not None:  # the quarantine's changes held while it was down
            self._ingest.subscriptions.reconnected()

    async def _load_reconnected(self) -> None:
        if self._load_subs is not None:  # the quarantine's changes held while it was down
            self._load_subs.reconnected()

    def _nats_errors(self, conn: str) -> Callable[[Exception], Awaitable[None]]:
        """The error_cb of connection `conn`: messages nats-py dropped as a slow consumer (a handler
        behind by its subscription's pending limit) counted by subscription, a WARNING for each at
        most every 30 s; the rest as every NATS client says them (runtime.nats_connect)."""
        others = error_reporter(log, self.config.nats.shown_servers(), self.config.nats.credential_flags())

        async def on_error(exc: Exception) -> None:
            if not isinstance(exc, SlowConsumerError):
                await others(exc)
                return
            which = self._subscription(conn, exc.sub.subject)
            self.slow_consumer_dropped[which] += 1
            if (said := self._slow_consumer_said.get(which)) is None:
                said = self._slow_consumer_said[which] = RepeatedErrors(
                    log,
                    f"NATS subscription {exc.sub.subject} ({which})",
                    "its handler falls behind what comes: messages dropped, counted in "
                    "kvswitch_router_nats_slow_consumer_dropped_total"
                    + ("; a sender over its budget is named in a WARNING of its own" if which == "load" else ""),
                )
            await said.on_error(exc)

        return on_error

    def _subscription(self, conn: str, subject: str) -> str:
        """The kind of subscription (a metric label) `subject` is on connection `conn`."""
        if conn in ("load", "kv", "kvstate"):  # {ns}.load.* or {ns}.kv.* (or a worker's own), or kvstate replies
            return conn
        return "sync" if subject == subjects.sync(self.ns) else "replies"

    async def _nats_reconnected(self) -> None:
        self._reconnected_at = time.monotonic()
        if self._dispatcher is not None:
            self._dispatcher.nats_back()
        log.warning("NATS connection re-established: not ready until a worker reports again")

    async def _on_load(self, msg: Msg) -> None:
        # Its receipt before any await: a wait here is ours, and would read as the worker's clock behind
        received, at = time.time(), asyncio.get_running_loop().time()
        sender = msg.subject.rpartition(".")[2]
        if not self.load_budget.admit(sender, time.monotonic()):
            self._over_budget(sender, msg.subject)
            return
        # nats-py runs the callbacks of a queued backlog back to back: folded in one turn, 1,000
        # workers' reports held the loop for 0.2-0.3 s at a time (scale audit of 2026-12-06)
        await self._load_turns.take()
        try:
            report = decode_msg(msg.data, LoadReport)
        except ProtocolError as exc:
            self._load_dropped(msg.subject, str(exc))
            return
        if (problem := self._load_problem(msg.subject, report)) is not None:
            self._load_dropped(msg.subject, problem)
            return
        if self._registry is None:
            return  # before the registry starts: every worker is unknown then, none is counted
        info = self._registry.get(report.worker)
        if info is None:
            if not self._registry_ready:
                return  # nor before its first read of etcd is in: a record may be on its way
            self.load_unknown += 1  # not (yet) registered: holding it would let anyone grow our memory
            # not each worker at startup, nor one whose registration lands just after its first reports
            due = self._first_heard.past_grace(report.worker)
            if due and self._load_said("unknown", report.worker):
                self._unregistered_lines.say(
                    report.worker,
                    "load reports from worker %s dropped: it has no usable record under %s (logged once per "
                    "worker, counted in kvswitch_router_load_unknown_total)",
                    report.worker,
                    subjects.workers_prefix(self.ns),
                )
            return
        now = time.monotonic()
        stalled_within = functools.partial(self.loop_watch.stalled_within, until=at)  # the loop's, before the receipt
        if (skew := self.clocks.observe(report.worker, report.ts, received, stalled_within)) is not None:
            self.skew_news.heard(skew, now, report.period_s)
        if (said := self.skew_news.due(now)) is not None:
            _say_skews(said)
        if (back := self.view.update(report)) is not None and self._load_said("clock step", report.worker):
            self._clock_step_lines.say(
                report.worker,
                "worker %s's clock stepped back: a load report stamped %.1f s before its last one; its "
                "reports are taken in the order they come, so it stays routed; keep worker hosts on NTP "
                "(logged once per worker)",
                report.worker,
                back,
            )
        self.planner.disagg.transfers.reported(report.worker, report.kv_transfers_failed)
        if self.calibration is not None:
            self.calibration.observe(info, report)
        self.eligibility.reported(report.worker)
        if info.role != "prefill":
            self._reconnected_at = None
        self.ingest.check_digest(report)
        self.path.admission.notify()

    @staticmethod
    def _load_problem(subject: str, report: LoadReport) -> str | None:
        """Why a decoded load report must be dropped, or None. A shim publishes on its own subject
        only (NATS permissions can hold it to that): a report naming another worker would let one
        worker mark another draining or unhealthy, or keep a dead one alive."""
        sender = subject.rpartition(".")[2]
        if report.worker != sender:
            return f"it names worker {report.worker!r}, not {sender!r} whose subject it came on"
        return load_report_problem(report)

    def _load_dropped(self, subject: str, why: str) -> None:
        self.load_malformed += 1
        sender = subject.rpartition(".")[2]
        if self._load_said("malformed", sender):
            self._malformed_lines.say(
                sender,
                "malformed load report from worker %s dropped (logged once per worker, counted in "
                "kvswitch_router_load_malformed_total): %s",
                sender,
                why,
            )

    def _over_budget(self, sender: str, subject: str) -> None:
        if self._registry is not None and self._registry.get(sender) is not None:
            self.load_over_budget[sender] += 1
        if self._load_subs is not None:
            self._load_subs.quarantine(sender)
        if self._load_said("budget", sender):
            budget = self.load_budget
            self._over_budget_lines.say(
                sender,
                "load reports from worker %s come faster than %g a second (bursts of %g; a shim sends at most %g): "
                "the rest dropped unread, and %s unheard for %g s, twice as long each time it floods again up to %g s, "
                "so it reads silent (logged once per worker, counted in kvswitch_router_load_over_budget_total); "
                "something other than its shim "
                "publishes there (or an older shim given a --load-period-s under %g s, which shims now refuse)",
                sender,
                budget.rate_per_s,
                budget.burst,
                1 / MIN_LOAD_PERIOD_S,
                subject,
                self._load_subs.quarantine_s if self._load_subs is not None else 0,
                self._load_subs.quarantine_max_s if self._load_subs is not None else 0,
                MIN_LOAD_PERIOD_S,
            )

    async def _follow_config(self, watcher: ConfigWatcher) -> None:
        async for settings in watcher:
            if settings == self.settings:
                continue
            try:
                if settings.prefill_timeout_s >= self.config.request_timeout_s:
                    # as refused at startup (router.cli): a prefill leg that outlives the request's
                    # deadline is never blamed, so a hung prefill worker never falls back to local
                    raise ValueError(
                        f"prefill_timeout_s {settings.prefill_timeout_s:g} must be < this replica's "
                        f"--request-timeout ({self.config.request_timeout_s:g} s)"
                    )
                self.planner.configure(settings)
            except ValueError as exc:
                watcher.refuse(str(exc))
                continue
            self.settings = settings
            log.info("live config applied: %s", msgspec.to_builtins(settings))
            calibrated = self.calibration is not None
            digest = settings_digest(settings, calibrated=calibrated)
            if digest != self.peer_settings.digest:  # peers compare theirs with it
                self.peer_settings.mine(digest, settings_fields(settings, calibrated=calibrated))
                if self._registration is not None:
                    self._registration.update()

    # --- routing, for callers in-process (tests, bench) ----------------------------------------------

    def models(self) -> list[str]:
        return self.registry.models() if self._registry is not None else []

    def adapters(self) -> dict[str, str]:
        return self.registry.adapters() if self._registry is not None else {}

    def _departed(self) -> Mapping[str, Departed]:
        return self.registry.departed() if self._registry is not None else {}

    def aliases(self) -> dict[str, str]:
        return self.registry.aliases() if self._registry is not None else {}

    def name_clashes(self) -> dict[str, dict[str, list[str]]]:
        return self.registry.name_clashes if self._registry is not None else {}

    def max_model_len(self, model: str) -> int | None:
        return self.registry.max_model_len(model) if self._registry is not None else None

    @property
    def disagg(self) -> Disaggregator:
        """The policy, guard and outcome counts in use (read-only: live config changes them)."""
        return self.planner.disagg

    # --- metrics -------------------------------------------------------------------------------

    def _figures(self) -> StateFigures:
        return StateFigures(
            decisions={str(k): v for k, v in self._planner.disagg.counts.items()} if self._planner else {},
            index_blocks=len(self.index),
            index_entries=self.index.entries,
            index_memory_bytes=self.index.memory_bytes(),
            ingest=self._ingest.stats if self._ingest is not None else IngestStats(),
            queue_depth=self._path.admission.depth if self._path is not None else 0,
            inflight=self._path.inflight if self._path is not None else 0,
            workers=len(self._registry) if self._registry is not None else 0,  # routed or not
            retries=self._dispatcher.retries if self._dispatcher is not None else 0,
            engine_refusals=dict(self._dispatcher.engine_refusals) if self._dispatcher is not None else {},
            prefill_fallbacks=self._dispatcher.fallbacks if self._dispatcher is not None else 0,
            refusal_fallbacks=self._dispatcher.refusal_fallbacks if self._dispatcher is not None else 0,
            transfer_fallbacks=self._dispatcher.transfer_fallbacks if self._dispatcher is not None else 0,
            handle_fallbacks=self._dispatcher.handle_fallbacks if self._dispatcher is not None else 0,
            slow_readers=self._dispatcher.slow_readers if self._dispatcher is not None else 0,
            client_buffered=self._dispatcher.buffers.held if self._dispatcher is not None else 0,
            client_buffer_budget=self.config.client_buffer_bytes,
            client_buffer_cuts=dict(self._dispatcher.buffers.cuts) if self._dispatcher is not None else {},
            cancels_again=self._dispatcher.cancels_again if self._dispatcher is not None else 0,
            malformed_replies=dict(self._dispatcher.malformed_replies) if self._dispatcher is not None else {},
            refusals_overruled=dict(self._dispatcher.refusals_overruled) if self._dispatcher is not None else {},
            legs_failed=dict(self._dispatcher.legs_failed) if self._dispatcher is not None else {},
            load_malformed=self.load_malformed,
            load_unknown=self.load_unknown,
            load_over_budget=self.load_budget.over,
            worker_load_over_budget=dict(self.load_over_budget),
            kv_disconnects=self.kv_disconnects,
            kv_quarantined=len(self._ingest.subscriptions.quarantined()) if self._ingest is not None else 0,
            kv_quarantines=self._ingest.subscriptions.quarantines if self._ingest is not None else 0,
            load_disconnects=self.load_disconnects,
            kvstate_disconnects=self.kvstate_disconnects,
            load_quarantined=len(self._load_subs.quarantined()) if self._load_subs is not None else 0,
            load_quarantines=self._load_subs.quarantines if self._load_subs is not None else 0,
            slow_consumer_dropped=dict(self.slow_consumer_dropped),
            records_refused=self._registry.refused if self._registry is not None else 0,
            sync=self._sync.stats if self._sync is not None else SyncStats(),
            timing=self.calibration.factors() if self.calibration is not None else {},
            timing_dropped=self.calibration.dropped() if self.calibration is not None else {},
            clock_offsets=self.clocks.offsets(),
            credit_short=self.view.credit_short(),
            transfers_failing=self._planner.disagg.transfers.workers() if self._planner else [],
            prompt_tokens=self._planner.reach.as_dict() if self._planner else {},
            peer_settings_mismatch=self.peer_settings.settings_mismatch(),
            peer_version_mismatch=self.peer_settings.version_mismatch(),
            workers_other_version=len(self.worker_versions.others()),
            workers_routable=dict(self.fleet_news.routable),
            workers_excluded={m: {str(r): n for r, n in by.items()} for m, by in self.fleet_news.excluded.items()},
            config_rejected=self.config_rejected,
            loop_stalls=self.loop_watch.stalls,
        )
