"""The async driver of one engine: steps the synchronous scheduler in modelled time, delivers
tokens to request streams, publishes KV events, runs KV transfers and the leases on pinned KV
(vLLM 0.32's NixlConnector: engine_sim/disagg.py).

Time keeping: each step's end is scheduled at an absolute deadline (`previous deadline + modelled
duration / speedup`), not "now + duration", so timer granularity (the event loop wakes ~1 ms late)
does not accumulate: a late wake-up is absorbed by the next step. Steps due within QUANTUM are
run without sleeping (their tokens go out up to QUANTUM early), which bounds the wake-ups per
wall second of a fast-forwarded engine. A stall shorter than MAX_LAG (the
process descheduled, a GC pause) is caught up by running the late steps back to back, keeping
every token's modelled time; beyond it (a saturated CPU) the clock restarts from now and
`lag_resets` counts it. Tokens are
stamped with the step's deadline, which is what the latency histograms use.

An idle engine awaits an event and costs nothing; `_wake` is set by every change that could make
work schedulable (a new request, an abort, a finished transfer, a freed pin, un-hanging).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aiohttp

from engine_sim import disagg
from engine_sim.event_publisher import EventPublisher
from engine_sim.faults import Faults
from engine_sim.request import SimRequest
from engine_sim.scheduler import Scheduler, StepResult
from runtime import cancel_and_wait

__all__ = ["MAX_LAG", "QUANTUM", "EngineRunner", "RequestStream", "StreamClosed"]

log = logging.getLogger("engine_sim.runner")

T = TypeVar("T")

MAX_LAG = 0.25
QUANTUM = 0.001
"""Steps ending within this many wall seconds of now are not slept for: their outputs go out at
once and the next step is computed. The event loop's timers are only ~1 ms precise anyway, and a
fleet at 10x speed would otherwise pay a sleep and a wake-up per 0.5 ms step. Latency stamps
(and so the histograms) still use each step's exact modelled end."""
_BURST = 16  # back-to-back steps before yielding to the event loop


class StreamClosed(Exception):
    """The engine went away (stop, crash, restart) before the request finished."""


class RequestStream:
    """What one request has produced so far. The driver pushes, an HTTP handler reads."""

    __slots__ = (
        "_event",
        "_read",
        "arrival",
        "closed",
        "finish_reason",
        "first_at",
        "kv_transfer_params",
        "last_at",
        "num_cache_creation_tokens",
        "num_cached_tokens",
        "prefill_kv_computed",
        "prompt_len",
        "request_id",
        "scheduled_at",
        "token_ids",
    )

    def __init__(self, request_id: str, prompt_len: int, arrival: float) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.arrival = arrival
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        self.num_cached_tokens = 0
        self.num_cache_creation_tokens = 0
        self.prefill_kv_computed = prompt_len  # replaced at submit (Scheduler.prefill_kv_computed_unserved)
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.scheduled_at: float | None = None
        self.closed = False
        self._event = asyncio.Event()
        self._read = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def next_tokens(self) -> list[int]:
        """Tokens not read yet, waiting for at least one; [] once finished and drained.
        Raises StreamClosed if the engine went away first."""
        while self._read == len(self.token_ids):
            if self.finished:
                return []
            if self.closed:
                raise StreamClosed(self.request_id)
            self._event.clear()
            await self._event.wait()
        new = self.token_ids[self._read :]
        self._read = len(self.token_ids)
        return new

    async def result(self) -> list[int]:
        while await self.next_tokens():
            pass
        return self.token_ids

    def _close(self) -> None:
        self.closed = True
        self._event.set()


class EngineRunner:
    """Owns the step-loop task, transfer and heartbeat tasks and lease timers of one Scheduler;
    `stop()` ends them all and closes every open stream.

    Leases (vLLM 0.32's NixlConnector, `kv_lease_duration` seconds of wall time): a prefill engine
    keeps a finished request's blocks pinned for a lease; a decode engine holding a request whose KV
    it has not pulled renews that lease every `kv_lease_duration // 6` seconds (at least
    disagg.MIN_HEARTBEAT_INTERVAL), each heartbeat extending it to at least `kv_lease_duration * 2 // 3`
    (the prefill engine's lease) from then, in vLLM's floored arithmetic. A decode request
    aborted before its pull frees the prefill pin at once; a lease nobody renews runs out."""

    def __init__(
        self,
        scheduler: Scheduler,
        publisher: EventPublisher,
        faults: Faults,
        *,
        speedup: float = 1.0,
        kv_transfer_gbps: float = 50.0,
        kv_lease_duration: float = 30.0,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.on_death = on_death  # the step loop raised: the engine is dead, as vLLM's is then
        self.publisher = publisher
        self.faults = faults
        self.speedup = speedup
        self.kv_transfer_gbps = kv_transfer_gbps
        self.kv_lease_duration = kv_lease_duration
        self.streams: dict[str, RequestStream] = {}
        self.cpu_s = 0.0
        self.sim_s = 0.0
        self.lag_resets = 0
        self._wake = asyncio.Event()
        self._poked_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # Prefill side: when each unpulled pin's lease runs out, and the timer that checks it.
        self._pin_expiry: dict[str, float] = {}
        self._pin_timers: dict[str, asyncio.TimerHandle] = {}
        # Decode side: the kv_transfer_params of each request whose KV is not being pulled yet.
        self._held: dict[str, dict[str, Any]] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        self._beats: dict[str, asyncio.Task[None]] = {}  # the heartbeats in flight, by prefill engine
        self._session: aiohttp.ClientSession | None = None
        faults._on_change = self._poke

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            disagg.register(self.scheduler.engine_id, self)
            self._task = asyncio.create_task(self._run(), name=f"engine-{self.scheduler.engine_id[:8]}")
            self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """Said at once: a step loop that raised leaves every request hanging on a sim that still
        answers /health, unless the server is told to die (`on_death`), as vLLM's does."""
        if task.cancelled() or (exc := task.exception()) is None:
            return
        log.error("engine %s: the step loop raised; the engine is dead", self.scheduler.engine_id[:8], exc_info=exc)
        if self.on_death is not None:
            self.on_death(exc)

    async def stop(self) -> None:
        disagg.unregister(self.scheduler.engine_id)
        # A stopped engine tells no prefill engine anything: the leases it held run out there.
        self._held.clear()
        self._heartbeat = None
        self._beats.clear()  # cancelled with the other tasks below
        tasks = [t for t in (self._task, *self._tasks) if t is not None]
        self._task = None
        # A step loop that raised was said when it did (_ended); its error is not stop()'s.
        await cancel_and_wait(*tasks)
        self._tasks.clear()
        for h in self._pin_timers.values():
            h.cancel()
        self._pin_timers.clear()
        self._pin_expiry.clear()
        for s in self.streams.values():
            s._close()
        self.streams.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- requests --------------------------------------------------------------------------------

    def submit(self, req: SimRequest) -> RequestStream:
        self.scheduler.add_request(req)
        # Arrival is stamped after admission so the simulator's own bookkeeping (hashing a long
        # prompt takes milliseconds of Python) does not show up as modelled latency.
        stream = RequestStream(req.request_id, req.num_prompt_tokens, asyncio.get_running_loop().time())
        stream.prefill_kv_computed = self.scheduler.prefill_kv_computed_unserved(req)
        self.streams[req.request_id] = stream
        if req.remote_prefill is not None:
            self._held[req.request_id] = req.remote_prefill
            if self._heartbeat is None:
                self._heartbeat = self._spawn(self._heartbeats(), f"kv-heartbeat-{self.scheduler.engine_id[:8]}")
        self._poke()
        return stream

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        stream = self.streams.pop(request_id, None)
        found = self.scheduler.abort(request_id, reason)
        self._drop_lease(request_id)
        if (params := self._held.pop(request_id, None)) is not None:
            # vLLM 0.32 (nixl pull_scheduler.request_finished): a request aborted before its pull
            # tells the prefill engine to free the blocks now, rather than strand them for a lease.
            self._spawn(disagg.pull(params, self._session_for(params)), f"kv-release-{request_id}")
        if stream is not None and not stream.finished:
            if reason != "abort":  # ended by the engine (a stop string, a failed KV load): vLLM counts it finished
                self._count_finish(stream, reason, asyncio.get_running_loop().time())
            stream.finish_reason = reason
            stream._event.set()
        self._poke()
        return found

    def reject(self, params: dict[str, Any] | None) -> None:
        """A request refused before it reached the engine (a 400, a 404): vLLM 0.32's
        notify_kv_transfer_request_rejected submits it pre-aborted, so its connector frees the
        prefill blocks its `kv_transfer_params` pin at once (do_remote_prefill), as for an abort."""
        if params and params.get("do_remote_prefill"):
            self._spawn(disagg.pull(params, self._session_for(params)), f"kv-release-{params.get('remote_request_id')}")

    def release_pin(self, request_id: str | None, block_ids: list[list[int]] | None = None) -> bool:
        """Called by a decode sim's pull (disagg.PinHolder)."""
        if request_id is not None:
            self._drop_lease(request_id)
        ok = self.scheduler.release_pin(request_id, block_ids)
        if ok:
            self._poke()
        return ok

    def renew_pins(self, request_ids: list[str]) -> int:
        """A decode sim's heartbeat (disagg.PinHolder): it still holds these requests, so each
        lease runs until at least `lease * 2 // 3` from now (vLLM's _handle_heartbeat).
        Returns how many leases were still held."""
        until = asyncio.get_running_loop().time() + disagg.lease_extension(self.kv_lease_duration)
        renewed = 0
        for rid in request_ids:
            if (expiry := self._pin_expiry.get(rid)) is not None:
                self._pin_expiry[rid] = max(expiry, until)
                renewed += 1
        return renewed

    def reset_prefix_cache(self) -> bool:
        # The AllBlocksCleared event goes out with the engine's next step, as vLLM's does.
        return self.scheduler.reset_prefix_cache()

    # --- the step loop ---------------------------------------------------------------------------

    def _poke(self) -> None:
        """Wake the step loop. The first poke after idling stamps when work appeared, and the
        engine's clock restarts from that instant rather than from whenever the loop got to run
        (on a busy machine that can be many milliseconds later)."""
        if not self._wake.is_set():
            self._poked_at = asyncio.get_running_loop().time()
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        next_at = loop.time()
        burst = 0
        while True:
            self._wake.clear()
            if self.faults.hang:
                await self._wake.wait()
                next_at = self._poked_at
                continue
            t0 = time.perf_counter()
            result = sched.step()
            for rid, tokens in result.transfers:
                self._start_transfer(rid, tokens)
            if not result.num_scheduled_tokens:
                self.cpu_s += time.perf_counter() - t0
                # vLLM steps on while it holds any request (one pulling its KV, one waiting for
                # room, one just aborted), and an empty step sends its scheduler stats and events
                # too (a pull's start can evict cached blocks).
                sched.publish_stats()
                self._publish_events()
                await self._wake.wait()
                next_at = self._poked_at
                continue
            sim = result.duration * self.faults.slowdown
            self.sim_s += sim
            now = loop.time()
            if next_at < now - MAX_LAG:
                next_at = now
                self.lag_resets += 1
            for rid in result.started:
                stream = self.streams.get(rid)
                if stream is not None and stream.scheduled_at is None:
                    stream.scheduled_at = next_at
            next_at += sim / self.speedup
            self.cpu_s += time.perf_counter() - t0
            delay = next_at - loop.time()
            if delay > QUANTUM:
                burst = 0
                await asyncio.sleep(delay)
            else:
                burst += 1
                if burst >= _BURST:
                    burst = 0
                    await asyncio.sleep(0)
            t1 = time.perf_counter()
            self._deliver(result, next_at)
            sched.publish_stats()
            self._publish_events()
            self.cpu_s += time.perf_counter() - t1

    def _publish_events(self) -> None:
        events = self.scheduler.take_events()
        if events:
            self.publisher.drop_fraction = self.faults.drop_event_fraction
            self.publisher.publish(events)

    def _deliver(self, result: StepResult, at: float) -> None:
        stats = self.scheduler.stats
        speedup = self.speedup
        for out in result.outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if stream.first_at is None:
                stream.first_at = at
                stream.num_cached_tokens = out.num_cached_tokens
                stream.num_cache_creation_tokens = out.num_cache_creation_tokens
                if out.prefill_kv_computed is not None:
                    stream.prefill_kv_computed = out.prefill_kv_computed
                stats.ttft.observe((at - stream.arrival) * speedup)
            elif stream.last_at is not None:
                stats.itl.observe((at - stream.last_at) * speedup)
            stream.last_at = at
            stream.token_ids.extend(out.new_token_ids)
            if out.finish_reason is not None:
                stream.finish_reason = out.finish_reason
                stream.kv_transfer_params = out.kv_transfer_params
                self._count_finish(stream, out.finish_reason, at)
                del self.streams[out.request_id]
                if out.kv_transfer_params is not None:
                    loop = asyncio.get_running_loop()
                    self._pin_expiry[out.request_id] = loop.time() + self.kv_lease_duration
                    self._pin_timers[out.request_id] = loop.call_later(
                        self.kv_lease_duration, self._expire_pin, out.request_id
                    )
            stream._event.set()

    def _count_finish(self, stream: RequestStream, reason: str, at: float) -> None:
        """vLLM 0.32's per-finished-request stats, counted together when the front end sees the
        finish (output_processor.py, _update_stats_from_finished): request_success_total by reason,
        e2e latency, request_prefill_time_seconds (first scheduled to first token) and
        request_prefill_kv_computed_tokens. A client's abort is no finish: vLLM drops the request's
        state first and ignores its outputs, even those of the step that finished it. One that
        ends before its first token (a failed KV load) counts 0 s of prefill: vLLM's own figure
        there is a clock reading, as it never scheduled the request."""
        seconds = 0.0
        if stream.first_at is not None:
            started = stream.scheduled_at if stream.scheduled_at is not None else stream.arrival
            seconds = (stream.first_at - started) * self.speedup
        stats = self.scheduler.stats
        stats.finished[reason] += 1
        stats.e2e.observe((at - stream.arrival) * self.speedup)
        stats.prefill_time.observe(seconds)
        stats.prefill_kv_computed.observe(stream.prefill_kv_computed)

    def _expire_pin(self, request_id: str) -> None:
        expiry = self._pin_expiry.get(request_id)
        if expiry is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < expiry:  # renewed since the timer was set
            self._pin_timers[request_id] = loop.call_at(expiry, self._expire_pin, request_id)
            return
        self._drop_lease(request_id)
        if self.scheduler.release_pin(request_id):
            log.info("kv lease of %s expired unpulled; blocks freed", request_id)
            self._poke()

    def _drop_lease(self, request_id: str) -> None:
        self._pin_expiry.pop(request_id, None)
        if (h := self._pin_timers.pop(request_id, None)) is not None:
            h.cancel()

    # --- remote KV (decode side) -------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _session_for(self, params: dict[str, Any]) -> aiohttp.ClientSession | None:
        """The HTTP session to reach the prefill sim `params` name; None when it is in this process."""
        if disagg.is_local(params):
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _heartbeats(self) -> None:
        """Renew the leases of the KV this engine holds requests for, one message per prefill
        engine every `disagg.heartbeat_interval`, until it holds none (vLLM's NixlConnector). A hung
        engine sends none, as a stuck vLLM scheduler builds none. No heartbeat is awaited here, and
        an engine whose last one is still in flight is skipped (vLLM skips a peer whose handshake
        is pending): a prefill engine that does not answer delays no other engine's leases."""
        try:
            while self._held:
                if not self.faults.hang:
                    by_engine: dict[str, tuple[dict[str, Any], list[str]]] = {}
                    for params in self._held.values():
                        if (rid := params.get("remote_request_id")) is not None:
                            by_engine.setdefault(str(params.get("remote_engine_id")), (params, []))[1].append(rid)
                    self._beats = {eid: t for eid, t in self._beats.items() if not t.done()}
                    for eid, (params, ids) in by_engine.items():
                        if eid not in self._beats:
                            self._beats[eid] = self._spawn(
                                disagg.renew(params, ids, self._session_for(params)), f"kv-beat-{eid[:8]}"
                            )
                await asyncio.sleep(disagg.heartbeat_interval(self.kv_lease_duration))
        finally:
            if self._heartbeat is asyncio.current_task():
                self._heartbeat = None

    def _start_transfer(self, request_id: str, tokens: int) -> None:
        self._held.pop(request_id, None)  # its pull starts now: no more heartbeats for it
        req = self.scheduler.requests.get(request_id)
        params = (req.remote_prefill if req is not None else None) or {}
        seconds = self.scheduler.timing.transfer(tokens, self.kv_transfer_gbps) / self.speedup
        self._spawn(self._transfer(request_id, params, seconds), f"kv-pull-{request_id}")

    async def _transfer(self, request_id: str, params: dict[str, Any], seconds: float) -> None:
        # The pull (which also tells the prefill side to unpin) runs alongside the modelled
        # transfer, so an HTTP round trip to another process hides under the transfer time as a
        # real RDMA read's control messages do; the request resumes when both are done.
        session = self._session_for(params)
        ok, _ = await asyncio.gather(disagg.pull(params, session), asyncio.sleep(seconds))
        resumed = self.scheduler.finish_remote_load(request_id, ok)
        if resumed is None:  # aborted during the pull: nothing waits for it
            return
        if not resumed:
            log.warning("remote KV for %s unavailable; the request fails (kv_load_failure_policy fail)", request_id)
            self.abort(request_id, "error")
        elif not ok:
            log.warning("remote KV for %s unavailable; prefilling locally", request_id)
        self._poke()
