"""SimServer: one simulated vLLM engine in this process (HTTP API, KV event sockets, step loop).

    async with SimServer(SimConfig(speedup=20)) as sim:
        sim.url               # http://127.0.0.1:PORT
        sim.events_endpoint   # tcp://127.0.0.1:PORT: a SUB connects here (or binds, if the PUB connects)
        sim.replay_endpoint   # tcp://127.0.0.1:PORT: a DEALER connects here
        sim.engine            # the Scheduler: cached_block_prefixes(), prefill_tokens_computed, ...
        sim.loras             # the LoRA adapters served (config.lora_modules, and loaded at run time)
        sim.faults.hang = True

Port 0 (HTTP or a ZMQ endpoint) picks a free port; the chosen ports stay the same across
`restart()`. Lifecycle: NEW → RUNNING → (CRASHED → RUNNING)* → STOPPED; `stop()` is idempotent.

Restart, like a real engine restart: the HTTP listener and every connection go down for a moment
(in-flight requests are cut), then come back on the same ports with a new engine: empty prefix
cache, a new engine id, a new hash root unless PYTHONHASHSEED is set, event seq from 0 and an
empty replay buffer. No AllBlocksCleared is sent; subscribers see seq start over.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import secrets
import uuid
from typing import Any

import msgspec
from aiohttp import web

from engine_sim.config import SimConfig
from engine_sim.event_publisher import NullEventPublisher, ZmqEventPublisher
from engine_sim.faults import Faults
from engine_sim.http_api import build_app
from engine_sim.lora import LoraAdapters
from engine_sim.openai_format import VLLM_VERSION
from engine_sim.runner import EngineRunner
from engine_sim.sampler import word_ids
from engine_sim.scheduler import Scheduler
from protocol.timing import TimingModel
from protocol.vllm_events import RESOLVED_BY_ENGINE, publisher_binds, rank_endpoint
from runtime import LISTEN_BACKLOG, cancel_and_wait

__all__ = ["ServerStatus", "SimServer"]

log = logging.getLogger("engine_sim.server")
# vLLM's uvicorn closes a connection idle this long between requests (VLLM_HTTP_TIMEOUT_KEEP_ALIVE);
# aiohttp's default is 75 s, which hid a client pool that kept connections past it.
KEEPALIVE_S = 5.0


class ServerStatus(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CRASHED = "crashed"
    STOPPED = "stopped"


def _with_port(endpoint: str | None, bound: str | None) -> str | None:
    """`tcp://*:0` (or ZMQ's wildcard port `:*`) → `tcp://*:<port chosen at first bind>`, so a
    restart binds the same port."""
    if endpoint is None or bound is None or not re.search(r":[0*]$", endpoint):
        return endpoint
    return endpoint[:-1] + bound.rsplit(":", 1)[1]


class SimServer:
    def __init__(self, config: SimConfig | None = None, **overrides: Any) -> None:
        cfg = config or SimConfig()
        if overrides:
            cfg = cfg.replace(**overrides)
        self.config = cfg.validate()
        self.faults = Faults(
            crash_after=cfg.crash_after,
            hang_after=cfg.hang_after,
            slowdown=cfg.slowdown,
            drop_event_fraction=cfg.drop_event_fraction,
        )
        self.status = ServerStatus.NEW
        self.timing = TimingModel.for_profile(cfg.profile)
        self.fingerprint = f"vllm-{VLLM_VERSION}-{secrets.token_hex(4)}"
        self.loras = LoraAdapters(cfg.lora_modules, (cfg.model, *cfg.aliases))
        self.ranked_requests = 0  # generate requests that named this engine's data-parallel rank
        self.server_load = 0  # generate requests in flight, counted with --enable-server-load-tracking
        self.open_transports: set[asyncio.Transport] = set()
        self.crashed = asyncio.Event()
        self._runner: EngineRunner | None = None
        self._publisher: ZmqEventPublisher | NullEventPublisher | None = None
        self._http: web.AppRunner | None = None
        self._port: int | None = cfg.port or None
        # Each data-parallel rank publishes and replays on the configured endpoints offset by its
        # rank, as vLLM's do (and lists them so on /kv_event_sources).
        ev, rank = cfg.kv_events, cfg.data_parallel_rank
        replay = rank_endpoint(ev.replay_endpoint, rank) if ev.replay_endpoint else None
        self._events_cfg = msgspec.structs.replace(
            ev, endpoint=rank_endpoint(ev.endpoint, rank), replay_endpoint=replay
        )
        self._events_given = self._events_cfg  # as configured: what /kv_event_sources lists is read from it
        self._lifecycle = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()

    # --- addresses -------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("SimServer has not started yet")
        return self._port

    @property
    def url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        return self._publisher.endpoint if self._publisher is not None else None

    @property
    def replay_endpoint(self) -> str | None:
        return self._publisher.replay_endpoint if self._publisher is not None else None

    @property
    def engine(self) -> Scheduler:
        if self._runner is None:
            raise RuntimeError("SimServer has not started yet")
        return self._runner.scheduler

    @property
    def runner(self) -> EngineRunner:
        if self._runner is None:
            raise RuntimeError("SimServer has not started yet")
        return self._runner

    @property
    def event_seq(self) -> int:
        """The seq the next KV event batch will carry."""
        return self._publisher.seq if self._publisher is not None else 0

    # --- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        async with self._lifecycle:
            if self.status is ServerStatus.RUNNING:
                return
            if self.status is ServerStatus.STOPPED:
                raise RuntimeError("a stopped SimServer cannot start again; make a new one")
            await self._bring_up()

    def event_sources(self) -> dict[str, dict[str, Any]]:
        """vLLM's GET /kv_event_sources: this engine's events config by data-parallel rank (its
        endpoints offset by the rank, a port 0 as bound); nothing when events are off. vLLM 0.32
        lists `tcp://*:0` as `tcp://<node IP>:<port>` (ZmqEventPublisher._bind), so the sim lists
        its host there; `tcp://*:PORT` and a concrete address as given."""
        cfg, given = self._events_cfg, self._events_given
        if not cfg.active:
            return {}
        listed = msgspec.structs.replace(
            cfg,
            endpoint=self._as_listed(given.endpoint, cfg.endpoint),
            replay_endpoint=self._as_listed(given.replay_endpoint, cfg.replay_endpoint),
        )
        return {str(self.config.data_parallel_rank): msgspec.to_builtins(listed)}

    def _as_listed(self, given: str | None, bound: str | None) -> str | None:
        if given != RESOLVED_BY_ENGINE or bound is None or bound == given:
            return bound
        host = self._node_host
        return f"tcp://{f'[{host}]' if ':' in host else host}:{bound.rsplit(':', 1)[1]}"

    @property
    def _node_host(self) -> str:
        """The address on this host a peer reaches the sim at (its HTTP host, loopback for all)."""
        host = self.config.host
        return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host

    async def _bring_up(self) -> None:
        cfg = self.config
        word_ids()  # built once per process (~0.3 s); not inside the first request's latency
        scheduler = Scheduler(
            block_size=cfg.block_size,
            num_gpu_blocks=cfg.resolved_num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            timing=self.timing,
            emit_events=self._events_cfg.active,
            engine_id=str(uuid.uuid4()),
            enable_prefix_caching=cfg.enable_prefix_caching,
            kv_connector=cfg.role != "agg",
            recompute_kv_load_failures=cfg.kv_load_failure_policy == "recompute",
        )
        publisher: ZmqEventPublisher | NullEventPublisher
        if self._events_cfg.active:
            publisher = ZmqEventPublisher(
                self._events_cfg,
                form=cfg.event_form,
                data_parallel_rank=cfg.data_parallel_rank,
                drop_fraction=self.faults.drop_event_fraction,
                binds=publisher_binds(self._events_given.endpoint),  # as first given, whatever port it chose
            )
        else:
            publisher = NullEventPublisher()
        runner = EngineRunner(
            scheduler,
            publisher,
            self.faults,
            speedup=cfg.speedup,
            kv_transfer_gbps=cfg.kv_transfer_gbps,
            kv_lease_duration=cfg.kv_lease_duration,
            on_death=lambda exc: self._spawn(self.crash(f"its step loop raised {type(exc).__name__}: {exc}")),
        )
        try:
            await publisher.start()
            http = web.AppRunner(
                build_app(self),
                handler_cancellation=True,
                access_log=None,
                shutdown_timeout=0.2,
                keepalive_timeout=KEEPALIVE_S,
            )
            await http.setup()
            try:
                site = web.TCPSite(http, cfg.host, self._port or 0, backlog=LISTEN_BACKLOG)
                await site.start()
            except BaseException:
                await http.cleanup()
                raise
        except BaseException:
            await publisher.stop()
            raise
        if self._port is None:
            self._port = int(http.addresses[0][1])
        scheduler.remote_host = self._node_host
        scheduler.remote_port = self.port
        if isinstance(publisher, ZmqEventPublisher):
            # Keep the ports a restart must rebind.
            self._events_cfg = msgspec.structs.replace(
                self._events_cfg,
                endpoint=_with_port(self._events_cfg.endpoint, publisher.endpoint) or self._events_cfg.endpoint,
                replay_endpoint=_with_port(self._events_cfg.replay_endpoint, publisher.replay_endpoint),
            )
        self._http, self._publisher, self._runner = http, publisher, runner
        runner.start()
        self.crashed.clear()
        self.status = ServerStatus.RUNNING
        log.info("sim %s up at %s (events %s)", scheduler.engine_id[:8], self.url, publisher.endpoint)

    async def _tear_down(self) -> None:
        http, runner, publisher = self._http, self._runner, self._publisher
        self._http = None
        for t in list(self.open_transports):
            t.abort()  # a dying engine drops connections; it does not finish responses
        self.open_transports.clear()
        if runner is not None:
            await runner.stop()
        if http is not None:
            await http.cleanup()
        if publisher is not None:
            await publisher.stop()

    async def stop(self) -> None:
        async with self._lifecycle:
            if self.status is ServerStatus.STOPPED:
                return
            self.status = ServerStatus.STOPPED
            pending = [t for t in self._pending if t is not asyncio.current_task()]
            await cancel_and_wait(*pending)
            for t in pending:
                if not t.cancelled():
                    t.result()  # its error, raised as awaiting it did
            await self._tear_down()

    async def crash(self, why: str = "fault injection") -> None:
        """Die as a crashed engine would (faults.py, or a step loop that raised). Comes back after
        restart_after_crash_s, if set."""
        async with self._lifecycle:
            if self.status is not ServerStatus.RUNNING:
                return
            self.status = ServerStatus.CRASHED
            await self._tear_down()
            self.crashed.set()
            log.warning("sim crashed (%s) after %d requests", why, self.faults.requests_seen)
        delay = self.config.restart_after_crash_s
        if delay is not None:
            await asyncio.sleep(delay)
            await self.restart()

    async def restart(self) -> None:
        """Come back with an empty cache and event seq from 0, on the same ports."""
        async with self._lifecycle:
            if self.status is ServerStatus.STOPPED:
                return
            if self.status is ServerStatus.RUNNING:
                await self._tear_down()
            self.faults.requests_seen = 0
            self.faults._hang = False
            await self._bring_up()

    def crash_soon(self) -> None:
        """crash() from inside a request handler, which the crash itself is about to cut."""
        self._spawn(self.crash())

    def restart_soon(self) -> None:
        self._spawn(self.restart())

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
