"""`WorkerShim`: the sidecar's lifecycle around one engine.

A session is one registration: the shim waits until the engine answers health, checks its limits
against the flags, starts the engine's event stream and waits until it is live, then registers
(lease id = worker id, a fresh random epoch), publishes its state so far, subscribes its subjects and
serves. A session ends when the engine fails `health_failures` checks in a row (deregister, publish
Cleared, wait for it to come back), when the lease is lost (register anew: new worker id, new epoch)
or when the shim stops (stop taking requests, finish in-flight within `drain_grace_s`, revoke the
lease, close). Everything the shim starts is kept on `self` and ended by `stop()`, which is safe to
call twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
from types import TracebackType
from typing import Self

from nats.aio.client import Client as Nats
from nats.aio.subscription import Subscription

from discovery import Discovery, DiscoveryError, Lease
from protocol import Cleared, ConfigError, WorkerInfo, subjects
from protocol.config import EtcdSettings, NatsSettings
from protocol.hashing import block_hashes
from protocol.timing import load_profile
from protocol.version import __version__
from worker_shim.adapters import EngineAdapter, EngineError, EngineLimits, make_adapter
from worker_shim.config import ShimConfig
from worker_shim.engine_events import EngineBatch
from worker_shim.kv_publisher import KvPublisher
from worker_shim.load_reporter import LoadReporter
from worker_shim.nats_connect import connect_nats
from worker_shim.normaliser import Normaliser
from worker_shim.request_service import RequestService

__all__ = ["ShimStatus", "WorkerShim"]

log = logging.getLogger(__name__)
LIVE_TIMEOUT_S = 30.0


class ShimStatus(enum.Enum):
    NEW = "new"
    WAITING_ENGINE = "waiting_engine"
    REGISTERED = "registered"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


def _checked(setting: str, flag: int | None, engine: int | None) -> int | None:
    if flag is not None and engine is not None and flag != engine:
        raise ConfigError(setting, flag, f"the engine reports {engine}; drop the flag or make them agree")
    return engine if engine is not None else flag


class WorkerShim:
    def __init__(
        self, config: ShimConfig, nats: NatsSettings, etcd: EtcdSettings, adapter: EngineAdapter | None = None
    ) -> None:
        self.config = config.validate()
        self.nats_settings = nats
        self.etcd_settings = etcd
        self.ns = config.namespace
        self.adapter = adapter or make_adapter(config)
        self.status = ShimStatus.NEW
        self.worker_id: str | None = None
        self.epoch = 0
        self.registered = asyncio.Event()
        self.failure: BaseException | None = None
        self.done = asyncio.Event()
        self.limits = EngineLimits()
        self.normaliser: Normaliser | None = None
        self.publisher: KvPublisher | None = None
        self.load_reporter: LoadReporter | None = None
        self.requests: RequestService | None = None
        self.sessions = 0
        self._nc: Nats | None = None
        self._discovery: Discovery | None = None
        self._lease: Lease | None = None
        self._subs: list[Subscription] = []
        self._events_task: asyncio.Task[None] | None = None
        self._main: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None

    # --- public ---------------------------------------------------------------------------------

    def _cached_prompt_tokens(self, token_ids: list[int]) -> int:
        norm, limits = self.normaliser, self.limits
        if norm is None or not limits.block_size:
            return 0
        hashes = block_hashes(token_ids, limits.block_size)
        return norm.cached_prefix_blocks(hashes) * limits.block_size

    def canonical_hashes(self) -> set[int]:
        """What the shim believes the engine caches, as canonical hashes."""
        return self.normaliser.canonical_hashes() if self.normaliser is not None else set()

    @property
    def nc(self) -> Nats:
        if self._nc is None:
            raise RuntimeError("the shim is not started")
        return self._nc

    async def start(self) -> None:
        if self._main is not None:
            return
        self._nc = await connect_nats(self.nats_settings, f"kvswitch-shim-{self.config.model}")
        try:
            self._discovery = await Discovery(self.etcd_settings, self.ns).connect()
            await self.adapter.open()
        except BaseException:
            await self._close_clients()
            raise
        self.requests = RequestService(
            self._nc, self.adapter, lambda: self.worker_id or "", self._poke_load, self._cached_prompt_tokens
        )
        self.status = ShimStatus.WAITING_ENGINE
        self._main = asyncio.create_task(self._supervise(), name="shim-supervisor")

    async def stop(self) -> None:
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._stop())
        await asyncio.shield(self._stop_task)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- supervision ----------------------------------------------------------------------------

    async def _supervise(self) -> None:
        try:
            while not self._stopping.is_set():
                if not await self._wait_healthy():
                    return
                self.limits = await self._check_limits()
                await self._session()
        except ConfigError as exc:
            log.error("shim cannot serve this engine: %s", exc)
            self.failure = exc
            self.status = ShimStatus.FAILED
        finally:
            self.done.set()

    async def _wait_healthy(self) -> bool:
        self.status = ShimStatus.WAITING_ENGINE
        while not await self.adapter.health():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.health_interval_s):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return False
        return True

    async def _check_limits(self) -> EngineLimits:
        c = self.config
        try:
            eng = await self.adapter.limits()
        except EngineError as exc:
            log.warning("engine limits unavailable (%s); using the flags", exc)
            eng = EngineLimits()
        limits = EngineLimits(
            block_size=_checked("block_size", c.block_size, eng.block_size),
            kv_total_blocks=_checked("kv_total_blocks", c.kv_total_blocks, eng.kv_total_blocks),
            max_num_batched_tokens=_checked(
                "max_num_batched_tokens", c.max_num_batched_tokens, eng.max_num_batched_tokens
            ),
        )
        if limits.block_size is None:
            raise ConfigError("block_size", None, f"the {c.engine} engine does not report it: give --block-size")
        return limits

    def _kv_bytes_per_token(self) -> int | None:
        if self.config.kv_bytes_per_token is not None:
            return self.config.kv_bytes_per_token
        try:
            return load_profile(self.config.timing_profile).kv_bytes_per_token
        except (ValueError, KeyError, OSError):
            return None

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
            kv_bytes_per_token=self._kv_bytes_per_token(),
            timing_profile=c.timing_profile,
            epoch=self.epoch,
            version=__version__,
            engine_url=c.engine_url,
        )

    def _sink(self, batch: EngineBatch) -> None:
        norm = self.normaliser
        if norm is None:
            return
        out = norm.reset(exact=batch.complete) if batch.reset else []
        out += norm.apply(batch.events)
        if norm.needs_rebuild:
            norm.needs_rebuild = False
            log.warning("KV event with an unknown parent: asking the engine for its whole state")
            self.adapter.request_rebuild()
        if self.publisher is not None:
            self.publisher.add(out)

    def _poke_load(self) -> None:
        if self.load_reporter is not None:
            self.load_reporter.poke()

    async def _session(self) -> None:
        assert self.limits.block_size is not None and self._discovery is not None
        self.sessions += 1
        self.normaliser = Normaliser(self.limits.block_size)
        live = asyncio.Event()
        self._events_task = asyncio.create_task(self.adapter.run_events(self._sink, live), name="engine-events")
        try:
            if not await self._wait_live(live):
                return
            self.epoch = secrets.randbits(64)
            try:
                self._lease = await self._discovery.register_worker(self._info, ttl=self.config.lease_ttl)
            except DiscoveryError as exc:
                log.warning("registration failed (%s); retrying", exc)
                await asyncio.sleep(self.config.health_interval_s)
                return
            await self._serve(self._lease)
        finally:
            await self._end_session()

    async def _wait_live(self, live: asyncio.Event) -> bool:
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
            log.warning("engine event stream failed: %s", self._events_task.exception())
            await asyncio.sleep(self.config.health_interval_s)
        return live.is_set() and not self._stopping.is_set() and not self._events_task.done()

    async def _serve(self, lease: Lease) -> None:
        worker = self.worker_id = lease.hex_id
        assert self.normaliser is not None and self.requests is not None
        nc = self.nc
        self.publisher = KvPublisher(nc, self.ns, worker, self.epoch, self.normaliser)
        self.publisher.start()
        # Routers that follow from seq 1 must see what the engine held before registration.
        self.publisher.add([Cleared(), *self.normaliser.snapshot()])
        self.load_reporter = LoadReporter(
            nc,
            self.ns,
            worker,
            self.adapter,
            lambda: self.requests.prefill_tokens_queued if self.requests else 0,
            self.limits.kv_total_blocks,
            poll_s=min(0.25, self.config.health_interval_s),
        )
        self.load_reporter.start()
        for role in ("prefill", "decode", "agg"):
            self._subs.append(await nc.subscribe(subjects.gen(self.ns, role, worker), cb=self.requests.on_generate))
        self._subs.append(await nc.subscribe(subjects.cancel(self.ns, worker), cb=self.requests.on_cancel))
        self._subs.append(await nc.subscribe(subjects.kvstate(self.ns, worker), cb=self.publisher.on_kvstate))
        await nc.flush()
        self.status = ShimStatus.REGISTERED
        self.registered.set()
        log.info("registered worker %s (epoch %x, block size %s)", worker, self.epoch, self.limits.block_size)
        await self._monitor(lease)

    async def _monitor(self, lease: Lease) -> None:
        failures = 0
        assert self._events_task is not None
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.health_interval_s):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return
            if lease.lost.is_set():
                log.warning("lease %s lost (%s): registering anew", lease.hex_id, lease.lost_reason)
                return
            if self._events_task.done():
                log.warning("engine event stream ended: %s", self._events_task.exception())
                return
            failures = 0 if await self.adapter.health() else failures + 1
            if failures >= self.config.health_failures:
                log.warning("engine at %s failed %d health checks: deregistering", self.config.engine_url, failures)
                return

    async def _end_session(self) -> None:
        self.registered.clear()
        if self._stopping.is_set() and self.requests is not None:
            self.status = ShimStatus.DRAINING
            await self.requests.drain(self.config.drain_grace_s)
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self.load_reporter is not None:
            await self.load_reporter.stop()
            self.load_reporter = None
        if self.publisher is not None:
            self.publisher.add([Cleared()])
            await self.publisher.stop()
            self.publisher = None
        lease, self._lease = self._lease, None
        if lease is not None and self._discovery is not None:
            await self._discovery.release(lease)
        task, self._events_task = self._events_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.worker_id = None

    # --- stop -----------------------------------------------------------------------------------

    async def _stop(self) -> None:
        self._stopping.set()
        if self.requests is not None:
            self.requests.accepting = False
        main, self._main = self._main, None
        if main is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await main
        if self.requests is not None:
            await self.requests.abort_all()
        await self._close_clients()
        if self.status is not ShimStatus.FAILED:
            self.status = ShimStatus.STOPPED
        self.done.set()

    async def _close_clients(self) -> None:
        await self.adapter.close()
        discovery, self._discovery = self._discovery, None
        if discovery is not None:
            await discovery.close()
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.drain()
            if not nc.is_closed:
                await nc.close()
