"""Prometheus metrics of one router replica, on a registry of its own (several replicas can live in
one process, as in the tests).

Request-path figures are observed as they happen (requests, TTFT, ITL, planning time, admission
wait); state figures (decisions by outcome, retries and fallbacks, index size, event lag, repairs,
queue) are read from their owners at scrape time, so each has exactly one source of truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.config import MIN_LOAD_PERIOD_S
from router.dispatch import LEG_FAILED_KINDS
from router.gap_repair import FailureKind
from router.ingest_stats import IngestStats
from router.loop_histogram import LoopHistogram
from router.replica_sync import SyncStats
from router.routes import PROBES_NAMED
from router.sender_budget import LOAD_BURST, LOAD_RATE_PER_S
from router.sender_subscriptions import QUARANTINE_MAX_FACTOR, QUARANTINE_S

__all__ = ["CLIENT_SHED_HOW", "CONTENT_TYPE", "RouterMetrics", "StateFigures"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_SHED_HOW = ("idle_closed", "refused", "silent", "dropped")  # client_connections_shed's labels
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Edges at the default SLOs (slo_ttft_s 2.0, slo_itl_s 0.025) and close around them, so the share
# within the SLO and quantiles near it read true.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


@dataclass(frozen=True, slots=True)
class StateFigures:
    decisions: Mapping[str, int] = field(default_factory=dict)
    index_blocks: int = 0
    index_entries: int = 0
    index_memory_bytes: int = 0
    ingest: IngestStats = field(default_factory=IngestStats)  # router.kv_ingest's counts
    queue_depth: int = 0
    inflight: int = 0
    workers: int = 0
    retries: int = 0  # router.dispatch.Dispatcher's counts
    engine_refusals: Mapping[int, int] = field(default_factory=dict)  # by the engine's status, 408 or 429
    prefill_fallbacks: int = 0
    refusal_fallbacks: int = 0
    transfer_fallbacks: int = 0
    handle_fallbacks: int = 0
    slow_readers: int = 0
    client_buffered: int = 0  # router.client_buffers: bytes held for clients now
    client_buffer_budget: int = 0
    client_buffer_cuts: Mapping[str, int] = field(default_factory=dict)  # ... holders ended over it, by what
    cancels_again: int = 0
    malformed_replies: Mapping[str, int] = field(default_factory=dict)  # by worker, registered ones only
    refusals_overruled: Mapping[str, int] = field(default_factory=dict)  # by prefill worker, registered ones only
    legs_failed: Mapping[tuple[str, str], int] = field(default_factory=dict)  # by (worker, kind), registered ones only
    load_malformed: int = 0  # router.service's load reports dropped
    load_unknown: int = 0
    load_over_budget: int = 0  # router.sender_budget's: past their sender's budget, from any sender
    worker_load_over_budget: Mapping[str, int] = field(default_factory=dict)  # the same, registered workers'
    load_disconnects: int = 0  # router.service's load report connection cut
    kvstate_disconnects: int = 0  # router.service's kvstate connection cut
    load_quarantined: int = 0  # router.sender_subscriptions: senders unheard now
    load_quarantines: int = 0  # ... and each time one was quarantined
    slow_consumer_dropped: Mapping[str, int] = field(default_factory=dict)  # nats-py's drops, by subscription
    config_rejected: int = 0
    loop_stalls: int = 0  # runtime.loop_watch's: stalls of this router's own event loop
    kv_disconnects: int = 0  # router.service's KV event connection cut
    kv_quarantined: int = 0  # router.kv_ingest's subscriptions: KV event senders unheard now
    kv_quarantines: int = 0  # ... and each time one was quarantined
    records_refused: int = 0  # router.worker_registry's `refused`
    sync: SyncStats = field(default_factory=SyncStats)  # router.replica_sync's counts
    timing: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)  # router.calibration
    timing_dropped: Mapping[str, int] = field(default_factory=dict)  # router.calibration's `dropped`
    prompt_tokens: Mapping[str, int] = field(default_factory=dict)  # router.planner.PrefixReach
    clock_offsets: Mapping[str, float] = field(default_factory=dict)  # router.clock_skew, skewed workers only
    credit_short: Sequence[str] = ()  # workers whose shims report LoadReport.prefix_credit_short
    transfers_failing: Sequence[str] = ()  # decode workers with a KV pull that failed lately (router.transfer_health)
    peer_settings_mismatch: Sequence[str] = ()  # peer routers that route or render otherwise (router.peer_settings)
    peer_version_mismatch: Sequence[str] = ()  # peer routers of another version
    workers_other_version: int = 0  # registered workers of another build (router.worker_versions)
    # router.fleet_news's last check, by model: decode and agg workers taking requests, and left out by reason
    workers_routable: Mapping[str, int] = field(default_factory=dict)
    workers_excluded: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


class _StateCollector(Collector):
    def __init__(self, source: Callable[[], StateFigures]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        s = self._source()
        decisions = CounterMetricFamily("kvswitch_router_decisions", "Routing decisions by outcome", labels=["outcome"])
        for outcome, n in sorted(s.decisions.items()):
            decisions.add_metric([outcome], n)
        yield decisions
        yield CounterMetricFamily(
            "kvswitch_router_retries", "Requests retried on another worker before their first token", s.retries
        )
        refusals = CounterMetricFamily(
            "kvswitch_router_engine_refusals",
            "Legs an engine turned away for now, by its status: its 429 (or a 408 from it or a proxy before it); "
            "each retried on another worker before the first token, or, with none left, the client's 429 (503 for "
            'a 408). kvswitch_router_requests_total{code="429"} counts these and the router\'s own admission 429s',
            labels=["status"],
        )
        for status in sorted({408, 429, *s.engine_refusals}):
            refusals.add_metric([str(status)], s.engine_refusals.get(status, 0))
        yield refusals
        fallbacks = CounterMetricFamily(
            "kvswitch_router_fallbacks",
            "Remote prefills given up for a local one: the prefill leg failed (prefill_failed), its engine "
            "refused the request and the decode engine served it (prefill_refused), the decode engine failed to "
            "pull its KV (transfer_failed), or the decode leg with its transfer handle would be over NATS's "
            "max_payload (handle_too_large)",
            labels=["cause"],
        )
        fallbacks.add_metric(["prefill_failed"], s.prefill_fallbacks)
        fallbacks.add_metric(["prefill_refused"], s.refusal_fallbacks)
        fallbacks.add_metric(["transfer_failed"], s.transfer_fallbacks)
        fallbacks.add_metric(["handle_too_large"], s.handle_fallbacks)
        yield fallbacks
        yield CounterMetricFamily(
            "kvswitch_router_slow_readers",
            "Streams cut because their client read too slowly: their queued chunks passed the router's limit, or "
            "they were furthest behind when its clients held more than its budget",
            s.slow_readers,
        )
        yield GaugeMetricFamily(
            "kvswitch_router_client_buffered_bytes",
            "Bytes held for clients: streamed chunks they have not taken yet and what is left to write of whole "
            "answers, under the budget kvswitch_router_client_buffer_budget_bytes (--client-buffer-mib)",
            s.client_buffered,
        )
        yield GaugeMetricFamily(
            "kvswitch_router_client_buffer_budget_bytes",
            "The most bytes held for clients at once (--client-buffer-mib)",
            s.client_buffer_budget,
        )
        cuts = CounterMetricFamily(
            "kvswitch_router_client_buffer_cuts",
            "Held for clients past the budget: streams cut furthest behind (stream; counted in "
            "kvswitch_router_slow_readers_total too), whole answers ended while written, their clients having "
            "taken nothing for a while (answer), and whole answers refused before their head: larger than the "
            "budget, or no room while the other clients took theirs (refused)",
            labels=["what"],
        )
        for what in ("answer", "refused", "stream"):
            cuts.add_metric([what], s.client_buffer_cuts.get(what, 0))
        yield cuts
        yield CounterMetricFamily(
            "kvswitch_router_cancels_again",
            "Cancels sent again because a cancelled leg's chunks still came (the first lost: an engine kept "
            "generating for nobody meanwhile)",
            s.cancels_again,
        )
        yield _per_worker(
            "kvswitch_router_worker_malformed_replies",
            "Replies to a request that did not decode, by worker: each leaves the worker out of routing for a "
            "cooldown (/ready says so)",
            s.malformed_replies,
        )
        yield _per_worker(
            "kvswitch_router_worker_prefill_refusals_overruled",
            "Requests a prefill worker's engine refused (a 4xx) that a decode engine then served, by prefill worker: "
            "an engine started with other flags than its decode workers'",
            s.refusals_overruled,
        )
        failed = CounterMetricFamily(
            "kvswitch_router_worker_legs_failed",
            "Decode and agg legs that failed before their first output, by registered worker and kind: "
            + ", ".join(f"{kind} ({counts})" for kind, counts in LEG_FAILED_KINDS.items())
            + "; not a decode leg's failed KV pull, the pair's. Each retried once on another worker where one is left",
            labels=["worker", "kind"],
        )
        for (worker, kind), n in sorted(s.legs_failed.items()):
            failed.add_metric([worker, kind], n)
        yield failed
        yield CounterMetricFamily(
            "kvswitch_router_load_malformed",
            "Load reports dropped: undecodable, naming another worker than their subject's, or a field out of range",
            s.load_malformed,
        )
        yield CounterMetricFamily(
            "kvswitch_router_kv_disconnects",
            "Times the connection KV events come on dropped (a NATS outage, or nats-server cutting a slow consumer: "
            "some worker publishes more than this replica folds); routing and replies go on on another connection",
            s.kv_disconnects,
        )
        yield GaugeMetricFamily(
            "kvswitch_router_kv_senders_quarantined",
            "KV event senders past their budget whose subjects this router does not hear now (each for "
            f"{QUARANTINE_S:g} s, doubling while it floods on up to {QUARANTINE_MAX_FACTOR * QUARANTINE_S:g} s, "
            "router.sender_subscriptions): their indexes are repaired through kvstate",
            s.kv_quarantined,
        )
        yield CounterMetricFamily(
            "kvswitch_router_kv_quarantines",
            f"Times a KV event sender past its budget was quarantined (its subject unheard for "
            f"{QUARANTINE_S:g} s, or twice its last quarantine when it floods again after it)",
            s.kv_quarantines,
        )
        yield CounterMetricFamily(
            "kvswitch_router_load_over_budget",
            "Load reports dropped before decoding, past their sender's budget (router.sender_budget: "
            f"{LOAD_RATE_PER_S:g} a second, bursts of {LOAD_BURST:g}; a shim sends at most {1 / MIN_LOAD_PERIOD_S:g}): "
            f"something other than a shim (or an older shim given a --load-period-s under {MIN_LOAD_PERIOD_S:g} s) "
            "publishes on its subject",
            s.load_over_budget,
        )
        yield _per_worker(
            "kvswitch_router_worker_load_over_budget",
            "Load reports dropped past their sender's budget, by registered worker (the worker whose subject they "
            "came on)",
            s.worker_load_over_budget,
        )
        yield GaugeMetricFamily(
            "kvswitch_router_load_senders_quarantined",
            "Load report senders past their budget whose subjects this router does not hear now (each for "
            f"{QUARANTINE_S:g} s, doubling while it floods on up to {QUARANTINE_MAX_FACTOR * QUARANTINE_S:g} s, "
            "router.sender_subscriptions): they read silent",
            s.load_quarantined,
        )
        yield CounterMetricFamily(
            "kvswitch_router_load_quarantines",
            f"Times a load report sender past its budget was quarantined (its subject unheard for "
            f"{QUARANTINE_S:g} s, or twice its last quarantine when it floods again after it)",
            s.load_quarantines,
        )
        yield CounterMetricFamily(
            "kvswitch_router_load_disconnects",
            "Times the connection load reports come on dropped (a NATS outage, or nats-server cutting a slow "
            "consumer: reports come faster than this replica reads them); replies go on on another connection",
            s.load_disconnects,
        )
        yield CounterMetricFamily(
            "kvswitch_router_kvstate_disconnects",
            "Times the connection gap repair's kvstate requests and replies go on dropped (a NATS outage, or "
            "nats-server cutting a slow consumer: shims' dumps in flight past its pending bytes); the repairs in "
            "flight are retried, requests and replica sync go on on another connection",
            s.kvstate_disconnects,
        )
        dropped = CounterMetricFamily(
            "kvswitch_router_nats_slow_consumer_dropped",
            "Messages the NATS client dropped because a subscription's handler fell behind its pending limit, by "
            "subscription (load, kv, sync, replies, kvstate)",
            labels=["subscription"],
        )
        for which, n in sorted(s.slow_consumer_dropped.items()):
            dropped.add_metric([which], n)
        yield dropped
        yield CounterMetricFamily(
            "kvswitch_router_load_unknown",
            "Load reports dropped as from no registered worker (not yet, no longer, or its record refused)",
            s.load_unknown,
        )
        yield CounterMetricFamily(
            "kvswitch_router_config_rejected",
            "Live config values refused (each PUT of one; the last good settings kept); /ready warns while the "
            "stored one is refused",
            s.config_rejected,
        )
        yield CounterMetricFamily(
            "kvswitch_router_loop_stalls",
            "Stalls of this router's event loop (a tick over 100 ms late): a worker's silence is not counted "
            "through one (a report's age less the stalls within it), a leg's is excused one more window at most; "
            "one of 1 s or more is also a WARNING",
            s.loop_stalls,
        )
        yield CounterMetricFamily(
            "kvswitch_router_worker_records_refused",
            "Worker records in etcd refused (undecodable or impossible), each time one is read; /ready counts "
            "those refused now as bad_record and names the first eight, /debug/workers lists them all",
            s.records_refused,
        )
        yield from _sync_counters(s.sync)
        yield GaugeMetricFamily("kvswitch_router_index_blocks", "Distinct block hashes in the index", s.index_blocks)
        yield GaugeMetricFamily("kvswitch_router_index_entries", "(block, worker) pairs in the index", s.index_entries)
        yield GaugeMetricFamily(
            "kvswitch_router_index_memory_bytes", "Bytes the prefix index holds, by its own count", s.index_memory_bytes
        )
        yield from _ingest_counters(s.ingest)
        yield GaugeMetricFamily("kvswitch_router_queue_depth", "Requests waiting for admission", s.queue_depth)
        yield GaugeMetricFamily(
            "kvswitch_router_inflight_requests",
            "Requests being served: admitted, their answers not yet written to their clients",
            s.inflight,
        )
        yield GaugeMetricFamily("kvswitch_router_workers", "Registered workers", s.workers)
        yield GaugeMetricFamily(
            "kvswitch_router_workers_other_version",
            "Registered workers whose shims run another kvswitch build (WorkerInfo.version) than this router: "
            "a rolling upgrade in progress, or workers it left behind",
            s.workers_other_version,
        )
        routable = GaugeMetricFamily(
            "kvswitch_router_workers_routable",
            "A model's decode and agg workers taking requests: its routable ones, or while none is its "
            "engine_unhealthy ones, which the planner then uses; 0: every request for it is refused (503)",
            labels=["model"],
        )
        for model, n in sorted(s.workers_routable.items()):
            routable.add_metric([model], n)
        yield routable
        excluded = GaugeMetricFamily(
            "kvswitch_router_workers_excluded",
            "A model's decode and agg workers left out of routing, by reason (router.eligibility); a reason "
            "no worker has has no sample",
            labels=["model", "reason"],
        )
        for model, reasons in sorted(s.workers_excluded.items()):
            for reason, n in sorted(reasons.items()):
                excluded.add_metric([model, reason], n)
        yield excluded
        reach = CounterMetricFamily(
            "kvswitch_router_prompt_tokens",
            "Prompt tokens routed (reach=prompt), and of them cached on the decode candidate holding the longest "
            "prefix (held), on the best one with room (with_room), on the one chosen (chosen)",
            labels=["reach"],
        )
        for name, n in s.prompt_tokens.items():
            reach.add_metric([name], n)
        yield reach
        scale = GaugeMetricFamily(
            "kvswitch_router_timing_scale",
            "A worker's engine time over its timing profile's, as calibrated from its load reports",
            labels=["worker", "part"],
        )
        warm = GaugeMetricFamily(
            "kvswitch_router_timing_observed_seconds", "Busy engine seconds the calibration has seen", labels=["worker"]
        )
        for worker, (k_d, k_p, busy_s) in sorted(s.timing.items()):
            scale.add_metric([worker, "decode"], k_d)
            scale.add_metric([worker, "prefill"], k_p)
            warm.add_metric([worker], busy_s)
        yield scale
        yield warm
        yield _per_worker(
            "kvswitch_router_timing_dropped_stretches",
            "A worker's busy stretches the calibration could not read (readings missing around a start or stop, "
            "or not true) and dropped",
            s.timing_dropped,
        )
        skew = GaugeMetricFamily(
            "kvswitch_router_worker_clock_offset_seconds",
            "A worker's clock minus this router's, for workers off by more than the tolerance (1 s)",
            labels=["worker"],
        )
        for worker, offset in sorted(s.clock_offsets.items()):
            skew.add_metric([worker], offset)
        yield skew
        yield _flagged(
            "kvswitch_router_worker_prefix_credit_short",
            "1 for a worker whose engine reuses far less of the prefixes its KV events promise (its shim's check)",
            s.credit_short,
        )
        yield _flagged(
            "kvswitch_router_worker_transfers_failing",
            "1 for a decode worker with a KV pull that failed lately: its requests pair with other prefill "
            "workers, or prefill there",
            s.transfers_failing,
        )
        yield _flagged(
            "kvswitch_router_peer_settings_mismatch",
            "1 for a peer router whose routing settings or chat rendering (RouterInfo.settings_digest, "
            "rendering_digest) differ from this one's",
            s.peer_settings_mismatch,
            label="peer",
        )
        yield _flagged(
            "kvswitch_router_peer_version_mismatch",
            "1 for a peer router of another kvswitch version than this one",
            s.peer_version_mismatch,
            label="peer",
        )


def _ingest_counters(s: IngestStats) -> Iterator[Metric]:
    """The KV event ingest's: what it applied, and each batch it dropped or repaired for."""
    yield GaugeMetricFamily(
        "kvswitch_router_kv_event_lag_seconds", "Receive time minus send time of the last KV batch", s.last_lag_s
    )
    yield CounterMetricFamily("kvswitch_router_kv_batches", "KV event batches applied", s.batches_applied)
    yield CounterMetricFamily("kvswitch_router_kv_events", "KV events applied", s.events_applied)
    yield CounterMetricFamily("kvswitch_router_kv_malformed", "KV payloads dropped as malformed", s.malformed)
    unknown = CounterMetricFamily(
        "kvswitch_router_kv_events_unknown",
        "KV events of a type this router does not know (a newer shim's), skipped, by type (the first 8 types seen; "
        "any other as other); the rest of their batches applied",
        labels=["type"],
    )
    for kind, n in sorted(s.events_unknown.items()):
        unknown.add_metric([kind], n)
    yield unknown
    yield CounterMetricFamily(
        "kvswitch_router_kv_duplicates",
        "KV batches dropped as already applied (seq not past the index's)",
        s.duplicates,
    )
    dropped = CounterMetricFamily(
        "kvswitch_router_kv_dropped",
        "KV batches dropped unapplied: of a worker not registered within unknown_ttl_s, or past the bounds on "
        "such batches (unknown); held during a repair past a worker's bound or the shared byte budget, a full dump "
        "catching up (overflow); held ones a repair reply showed the shim never sent (impossible); held before "
        "their worker registered, of an epoch its name had when it last left, or of any other where the router may "
        "have missed that session: an earlier session's (stale_session)",
        labels=["reason"],
    )
    dropped.add_metric(["unknown"], s.dropped_unknown)
    dropped.add_metric(["overflow"], s.dropped_overflow)
    dropped.add_metric(["impossible"], s.dropped_impossible)
    dropped.add_metric(["stale_session"], s.dropped_stale_session)
    yield dropped
    yield CounterMetricFamily(
        "kvswitch_router_kv_over_budget",
        "KV batches dropped before decoding, past their sender's budget (router.sender_budget, the --kv-budget-* "
        "flags): something other than a shim publishes on its subject; the worker's index is repaired",
        s.over_budget,
    )
    yield _per_worker(
        "kvswitch_router_worker_kv_over_budget",
        "KV batches dropped past their sender's budget, by registered worker (the worker whose subject they came on)",
        s.worker_over_budget,
    )
    yield GaugeMetricFamily(
        "kvswitch_router_kv_unknown_held", "KV batches held for a worker not (yet) registered", s.unknown_held
    )
    yield CounterMetricFamily("kvswitch_router_kv_gaps", "KV sequence gaps detected", s.gaps)
    yield CounterMetricFamily(
        "kvswitch_router_kv_epoch_changes",
        "Workers seen at a new epoch (a restarted shim, or a batch of another epoch): each takes a full dump",
        s.epoch_changes,
    )
    yield CounterMetricFamily(
        "kvswitch_router_kv_digest_mismatches",
        "Load reports whose KV digest disagreed with the index at the same seq, or stayed below the index's seq "
        "past the grace: each takes a full dump",
        s.digest_mismatches,
    )
    yield GaugeMetricFamily(
        "kvswitch_router_kv_digest_unfixed_workers",
        "Workers whose KV digest disagreed again right after the full dump taken for it (their shims' digest and "
        "dump disagree: another build?): each stays routable, dumped again with a backoff up to 64 s, until it agrees",
        s.digest_unfixed,
    )
    yield CounterMetricFamily(
        "kvswitch_router_kv_digest_lags",
        "Load reports whose KV seq stayed ahead of the index past the grace (its last batches lost): each starts "
        "a repair",
        s.digest_lags,
    )
    yield CounterMetricFamily(
        "kvswitch_router_kv_repairs", "KV state repairs (replays and dumps)", s.repairs_batches + s.repairs_dumps
    )
    yield CounterMetricFamily(
        "kvswitch_router_kv_repair_timeouts",
        "kvstate requests that got no complete answer in time (the shim, or NATS between): each is retried after a "
        "backoff, with a full dump",
        s.repair_timeouts,
    )
    failures = CounterMetricFamily(
        "kvswitch_router_kv_repair_failures",
        "kvstate requests that failed, by kind: timed_out, no_responders, malformed, nats_error, byte_limit (this "
        "router's replies in flight at their byte budget), over_capacity, crashed (a bug in this router's repair loop: "
        "an ERROR with its traceback): each is retried after a backoff, a crashed one by its loop started again",
        labels=["kind"],
    )
    for kind in FailureKind:
        failures.add_metric([kind.label], s.repair_failures[kind])
    yield failures


def _sync_counters(s: SyncStats) -> Iterator[Metric]:
    """Replica sync's traffic, and its drops and losses: each skews this replica's or its peers' load view."""
    yield CounterMetricFamily(
        "kvswitch_router_sync_messages_sent",
        "Sync messages this router published to its peers (its bookings, batched)",
        s.messages_sent,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_entries_sent", "Booking entries this router published to its peers", s.entries_sent
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_entries_received",
        "Booking entries taken from registered peer routers (none while peers route: their sync does not arrive)",
        s.entries_received,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_malformed",
        "Peer routers' sync messages that did not decode, and bookings in them no request makes: dropped",
        s.malformed,
    )
    unknown = CounterMetricFamily(
        "kvswitch_router_sync_entries_unknown",
        "Peer routers' sync entries of a kind this router does not know (a newer router's), skipped, by kind (the "
        "first 8 kinds seen; any other as other); the other entries of their messages applied",
        labels=["kind"],
    )
    for kind, n in sorted(s.entries_unknown.items()):
        unknown.add_metric([kind], n)
    yield unknown
    yield CounterMetricFamily(
        "kvswitch_router_router_records_refused",
        "Router records under /{ns}/routers/ that did not decode, each time one is read: each reads as no router "
        "(and a peer whose record turns so is forgotten)",
        s.records_refused,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_unregistered",
        "Sync messages from routers with no key under /{ns}/routers/ (forged, or not yet seen registering): dropped",
        s.unregistered,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_departed",
        "Sync messages from peer routers whose key went (their bookings were dropped with it): dropped",
        s.departed,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_send_failures",
        "Publishes of this router's bookings that failed (the entries queued are lost): peers keep what they "
        "had of them until peer_ttl_s",
        s.send_failures,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_too_large",
        "This router's requests whose booking (or an entry of it) alone is over the NATS server's max_payload: "
        "never sent to peers, nor in snapshots (the rest of the flush and snapshot are), so peers do not count them",
        s.too_large,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_peer_bookings_expired",
        "Peer routers' bookings dropped for age (peer_ttl_s), no snapshot naming them: each is a free that never "
        "arrived from a router that sends no snapshot, or a peer whose snapshots stopped arriving",
        s.bookings_expired,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_snapshots_sent",
        "Snapshots of this router's live bookings published to its peers, each in one or more sync messages",
        s.snapshots_sent,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_snapshots_taken",
        "Peer routers' snapshots that came whole and in order: each dropped the bookings it left out",
        s.snapshots_taken,
    )
    yield CounterMetricFamily(
        "kvswitch_router_sync_snapshots_incomplete",
        "Peer routers' snapshots with a part missing or out of order: they dropped nothing (the next one heals)",
        s.snapshots_incomplete,
    )
    healed = CounterMetricFamily(
        "kvswitch_router_sync_snapshot_healed",
        "Peer routers' bookings their snapshots healed, each a sync message lost: added (an add), dropped (a "
        "free), state (a prefill_done or a new booking)",
        labels=["what"],
    )
    for what, n in s.healed.items():
        healed.add_metric([what], n)
    yield healed
    yield CounterMetricFamily(
        "kvswitch_router_sync_peers_forgotten",
        "Peer routers forgotten, their bookings dropped, when their key under /{ns}/routers/ went or its record "
        "turned bad (a key that never held a good record is no peer)",
        s.routers_forgotten,
    )


def _per_worker(name: str, doc: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    """A counter with a sample for each worker in `counts`."""
    counter = CounterMetricFamily(name, doc, labels=["worker"])
    for worker, n in sorted(counts.items()):
        counter.add_metric([worker], n)
    return counter


def _flagged(name: str, doc: str, workers: Sequence[str], label: str = "worker") -> GaugeMetricFamily:
    """A gauge of 1 for each of `workers` (and no sample for the rest)."""
    gauge = GaugeMetricFamily(name, doc, labels=[label])
    for worker in workers:
        gauge.add_metric([worker], 1.0)
    return gauge


class RouterMetrics:
    def __init__(self, state: Callable[[], StateFigures]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "kvswitch_router_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvswitch_router_ttft_seconds",
            "Time to first token as the client sees it, by prefill path: from the request's arrival (body "
            "read, tokenizing, planning and admission wait included) to its first token sent; streaming "
            "requests only",
            ["path"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.upstream_ttft = Histogram(
            "kvswitch_router_upstream_ttft_seconds",
            "Dispatch to first token, by prefill path: the part of kvswitch_router_ttft_seconds spent on "
            "NATS, the shims and the engines; streaming requests only",
            ["path"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        # observed per streamed chunk: without prometheus_client's locks (router.loop_histogram)
        self.itl = LoopHistogram(
            "kvswitch_router_itl_seconds",
            "Inter-token latency; streaming requests only",
            _ITL_BUCKETS,
            self.registry,
        )
        self.route = Histogram(
            "kvswitch_router_route_seconds",
            "Planning time of an admitted request: hash, match, select, policy, each offer at admission "
            "included (tokenizing comes before it, the wait for room is kvswitch_router_queue_wait_seconds)",
            buckets=_ROUTE_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "kvswitch_router_queue_wait_seconds",
            "Time an admitted request waited at admission for a worker with room (about 0: taken at once)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        # router.client_connections: the front door's connections against its cap
        self.client_connections = Gauge(
            "kvswitch_router_client_connections",
            "Client HTTP connections open now (the start door's included)",
            registry=self.registry,
        )
        self.client_connections_cap = Gauge(
            "kvswitch_router_client_connections_cap",
            "The most client connections held at once: derived from the open-file limit at start",
            registry=self.registry,
        )
        self.client_connections_shed = Counter(
            "kvswitch_router_client_connections_shed",
            "Connections shed at the cap: the connection idle longest closed for a new one (idle_closed); none "
            f"idle, a request on the new one answered 503 and the connection closed (refused; {PROBES_NAMED} are "
            "answered); a refused one closed with no request head in 2 s, or for a new one after 1 s "
            "(silent); none idle and the refused ones at the listen backlog, the new one closed at once (dropped)",
            ["how"],
            registry=self.registry,
        )
        for how in CLIENT_SHED_HOW:
            self.client_connections_shed.labels(how)
        self.registry.register(_StateCollector(state))
        # Labelled children bound once: `labels()` validates and locks on every call (~3 us).
        self._requests: dict[tuple[str, int], Counter] = {}
        self._ttft: dict[str, tuple[Histogram, Histogram]] = {}

    def count_request(self, endpoint: str, code: int) -> None:
        child = self._requests.get((endpoint, code))
        if child is None:
            child = self._requests[endpoint, code] = self.requests.labels(endpoint, str(code))
        child.inc()

    def observe_ttft(self, path: str, seconds: float, upstream_s: float) -> None:
        """A stream's first token: `seconds` since its arrival, `upstream_s` since its dispatch."""
        children = self._ttft.get(path)
        if children is None:
            children = self._ttft[path] = (self.ttft.labels(str(path)), self.upstream_ttft.labels(str(path)))
        children[0].observe(seconds)
        children[1].observe(upstream_s)

    def observe_itl(self, seconds: float, tokens: int = 1) -> None:
        """`tokens` inter-token gaps of `seconds` each (a chunk carrying several tokens)."""
        self.itl.observe(seconds, tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def render_off_loop(self) -> bytes:
        """`render`, its text formatted on a thread: the figures are collected here, on the loop
        (they read routing state), and formatting them is most of the time. At 1,000 workers (three
        per-worker samples each) a render took 24 ms, 14 ms of it formatting, and a scrape held the
        replica's loop 18-75 ms (scale audit of 2026-12-06)."""
        families = list(self.registry.collect())
        return await asyncio.to_thread(generate_latest, cast(CollectorRegistry, _Collected(families)))


class _Collected:
    """Metric families collected already, for generate_latest to format."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
