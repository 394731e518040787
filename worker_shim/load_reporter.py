"""`LoadReport`s on `{ns}.load.{worker}`: on every change and at least once a second.

The engine's numbers (running, waiting, KV use) are polled every `poll_s`; the shim's own number
(prompt tokens of its requests not yet at first token) changes with every request and `poke()`
publishes it at once, at most every `MIN_GAP_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as Nats

from protocol import LoadReport, encode_msg, subjects
from worker_shim.adapters.base import EngineAdapter, EngineError, EngineLoad

__all__ = ["HEARTBEAT_S", "LoadReporter"]

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
MIN_GAP_S = 0.02


class LoadReporter:
    def __init__(
        self,
        nc: Nats,
        ns: str,
        worker: str,
        adapter: EngineAdapter,
        queued_tokens: Callable[[], int],
        kv_total_blocks: int | None,
        poll_s: float = 0.25,
    ) -> None:
        self.nc = nc
        self.subject = subjects.load(ns, worker)
        self.worker = worker
        self.adapter = adapter
        self.queued_tokens = queued_tokens
        self.kv_total_blocks = kv_total_blocks
        self.poll_s = min(poll_s, HEARTBEAT_S)
        self.published = 0
        self._engine = EngineLoad()
        self._healthy = True
        self._last_key: tuple[object, ...] | None = None
        self._last_sent = 0.0
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"load-{self.worker}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def poke(self) -> None:
        self._poke.set()

    def report(self) -> LoadReport:
        e = self._engine
        total = e.kv_total_blocks or self.kv_total_blocks
        used = round(e.kv_usage * total) if e.kv_usage is not None and total else 0
        return LoadReport(
            worker=self.worker,
            ts=time.time(),
            running=e.running,
            waiting=e.waiting,
            kv_used_blocks=used,
            kv_total_blocks=total,
            prefill_tokens_queued=self.queued_tokens(),
            kv_usage=e.kv_usage,
            num_preemptions=e.num_preemptions,
            healthy=self._healthy,
        )

    async def _poll(self) -> None:
        try:
            self._engine = await self.adapter.load()
            self._healthy = True
        except EngineError as exc:
            if self._healthy:
                log.warning("load poll failed: %s", exc)
            self._healthy = False

    async def _publish_if_due(self) -> None:
        rep = self.report()
        key = (
            rep.running,
            rep.waiting,
            rep.kv_used_blocks,
            rep.prefill_tokens_queued,
            rep.healthy,
            rep.kv_total_blocks,
        )
        now = time.monotonic()
        if key != self._last_key or now - self._last_sent >= HEARTBEAT_S:
            self._last_key, self._last_sent = key, now
            await self.nc.publish(self.subject, encode_msg(rep))
            self.published += 1

    async def _run(self) -> None:
        next_poll = 0.0
        while True:
            now = time.monotonic()
            if now >= next_poll:
                await self._poll()
                next_poll = time.monotonic() + self.poll_s
            await self._publish_if_due()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_poll - time.monotonic())):
                    await self._poke.wait()
                    await asyncio.sleep(MIN_GAP_S)
            self._poke.clear()
