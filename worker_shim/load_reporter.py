"""`LoadReport`s on `{ns}.load.{worker}`: on every change and at least every `period_s`.

A router treats a worker silent for three periods as gone, so the reports are the shim's liveness
signal: they leave on time whatever the engine does. The engine's numbers (running, waiting, KV
use) are polled every `poll_s` by a task of their own, so a slow `/metrics` delays only those; the
shim's own numbers (prompt tokens not yet at first token, events_ok) change with every request and
`poke()` publishes them at once, at most every `MIN_GAP_S`. Every report carries `period_s` and the
KV digest as of the last batch handed to NATS (kv_epoch 0 when there is none yet). `healthy` is
what the reports say of the engine and `error` why its last poll failed: the shim's /health and
/metrics show both, so the state routers act on is not hidden from whoever looks at the shim.

Failed polls: each is counted by kind (the EngineError's; `internal` for a reading the shim cannot
use) in `polls_failed`, which the shim exports. An episode of them (healthy, then not) starts with a
WARNING, at most one per kind a minute, saying how many were held back meanwhile; a said episode's
end is an INFO. A /metrics that alternates good and bad answers logged a WARNING per flip before
(38 in 20 s) and its failed polls were counted nowhere.

A stale reading (EngineLoad.stale: the engine gave nothing new, its last figures repeated) is no
failure, but no idle figure is published from it: its running requests are raised to the shim's
own legs in flight less those it reports waiting, and `engine_ts` stays at the last fresh
reading's. Until 2026-12-07 TensorRT-LLM's repeated idle load went out as current while a burst
ran on the engine.

While the NATS connection is down no report is published: nats-py would keep it in its reconnect
buffer and send it, stale, once NATS is back, where the newest report supersedes every older one (a
router read three stale stamps in a row as the worker's clock behind by the outage: a false "keep
hosts on NTP" WARNING for every worker, and its deadlines moved by that much). The first report after
it goes at the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as Nats
from nats.errors import Error as NatsError

from protocol import LoadReport, encode_msg, subjects
from protocol.config import MIN_LOAD_PERIOD_S
from runtime import Throttle, background, cancel_and_wait, clipped
from worker_shim.adapters.base import EngineAdapter, EngineError, EngineLoad
from worker_shim.kv_publisher import KvDigestAt

__all__ = ["DEFAULT_PERIOD_S", "EPISODE_SAID_S", "MIN_GAP_S", "POLL_FAILURE_KINDS", "LoadReporter"]

log = logging.getLogger(__name__)
MIN_GAP_S = MIN_LOAD_PERIOD_S  # routers budget a sender at twice this rate (router.sender_budget)
DEFAULT_PERIOD_S = 0.5  # the heartbeat: a report at least this often, changed or not
EPISODE_SAID_S = 60.0  # a failing episode's WARNING, per kind, at most this often
# The kinds a failed poll is counted under: the adapters' EngineError kinds a poll meets (no answer,
# a non-200, a body the shim cannot read), and `internal` for any other exception.
POLL_FAILURE_KINDS = ("engine_unavailable", "engine_error", "engine_protocol", "internal")


class LoadReporter:
    """Owns two tasks (poll, publish); `start()`/`stop()` (safe twice) own them."""

    def __init__(
        self,
        nc: Nats,
        ns: str,
        worker: str,
        adapter: EngineAdapter,
        queued_tokens: Callable[[], int],
        kv_total_blocks: int | None,
        *,
        legs_in_flight: Callable[[], int] = lambda: 0,
        period_s: float = DEFAULT_PERIOD_S,
        poll_s: float = 0.25,
        digest: Callable[[], KvDigestAt | None] = lambda: None,
        events_ok: Callable[[], bool] = lambda: True,
        decode_context: Callable[[], float] = lambda: 0.0,
        credit_short: Callable[[], bool] = lambda: False,
        transfers_failed: Callable[[], int] = lambda: 0,
        draining: Callable[[], bool] = lambda: False,
        on_reading: Callable[[float, float, EngineLoad | None], None] = lambda _asked, _done, _load: None,
        on_published: Callable[[], None] = lambda: None,
        on_unencodable: Callable[[], None] = lambda: None,
        on_crash: Callable[[], None] = lambda: None,
        polls_failed: Counter[str] | None = None,
    ) -> None:
        self.nc = nc
        self.subject = subjects.load(ns, worker)
        self.worker = worker
        self.adapter = adapter
        self.queued_tokens = queued_tokens
        self.legs_in_flight = legs_in_flight  # the floor under a stale reading's requests
        self.kv_total_blocks = kv_total_blocks
        self.period_s = period_s
        self.poll_s = min(poll_s, period_s)
        self.digest = digest
        self.events_ok = events_ok
        self.decode_context = decode_context
        self.credit_short = credit_short
        self.transfers_failed = transfers_failed
        self.draining = draining
        # Each poll's result (None: it failed), with the time.monotonic() it was asked for and came back.
        self.on_reading = on_reading
        # Each report sent: the shim counts them over its lifetime, not this worker id's.
        self.on_published = on_published
        self.on_unencodable = on_unencodable  # a report that could not be encoded, so not sent
        self.on_crash = on_crash  # one of its tasks crashed (said at ERROR): the shim counts it
        # Failed polls by kind; the shim passes one Counter to each of its reporters.
        self.polls_failed: Counter[str] = Counter() if polls_failed is None else polls_failed
        self._engine = EngineLoad()
        self._engine_at = 0.0
        self.healthy = True  # what the reports say of the engine: False while its load polls fail
        self.error = ""  # why the last poll failed, shortened; "" while healthy
        self._episodes = Throttle(EPISODE_SAID_S)  # a failing episode's start, said by kind
        self._episode: tuple[float, int] | None = None  # a said episode's start and failed polls
        self._unencodable_said = False
        self._on_reading_said = False
        self._last_key: tuple[object, ...] | None = None
        self._last_sent = 0.0
        self._poke = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                background(
                    self._poll_loop(),
                    f"load-poll-{self.worker}",
                    "the engine's load is not read: the shim ends the session and starts a new one",
                    self.on_crash,
                ),
                background(
                    self._publish_loop(),
                    f"load-{self.worker}",
                    "no load report is sent: the shim ends the session and starts a new one",
                    self.on_crash,
                ),
            ]

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """Its loops, from start() until stop() (which alone ends them): the shim ends the session should
        one end before (runtime.ended), as a worker that sends no reports, or stale ones, stays
        registered otherwise."""
        return list(self._tasks)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(*tasks)  # a crash was logged when it happened

    def poke(self) -> None:
        self._poke.set()

    def report(self) -> LoadReport:
        e = self._engine
        t = e.timing
        running = max(e.running, self.legs_in_flight() - e.waiting) if e.stale else e.running
        total = e.kv_total_blocks or self.kv_total_blocks
        # kv_usage may stray past [0, 1] by a rounding (_unusable): never more blocks than there are.
        used = min(round(max(0.0, e.kv_usage) * total), total) if e.kv_usage is not None and total else 0
        d = self.digest()
        return LoadReport(
            worker=self.worker,
            ts=time.time(),
            running=running,
            waiting=e.waiting,
            kv_used_blocks=used,
            kv_total_blocks=total,
            prefill_tokens_queued=self.queued_tokens(),
            kv_usage=e.kv_usage,
            num_preemptions=e.num_preemptions,
            healthy=self.healthy,
            period_s=self.period_s,
            events_ok=self.events_ok(),
            kv_epoch=d.epoch if d else 0,
            kv_seq=d.seq if d else 0,
            kv_blocks=d.blocks if d else 0,
            kv_xor=d.xor if d else 0,
            iterations=t.iterations,
            iteration_tokens=t.iteration_tokens,
            prefill_requests=t.prefill_requests,
            prefill_seconds=t.prefill_seconds,
            prefill_computed_tokens=t.prefill_computed_tokens,
            prefix_hit_tokens=t.prefix_hit_tokens,
            itl_count=t.itl_count,
            itl_seconds=t.itl_seconds,
            engine_ts=self._engine_at,
            decode_context=self.decode_context(),
            prefix_credit_short=self.credit_short(),
            kv_transfers_failed=self.transfers_failed(),
            draining=self.draining(),
            generation_tokens=t.generation_tokens,
        )

    async def _poll_loop(self) -> None:
        while True:
            asked_mono = time.monotonic()
            good: EngineLoad | None = None  # the reading, once it proved usable
            try:
                asked = time.time()
                reading = await self.adapter.load()
                if (bad := _unusable(reading)) is not None:
                    raise EngineError(502, "engine_protocol", f"the engine's load reading has {bad}")
                self._engine = reading
                if not reading.stale:
                    self._engine_at = (asked + time.time()) / 2  # the engine rendered them in between
                if self._episode is not None:
                    since, failed = self._episode
                    log.info("load polls work again after %.1fs (%d failed)", time.monotonic() - since, failed)
                    self._episode = None
                self.healthy, self.error = True, ""
                good = reading
            except Exception as exc:
                # Whatever the reading (a NaN in /metrics, a field of the wrong type), the reports
                # go on: the worker says it is unhealthy until a reading works again.
                self._failed(exc)
            self._hand_on(asked_mono, good)
            self._poke.set()
            await asyncio.sleep(self.poll_s)

    def _hand_on(self, asked: float, reading: EngineLoad | None) -> None:
        """`on_reading`, outside the poll's try: a bug of the shim's there is no failed poll (until
        2026-12-08 it read as the engine unhealthy, `internal`, and the hook was called again with
        None). Said once, with its traceback; the reading stands and the reports go on."""
        try:
            self.on_reading(asked, time.monotonic(), reading)
        except Exception as exc:
            if not self._on_reading_said:
                self._on_reading_said = True
                log.error(
                    "the shim's on_reading hook failed on a load reading (a bug of the shim's, not the "
                    "engine's; said once): %r",
                    exc,
                    exc_info=exc,
                )

    def _failed(self, exc: Exception) -> None:
        """Counts a failed poll, and says it where it starts an episode the throttle lets through."""
        engine = isinstance(exc, EngineError)
        kind = exc.kind if isinstance(exc, EngineError) else "internal"
        why = clipped(str(exc) if engine else repr(exc))
        self.polls_failed[kind] += 1
        if self._episode is not None:
            self._episode = (self._episode[0], self._episode[1] + 1)
        elif self.healthy and (said := self._episodes(kind)) is not None:
            self._episode = (time.monotonic(), 1)
            held, ago = said
            more = f" ({held} more episodes of it since the one said {ago:.0f}s ago)" if held else ""
            if engine:
                log.warning("load poll failed: %s%s", why, more)
            else:
                log.error("load poll failed on a reading the shim cannot use: %s%s", why, more, exc_info=exc)
        self.healthy, self.error = False, why

    async def _publish_if_due(self) -> None:
        if not self.nc.is_connected:  # it would go out stale from the reconnect buffer (module docstring)
            # None sent, but the loop waits as if one had (it spun without a wait for the whole
            # outage before); no key, so the first report once connected goes at the next poll.
            self._last_key, self._last_sent = None, time.monotonic()
            return
        rep = self.report()
        key = (
            rep.running,
            rep.waiting,
            rep.kv_used_blocks,
            rep.prefill_tokens_queued,
            rep.healthy,
            rep.kv_total_blocks,
            rep.events_ok,
            rep.prefix_credit_short,
            rep.kv_transfers_failed,
            rep.draining,
        )
        now = time.monotonic()
        if key != self._last_key or now - self._last_sent >= self.period_s:
            self._last_key, self._last_sent = key, now
            try:
                payload = encode_msg(rep)
            except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:
                # A number _unusable let through: this report is lost, the next may go, the session
                # goes on (a crash here ended it and re-registered twice a second).
                self.on_unencodable()
                if not self._unencodable_said:
                    self._unencodable_said = True
                    log.error("a load report could not be encoded, none such is sent: %r (%r)", exc, rep)
                return
            try:
                await self.nc.publish(self.subject, payload)
                self.on_published()
            except NatsError as exc:
                log.warning("publishing the load report failed: %s", exc)

    async def _publish_loop(self) -> None:
        while True:
            await self._publish_if_due()
            wait = self._last_sent + self.period_s - time.monotonic()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wait)):
                    await self._poke.wait()
                    await asyncio.sleep(MIN_GAP_S)
            self._poke.clear()


_INT_LIMIT = 2**63  # msgpack's signed integers, which a LoadReport's are
# vLLM's usage is 1 - free/total per rank, in [0, 1]; the mean over ranks may round past either end.
_KV_USAGE_SLACK = 1e-6


def _unusable(e: EngineLoad) -> str | None:
    """What in a reading is not a number a report can carry, if anything: a count that is not an
    integer in [0, 2**63), a time that is NaN, infinite or negative, a KV usage outside [0, 1]. A
    /metrics that says 1e30 requests run is no engine's load, and its report could not be encoded."""
    t = e.timing
    for name, count in (
        ("running", e.running),
        ("waiting", e.waiting),
        ("kv_total_blocks", e.kv_total_blocks),
        ("num_preemptions", e.num_preemptions),
        ("failed_transfers", e.failed_transfers),
        ("iterations", t.iterations),
        ("iteration_tokens", t.iteration_tokens),
        ("prefill_requests", t.prefill_requests),
        ("prefill_computed_tokens", t.prefill_computed_tokens),
        ("prefix_hit_tokens", t.prefix_hit_tokens),
        ("itl_count", t.itl_count),
        ("generation_tokens", t.generation_tokens),
    ):
        if count is not None and not (type(count) is int and 0 <= count < _INT_LIMIT):
            return f"{name} = {count!r}, not a count"
    # Cached less pulled tokens: a difference, so it may be negative.
    reused = e.reused_tokens
    if reused is not None and not (type(reused) is int and -_INT_LIMIT <= reused < _INT_LIMIT):
        return f"reused_tokens = {reused!r}, not a 64-bit integer"
    for name, seconds in (("prefill_seconds", t.prefill_seconds), ("itl_seconds", t.itl_seconds)):
        if not (math.isfinite(seconds) and seconds >= 0):
            return f"{name} = {seconds}, not a time"
    usage = e.kv_usage
    if usage is not None and not -_KV_USAGE_SLACK <= usage <= 1 + _KV_USAGE_SLACK:
        return f"kv_usage = {usage}, not within [0, 1]"
    return None
