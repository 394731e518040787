"""`WorkerShim`: the sidecar's lifecycle around one engine.

A session lasts while the engine is healthy: the shim waits until the engine answers health, checks
its limits against the flags, starts the engine's event stream and waits until it is live, asks the
engine for its tokenizer fingerprint (asked again in the background while the engine fails that for
now: worker_shim.tokenizer_probe), then registers (a `discovery.Registration`: worker id = the
lease id, or `worker_name`; a fresh random epoch), publishes its state so far, subscribes its
subjects and serves. A session ends when the engine fails `health_failures` checks in a row, or
leaves /health unanswered for `busy_limit_s`, or makes no progress for `stall_limit_s`, or when its
event stream shows it restarted (EngineRestarted: back before the health checks failed, maybe with
other limits): Cleared, deregister, wait for it to come back. Only the stall, a proven hang, ends
the legs in flight (a retryable 503 `engine_unavailable`); on the others they run on, still
watched for a stall. It also ends when the shim stops (stop taking requests, finish in-flight
within `drain_grace_s`, revoke the lease, close), and, as a failed session, when the worker id's
KV publisher or load reporter crashed: a new session registers from a clean state. Legs a session leaves running keep
the old id's cancel subject heard until they end (routers cancel on the id they sent a leg to); a
session that served SESSION_SERVED_S before it failed starts the backoff before the next over.

A lost lease does not end the session. etcd merely unreachable changes nothing at all. When etcd
says the lease is gone, the Registration registers anew and the shim takes a new epoch and
publishes Cleared plus its state on the new id's subjects; the old id's subscriptions (gen, cancel,
kvstate) and its KV stream stay for `grace_s` so routers still routing there are served, then they
end with Cleared (the session's end cuts the grace short), all but the cancel subject, kept while
the legs in flight then run. In-flight requests are never touched. With a stable `worker_name` the
subjects stay the same and only the epoch changes.

Everything the shim starts is kept on `self` and ended by `stop()`, which is safe to call twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from discovery import Discovery, DiscoveryError, KeyTaken, Lease, Registration, RegistrationState
from protocol import (
    Cleared,
    ConfigError,
    EngineClaim,
    ErrorInfo,
    KvEvent,
    Removed,
    SamplingParams,
    Usage,
    WorkerInfo,
    subjects,
)
from protocol.config import EtcdSettings, NatsSettings
from protocol.errors import listen_error
from protocol.hashing import block_hashes
from protocol.version import BUILD
from runtime import background, cancel_and_wait, clipped, ended, guarded
from runtime.loop_watch import LoopWatch
from runtime.nats_connect import refused_subscriptions
from runtime.nats_flush import flush
from runtime.nats_unsubscribe import unsubscribe
from worker_shim import engine_claim, takeover
from worker_shim.adapters import (
    EngineAdapter,
    EngineCold,
    EngineError,
    EngineHealth,
    EngineLimits,
    EngineLoad,
    ModelCard,
    make_adapter,
)
from worker_shim.adapters.base import LegRequest
from worker_shim.adapters.zmq_bind import BindPending
from worker_shim.adapters.zmq_events import ZmqEventsAdapter
from worker_shim.config import ShimConfig
from worker_shim.credit_check import CreditCheck, reusable
from worker_shim.endpoint_probe import EndpointProbe
from worker_shim.engine_events import EngineBatch, EngineRestarted, EngineStored
from worker_shim.etcd_episodes import CutOff, RegisterFailures, stale_key
from worker_shim.event_health import EventProblem
from worker_shim.event_sources import EventSources
from worker_shim.http_server import ShimHttpServer
from worker_shim.kv_publisher import KvPublisher, PublisherCounters, check_payload
from worker_shim.load_reporter import LoadReporter
from worker_shim.metrics import render_metrics
from worker_shim.model_config import kv_bytes_per_token
from worker_shim.nats_connect import connect_nats
from worker_shim.normaliser import Normaliser, NormaliserStats
from worker_shim.orphaned_legs import OrphanedLegs, follow_routers
from worker_shim.rebuild_guard import RebuildGuard
from worker_shim.request_service import RequestService, leg_cap
from worker_shim.router_presence import RouterPresence
from worker_shim.stall_watchdog import StallWatchdog
from worker_shim.tokenizer_probe import TokenizerRetry, registered_as, transient
from worker_shim.transfer_failures import TransferFailures

__all__ = ["ShimStatus", "WorkerShim"]

log = logging.getLogger(__name__)
# how often a crashed loop watch is started again, at most (_check_tasks)
LOOP_WATCH_AGAIN_S = 60.0
_T = TypeVar("_T")
LIVE_TIMEOUT_S = 30.0
WAIT_SAID_S = 30.0  # how often a shim waiting for its engine says so
ADAPTERS_POLL_S = 5.0  # how often the engine's /v1/models is read for LoRA adapters loaded or unloaded
SESSION_RETRY_MAX_S = 30.0  # the longest wait before a new session after sessions that failed
# A session that served this long after registering starts the wait after its failure over: it is
# no failing streak (rare crashes days apart added up to SESSION_RETRY_MAX_S out of routing).
SESSION_SERVED_S = 60.0
NAME_WAIT_MARGIN_S = 5.0  # past a held name's (or engine claim's) lease TTL, before it is taken for another shim's
_TRANSIENT_STATUS = (408, 429)  # refusals that pass, like a 5xx: retried
ALIVE_TOKEN = 1  # the prompt of the one-token request that tells a hung engine with nothing to do serves again
ALIVE_OUTPUT_TOKENS = 1
UNSUB_S = 10.0  # the most a worker id's close waits for its server's barrier and handlers
# At stop, for every id together: nc.drain comes after, and the CLI kills a shim at drain_grace_s + 30 s
# (a frozen server held the stop 10 s per id before, one barrier per id, each up to its full timeout).
UNSUB_STOP_S = 2.0
# A session that cannot bind the events endpoint yet is said at WARNING at most this often (INFO
# between): one a second (health_interval_s) for the minute a port stays in TIME_WAIT was 60 lines.
BIND_PENDING_SAID_S = 60.0
# Work beside the session's that failed with an error no rule expected (kvswitch_shim_task_failures_total).
TASKS = ("kv_publisher", "load_reporter", "orphan_check", "retire", "loop_watch")


class _TaskCrashed(Exception):
    """A task of the session (`task`, one of TASKS) no longer runs, `why` (runtime.ended);
    runtime.background logged its traceback as it crashed, so the session's end needs none."""

    def __init__(self, task: str, why: str) -> None:
        super().__init__(f"the {task} {why}")
        self.task = task


class _Stopped(Exception):
    """The shim stopped while a session started: no failure, the supervision ends."""


class ShimStatus(enum.Enum):
    NEW = "new"
    WAITING_ENGINE = "waiting_engine"  # the engine down, or its session starting (events, tokenizer)
    # The engine up and its events live: the key being created (a held --worker-name waited out),
    # or a try etcd failed (/health's etcd_why says why). Until 2026-12-07 both read waiting_engine.
    REGISTERING = "registering"
    WAITING_ETCD = "waiting_etcd"
    REGISTERED = "registered"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


def _checked(setting: str, flag: int | None, engine: int | None) -> int | None:
    if flag is not None and engine is not None and flag != engine:
        raise ConfigError(setting, flag, f"the engine reports {engine}; drop the flag or make them agree")
    return engine if engine is not None else flag


def _unanswered_warning(workers: Sequence[str], bound: float, exc: BaseException) -> None:
    log.warning(
        "closing worker id(s) %s did not finish within its %.1f s bound (%r): requests the server gave "
        "them before the UNSUB may go unanswered, their routers waiting out the worker's silence",
        ", ".join(workers), bound, exc,
    )  # fmt: skip


class _Presence:
    """One worker id on NATS: its subscriptions, and the KV stream and load reports of one epoch."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.subs: list[Subscription] = []
        self.publisher: KvPublisher | None = None
        self.reporter: LoadReporter | None = None
        self.ended = asyncio.Event()  # its session ended: a retired id's grace is over
        self.closing: asyncio.Future[None] | None = None  # its last unsubscribe, shielded from its caller

    async def on_kvstate(self, msg: Msg) -> None:
        if self.publisher is not None:
            await self.publisher.on_kvstate(msg)


class WorkerShim:
    def __init__(
        self, config: ShimConfig, nats: NatsSettings, etcd: EtcdSettings, adapter: EngineAdapter | None = None
    ) -> None:
        self.config = config.validate()
        self.nats_settings = nats
        self.etcd_settings = etcd
        self.ns = self.config.namespace
        self.adapter = adapter or make_adapter(self.config)
        self.events = self.adapter.event_health
        self.events.on_change = self._on_events_change
        self.events.holds = self._holds
        self.probe = EndpointProbe(
            self.events,
            self.adapter.serve_probe if self.adapter.serves_probe else None,
            block_size=lambda: self.limits.block_size,
            prefix_caching=lambda: self.limits.prefix_caching,
            where=self._event_endpoints,
            on_foreign=self._on_foreign_events,
            engine_url=self.config.engine_url,
            enabled=not self.config.no_endpoint_probe,
        )
        self.events.on_connected = self.probe.connected
        self.credit = CreditCheck(self.config.engine_url)
        self.transfers = TransferFailures(self.config.engine_url)
        self.status = ShimStatus.NEW
        self.worker_id: str | None = None
        self.epoch = 0
        self.registered = asyncio.Event()
        self.failure: BaseException | None = None
        self.done = asyncio.Event()
        self.limits = EngineLimits()
        self._reported = EngineLimits()  # what the engine reported this session (the flags aside)
        # Whether this session found --model in the engine's /v1/models (None: unread), which only
        # engines that refuse unlisted models require (_served_model_len)
        self._model_listed: bool | None = None
        if isinstance(self.adapter, ZmqEventsAdapter):
            self.adapter.engine_changed = self._engine_changed
        self.kv_bytes_per_token: int | None = None
        self.tokenizer = ""
        self._tokenizer_retry: TokenizerRetry | None = None  # this session's, while the engine fails the probe
        self.adapters: list[str] = []
        self._adapter_paths: dict[str, str | None] = {}  # each adapter's path (its card's `root`)
        self.aliases: list[str] = []  # the other names the engine serves --model under
        self.event_sources = EventSources(self.config)  # the engine's own list of its KV event endpoints
        self.normaliser: Normaliser | None = None
        self.requests: RequestService | None = None
        self.registration: Registration | None = None
        self._deregistering: Registration | None = None  # the one stop() revokes, for revoke_now
        self.sessions = 0
        self.session_failures = 0  # sessions ended by an error no rule expected (logged at ERROR)
        self.task_failures = dict.fromkeys(TASKS, 0)  # each logged at ERROR with its traceback
        self.registration_count = 0
        self.register_failures = RegisterFailures()  # each session's: _end_session ends it
        # Its stalls are no silence of etcd's (the lease's and the cut-off's lines name them), and one
        # WARNING says each (until 2026-12-07 only the router watched its loop).
        self.loop_watch = LoopWatch("this shim")
        self._loop_watch_started = -LOOP_WATCH_AGAIN_S  # when _check_tasks last started it again
        self._cut_off = CutOff(self.loop_watch.stalled_within)
        self.adapter.silence.own_stall = self.loop_watch.stalled_within  # nor of the engine's
        self.norm_stats = NormaliserStats()
        self.kv_counters = PublisherCounters()
        self.load_reports_sent = 0  # by every worker id this process registered
        self.load_reports_unencodable = 0  # reports that could not be encoded, so not sent (a bug)
        self.load_polls_failed: Counter[str] = Counter()  # by kind, by every worker id's reporter
        self.engine_events = 0
        self.engine_batches = {True: 0, False: 0}
        self.rebuild_guard = RebuildGuard()
        self.http = ShimHttpServer(self.config.http_host, self.config.http_port, self.health_report, self.metrics_text)
        self._nc: Nats | None = None
        self._discovery: Discovery | None = None
        self._presence: _Presence | None = None
        # Old worker ids still heard, each with the task that closes it (_retire); with --worker-name
        # one id may be here twice, from two sessions.
        self._retired: dict[_Presence, asyncio.Task[None]] = {}
        self._registered_at: float | None = None  # when the session first registered
        self._events_task: asyncio.Task[None] | None = None
        self._main: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None
        # What the stop did, for its last line (_say_stopped): legs drained and cut, and the worker's
        # registration as it left (its id, its lease, whether that went), None where none was held.
        self._drained = (0, 0)
        self._left: tuple[str, Lease, bool | None] | None = None
        self._said: dict[str, None] = {}  # insertion-ordered: the oldest text is dropped first
        self._pending_said_at: float | None = None  # when a BindPending session was said at WARNING
        self._engine_load: EngineLoad | None = None  # the last usable reading of the engine's load
        self._engine_load_at: float | None = None  # ... and the time.monotonic() it came back
        self._iterating_at: float | None = None  # the last reading held while iterations ran (EngineLoad.iterating)
        # The shim's, not a session's: it watches legs a session left running too.
        self.stall = StallWatchdog(
            lambda: self.requests,
            lambda: self.adapter,
            stall_limit_s=self.config.stall_limit_s,
            health_interval_s=self.config.health_interval_s,
            engine_url=self.config.engine_url,
            own_stall=self.loop_watch.stalled_within,
        )
        self._engine_seen = False  # whether the engine's /health has said up
        self._held_since: float | None = None  # when --worker-name or the engine was first found held by another lease
        self.orphans: OrphanedLegs | None = None  # the legs of routers that died (worker_shim.orphaned_legs)
        self._orphans_task: asyncio.Task[None] | None = None

    # --- public ---------------------------------------------------------------------------------

    def canonical_hashes(self) -> set[int]:
        """What the shim believes the engine caches, as canonical hashes."""
        return self.normaliser.canonical_hashes() if self.normaliser is not None else set()

    @property
    def publisher(self) -> KvPublisher | None:
        """The KV stream of the current worker id and epoch."""
        return self._presence.publisher if self._presence is not None else None

    @property
    def load_reporter(self) -> LoadReporter | None:
        return self._presence.reporter if self._presence is not None else None

    @property
    def nc(self) -> Nats:
        if self._nc is None:
            raise RuntimeError("the shim is not started")
        return self._nc

    @property
    def nats_state(self) -> str:
        nc = self._nc
        return "closed" if nc is None or nc.is_closed else "connected" if nc.is_connected else "reconnecting"

    @property
    def serving(self) -> bool:
        reg = self.registration
        return (
            self.status is ShimStatus.REGISTERED
            and reg is not None
            and reg.state in (RegistrationState.REGISTERED, RegistrationState.UNKNOWN)
        )

    @property
    def lease_unrenewed_s(self) -> float | None:
        """Seconds since etcd last renewed the lease while it does not answer; None otherwise."""
        return self.registration.unrenewed_s if self.registration is not None else None

    async def start(self) -> None:
        if self._main is not None:
            return
        max_legs = leg_cap(self.config.max_inflight_legs)  # before anything opens: a refusal leaks nothing
        if (untimed := self.config.timing_warning()) is not None:
            log.warning("%s", untimed)
        if not self.event_sources.discovers and self.config.engine != "trtllm" and self.config.kv_replay is None:
            self._warn_no_replay()
        try:
            await self.http.start()
        except OSError as exc:
            raise listen_error(self.config.http_host, self.config.http_port, exc) from exc
        try:
            self._nc = await connect_nats(self.nats_settings, f"kvswitch-shim-{self.config.model}")
            check_payload(self._nc.max_payload, self.nats_settings.shown_servers())
            self._discovery = await Discovery(self.etcd_settings, self.ns).connect()
            await self.adapter.open()
        except BaseException:
            await self._close_clients()
            raise
        self.requests = RequestService(
            self._nc,
            self.adapter,
            self._poke_load,
            self._cached_prompt_tokens,
            on_served=self._on_served,
            on_scheduled=self.credit.scheduled,
            on_transfer_failed=self.transfers.leg_failed,
            block_size=lambda: self.limits.block_size,
            max_model_len=lambda: self.limits.max_model_len,
            model=self.config.model,
            max_legs=max_legs,
        )
        self.orphans = OrphanedLegs(self.requests.origins, self.requests.cancel_from, self.config.orphan_grace_s)
        self._orphans_task = background(
            self._follow_routers(self.orphans),
            "shim-routers",
            "the legs of routers that died are no longer cancelled until the shim restarts",
        )
        self.status = ShimStatus.WAITING_ENGINE
        self.loop_watch.start()
        self._main = asyncio.create_task(self._supervise(), name="shim-supervisor")

    async def stop(self) -> None:
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._stop())
        await asyncio.shield(self._stop_task)

    def revoke_now(self) -> None:
        """For a process about to exit at once (a second SIGTERM: runtime.run_service's on_abort):
        revoke the worker's lease within about a second, off the event loop, so that its key goes
        now rather than when its TTL runs out."""
        registration = self.registration or self._deregistering  # a stop's revoke may be slow
        if registration is not None:
            registration.revoke_now()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- reports ----------------------------------------------------------------------------------

    def health_report(self) -> tuple[bool, dict[str, Any]]:
        """(serving, the body of GET /health). `engine_healthy` is what the load reports say of the
        engine (None while none are sent): routers exclude a worker whose reports say False, so
        /health shows it, with why, though the shim still serves."""
        reg = self.registration
        lease = reg.lease if reg is not None else None
        reporter = self.load_reporter
        return self.serving, {
            "status": "serving" if self.serving else self.status.value,
            "registration": reg.state.value if reg is not None else "none",
            "worker": self.worker_id or "",
            "epoch": f"{self.epoch:x}",
            "engine_healthy": reporter.healthy if reporter is not None else None,
            "engine_error": reporter.error if reporter is not None else "",
            "events_ok": self.events.ok,
            "events_why": self.events.why,
            "prefix_credit_short": self.credit.short,
            "nats": self.nats_state,
            "etcd": lease.state.value if lease is not None else "none",
            "etcd_why": self._cut_off.trouble(reg) or stale_key(reg) or self.register_failures.trouble(),
            "lease_unrenewed_s": None if (unrenewed := self.lease_unrenewed_s) is None else round(unrenewed, 1),
            "engine_url": self.config.engine_url,
            "retired_workers": sorted({p.worker for p in self._retired}),
            "events_lag_s": None if (lag := self.adapter.events_lag_s()) is None else round(lag, 1),
        }

    def metrics_text(self) -> bytes:
        return render_metrics(self)

    # --- supervision ----------------------------------------------------------------------------

    async def _supervise(self) -> None:
        failed = 0  # sessions in a row that ended in an error no rule expected
        try:
            while not self._stopping.is_set():
                try:
                    if not await self._wait_healthy() or not await self._wait_progress():
                        return
                    if not await self._keys_waited():
                        continue
                    self.limits = await self._check_limits()
                    if self.event_sources.discovers:  # each session: a restarted engine may publish elsewhere
                        await self._discover_events()
                    self.kv_bytes_per_token = self._kv_bytes_per_token()
                    await self._session()
                    failed = 0
                except ConfigError:
                    raise
                except _Stopped:
                    return
                except BindPending as exc:
                    # A listed endpoint this host cannot bind yet: its cause was said once, naming the
                    # setting; each session's is as a --kv-events bind's (_wait_live).
                    self._bind_pending(exc)
                    await self._rest(self.config.health_interval_s)
                except Exception as exc:
                    # Say it, then start over as after an engine restart: a NATS flush that timed
                    # out or an engine's odd answer must not end the process with a traceback.
                    # Read once: a step before the next session that fails is no session that served.
                    at, self._registered_at = self._registered_at, None
                    failed = 1 if at is not None and time.monotonic() - at >= SESSION_SERVED_S else failed + 1
                    self.session_failures += 1
                    wait = min(SESSION_RETRY_MAX_S, self.config.health_interval_s * 2 ** min(failed - 1, 10))
                    # The engine's fault needs none; a crashed task's was logged as it crashed.
                    trace = None if isinstance(exc, EngineError | _TaskCrashed) else exc
                    log.error("the session with the engine at %s failed: %s; a new one starts in %.1fs",
                              self.config.engine_url, clipped(repr(exc)), wait, exc_info=trace)  # fmt: skip
                    await self._rest(wait)
        except ConfigError as exc:
            log.error("shim cannot serve this engine: %s", exc)
            self.failure = exc
            self.status = ShimStatus.FAILED
        finally:
            self.done.set()

    def _bind_pending(self, exc: BindPending) -> None:
        """A session does not start for a bind a later one may make: its cause is on /health
        (events_why) and kvswitch_shim_events_problem{problem="bind_pending"} until a session's
        events go live, and said at WARNING at most every BIND_PENDING_SAID_S."""
        self.events.problem(EventProblem.BIND_PENDING, str(exc), logging.DEBUG)  # said below
        now = time.monotonic()
        level = logging.INFO
        if self._pending_said_at is None or now - self._pending_said_at >= BIND_PENDING_SAID_S:
            self._pending_said_at, level = now, logging.WARNING
        log.log(level, "the session does not start: %s", exc)

    async def _rest(self, wait: float) -> None:
        """`wait` seconds before the next session, or less if the shim stops."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._stopping.wait()

    def _warn_no_replay(self) -> None:
        """Without a replay endpoint nothing shows that a reconnection of the event socket is to the
        same engine run, so each one ends the session (zmq_events): said once, at start."""
        self._say_once(
            logging.WARNING,
            "no --kv-replay for the %s engine's KV events: the shim cannot show that a reconnection of its event "
            "socket (a network blip, a proxy's idle timeout) is to the same engine run, so every one ends the "
            "session and the worker registers anew under a new id, its index rebuilt from what the engine "
            "publishes next; give --kv-replay with the engine's replay endpoint (replay_endpoint in its "
            "--kv-events-config)",
            self.config.engine,
        )

    def _say_once(self, level: int, message: str, *args: object) -> None:
        text = message % args
        if text in self._said:
            return
        # A text can name what changes (adapters): the oldest goes past 1024, so a new one is still said.
        self._said[text] = None
        if len(self._said) > 1024:
            del self._said[next(iter(self._said))]
        log.log(level, "%s", text)

    async def _wait_healthy(self) -> bool:
        """Until the engine's /health says up (True) or the shim stops (False); says that it waits,
        and again every WAIT_SAID_S, so a shim whose engine never comes is not silent. A /health
        answered 404 or 405 before the engine was first up is a wrong --engine-url (ConfigError:
        exit 2); until 2026-12-07 the shim waited for good at INFO. A refused connection or a 503
        (an engine starting) is waited for."""
        self.status = ShimStatus.WAITING_ENGINE
        c = self.config
        since = time.monotonic()
        said: float | None = None
        while (health := await self.adapter.health()) is not EngineHealth.UP:
            # Before the engine was first up only: a 404 after it is whatever answers at its address now.
            if not self._engine_seen and (wrong := await self.adapter.misdirected()) is not None:
                raise wrong
            if self.requests is not None and self.requests.inflight:
                await self._watch_left_legs()
            now = time.monotonic()
            if said is None or now - said >= WAIT_SAID_S:
                waited = f" for {now - since:.0f}s" if said is not None else ""
                log.info("waiting for the %s engine at %s: its /health is %s%s (check --engine-url and the engine)",
                         c.engine, c.engine_url, health.value, waited)  # fmt: skip
                said = now
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(c.health_interval_s):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return False
        self._engine_seen = True
        if said is not None:
            log.info("the engine at %s is up after %.0fs", c.engine_url, time.monotonic() - since)
        return True

    async def _wait_progress(self) -> bool:
        """After a session ended on a hung engine: until it moves again, or, with nothing left to
        do, serves a one-token request within the stall limit (True), or the shim stops (False).
        Its /health answers all along, and registering at once would hand it new requests to hang
        on. Nothing left to do is no sign of life: its legs were failed as the session ended, and
        a hung engine's stats can stay at what it last reported (0 running, 0 waiting). With
        --no-endpoint-probe no such request is sent: its step counter or KV usage must move."""
        said = False
        while (stalled := self.stall.stalled) is not None:
            await self._read_load()
            mark = self.stall.progress(self._engine_load)
            if mark is not None:
                moved = mark.moved_since(stalled)
            elif self.stall.idle(self._engine_load).moved_since(stalled):
                moved = True
            elif self.config.no_endpoint_probe:
                moved = False
                if not said:
                    said = True
                    log.warning(
                        "the engine at %s has nothing to run: --no-endpoint-probe sends it no one-token request to "
                        "tell whether it serves again, so it stays deregistered until its step counter or KV usage "
                        "moves (a request sent to it directly does it)",
                        self.config.engine_url,
                    )
            else:
                served = await self._unless_stopping(self._serves_one_token())
                if served is None:
                    return False
                moved = served
            if moved:
                log.info("the engine at %s makes progress again", self.config.engine_url)
                self.stall.stalled = None
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.health_interval_s):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return False
        return True

    async def _watch_left_legs(self) -> None:
        """The stall watchdog over legs left running when the session ended on a busy or down
        engine: one that hangs later still has them ended after the stall limit. No load reporter
        runs between sessions, so the engine's load is read here."""
        await self._read_load()
        why = self._hung(time.monotonic())
        if why is not None:
            await self._fail_legs(why)

    async def _read_load(self) -> None:
        """The engine's load between sessions (no load reporter runs), as the reporter's polls take
        it: a stale reading is no news, and stamps no time."""
        with contextlib.suppress(EngineError):
            load = await self.adapter.load()
            if load.iterating:
                self._iterating_at = time.monotonic()
            if not load.stale:
                self._engine_load, self._engine_load_at = load, time.monotonic()

    async def _unless_stopping(self, work: Coroutine[Any, Any, _T]) -> _T | None:
        """`work`'s result; None, `work` cancelled, as soon as the shim stops: a stop waited out a
        hung engine's one-token request, up to the stall limit (120 s), before."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(task, stop)
        return None if task.cancelled() else task.result()  # an error it ended with is raised

    async def _serves_one_token(self) -> bool:
        """Whether the engine serves a one-token completion of a one-token prompt within the stall
        limit (cancelled past it: its connection closed, which the engines take for an abort).
        Counted with the endpoint probes' work (EndpointProbe.alive_sent): it is no client's."""
        leg = LegRequest(
            request_id=f"kvswitch-alive-{secrets.token_hex(8)}",
            model=self.config.model,
            token_ids=[ALIVE_TOKEN],
            sampling=SamplingParams(max_tokens=ALIVE_OUTPUT_TOKENS),
            stream=False,
            transfer=self.adapter.alive_transfer(),
        )
        self.probe.alive_sent(len(leg.token_ids), ALIVE_OUTPUT_TOKENS)
        try:
            async with asyncio.timeout(self.config.stall_limit_s):
                await self.adapter.generate(leg, _no_output)
        except (TimeoutError, EngineError):
            return False
        return True

    async def _check_limits(self) -> EngineLimits:
        c = self.config
        eng = self._reported = await self._engine_limits()
        limits = EngineLimits(
            block_size=_checked("block_size", c.block_size, eng.block_size),
            kv_total_blocks=_checked("kv_total_blocks", c.kv_total_blocks, eng.kv_total_blocks),
            max_num_batched_tokens=_checked(
                "max_num_batched_tokens", c.max_num_batched_tokens, eng.max_num_batched_tokens
            ),
            cache_dtype=eng.cache_dtype,
            max_model_len=await self._served_model_len(),
            prefix_caching=eng.prefix_caching,
        )
        if eng.prefix_caching is False:
            self._say_once(
                logging.WARNING,
                "the %s engine at %s runs without prefix caching (vLLM: --no-enable-prefix-caching; SGLang: "
                "--disable-radix-cache): it reuses no cached prompt and publishes no KV events, so routers route "
                "to this worker by load alone",
                c.engine,
                c.engine_url,
            )
        if limits.block_size is None:
            raise ConfigError("block_size", None, f"the {c.engine} engine does not report it: give --block-size")
        for name, flag in (
            ("kv_total_blocks", "--kv-total-blocks"),
            ("max_num_batched_tokens", "--max-num-batched-tokens"),
        ):
            if getattr(eng, name) is None:
                value = getattr(limits, name)
                self._say_once(
                    logging.INFO,
                    "the %s engine does not report %s: %s",
                    c.engine,
                    name,
                    f"registering {flag} {value}" if value is not None else f"not registered (give {flag})",
                )
        if limits.max_model_len is None:
            self._say_once(
                logging.INFO,
                "the %s engine does not report max_model_len on /v1/models: %s",
                c.engine,
                "routers' /v1/models will not show it",
            )
        return limits

    async def _engine_changed(self) -> str | None:
        """What the engine reports now that differs from what this session registered: its limits,
        or --model's context length or listing; None if nothing. One that cannot be read is taken as
        changed (a restart is not ruled out). LoRA adapters and other names are followed anyway
        (_poll_adapters)."""
        c = self.config
        try:
            eng = await self._engine_limits()
            models = await self.adapter.served_models()
        except Exception as exc:  # whatever it is, the session cannot be shown to hold
            return f"its limits could not be read again ({clipped(repr(exc))})"
        if eng != self._reported:
            return f"its limits went from {self._reported} to {eng}"
        # As the session found them: an engine that did not list --model (SGLang under another
        # served name) or whose /v1/models was unread (where allowed) ended every session that
        # reconnected, where nothing had changed (final read of 2026-12-07)
        if models is None:
            unread = self._model_listed is None
            return None if unread else f"its /v1/models could not be read again at {c.engine_url}"
        if c.model not in models:
            return f"it no longer lists --model {c.model}" if self._model_listed else None
        if (now := models[c.model].max_model_len) != self.limits.max_model_len:
            return f"--model's max_model_len went from {self.limits.max_model_len} to {now}"
        return None

    async def _engine_limits(self) -> EngineLimits:
        """The limits the engine reports. A 5xx or no answer (its limits endpoint timed out or
        answered 503) fails the session, which is retried: taken as "no limits", one blip ended the
        shim asking for --block-size, or skipped the check of the flags given. A 404 is an engine
        without the route (an agg shim's SGLang serving no server info): it reports no limits, and
        the flags stand in, as before; retried, the shim never registered. Any other refusal is the
        operator's."""
        try:
            return await self._warm_limits()
        except EngineError as exc:
            if exc.code >= 500 or exc.code in _TRANSIENT_STATUS:
                raise
            if exc.code != 404:
                raise ConfigError(
                    "engine_url", self.config.engine_url, f"the engine refuses its limits: {exc}"
                ) from exc
            self._say_once(logging.WARNING, "the %s engine reports no limits (%s): the flags stand in",
                           self.config.engine, exc.message)  # fmt: skip
            return EngineLimits()

    async def _warm_limits(self) -> EngineLimits:
        """The engine's limits; one that has served nothing yet (EngineCold) is warmed up and asked
        again. Still none after that (a TensorRT-LLM without enable_iter_perf_stats, or whose stats
        lag its first answer): the flags stand in where --block-size is given, else the session
        fails (EngineCold, a 503) and is retried. Until 2026-12-07 a fresh TensorRT-LLM's [] was "no
        limits", the shim exited asking for --block-size, and its next session's [] (each stat is
        handed out once) did the same."""
        try:
            return await self.adapter.limits()
        except EngineCold as exc:
            await self._warm_up(exc)
        try:
            return await self.adapter.limits()
        except EngineCold as exc:
            if self.config.block_size is None:
                raise
            self._say_once(logging.WARNING, "%s, after serving a one-token request: the flags stand in",
                           exc.message)  # fmt: skip
            return EngineLimits()

    async def _warm_up(self, cold: EngineCold) -> None:
        """Have an engine that reports nothing until it has served a request (`cold`) serve one
        one-token request (_serves_one_token, counted as one); EngineError where it does not, or
        --no-endpoint-probe forbids requests of the shim's own: the session fails, retried."""
        url = self.config.engine_url
        if self.config.no_endpoint_probe:
            raise EngineError(
                503, "engine_unavailable", f"{cold.message}; --no-endpoint-probe sends it no one-token request of "
                f"the shim's own: send one to {url} directly",
            )  # fmt: skip
        log.info("%s: sending it a one-token request", cold.message)
        served = await self._unless_stopping(self._serves_one_token())
        if served is None:
            raise _Stopped
        if not served:
            raise EngineError(
                503, "engine_unavailable", f"{cold.message}, and it did not serve a one-token request within "
                f"{self.config.stall_limit_s:.0f}s (--stall-limit-s)",
            )  # fmt: skip

    async def _served_model_len(self) -> int | None:
        """--model's max_model_len from the engine's /v1/models, whose other names for it and LoRA
        adapters on it are taken too (`_take_served_names`); a model the engine does not list is a
        startup error where the engine refuses requests for it (vLLM), a warning elsewhere. Where it is an
        error, an unreadable /v1/models fails the session (retried): unread is not "listed"."""
        c = self.config
        models = await self.adapter.served_models()
        self._model_listed = None if models is None else c.model in models
        if models is None and self.adapter.requires_served_model:
            raise EngineError(
                503, "engine_unavailable", f"GET {c.engine_url}/v1/models failed: --model is checked before registering"
            )
        if models is not None and c.model in models and (parent := models[c.model].parent) is not None:
            # Registered as a model of its own, its prompts were hashed unsalted while its engine's
            # events name the adapter: base-model blocks were credited to its requests.
            why = (
                f"the engine at {c.engine_url} serves it as a LoRA adapter of {parent}: give --model {parent}, "
                "whose adapters the shim registers and routers route by name"
            )
            raise ConfigError("model", c.model, why)
        if models is None or c.model in models:
            self._take_served_names(models)
            return models[c.model].max_model_len if models else None
        if self.adapter.requires_served_model:
            raise self._not_served(models)
        served = ", ".join(sorted(models)) or "no model"
        self._say_once(logging.WARNING, "the engine at %s lists %s, not --model %s", c.engine_url, served, c.model)
        return None

    def _not_served(self, models: dict[str, ModelCard]) -> ConfigError:
        served = ", ".join(sorted(models)) or "no model"
        why = f"the engine at {self.config.engine_url} serves {served}: give --model one of them"
        return ConfigError("model", self.config.model, why)

    async def _discover_events(self) -> None:
        """Take the KV event endpoints of the rank this shim serves from the engine's own list, when
        none were given (worker_shim.event_sources)."""
        self.config, rank = await self.event_sources.take(self.adapter, self.config)
        c = self.adapter.config = self.config
        if c.kv_replay is None:
            self._warn_no_replay()
        log.info(
            "KV events of rank %d from the engine's /kv_event_sources: %s (%s), replay %s, topic %r",
            rank, c.kv_events, c.kv_events_mode, c.kv_replay, c.kv_events_topic,
        )  # fmt: skip

    def _take_served_names(self, cards: dict[str, ModelCard] | None) -> bool:
        """Take the other names the engine serves --model under and the LoRA adapters on it that
        the engine lists; True when they changed."""
        if cards is None:
            return False
        c = self.config
        aliases = _aliases(cards, c.model)
        changed = aliases != self.aliases
        if changed:
            log.info("the engine serves %s under other names too: %s", c.model, ", ".join(aliases) or "none")
            self.aliases = aliases
            if self.requests is not None:
                self.requests.aliases = frozenset(aliases)
        # vLLM names an adapter's parent by the first of the model's names, which need not be --model.
        bases = {c.model, *aliases}
        listed = sorted(name for name, card in cards.items() if card.parent in bases)
        if listed and not self.adapter.serves_adapters_by_name:
            self._say_once(
                logging.WARNING,
                "the %s engine lists LoRA adapters (%s), but kvswitch routes adapters by name only on vLLM: "
                "requests naming them are refused",
                c.engine,
                ", ".join(listed),
            )
            listed = []
        self._follow_adapter_paths({name: cards[name].root for name in listed})
        if listed == self.adapters:
            return changed
        log.info("the engine serves LoRA adapters on %s: %s", c.model, ", ".join(listed) or "none")
        self.adapters = listed
        return True

    def _follow_adapter_paths(self, paths: dict[str, str | None]) -> None:
        """Stop publishing the chains of an adapter unloaded or re-pointed at another path since
        the engine was last read: vLLM 0.32 hashes an adapter's blocks by its name and path, so the
        engine reuses them no more, while its KV events name the adapter alone. An adapter loaded
        again from a path it was dropped from gets its chains back from the engine's replay."""
        norm = self.normaliser
        if norm is None:  # before the first session: what the engine serves is where it starts
            self._adapter_paths = paths
            return
        if self.registration is None:
            # Between sessions: a change is judged once the next one runs, its replay read (the
            # paths taken now, a path changed meanwhile was never dropped).
            return
        before, self._adapter_paths = self._adapter_paths, paths
        out: list[KvEvent] = []
        for name, path in before.items():
            if name in paths and paths[name] == path:
                continue
            removed = norm.drop_adapter(name, path)
            out += removed
            log.info(
                "LoRA adapter %s %s: the engine reuses none of what it cached from %s, so %d cached blocks are "
                "withdrawn from routers",
                name,
                f"now loads from {paths[name]}" if name in paths else "was unloaded",
                path,
                sum(len(e.hashes) for e in removed if isinstance(e, Removed)),
            )
        self._publish(out)
        revived = [name for name, path in paths.items() if before.get(name) != path and norm.revive_adapter(name, path)]
        if revived:
            self.adapter.request_rebuild()

    async def _poll_adapters(self) -> None:
        """Register adapters loaded or unloaded at run time (vLLM's /v1/load_lora_adapter); check
        --model again as at the start: an engine restarted faster than the health checks notice
        would otherwise leave a worker every request 404s on."""
        models = await self.adapter.served_models()
        if models is not None and self.config.model not in models and self.adapter.requires_served_model:
            raise self._not_served(models)
        if self._take_served_names(models) and self.registration is not None:
            self.registration.update()

    def _kv_bytes_per_token(self) -> int | None:
        c = self.config
        if c.kv_bytes_per_token is not None:
            return c.kv_bytes_per_token
        model_dir = c.model_path or (c.model if Path(c.model).is_dir() else None)
        if model_dir is None:
            self._say_once(
                logging.INFO,
                "kv_bytes_per_token not registered: the served model %r is not a local directory; give "
                "--model-path DIR (its config.json) or --kv-bytes-per-token",
                c.model,
            )
            return None
        value, why = kv_bytes_per_token(model_dir, self.limits.cache_dtype)
        if value is None:
            self._say_once(logging.WARNING, "kv_bytes_per_token not registered: %s", why)
        return value

    async def _tokenizer(self) -> str:
        """The engine's tokenizer fingerprint, "" when unknown; a probe the engine failed for now
        is tried again through the session (worker_shim.tokenizer_probe), and registered once it
        succeeds."""
        why = f"the {self.config.engine} adapter cannot ask the engine to tokenize"
        try:
            fp = await self.adapter.tokenizer_fingerprint()
        except EngineError as exc:
            if transient(exc):
                self._tokenizer_retry = TokenizerRetry(self.adapter.tokenizer_fingerprint, exc, self._tokenizer_found)
                return ""
            fp, why = None, f"the engine's tokenizer could not be probed ({exc})"
        if fp is None:
            self._say_once(
                logging.WARNING, "%s: tokenizer unknown, so routers refuse text requests for this worker", why
            )
            return ""
        return registered_as(fp)

    def _tokenizer_found(self, fp: str) -> None:
        self.tokenizer = fp
        if self.registration is not None:  # else the registration, still to come, reads it
            self.registration.update()

    def _info(self, worker: str) -> WorkerInfo:
        c, lim = self.config, self.limits
        assert lim.block_size is not None
        return WorkerInfo(
            worker=worker,
            model=c.model,
            role=c.role,
            engine=c.engine,
            block_size=lim.block_size,
            kv_total_blocks=lim.kv_total_blocks,
            max_num_batched_tokens=lim.max_num_batched_tokens,
            kv_bytes_per_token=self.kv_bytes_per_token,
            timing_profile=c.timing_profile,
            epoch=self.epoch,
            version=BUILD,
            engine_url=c.engine_url,
            tokenizer=self.tokenizer,
            events_ok=self.events.ok,
            shim_url=self.http.url,
            max_model_len=lim.max_model_len,
            adapters=self.adapters,
            aliases=self.aliases,
            prefix_caching=lim.prefix_caching is not False,
            sliding_window=self.normaliser.windows.window if self.normaliser is not None else 0,
            local_prefill=c.role != "decode" or self.adapter.decode_prefills,
        )

    # --- engine events ------------------------------------------------------------------------------

    async def _sink(self, batch: EngineBatch) -> None:
        norm = self.normaliser
        if norm is None:
            return
        self.engine_events += len(batch.events)
        self.engine_batches[batch.live] += 1
        if batch.reset:
            self.events.void_judgements()
        if batch.events:
            stored = any(isinstance(e, EngineStored) and not self.probe.owns(e) for e in batch.events)
            if batch.live:
                self.events.live(stored)
            else:
                self.events.replayed(stored)
        self.probe.batch(batch)
        if self.probe.foreign:
            return  # another engine's: withheld (_on_foreign_events cleared what was published)
        out = norm.reset(exact=batch.complete) if batch.reset else []
        window = norm.windows.window
        for _ in norm.folding(batch.events, out):
            # Part of a long chain folded (a 128 k-token prompt's one Stored is 8,192 blocks):
            # published before the loop runs, as what runs may read the set (a kvstate dump).
            self._publish(out)
            out.clear()
            await asyncio.sleep(0)
        if norm.windows.window != window:
            log.info(
                "the engine runs a hybrid model (a sliding window of %d tokens): its cached prefixes are "
                "reused only where the window is cached too, which routers are told",
                norm.windows.window,
            )
            if self.registration is not None:
                self.registration.update()
        if norm.needs_rebuild:
            parents, norm.rebuild_parents = norm.rebuild_parents, set()
            if self.rebuild_guard.ask(parents):
                log.warning("KV event with an unknown parent: asking the engine for its whole state")
                self.adapter.request_rebuild()
        self._publish(out)

    def _event_endpoints(self) -> str:
        c = self.config
        return f"--kv-events {c.kv_events}" + (f" (--kv-replay {c.kv_replay})" if c.kv_replay else "")

    def _on_foreign_events(self, foreign: bool) -> None:
        """The endpoint probe found the stream another engine's (withhold it: routers forget what
        it said) or, after that, this engine's (rebuild the index from the engine's replay)."""
        norm = self.normaliser
        if foreign and norm is not None:
            self._publish(norm.reset(exact=False))
        elif not foreign:
            self.adapter.request_rebuild()

    def _publish(self, out: list[KvEvent]) -> None:
        if out:
            for presence in self._presences():
                if presence.publisher is not None:
                    presence.publisher.add(out)

    def _holds(self, canonical: int) -> bool:
        return self.normaliser is not None and self.normaliser.holds(canonical)

    def _on_served(self, request_id: str, token_ids: list[int], salt: str, usage: Usage) -> None:
        bs = self.limits.block_size
        if not bs or self.limits.prefix_caching is False:  # no Stored event is due
            return
        full = len(token_ids) // bs
        cached = usage.cached_tokens
        uncached = full - (cached or 0) // bs
        hit = reusable(full * bs, len(token_ids), bs)  # what the engine counts for a prompt all cached
        if uncached > 0 and not (cached is not None and 0 < hit <= cached):
            last = block_hashes(token_ids[: full * bs], bs, salt=salt)[-1]
            # The engine's own word on this prompt's cache is final; without it, its reuse counter.
            leg = self.requests.inflight.get(request_id) if self.requests is not None and cached is None else None
            before = leg.reuse_before if leg is not None else None
            self.events.expect_stored(last, request_id, uncached, before=before, served=time.monotonic(), hit=hit)

    def _count_load_report(self) -> None:
        self.load_reports_sent += 1

    def _count_unencodable_report(self) -> None:
        self.load_reports_unencodable += 1

    def _on_engine_reading(self, asked: float, done: float, load: EngineLoad | None) -> None:
        if load is not None and load.stale:
            # The last figures again: no time stamped (the stall watchdog then takes progress for
            # unknown), and its counters say nothing of now (reuse, failed pulls). Until 2026-12-07
            # TensorRT-LLM's repeated load read as fresh: a long non-streamed request from idle was
            # ended as hung. One held while iterations run is progress (_hung).
            if load.iterating:
                self._iterating_at = done
            return
        requests = self.requests
        self.events.hits(
            asked,
            load.reused_tokens if load is not None else None,
            started=requests.reuse_started if requests is not None else 0,
            settled=requests.reuse_settled_by(asked) if requests is not None else 0,
        )
        if load is None:
            self.credit.lost()
            return
        self._engine_load, self._engine_load_at = load, done
        if load.reused_tokens is None:
            self._say_once(
                logging.INFO,
                "the %s engine exports no prefix reuse counter: the credit check (does it reuse what its KV "
                "events promise?) is off for this worker",
                self.config.engine,
            )
        self.credit.reading(asked, done, load.reused_tokens)
        if self.transfers.reading(load.failed_transfers, done):
            self._poke_load()

    def _on_events_change(self) -> None:
        if self.registration is not None and self.registration.state is not RegistrationState.STOPPED:
            self.registration.update()
        self._poke_load()

    def _cached_prompt_tokens(self, token_ids: list[int], salt: str = "") -> int:
        norm, limits = self.normaliser, self.limits
        if norm is None or not limits.block_size or limits.prefix_caching is False:
            return 0  # with no prefix caching no block is announced: no hashing for a 50 ms watch
        hashes = block_hashes(token_ids, limits.block_size, salt=salt)
        return norm.cached_prefix_blocks(hashes) * limits.block_size

    def _poke_load(self) -> None:
        for presence in self._presences():
            if presence.reporter is not None:
                presence.reporter.poke()

    def _presences(self) -> list[_Presence]:
        current = [self._presence] if self._presence is not None else []
        return current + list(self._retired)

    # --- one session ------------------------------------------------------------------------------

    async def _session(self) -> None:
        assert self.limits.block_size is not None and self._discovery is not None
        self.sessions += 1
        self._registered_at = None
        self.normaliser = Normaliser(self.limits.block_size, stats=self.norm_stats, after=self.normaliser)
        lost: str | None = None  # why the engine was taken out of service, when it was
        live = asyncio.Event()
        self._events_task = asyncio.create_task(self.adapter.run_events(self._sink, live), name="engine-events")
        try:
            if not await self._wait_live(live):
                return
            self._pending_said_at = None
            self.events.resolved(EventProblem.BIND_PENDING)
            self.tokenizer = await self._tokenizer()
            self.epoch = secrets.randbits(64) | 1
            self.registration = Registration(
                self._discovery,
                key=lambda wid: subjects.worker_key(self.ns, wid),
                value=self._info,
                ttl=self.config.lease_ttl,
                name=self.config.worker_name,
                on_lost=self._on_lease_lost,
                on_registered=self._on_registered,
                on_failing=self._reregister_failed,
                on_answered=self._lost_lease_waited,
                before_create=self._before_announce,
                claims=self._engine_claim,
            )
            self.status = ShimStatus.REGISTERING
            while (worker := await self._register()) is None:
                if not await self._register_again():
                    return
            self._held_since = None
            await self._on_registered(worker)
            lost = await self._monitor()
        finally:
            await self._end_session(lost)

    def _engine_claim(self, worker: str) -> dict[str, EngineClaim]:
        c = self.config
        return engine_claim.claim(self.ns, c.engine_url, c.data_parallel_rank, worker)

    async def _keys_free(self) -> bool:
        """Whether --worker-name's key and the engine's claim may be made, read in the order the
        registration creates them, before the session binds the engine's event address
        (engine_claim): absent, or their holder proven gone and evicted. True too when etcd does not
        answer: the registration's create meets that. False while a holder's lease may yet expire,
        as at registration; past that, the ConfigError naming --worker-name or --engine-url."""
        assert self._discovery is not None
        c = self.config
        keys = [subjects.worker_key(self.ns, c.worker_name)] if c.worker_name is not None else []
        keys.append(engine_claim.claim_key(self.ns, c.engine_url, c.data_parallel_rank))
        for key in keys:
            try:
                held = await self._discovery.held(key)
            except DiscoveryError:
                return True
            if held is None or await self._took_over(held):
                continue
            if not self._held_may_free(held):
                raise self._taken(held)
            self.status = ShimStatus.REGISTERING  # etcd answered: the key is waited out
            return False
        return True

    async def _keys_waited(self) -> bool:
        """Until `_keys_free` (True), read again each health interval while the engine stays up:
        /health says registering all along (a pass through `_wait_healthy` said waiting_engine on
        each read, review of 2026-12-07). False when the engine is no longer up or the shim stops:
        the session starts over from its wait for the engine."""
        while not await self._keys_free():
            await self._rest(self.config.health_interval_s)
            if self._stopping.is_set() or await self.adapter.health() is not EngineHealth.UP:
                return False
        return True

    async def _register(self) -> str | None:
        """The worker id once registered (its key and engine claim created); None when a key is
        held by a lease that may yet expire, or etcd does not answer: the session starts over."""
        assert self.registration is not None
        try:
            try:
                return await self.registration.start()
            except KeyTaken as exc:
                if not await self._took_over(exc):
                    raise
            return await self.registration.start()  # at once: the holder's lease is gone
        except KeyTaken as exc:
            if not self._held_may_free(exc):
                raise self._taken(exc) from exc
            self.status = ShimStatus.REGISTERING  # etcd answered: the key is waited out
            self.register_failures.answered()
        except DiscoveryError as exc:
            self.status = ShimStatus.WAITING_ETCD  # until it registers, or the session ends
            self.register_failures.failed(exc, self.config.health_interval_s)
        return None

    async def _register_again(self) -> bool:
        """Whether to try registering again, health_interval_s after a try that failed: not once
        the shim stops, the event stream ends or the engine fails its health check (the next
        session starts from the engine's health, as after any). The session goes on meanwhile: a
        new one each try (until 2026-12-07) read the engine's limits and tokenizer and asked it for
        a full replay of its KV events, every health_interval_s while etcd was down."""
        assert self._events_task is not None
        await self._next_check()
        if self._stopping.is_set():
            return False
        if self._events_task.done():
            self._events_ended(self._events_task)
            return False
        return await self.adapter.health() is EngineHealth.UP

    async def _next_check(self) -> None:
        """Wait health_interval_s, cut short by the shim's stop or the end of the event stream (it
        ends on an engine restart, EngineRestarted, seen at once)."""
        assert self._events_task is not None
        stopping = asyncio.ensure_future(self._stopping.wait())
        ended = (stopping, self._events_task)
        try:
            await asyncio.wait(ended, timeout=self.config.health_interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()

    async def _took_over(self, exc: KeyTaken) -> bool:
        """Whether the holder of a held --worker-name or engine claim was proven gone and its lease
        revoked (worker_shim.takeover); why not is said once, with the wait. Never under NATS
        credentials: the lease is waited out. The proof may wait a few seconds for a missed renewal
        to show: a stop meanwhile ends it, nothing revoked."""
        assert self._discovery is not None
        if credentials := self.nats_settings.credential_flags():
            # etcd alone cannot tell a holder whose event loop stalled past a renewal from a dead
            # one, and an identity kvswitch secrets makes may not probe another worker's subjects
            if self._held_since is None:
                log.info(
                    "%s: its holder is not proven gone: with NATS credentials (%s) NATS is not asked "
                    "whether it is alive, and etcd alone cannot tell a stalled holder from a dead one",
                    exc.key, credentials[0],
                )  # fmt: skip
            return False
        proof = asyncio.create_task(takeover.take_over(self.nc, self._discovery, self.ns, exc), name="takeover")
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([proof, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(proof, stopping)
        if proof.cancelled():
            return False
        if (failure := proof.exception()) is None:
            return True
        if not isinstance(failure, takeover.NotProven):
            raise failure
        if self._held_since is None:
            log.info("%s: its holder is not proven gone: %s", exc.key, failure)
        return False

    def _held_may_free(self, exc: KeyTaken) -> bool:
        """Whether a held --worker-name or engine claim may still come free: for one lease TTL (and
        a margin) it may be a crashed shim's that was not proven gone (worker_shim.takeover), or
        this one's own from a session whose revoke did not reach etcd, and its lease expires. Past
        that, another live shim holds it."""
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
            log.warning("%s; waiting up to %.0fs for it to expire (a crashed shim's lease does)",
                        exc, self.config.lease_ttl + NAME_WAIT_MARGIN_S)  # fmt: skip
        return now - self._held_since < self.config.lease_ttl + NAME_WAIT_MARGIN_S

    def _reregister_failed(self, exc: DiscoveryError, retry_s: float) -> None:
        """Registering anew, a try etcd failed (Registration's on_failing): /health says it, as for
        the session's first registration."""
        self._registration_status(ShimStatus.WAITING_ETCD)
        self.register_failures.failed(exc, retry_s)

    def _registration_status(self, status: ShimStatus) -> None:
        """What the registration's hooks say on /health, unless the shim stops: its registration
        runs on through the drain, and a lease lost or registered anew then said `registering`, or
        `serving` with a 200, of a draining shim (final read of 2026-12-07)."""
        if not self._stopping.is_set():
            self.status = status

    def _lost_lease_waited(self, exc: KeyTaken) -> None:
        """Registering anew, etcd answered that the key is still held by the lost lease (its revoke
        failed): the failing episode ends while the lease is waited out (Registration's on_answered)."""
        self._registration_status(ShimStatus.REGISTERING)
        self.register_failures.answered(f"this shim's lost lease {exc.holder:x}")

    def _taken(self, exc: KeyTaken) -> ConfigError:
        """The startup error of a key another live shim holds: this worker's name, or its engine."""
        c = self.config
        if exc.key.startswith(subjects.engines_prefix(self.ns)):
            return engine_claim.taken(exc, c.engine_url, c.lease_ttl)
        return ConfigError(
            "worker_name",
            c.worker_name,
            f"{exc}: another shim serves under this name (a crashed one's lease would have expired "
            f"within {c.lease_ttl}s)",
        )

    async def _wait_live(self, live: asyncio.Event, *, warmed: bool = False) -> bool:
        """Whether the session's events went live. A stream that fails as an engine's that has
        served nothing yet (EngineCold) starts again once the engine served a one-token request; if
        it fails so again, the session fails (retried, after a wait that grows). Such an engine is
        a fresh one, which may have restarted with other limits than those the session took from
        the last (held by the adapter): they are read again after the warm-up, and where they
        differ the session ends before it registers, and the next one takes them."""
        assert self._events_task is not None
        waiter = asyncio.create_task(live.wait())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait(
                [waiter, stopping, self._events_task], timeout=LIVE_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiter.cancel()
            stopping.cancel()
        if self._events_task.done() and not self._events_task.cancelled() and self._events_task.exception():
            if isinstance(failure := self._events_task.exception(), ConfigError):  # no new session cures it
                raise failure
            if isinstance(failure, EngineCold):
                if warmed:
                    raise EngineError(503, "engine_unavailable", f"{failure.message}; still so after it served one")
                await self._warm_up(failure)
                if (limits := await self._check_limits()) != self.limits:
                    log.info("the engine at %s is a fresh one with other limits (%s, not %s): the session "
                             "starts again", self.config.engine_url, limits, self.limits)  # fmt: skip
                    return False
                self._events_task = asyncio.create_task(self.adapter.run_events(self._sink, live), name="engine-events")
                return await self._wait_live(live, warmed=True)
            if isinstance(failure, BindPending):
                self._bind_pending(failure)
            else:
                log.warning("engine event stream failed: %s", failure)
            await asyncio.sleep(self.config.health_interval_s)
        return live.is_set() and not self._stopping.is_set() and not self._events_task.done()

    async def _start_epoch(self, presence: _Presence) -> None:
        assert self.normaliser is not None and self.requests is not None
        requests = self.requests
        publisher = KvPublisher(
            self.nc, self.ns, presence.worker, self.epoch, self.normaliser, self.kv_counters,
            on_crash=lambda: self._count_task_failure("kv_publisher"),
        )  # fmt: skip
        publisher.start()
        # Routers that follow from seq 1 must see what the engine held before registration.
        publisher.add([Cleared(), *self.normaliser.snapshot()])
        presence.publisher = publisher
        presence.reporter = LoadReporter(
            self.nc,
            self.ns,
            presence.worker,
            self.adapter,
            lambda: requests.prefill_tokens_queued,
            self.limits.kv_total_blocks,
            legs_in_flight=lambda: len(requests.inflight),
            period_s=self.config.load_period_s,
            poll_s=min(0.25, self.config.health_interval_s),
            digest=publisher.digest,
            events_ok=lambda: self.events.ok,
            decode_context=requests.contexts.mean,
            credit_short=lambda: self.credit.short,
            transfers_failed=lambda: self.transfers.total,
            draining=self._stopping.is_set,
            on_reading=self._on_engine_reading,
            on_published=self._count_load_report,
            on_unencodable=self._count_unencodable_report,
            on_crash=lambda: self._count_task_failure("load_reporter"),
            polls_failed=self.load_polls_failed,
        )
        presence.reporter.start()

    async def _end_epoch(self, presence: _Presence, *, cleared: bool) -> None:
        reporter, presence.reporter = presence.reporter, None
        if reporter is not None:
            await reporter.stop()
        publisher, presence.publisher = presence.publisher, None
        if publisher is not None:
            if cleared:
                publisher.add([Cleared()])
            await publisher.stop()

    async def _open_presence(self, worker: str) -> _Presence:
        assert self.requests is not None
        presence = _Presence(worker)
        nc = self.nc
        # A refusal recorded before (a permissions reload since fixed) says nothing of these new
        # SUBs: the server answers each before the flush below returns.
        on_generate = guarded(self.requests.on_generate, "the request handler")
        handlers = [(subjects.gen(self.ns, role, worker), on_generate) for role in ("prefill", "decode", "agg")]
        handlers += [
            (subjects.cancel(self.ns, worker), guarded(self.requests.on_cancel, "the cancel handler")),
            (subjects.kvstate(self.ns, worker), guarded(presence.on_kvstate, "the kvstate handler")),
        ]
        refused_subscriptions(nc).difference_update(subject.lower() for subject, _ in handlers)
        try:
            for subject, cb in handlers:
                presence.subs.append(await nc.subscribe(subject, cb=cb))
            await flush(nc)
        except asyncio.CancelledError:
            # The session ending: held as the current presence, its end closes it with the retired
            # ids under the stop's one short barrier (closed here, a second barrier followed).
            self._presence = presence
            raise
        except BaseException:
            # Held by nothing else yet: left open, a retry of the registration had each request of
            # this id reach a second handler. No key of this registration names the id yet: the
            # stop's short barrier.
            await self._close_presences(presence, timeout=UNSUB_STOP_S)
            raise
        # The server refuses a subject of another identity only in an -ERR (read before the flush's
        # PONG): registered, the worker would look healthy and get no request ever.
        refused = sorted(sub.subject for sub in presence.subs if sub.subject.lower() in refused_subscriptions(nc))
        if refused:
            await self._close_presences(presence)
            name = self.config.worker_name
            why = (
                f"the seed in --nats-nkey-file (or --nats-creds-file) is another worker's, or this --worker-name or "
                f"--namespace ({self.ns}) is not one kvswitch secrets was given"
                if name is not None
                else "without --worker-name the worker id is its lease id, which no identity kvswitch secrets makes "
                "may use: give the name kvswitch secrets --workers was given"
            )
            more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
            raise ConfigError(
                "worker_name", name, f"NATS refuses this identity the subscription to {refused[0]}{more}: {why}"
            )
        return presence

    async def _close_presences(
        self, *presences: _Presence, timeout: float = UNSUB_S, bound: float | None = None
    ) -> None:
        """`bound`: the limit `timeout` is what is left of, for the warning should it run out."""
        # Unsubscribe before the Cleared goes out: on one connection the server applies the UNSUBs
        # first, so whoever sees the Cleared gets "no responders" from the id at once, not a timeout.
        holding = [presence for presence in presences if presence.subs]
        subs = [sub for presence in holding for sub in presence.subs]
        for presence in presences:
            presence.subs = []
        await self._unsubscribe(holding, subs, timeout, timeout if bound is None else bound)  # one barrier
        for presence in presences:
            await self._end_epoch(presence, cleared=True)

    @staticmethod
    async def _unsubscribe(
        presences: Sequence[_Presence], subs: list[Subscription], timeout: float, bound: float
    ) -> None:
        """runtime.nats_unsubscribe, shielded: cancelled mid-way (_close_retired cancels a retirement),
        its nats-py unsubscribe() discarded the requests delivered but not yet handled, and each
        requester waited out its timeout. `closing` lets _close_retired wait for it instead. A close
        that fails is said by its own callback, so also when its caller was cancelled."""
        workers = [presence.worker for presence in presences]

        def said(done: asyncio.Future[None]) -> None:
            if not done.cancelled() and (exc := done.exception()) is not None:
                _unanswered_warning(workers, bound, exc)

        closing = asyncio.ensure_future(unsubscribe(subs, timeout))
        closing.add_done_callback(said)
        for presence in presences:
            presence.closing = closing
        with contextlib.suppress(Exception):  # said by its callback
            await asyncio.shield(closing)  # a request delivered before the UNSUB is answered

    async def _before_announce(self, worker: str) -> None:
        """Subscribed, the server holding the subscriptions, and the epoch's KV stream started
        before the etcd key tells routers the worker serves: a request or a kvstate request sent
        the moment they read it finds a responder with state to answer from (a kvstate request
        before the epoch started went unanswered, and the router's repair waited out its timeout)."""
        presence = self._presence
        if presence is not None and presence.worker != worker:  # opened for an id whose key was never created
            await self._close_presences(presence)
            presence = None
        if presence is None:
            presence = self._presence = await self._open_presence(worker)
            # A --worker-name's id, retired by the last session's end with legs running: the new
            # presence hears its cancels now (with both, one cancel was handled twice).
            await self._close_retired(worker)
        if presence.publisher is None:
            await self._start_epoch(presence)

    async def _on_registered(self, worker: str) -> None:
        presence = self._presence
        assert presence is not None and presence.worker == worker, "opened by _before_announce"
        assert presence.publisher is not None, "its epoch started by _before_announce"
        self.worker_id = worker
        self.registration_count += 1
        self.register_failures.registered()
        if self._registered_at is None:
            self._registered_at = time.monotonic()
        self._registration_status(ShimStatus.REGISTERED)
        self.registered.set()
        log.info(
            "registered worker %s at %s (namespace %s: routers of the same --namespace see it; epoch %x, "
            "block size %s)",
            worker, subjects.worker_key(self.ns, worker), self.ns, self.epoch, self.limits.block_size,
        )  # fmt: skip

    async def _on_lease_lost(self, old: str) -> None:
        # Registering anew: until 2026-12-07 /health said "registered" on its 503.
        self._registration_status(ShimStatus.REGISTERING)
        self.registered.clear()
        self.epoch = secrets.randbits(64) | 1
        presence, self._presence = self._presence, None
        if presence is None:
            return
        if self.config.worker_name is not None:
            # Same subjects under the same name: the old epoch's stream ends; the new one starts
            # with Cleared and the whole state once registered again. Put back however the await
            # ends: a session ending in it (Registration.stop cancels this hook) closes only what
            # _presence and _retired hold.
            try:
                await self._end_epoch(presence, cleared=False)
            finally:
                self._presence = presence
            return
        # Retired first, so the old stream misses no event while its load reports stop.
        grace = self.config.grace_s
        self._retire(presence, grace)
        log.warning("serving the old worker id %s for %.1fs more while registering anew", old, grace)
        reporter, presence.reporter = presence.reporter, None
        if reporter is not None:
            await reporter.stop()

    def _retire(self, presence: _Presence, grace: float) -> None:
        """Serve `presence`'s old id for `grace` more (until its session ends, at most), then close it
        but for its cancel subject, kept until the legs in flight then have ended. /health lists it
        in retired_workers until then."""
        self._retired[presence] = background(
            self._retire_later(presence, grace),
            f"retire-{presence.worker}",
            f"the old worker id {presence.worker} is closed at once",
            lambda: self._count_task_failure("retire"),
        )

    async def _retire_later(self, presence: _Presence, grace: float) -> None:
        """Its id leaves `_retired` however this ends; a crash closes what it still holds."""
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await presence.ended.wait()
            legs = await self._close_but_cancels(presence)
            log.info(
                "stopped serving the old worker id %s%s", presence.worker,
                f"; its cancels are heard until the {len(legs)} legs in flight end" if legs else "",
            )  # fmt: skip
            if legs:
                await asyncio.wait(legs)
            # Still in _retired: a stop meanwhile cancels this close and waits for its barrier.
            await self._close_presences(presence)
        except Exception:
            await self._close_presences(presence)
            raise
        finally:
            self._retired.pop(presence, None)

    async def _close_but_cancels(self, presence: _Presence) -> list[asyncio.Task[None]]:
        """Close `presence` but for its cancel subject: no request comes on its id any more and its
        KV stream ends (Cleared). The legs in flight now, which its cancels are heard for until they
        end: a router cancels a leg on the subject of the id it sent it to (router.dispatch), and
        with nobody on it a client that left had the engine decode for nobody up to the request's
        deadline. Called again, it closes nothing more."""
        cancel = subjects.cancel(self.ns, presence.worker)
        dropped = [sub for sub in presence.subs if sub.subject != cancel]
        presence.subs = kept = [sub for sub in presence.subs if sub.subject == cancel]  # before any await:
        # a stop meanwhile closes what the presence still holds
        # Lossless: a request the server sent before the UNSUB, dropped, was answered by
        # neither the shim nor "no responders", and its router leg waited out its silence.
        await self._unsubscribe([presence], dropped, UNSUB_S, UNSUB_S)
        await self._end_epoch(presence, cleared=True)
        return [leg.task for leg in self.requests.inflight.values() if leg.task] if kept and self.requests else []

    async def _close_retired(
        self, worker: str | None = None, *, also: _Presence | None = None, timeout: float = UNSUB_S
    ) -> None:
        """Every old id's retirement ends now, and what it held is closed, with `also`, under one
        barrier of `timeout` at most: at stop; and, for `worker` only, when a --worker-name's next
        session takes over the cancels its id kept."""
        retired = {p: t for p, t in self._retired.items() if worker in (None, p.worker)}
        for presence in retired:
            del self._retired[presence]
        await cancel_and_wait(*retired.values())
        # A retirement cancelled while it unsubscribed: its requests already delivered are handled
        # first, under the same deadline as the barrier after it.
        deadline = time.monotonic() + timeout
        closing = {p: p.closing for p in retired if p.closing is not None and not p.closing.done()}
        if closing:
            _, late = await asyncio.wait(closing.values(), timeout=timeout)
            if late:  # given up, not left running into the NATS drain
                _unanswered_warning([p.worker for p, c in closing.items() if c in late], timeout, TimeoutError())
                for close in late:
                    close.cancel()
        left = max(0.0, deadline - time.monotonic())
        await self._close_presences(*retired, *([also] if also is not None else []), timeout=left, bound=timeout)

    async def _monitor(self) -> str | None:
        """Until the session ends; why, where it ends on a hang the stall watchdog proved (its legs
        in flight are then failed: _end_session), else None."""
        failures = 0
        busy_since: float | None = None
        adapters_due = time.monotonic() + ADAPTERS_POLL_S
        assert self._events_task is not None and self.registration is not None
        while not self._stopping.is_set():
            await self._next_check()
            if self._stopping.is_set():
                return None
            self._cut_off.check(self.registration)
            if self.registration.failed.is_set():
                failure = self.registration.failure
                if isinstance(failure, KeyTaken):
                    raise self._taken(failure)
                log.error("re-registration failed (%s): starting a new session", failure)
                return None
            if self._events_task.done():
                self._events_ended(self._events_task)
                return None
            self._check_tasks()
            health = await self.adapter.health()
            now = time.monotonic()
            if health is EngineHealth.UP:
                failures, busy_since = 0, None
                if now >= adapters_due:
                    adapters_due = now + ADAPTERS_POLL_S
                    await self._poll_adapters()
            elif health is EngineHealth.DOWN:
                failures, busy_since = failures + 1, None
            elif busy_since is None:
                busy_since = now
                log.warning(
                    "engine at %s does not answer its health check in time: busy, or hung", self.config.engine_url
                )
            # A hung engine answers /health and /metrics; only the work it does not do shows it.
            if (why := self._hung(now)) is not None:
                return why
            if failures >= self.config.health_failures:
                log.warning("engine at %s failed %d health checks: deregistering", self.config.engine_url, failures)
                self._leave_legs()
                return None
            # A loaded engine answers late; only one that stays silent this long is taken for hung.
            if busy_since is not None and now - busy_since >= self.config.busy_limit_s:
                log.error(
                    "engine at %s has not answered a health check for %.0fs: deregistering",
                    self.config.engine_url,
                    now - busy_since,
                )
                self._leave_legs()
                return None
        return None

    def _events_ended(self, task: asyncio.Task[None]) -> None:
        """Say why the session ends with its event stream: an engine restart the stream showed
        (EngineRestarted, within the health checks), or a failure."""
        failure = None if task.cancelled() else task.exception()
        if isinstance(failure, EngineRestarted):
            log.warning(
                "the %s engine at %s restarted (%s): its session ends, and the worker registers anew under a new "
                "id, the engine's limits and tokenizer read again",
                failure.engine,
                self.config.engine_url,
                failure.why,
            )
            return
        log.warning("engine event stream ended: %s", failure)

    def _count_task_failure(self, task: str) -> None:
        self.task_failures[task] += 1

    def _check_tasks(self) -> None:
        """_TaskCrashed when a loop of the worker id's KV publisher or load reporter no longer runs
        (runtime.ended; each runs until its stop(), which takes it away first): the session ends as
        failed and a new one registers. Left to run, routers kept routing on a KV index that changed
        no more (the load reports' digest stayed at the last batch, so no repair came), or on a
        worker that sent no load report while its /health said serving. The loop watch, should it
        have ended, is started again in place: it is the process's, so a new session would not start
        it, and until then the shim's stalls are blamed on etcd (a review of 2026-12-07: it lay dead
        after one ERROR, and every later cut-off was named this process's stall)."""
        now = time.monotonic()
        # at most once a LOOP_WATCH_AGAIN_S: one that crashes at once each start logged an ERROR with
        # its traceback at every health check (final read of 2026-12-07)
        if now - self._loop_watch_started >= LOOP_WATCH_AGAIN_S and (why := ended(self.loop_watch.task)):
            self._count_task_failure("loop_watch")
            log.info("%s; started again (at most once a %.0fs)", why, LOOP_WATCH_AGAIN_S)
            self._loop_watch_started = now
            self.loop_watch.start()
        presence = self._presence
        if presence is None:
            return
        publisher, reporter = presence.publisher, presence.reporter
        loops = [("kv_publisher", publisher.task)] if publisher is not None else []
        loops += [("load_reporter", task) for task in (reporter.tasks if reporter is not None else ())]
        for name, task in loops:
            if (why := ended(task)) is not None:
                raise _TaskCrashed(name, why)  # counted as it crashed

    def _leave_legs(self) -> None:
        """Deregistered as down or busy, the legs in flight run on: neither proves a hang. A loaded
        engine answers /health late while it streams (vLLM under saturation misses 2 s deadlines),
        one draining refuses it while it finishes them (SGLang on SIGTERM), and a dead one drops
        their connections, so they fail by themselves. They stay watched (_wait_healthy, the next
        session): one that then makes no progress, or answers nothing at all (SIGSTOPped, cut off),
        for the stall limit is ended as hung."""
        legs = len(self.requests.inflight) if self.requests is not None else 0
        if legs:
            log.warning("the %d legs in flight on the engine at %s are left to finish, watched for a stall: they "
                        "end once it makes no progress, or answers nothing at all, for --stall-limit-s (%.0fs)",
                        legs, self.config.engine_url, self.config.stall_limit_s)  # fmt: skip

    def _hung(self, now: float) -> str | None:
        """The stall watchdog's look (worker_shim.stall_watchdog) on the engine's last readings."""
        return self.stall.look(now, self._engine_load, self._engine_load_at, self._iterating_at)

    async def _end_session(self, lost: str | None = None) -> None:
        """Deregister and close what the session opened; `lost`: why the engine was taken out of
        service, and then its legs in flight end too, once no new one can arrive."""
        if self.status in (ShimStatus.REGISTERING, ShimStatus.WAITING_ETCD, ShimStatus.REGISTERED):
            self.status = ShimStatus.DRAINING if self._stopping.is_set() else ShimStatus.WAITING_ENGINE
        self.registered.clear()
        if self._stopping.is_set() and self.requests is not None:
            self._count_drained(await self.requests.drain(self.config.drain_grace_s))
        # First the registration (its task may be re-registering), then what it opened.
        registration, self.registration = self.registration, None
        if registration is not None:
            lease = registration.lease
            self._deregistering = registration
            try:
                await registration.stop()
            finally:  # revoked None: the revoke cut short by a cancellation
                self._deregistering = None
                if self._stopping.is_set() and lease is not None:
                    self._left = (registration.id, lease, registration.revoked)
        # after stop(): no try of the session's comes later
        self.register_failures.session_ended(self._stopping.is_set())
        self._cut_off.session_ended()
        if self._stopping.is_set():  # the current id with the old ones: one short barrier for all
            presence, self._presence = self._presence, None
            await self._close_retired(also=presence, timeout=UNSUB_STOP_S)
        for old in self._retired:
            old.ended.set()  # no grace past the session: cancels alone are heard on the old ids
        presence, self._presence = self._presence, None
        if presence is not None:
            if self._stopping.is_set() or self.requests is None or not self.requests.inflight:
                await self._close_presences(presence)
            else:  # its legs run on, and a router cancels one on the subject of the id it sent it to
                await self._close_but_cancels(presence)  # now: no new leg comes before _fail_legs
                presence.ended.set()
                self._retire(presence, 0.0)
        if lost is not None and self.requests is not None:
            await self._fail_legs(lost)
        task, self._events_task = self._events_task, None
        if task is not None:
            await cancel_and_wait(task)
        retry, self._tokenizer_retry = self._tokenizer_retry, None
        if retry is not None:
            await retry.stop()
        self.events.close(keep_retest=not self._stopping.is_set())
        self.probe.close()
        self.worker_id = None

    async def _fail_legs(self, lost: str) -> None:
        """End the legs in flight on an engine taken out of service with a retryable 503 (their
        engine connections closed): the router retries one with no output yet on another worker,
        and a stream under way gets an error event. Left to run, each waited out its deadline
        (--request-timeout, 600 s), heartbeats beating, as the router read the leg alive."""
        assert self.requests is not None
        legs = len(self.requests.inflight)
        if legs:
            log.error("ending the %d legs in flight on the engine at %s with 503 engine_unavailable",
                      legs, self.config.engine_url)  # fmt: skip
        error = ErrorInfo(
            code=503, kind="engine_unavailable", message=f"the worker's engine was taken out of service: {lost}"
        )
        await self.requests.abort_all(error)

    # --- routers that died ----------------------------------------------------------------------

    async def _follow_routers(self, orphans: OrphanedLegs) -> None:
        """The routers' keys, and their legs here checked against them (worker_shim.orphaned_legs)."""
        assert self._discovery is not None
        await follow_routers(
            self._discovery,
            self.ns,
            orphans,
            lambda: self._count_task_failure("orphan_check"),
            RouterPresence(self._discovery, self.ns),
            lambda: self.worker_id if self.registered.is_set() else None,
        )

    # --- stop -----------------------------------------------------------------------------------

    async def _stop(self) -> None:
        self._stopping.set()
        if self.requests is not None:
            self.requests.accepting = False
        self._poke_load()  # `draining`: routers stop sending new requests now, not at the next period
        orphans, self._orphans_task = self._orphans_task, None
        if orphans is not None:
            await cancel_and_wait(orphans)
        main, self._main = self._main, None
        if main is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await main
        if self.requests is not None:  # stopped between sessions, the legs a session's end left running
            self._count_drained(await self.requests.drain(self.config.drain_grace_s))  # drained too, not cut
        # Those a session that ended before the stop left hearing cancels.
        await self._close_retired(timeout=UNSUB_STOP_S)
        await self._close_clients()
        await self.loop_watch.stop()
        if self.status is not ShimStatus.FAILED:
            self.status = ShimStatus.STOPPED
        self._say_stopped()
        self.done.set()

    def _count_drained(self, drained: tuple[int, int]) -> None:
        self._drained = (self._drained[0] + drained[0], self._drained[1] + drained[1])

    def _say_stopped(self) -> None:
        """The stop's last line: the legs it drained and cut, and whether routers dropped the worker
        at once (its lease revoked) or see its key until the TTL passes. Until 2026-12-07 a shim's
        log ended at "SIGTERM: draining", its end unsaid."""
        finished, cut = self._drained
        legs = (
            f"{finished + cut} legs drained, {cut} of them cut at --drain-grace-s"
            if finished + cut
            else "no leg in flight"
        )
        if self._left is None:
            log.info("stopped, not registered (%s)", legs)
            return
        worker, lease, revoked = self._left
        if revoked:
            log.info(
                "worker %s deregistered (lease %s %s), stopped (%s)", worker, lease.hex_id, lease.state.value, legs
            )
        else:
            log.warning(
                "worker %s stopped (%s), its lease %s not revoked (%s): routers see its key until its TTL (%d s) "
                "passes",
                worker,
                legs,
                lease.hex_id,
                "the revoke was cut short" if revoked is None else "said above",
                lease.ttl,
            )

    async def _close_clients(self) -> None:
        await self.http.stop()
        await self.adapter.close()
        discovery, self._discovery = self._discovery, None
        if discovery is not None:
            await discovery.close()
        nc, self._nc = self._nc, None
        if nc is None or nc.is_closed:
            return
        try:
            if nc.is_connected:  # nats-py refuses to drain a connection that is down
                with contextlib.suppress(Exception):
                    await nc.drain()
            if not nc.is_closed:
                await nc.close()
        except Exception as exc:
            # NATS down at stop: nats-py's close writes to a socket that is gone (uvloop raises).
            # Nothing is left to flush; the shim stops cleanly rather than with a traceback.
            log.warning("the NATS connection did not close cleanly (%r); stopping anyway", exc)


async def _no_output(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
    pass


def _aliases(cards: dict[str, ModelCard], model: str) -> list[str]:
    """The other names the engine serves `model` under: base cards (no parent) with its root."""
    own = cards.get(model)
    if own is None or own.root is None:
        return []
    return sorted(
        name for name, card in cards.items() if name != model and card.parent is None and card.root == own.root
    )
