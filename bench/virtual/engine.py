"""One simulated engine on the virtual clock: engine_sim's own Scheduler (block pool, prefix cache,
chunked prefill, preemption, NixlConnector-style remote KV) stepped the way engine_sim.runner
steps it in real time, with the runner's sleeps replaced by callbacks at virtual times.

Step loop (as the runner's `_run`): `step()` is computed when the previous step ends (or when work
appears on an idle engine); its KV transfers start at once; its outputs are delivered and its KV
events handed to the shim when its modelled duration has passed; then the next step is computed.
An engine with nothing schedulable idles until a request, an abort, a finished transfer or a
freed pin wakes it.

Remote KV (decode side, as the runner's `_transfer`): the pull that frees the prefill engine's pin
runs alongside the modelled transfer, so the pin goes when the transfer starts and the request
resumes `transfer_s(tokens)` later; a pin already gone (its lease ran out) makes the request
prefill locally. Leases as the runner keeps them (vLLM 0.32's NixlConnector): a prefill engine
pins a finished request's KV for `kv_lease_duration`; a decode engine renews the leases of the
requests it holds every `kv_lease_duration // 6` (at least engine_sim.disagg.MIN_HEARTBEAT_INTERVAL)
until their pulls start (each renewal: to at least `kv_lease_duration * 2 // 3` from then, vLLM's
floored arithmetic); a decode request aborted before its pull frees the pin at once;
an unrenewed lease runs out and frees the blocks.

Timing observations: the engine keeps what vLLM's /metrics histograms would show (their sums and
counts), which its shim forwards in every LoadReport (router.calibration fits from them):
iterations and their tokens (`vllm:iteration_tokens_total`), per request the PREFILL-phase time,
from first scheduled to first token (`vllm:request_prefill_time_seconds`) and the KV tokens it
computed (`vllm:request_prefill_kv_computed_tokens`), both observed as the request finishes, with
its `vllm:request_success_total`, as vLLM 0.32 observes them (a client's abort is no finish, even
one during the step that finishes the request: vLLM ignores that output), and inter-token gaps
(`vllm:inter_token_latency_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bench.virtual.clock import VirtualClock
from engine_sim import disagg
from engine_sim.request import SimRequest
from engine_sim.scheduler import Scheduler, StepOutput, StepResult
from protocol.vllm_events import KVEvent

__all__ = ["EngineTimingStats", "OutputSink", "VirtualEngine"]

OutputSink = Callable[[StepOutput, float], None]
"""Receives each output of a request with the virtual time its step ended."""


@dataclass(slots=True)
class EngineTimingStats:
    """The engine's latency figures in virtual time, cumulative like Prometheus histogram sums (a
    reader takes differences). Token counts per step are the Scheduler's own (EngineStats)."""

    prefill_requests: int = 0
    prefill_s: float = 0.0
    itl_tokens: int = 0
    itl_s: float = 0.0
    busy_s: float = 0.0  # modelled step time; not a vLLM metric, kept for the benchmark's own figures


class VirtualEngine:
    """Owns its Scheduler's time: no other code calls `step()`. `peers` maps engine ids to the
    engines a decode engine may pull KV from."""

    def __init__(
        self,
        clock: VirtualClock,
        scheduler: Scheduler,
        *,
        peers: Mapping[str, VirtualEngine],
        kv_transfer_gbps: float = 50.0,
        kv_lease_duration: float = 30.0,
    ) -> None:
        self.clock = clock
        self.scheduler = scheduler
        self.peers = peers
        self.kv_transfer_gbps = kv_transfer_gbps
        self.kv_lease_duration = kv_lease_duration
        self.on_events: Callable[[list[KVEvent]], None] = lambda events: None
        self.timing = EngineTimingStats()
        self.transfers = 0
        self.failed_pulls = 0
        self._sinks: dict[str, OutputSink] = {}
        self._requests: dict[str, SimRequest] = {}
        self._last_token_at: dict[str, float] = {}
        self._scheduled_at: dict[str, float] = {}
        # (first scheduled to first token, KV tokens computed), observed together at the finish
        self._prefill: dict[str, tuple[float, int]] = {}
        self._busy = False
        self._woken = False
        self._pin_expiry: dict[str, float] = {}  # prefill side: when each unpulled pin's lease runs out
        self._held: dict[str, dict[str, Any]] = {}  # decode side: params of KV not being pulled yet
        self._beating = False

    @property
    def engine_id(self) -> str:
        return self.scheduler.engine_id

    # --- requests --------------------------------------------------------------------------------

    def submit(self, req: SimRequest, sink: OutputSink) -> None:
        self.scheduler.add_request(req)
        rid = req.request_id
        self._sinks[rid] = sink
        self._requests[rid] = req
        self._prefill[rid] = (0.0, self.scheduler.prefill_kv_computed_unserved(req))
        if req.remote_prefill is not None:
            self._held[rid] = req.remote_prefill
            if not self._beating:
                self._beating = True
                self._heartbeat()
        self._wake()

    def abort(self, request_id: str) -> None:
        self._forget(request_id)
        self._pin_expiry.pop(request_id, None)
        if (params := self._held.pop(request_id, None)) is not None:
            # Aborted before its pull: the prefill engine frees the blocks now (vLLM 0.32).
            source = self.peers.get(str(params.get("remote_engine_id")))
            if source is not None:
                source.release_pin(params.get("remote_request_id"), params.get("remote_block_ids"))
        if self.scheduler.abort(request_id):
            self._wake()

    def release_pin(self, request_id: str | None, block_ids: list[list[int]] | None = None) -> bool:
        if request_id is not None:
            self._pin_expiry.pop(request_id, None)
        ok = self.scheduler.release_pin(request_id, block_ids)
        if ok:
            self._wake()
        return ok

    def renew_pins(self, request_ids: list[str]) -> None:
        """A decode engine's heartbeat: each lease runs until at least `lease * 2 // 3` from now."""
        until = self.clock.now + disagg.lease_extension(self.kv_lease_duration)
        for rid in request_ids:
            if (expiry := self._pin_expiry.get(rid)) is not None:
                self._pin_expiry[rid] = max(expiry, until)

    def _heartbeat(self) -> None:
        if not self._held:
            self._beating = False
            return
        by_engine: dict[str, list[str]] = {}
        for params in self._held.values():
            if (rid := params.get("remote_request_id")) is not None:
                by_engine.setdefault(str(params.get("remote_engine_id")), []).append(rid)
        for engine_id, ids in by_engine.items():
            if (source := self.peers.get(engine_id)) is not None:
                source.renew_pins(ids)
        self.clock.after(disagg.heartbeat_interval(self.kv_lease_duration), self._heartbeat)

    def _forget(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self._requests.pop(rid, None)
        self._last_token_at.pop(rid, None)
        self._scheduled_at.pop(rid, None)
        self._prefill.pop(rid, None)

    # --- the step loop ---------------------------------------------------------------------------

    def _wake(self) -> None:
        """Work may be schedulable: an idle engine computes its next step in this instant (after
        whatever else happens in it, as the runner's loop runs after the poke's caller)."""
        if not self._busy and not self._woken:
            self._woken = True
            self.clock.after(0.0, self._step)

    def _step(self) -> None:
        self._woken = False
        if self._busy:
            return
        result = self.scheduler.step()
        now = self.clock.now
        for rid in result.started:
            if rid in self._requests:
                self._scheduled_at.setdefault(rid, now)
        for rid, tokens in result.transfers:
            self._start_transfer(rid, tokens)
        if not result.num_scheduled_tokens:
            # As engine_sim.runner: an empty step (a request pulling its KV, one waiting for room,
            # one just aborted, a pin released) sends its scheduler stats too; the figures read
            # stale until the next step with work otherwise.
            self.scheduler.publish_stats()
            return  # idle until woken
        self._busy = True
        self.clock.at(now + result.duration, self._end_step, result)

    def _end_step(self, result: StepResult) -> None:
        now = self.clock.now
        self._busy = False
        t = self.timing
        t.busy_s += result.duration
        last, sinks, requests = self._last_token_at, self._sinks, self._requests
        for out in result.outputs:
            rid = out.request_id
            if rid not in requests:
                continue  # aborted during the step: vLLM ignores its output (as the runner's _deliver)
            prev = last.get(rid)
            if prev is None:
                self._first_token(rid, now, out)
            else:
                t.itl_tokens += 1
                t.itl_s += now - prev
            last[rid] = now
            sink = sinks.get(rid)
            if out.finish_reason is not None:
                self._count_finish(rid, out.finish_reason)
                self._forget(rid)
                if out.kv_transfer_params is not None:
                    self._pin_expiry[rid] = now + self.kv_lease_duration
                    self.clock.at(now + self.kv_lease_duration, self._expire_pin, rid)
            if sink is not None:
                sink(out, now)
        self.scheduler.publish_stats()  # what its /metrics shows
        events = self.scheduler.take_events()
        if events:
            self.on_events(events)
        self._step()

    def _first_token(self, rid: str, now: float, out: StepOutput) -> None:
        computed = self._prefill[rid][1] if out.prefill_kv_computed is None else out.prefill_kv_computed
        self._prefill[rid] = (now - self._scheduled_at.pop(rid, now), computed)

    def _count_finish(self, rid: str, reason: str) -> None:
        """The request ended in the engine: its finish, prefill time and computed KV tokens count
        together (the runner's _count_finish); 0 s for one that ended before its first token."""
        seconds, computed = self._prefill.pop(rid)
        self.scheduler.stats.finished[reason] += 1
        t = self.timing
        t.prefill_requests += 1
        t.prefill_s += seconds
        self.scheduler.stats.prefill_kv_computed.observe(computed)

    def _expire_pin(self, rid: str) -> None:
        expiry = self._pin_expiry.get(rid)
        if expiry is None:
            return
        if self.clock.now < expiry:  # renewed since
            self.clock.at(expiry, self._expire_pin, rid)
            return
        self.release_pin(rid)

    # --- remote KV (decode side) -----------------------------------------------------------------

    def transfer_s(self, tokens: int) -> float:
        """The sim's link model: the one place this engine's KV transfer time is computed."""
        return self.scheduler.timing.transfer(tokens, self.kv_transfer_gbps)

    def _start_transfer(self, rid: str, tokens: int) -> None:
        self._held.pop(rid, None)
        req = self.scheduler.requests.get(rid)
        params = (req.remote_prefill if req is not None else None) or {}
        source = self.peers.get(str(params.get("remote_engine_id")))
        ok = source is not None and source.release_pin(params.get("remote_request_id"), params.get("remote_block_ids"))
        self.transfers += 1
        self.failed_pulls += not ok
        self.clock.after(self.transfer_s(tokens), self._transfer_done, rid, ok)

    def _transfer_done(self, rid: str, ok: bool) -> None:
        if self.scheduler.finish_remote_load(rid, ok) is False:
            # Failed (kv_load_failure_policy fail): vLLM counts it finished, and its client gets
            # finish reason "error" with no token, as the runner ends its stream.
            self._count_finish(rid, "error")
            sink = self._sinks.get(rid)
            self._forget(rid)
            if sink is not None:
                sink(StepOutput(rid, [], "error"), self.clock.now)
        self._wake()

    # --- what the shim reads -----------------------------------------------------------------------

    @property
    def quiet(self) -> bool:
        """Idle with nothing pending: no request, step, pinned or held KV (no event of its own to come)."""
        return not (self._busy or self._woken or self._requests or self._pin_expiry or self._held or self._beating)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.scheduler.pool.usage
