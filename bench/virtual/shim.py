"""The worker shim beside one virtual engine, as worker_shim runs beside a live one:

- KV events: the engine's vLLM events go through the shim's own adapter conversion and its
  `Normaliser` (engine hash -> canonical hash, reference counted), so the routers' indexes see
  exactly the canonical hashes a live shim would publish; each non-empty result is one
  KvEventBatch (seq +1), delivered to every router `kv_event_s` later.
- Load: worker_shim.load_reporter's two loops. The poll reads the engine (`engine_read_s` from
  asking to the answer, the engine's figures as of half way, which the live shim stamps as the
  reading's engine_ts) and sleeps POLL_S after each answer, so its period is POLL_S plus the read
  and its phase drifts; each shim's first poll comes at its own `poll_offset_s` (live shims start at
  their own moments). The publish loop: a poke (each reading, each change of the shim's own queued
  prefill tokens) publishes MIN_GAP_S later, pokes in that gap folded in, and a report goes at
  least every DEFAULT_PERIOD_S (the heartbeat), changed or not, cutting the gap short at that
  deadline; each report delivered to every router `load_report_s` later. While the fleet is quiet
  (`quiet_until`: no request in flight, every engine idle) both loops skip to their last tick
  QUIET_MARGIN_S before the next arrival (the poll's a heartbeat and a poll earlier), at the very
  float their additions reach (`last_round`), so every report a router gets is one ticking through
  sends at that moment, byte for byte: each tick in between read the same idle engine, and a run at
  a tiny rate spent its wall time on them (5 requests at 1e-6 times the trace's rate took 79 s).
- Legs: a leg becomes a SimRequest as the vLLM adapter and engine_sim's HTTP API build it: a prefill
  leg with `do_remote_decode` and one output token, a decode leg with the prefill leg's
  kv_transfer_params (unless bypassed), anything else prefilled locally. While a leg waits for
  its first token, its uncached prompt tokens count as the shim's queued prefill tokens; from its
  first token to its end a decoding leg counts in the reports' `decode_context`
  (worker_shim.decode_context, as the live shim counts it).
- The credit check (worker_shim.credit_check): what each leg was promised at dispatch against the
  engine's reuse counter at each poll, so a replay tells how far a full cache falls short of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from bench.virtual.clock import VirtualClock, last_round
from bench.virtual.delays import Delays
from bench.virtual.engine import OutputSink, VirtualEngine
from bench.virtual.engine_hash import ChainedRequest
from engine_sim.scheduler import StepOutput
from protocol import KvEventBatch, LoadReport, WorkerInfo
from protocol.vllm_events import BlockRemoved, KVEvent
from worker_shim.adapters.vllm_events import to_engine_event
from worker_shim.credit_check import CreditCheck, reusable
from worker_shim.decode_context import DecodeContext
from worker_shim.engine_events import EngineEvent, EngineRemoved
from worker_shim.load_reporter import DEFAULT_PERIOD_S, MIN_GAP_S
from worker_shim.normaliser import Normaliser

if TYPE_CHECKING:
    from bench.virtual.router import VirtualRouter

__all__ = ["POLL_S", "VirtualShim"]

POLL_S = 0.25  # the shim's engine poll (worker_shim.shim: min(0.25, health_interval_s))
# Heartbeats resume this long before the next arrival after a quiet stretch, so the routers hold
# the reports ticking would have given them; polls a heartbeat and a poll earlier, so the first
# heartbeat carries the reading ticking's would.
QUIET_MARGIN_S = 10 * DEFAULT_PERIOD_S

_Sample = tuple[int, int, float]  # running, waiting, KV usage


class _Timing(NamedTuple):
    """The reports' timing fields, in order."""

    steps: int
    step_tokens: int
    prefill_requests: int
    prefill_s: float
    prefill_tokens: int
    hit_tokens: int
    itl_n: int
    itl_s: float
    generated: int


_Reading = tuple[_Sample, _Timing]


class VirtualShim:
    def __init__(
        self,
        clock: VirtualClock,
        engine: VirtualEngine,
        info: WorkerInfo,
        delays: Delays,
        *,
        epoch: int,
        poll_offset_s: float = 0.0,
    ) -> None:
        self.clock = clock
        self.engine = engine
        self.info = info
        self.worker = info.worker
        self.delays = delays
        self.epoch = epoch
        self.poll_offset_s = poll_offset_s
        self.routers: list[VirtualRouter] = []
        self.normaliser = Normaliser(info.block_size, clock=clock.time)
        self.seq = 0
        self.reports = 0
        self.running = True  # False once the replay is over: the periodic poll stops
        self._queued = 0
        self._queued_by_leg: dict[str, int] = {}
        self.contexts = DecodeContext()
        self.credit = CreditCheck(self.worker)
        self._promised: dict[str, tuple[float, int]] = {}  # by leg: dispatched at, promised tokens
        self._sample: _Sample = (0, 0, 0.0)
        self._timing = _Timing(0, 0, 0, 0.0, 0, 0, 0, 0.0, 0)
        self._sampled_at = 0.0
        self._last_key: tuple[object, ...] | None = None
        # The heartbeat's: the last report's time plus DEFAULT_PERIOD_S, or the tick it skipped to
        # (a poke after a skip cuts its gap at that, not at the past deadline, which published at once).
        self._deadline = float("-inf")
        self._gap = False  # the publish loop sleeps MIN_GAP_S after a poke (else it waits for one)
        self._wake_gen = 0  # the publish loop's pending wake-up; an older one is stale
        # The fleet's next arrival while nothing else can change what this shim reads (else None).
        self.quiet_until: Callable[[], float | None] = lambda: None
        engine.on_events = self._on_engine_events

    # --- KV events -------------------------------------------------------------------------------

    def _on_engine_events(self, events: list[KVEvent]) -> None:
        canonical = self.normaliser.apply(_merged(events))
        if not canonical:
            return
        self.seq += 1
        batch = KvEventBatch(worker=self.worker, epoch=self.epoch, seq=self.seq, ts=self.clock.now, events=canonical)
        at = self.clock.now + self.delays.kv_event_s
        for router in self.routers:
            self.clock.at(at, router.on_kv_batch, batch)

    def cached_tokens(self, hashes: Sequence[int]) -> int:
        return self.normaliser.cached_prefix_blocks(list(hashes)) * self.info.block_size

    # --- legs ------------------------------------------------------------------------------------

    def leg(
        self,
        request_id: str,
        token_ids: list[int],
        hashes: Sequence[int],
        max_tokens: int,
        sink: OutputSink,
        on_error: Callable[[int, str], None],
        prefill_only: bool = False,
        transfer: dict[str, Any] | None = None,
    ) -> None:
        """One leg arrives from a router. `hashes` are the prompt's canonical block hashes (the
        router computed them with the function the shim uses). A prompt the engine refuses (as
        engine_sim's HTTP API refuses one at or over max_model_len, with 400) goes back to the
        router as `on_error(status, message)`, `token_s` later."""
        limit = self.engine.scheduler.max_model_len
        if len(token_ids) >= limit:
            message = f"prompt of {len(token_ids)} tokens; this model's maximum context length is {limit}"
            self.clock.after(self.delays.token_s, on_error, 400, message)
            return
        queued = 0
        if transfer is None:
            held = self.cached_tokens(hashes)
            queued = max(0, len(token_ids) - held)
            if promised := reusable(held, len(token_ids), self.info.block_size):
                self._promised[request_id] = (self.clock.now, promised)
        if queued:
            self._queued_by_leg[request_id] = queued
            self._queued += queued
            self.poke()
        engine_max = self.engine.scheduler.max_model_len - len(token_ids)
        req = ChainedRequest(
            request_id,
            token_ids,
            max_tokens=1 if prefill_only else min(max_tokens, engine_max),
            remote_decode=prefill_only,
            remote_prefill=transfer if transfer is not None and transfer.get("do_remote_prefill") else None,
        )
        self.engine.submit(req, self._on_output(request_id, sink, 0 if prefill_only else len(token_ids)))

    def _on_output(self, request_id: str, sink: OutputSink, prompt_tokens: int) -> OutputSink:
        """`prompt_tokens`: 0 for a prefill leg, which never decodes here."""

        def on_output(out: StepOutput, at: float) -> None:
            self._first_token(request_id)
            if (promised := self._promised.pop(request_id, None)) is not None:
                self.credit.scheduled(promised[0], at, promised[1])
            if prompt_tokens:
                if out.finish_reason is None:
                    self.contexts.grow(request_id, len(out.new_token_ids), prompt_tokens)
                else:
                    self.contexts.end(request_id)
            sink(out, at)

        return on_output

    def _first_token(self, request_id: str) -> None:
        queued = self._queued_by_leg.pop(request_id, 0)
        if queued:
            self._queued -= queued
            self.poke()

    def cancel(self, request_id: str) -> None:
        self._first_token(request_id)
        self._promised.pop(request_id, None)
        self.contexts.end(request_id)
        self.engine.abort(request_id)

    # --- load reports ----------------------------------------------------------------------------

    def start(self) -> None:
        """The replay begins: the shim has read its idle engine and published, as a live shim
        running before the replay has; its next poll comes `poll_offset_s` later."""
        self._take(self.clock.now, self.clock.now, self._read())
        self._publish_if_due()
        self._arm()
        self.clock.after(self.poll_offset_s, self._poll)

    def poke(self) -> None:
        if not self._gap:
            self._gap = True
            self._wake_gen += 1
            wake = min(self.clock.now + MIN_GAP_S, self._deadline)
            self.clock.at(wake, self._wake, self._wake_gen)

    def _arm(self) -> None:
        """The publish loop waits for a poke, or for the heartbeat's deadline."""
        self._gap = False
        self._wake_gen += 1
        self._deadline = self._ahead(self._deadline, (DEFAULT_PERIOD_S,), QUIET_MARGIN_S)
        self.clock.at(self._deadline, self._wake, self._wake_gen)

    def _ahead(self, due: float, steps: tuple[float, ...], margin: float) -> float:
        """`due`, or, while the fleet is quiet, the tick its loop (adding `steps` in turn) would
        reach last, bit for bit, at least `margin` before the next arrival."""
        until = self.quiet_until()
        return due if until is None else last_round(due, steps, until - margin)

    def _wake(self, gen: int) -> None:
        if gen != self._wake_gen:
            return
        self._publish_if_due()
        if self.running:
            self._arm()
        else:
            self._gap = False  # the replay is over: no heartbeat, a poke still publishes

    def _poll(self) -> None:
        if self.running:
            self.clock.after(self.delays.engine_read_s / 2, self._rendered, self.clock.now)

    def _rendered(self, asked: float) -> None:
        quiet = self.quiet_until() is not None
        self.clock.after(self.delays.engine_read_s / 2, self._answered, asked, self._read(), quiet)

    def _answered(self, asked: float, reading: _Reading, quiet: bool) -> None:
        self._take(asked, self.clock.now, reading)
        self.poke()
        due = self.clock.now + POLL_S
        # Only after a reading of the quiet engine: the routers must see its last state before the skip.
        if quiet:
            read = self.delays.engine_read_s
            due = self._ahead(due, (read / 2, read / 2, POLL_S), QUIET_MARGIN_S + DEFAULT_PERIOD_S + POLL_S + read)
        self.clock.at(due, self._poll)

    def _read(self) -> _Reading:
        e = self.engine
        st = e.scheduler.stats
        shown, t = st.published, e.timing  # the step series as of its last step's end, as vLLM's /metrics
        timing = _Timing(
            shown.iteration_tokens.count,
            int(shown.iteration_tokens.sum),
            t.prefill_requests,
            t.prefill_s,
            int(st.prefill_kv_computed.sum),
            shown.prefix_cache_hits,
            t.itl_tokens,
            t.itl_s,
            shown.generation_tokens,
        )
        return (shown.running, shown.waiting, shown.kv_usage), timing

    def _take(self, asked: float, done: float, reading: _Reading) -> None:
        self._sample, self._timing = reading
        self._sampled_at = (asked + done) / 2  # the live shim's engine_ts: rendered in between
        self.credit.reading(asked, done, self._timing.hit_tokens)

    def report(self) -> LoadReport:
        running, waiting, usage = self._sample
        total = self.info.kv_total_blocks
        steps, step_tokens, prefill_requests, prefill_s, prefill_tokens, hit_tokens, itl_n, itl_s, generated = (
            self._timing
        )
        return LoadReport(
            worker=self.worker,
            ts=self.clock.now,
            running=running,
            waiting=waiting,
            kv_used_blocks=round(usage * total) if total else 0,
            kv_total_blocks=total,
            prefill_tokens_queued=self._queued,
            kv_usage=usage,
            iterations=steps,
            iteration_tokens=step_tokens,
            prefill_requests=prefill_requests,
            prefill_seconds=prefill_s,
            prefill_computed_tokens=prefill_tokens,
            prefix_hit_tokens=hit_tokens,
            itl_count=itl_n,
            itl_seconds=itl_s,
            generation_tokens=generated,
            period_s=DEFAULT_PERIOD_S,
            engine_ts=self._sampled_at,
            decode_context=self.contexts.mean(),
        )

    def _publish_if_due(self) -> None:
        rep = self.report()
        key = (rep.running, rep.waiting, rep.kv_used_blocks, rep.prefill_tokens_queued)
        now = self.clock.now
        # The deadline itself, as the wake-up was set (`now - last sent` may round below the period).
        if key == self._last_key and now < self._deadline:
            return
        self._last_key, self._deadline = key, now + DEFAULT_PERIOD_S
        self.reports += 1
        at = now + self.delays.load_report_s
        for router in self.routers:
            self.clock.at(at, router.on_load, rep)


def _merged(events: list[KVEvent]) -> list[EngineEvent]:
    """The engine's events as the shim's adapter converts them, consecutive removals (of one
    medium) joined into one: vLLM sends a BlockRemoved per evicted block, the Normaliser folds a
    removal's hashes in order either way, and a full trace evicts millions of blocks."""
    out: list[EngineEvent] = []
    removed: list[int] | None = None
    medium: str | None = None
    for event in events:
        if isinstance(event, BlockRemoved) and removed is not None and event.medium == medium:
            removed.extend(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            removed, medium = list(event.block_hashes), event.medium
            out.append(EngineRemoved(hashes=removed, medium=medium))
        else:
            removed = None
            out.append(to_engine_event(event))
    return out
