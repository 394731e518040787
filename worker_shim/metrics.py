"""The shim's Prometheus metrics, read from the shim's own counters at scrape time (own registry).

Names, kinds and meanings: docs/worker_shim.md, "Health and metrics".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from discovery import LeaseState
from protocol import LoadReport
from worker_shim.event_health import EventProblem
from worker_shim.load_reporter import POLL_FAILURE_KINDS

if TYPE_CHECKING:
    from worker_shim.shim import WorkerShim

__all__ = ["render_metrics"]

P = "kvswitch_shim_"


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, doc, value=value)


class _ShimCollector(Collector):
    def __init__(self, shim: WorkerShim) -> None:
        self.shim = shim

    def collect(self) -> Iterator[Metric]:
        yield from self._identity()
        yield from self._engine()
        yield from self._events()
        yield from self._publishing()
        yield from self._requests()
        yield from self._credit()
        yield from self._probe()

    def _identity(self) -> Iterator[Metric]:
        s, c = self.shim, self.shim.config
        info = GaugeMetricFamily(
            P + "info", "The shim's identity", labels=["worker", "epoch", "engine", "role", "model"]
        )
        info.add_metric([s.worker_id or "", f"{s.epoch:x}", c.engine, c.role, c.model], 1)
        yield info
        yield _gauge("serving", "1 while registered and serving", float(s.serving))
        reporter = s.load_reporter
        yield _gauge(
            "engine_healthy",
            "1 while the load reports call the engine healthy (its load polls work); 0 while they say it "
            "fails, which routers exclude it for, or none are sent",
            float(reporter is not None and reporter.healthy),
        )
        polls = CounterMetricFamily(
            P + "load_polls_failed",
            "Load polls of the engine that failed, by the error's kind: engine_unavailable (no answer), "
            "engine_error (not a 200), engine_protocol (a /metrics the shim cannot read or a reading it refuses), "
            "internal (any other exception)",
            labels=["kind"],
        )
        for kind in sorted({*POLL_FAILURE_KINDS, *s.load_polls_failed}):
            polls.add_metric([kind], float(s.load_polls_failed[kind]))
        yield polls
        reg = s.registration
        yield _counter("registrations", "Registrations, re-registrations included", float(s.registration_count))
        yield _counter(
            "session_failures", "Sessions ended by an error no rule expected, each logged", float(s.session_failures)
        )
        tasks = CounterMetricFamily(
            P + "task_failures",
            "Work beside the requests that failed with an error no rule expected, each logged at ERROR with its "
            "traceback: a crashed kv_publisher or load_reporter of the current worker id ends the session (a new "
            "one registers; an old id's in its grace is only counted), a failed "
            "orphan_check is run again a second later, a crashed retire closes the old worker id at once, a "
            "crashed loop_watch is started again",
            labels=["task"],
        )
        for task, n in s.task_failures.items():
            tasks.add_metric([task], float(n))
        yield tasks
        lease_state = reg.lease.state if reg is not None and reg.lease is not None else None
        states = GaugeMetricFamily(P + "etcd_lease_state", "1 for the lease's current state", labels=["state"])
        for state in LeaseState:
            states.add_metric([state.value], float(state is lease_state))
        yield states
        yield _gauge(
            "lease_unrenewed_seconds",
            "Seconds since etcd last renewed the lease, while it does not answer (0 otherwise): past the lease's TTL, "
            "routers that still reach etcd no longer see this worker",
            s.lease_unrenewed_s or 0.0,
        )
        yield _gauge("nats_connected", "1 while connected to NATS", float(s.nats_state == "connected"))

    def _engine(self) -> Iterator[Metric]:
        """The engine's load as the shim's load reports give it to routers (0 before the first)."""
        reporter = self.shim.load_reporter
        r = reporter.report() if reporter is not None else LoadReport(worker="", ts=0.0)
        yield _gauge("running_requests", "Requests the engine runs", float(r.running))
        yield _gauge("waiting_requests", "Requests in the engine's queue", float(r.waiting))
        yield _gauge("kv_used_blocks", "KV cache blocks in use", float(r.kv_used_blocks))
        yield _gauge("kv_total_blocks", "KV cache blocks the engine has", float(r.kv_total_blocks or 0))

    def _events(self) -> Iterator[Metric]:
        s = self.shim
        yield _gauge("events_ok", "1 while the engine's KV events flow as they should", float(s.events.ok))
        problems = GaugeMetricFamily(P + "events_problem", "1 per active KV event problem", labels=["problem"])
        for p in EventProblem:
            problems.add_metric([p.value], float(p in s.events.problems))
        yield problems
        yield _counter("kv_events_received", "Engine KV events received", float(s.engine_events))
        yield _gauge(
            "kv_events_poll_lag_seconds",
            "Seconds since the engine last answered a poll of its KV events (TensorRT-LLM, which may hold a poll "
            "while events keep coming): the index is at most this far behind it; 0 where events are pushed or no "
            "poll runs",
            s.adapter.events_lag_s() or 0.0,
        )
        batches = CounterMetricFamily(P + "kv_batches_received", "Engine event batches", labels=["live"])
        for live, n in s.engine_batches.items():
            batches.add_metric([str(live).lower()], float(n))
        yield batches
        transport = dict(s.adapter.event_stats())
        malformed = transport.pop("malformed", 0) + s.norm_stats.malformed
        yield _counter("kv_events_malformed", "Malformed engine events or frames, dropped", float(malformed))
        unknown = CounterMetricFamily(
            P + "kv_events_unknown_type",
            "Engine events of a type the shim does not know, dropped, by type (the first 8 types seen; any "
            "other as other)",
            labels=["type"],
        )
        for kind, n in sorted(s.adapter.unknown_event_types().items()):
            unknown.add_metric([kind], float(n))
        yield unknown
        yield _counter(
            "kv_unknown_parent", "Stored chains dropped for an unknown parent", float(s.norm_stats.unknown_parent)
        )
        yield _counter(
            "kv_unknown_removed",
            "Evictions of blocks the shim does not hold (not those of a chain it dropped), ignored",
            float(s.norm_stats.unknown_removed),
        )
        yield _counter(
            "kv_placeholders_dropped",
            "Offload tiers' blocks not credited: placeholders of blocks not held or of a sliding window, "
            "and every store of a tier that reports no eviction (STORAGE)",
            float(s.norm_stats.placeholders_dropped),
        )
        yield _counter("kv_resets", "State resets (restart, unrepairable gap, rebuild)", float(s.norm_stats.resets))
        yield _counter(
            "kv_rebuilds_held",
            "Rebuilds unknown parents asked for, held because the last rebuild did not cure them",
            float(s.rebuild_guard.held),
        )
        yield _counter(
            "kv_other_group_events",
            "Events of a KV cache group kind kvswitch does not model, dropped",
            float(s.norm_stats.other_groups),
        )
        yield _counter(
            "kv_full_groups_folded",
            "Full-attention KV cache groups past the first, folded into one chain (may over-credit)",
            float(s.norm_stats.full_groups_folded),
        )
        for name, value in sorted(transport.items()):
            yield _counter(f"kv_transport_{name}", f"The event transport's {name} counter", float(value))

    def _publishing(self) -> Iterator[Metric]:
        k = self.shim.kv_counters
        yield _counter("kv_batches_published", "KvEventBatches published", float(k.batches))
        yield _counter("kv_publish_failures", "KvEventBatches NATS refused", float(k.send_failures))
        kvstate = CounterMetricFamily(
            P + "kvstate_requests",
            "kvstate requests by reply: answered (batches, dump), failed, or dropped (malformed: no KvStateRequest; "
            "no_reply: no reply subject)",
            labels=["reply"],
        )
        kvstate.add_metric(["batches"], float(k.kvstate_batches))
        kvstate.add_metric(["dump"], float(k.kvstate_dumps))
        for kind in ("malformed", "no_reply"):
            kvstate.add_metric([kind], float(k.malformed[kind]))
        kvstate.add_metric(["failed"], float(k.kvstate_failures))
        yield kvstate
        yield _counter(
            "load_reports", "LoadReports published since the shim started", float(self.shim.load_reports_sent)
        )
        yield _counter(
            "load_reports_unencodable",
            "LoadReports that could not be encoded, so not sent (a number in the engine's reading the shim "
            "should have refused: a bug, said once at ERROR)",
            float(self.shim.load_reports_unencodable),
        )

    def _requests(self) -> Iterator[Metric]:
        svc = self.shim.requests
        by = CounterMetricFamily(P + "requests", "Legs ended, by role and outcome", labels=["role", "outcome"])
        for (role, outcome), n in sorted(svc.outcomes.items() if svc else []):
            by.add_metric([role, outcome], float(n))
        yield by
        yield _gauge("requests_inflight", "Legs running", float(len(svc.inflight) if svc else 0))
        bad = CounterMetricFamily(
            P + "requests_malformed",
            "Messages on the worker's subjects it could not serve, dropped (generate: no GenerateRequest, answered "
            "400; no_reply: no reply subject; cancel: no CancelRequest)",
            labels=["kind"],
        )
        for kind in ("generate", "no_reply", "cancel"):
            bad.add_metric([kind], float(svc.malformed[kind] if svc else 0))
        yield bad
        yield _counter(
            "legs_orphaned",
            "Legs cancelled because the router process that sent them had no key in etcd for --orphan-grace-s",
            float(self.shim.orphans.cancelled if self.shim.orphans else 0),
        )
        yield _counter(
            "router_records_refused",
            "Records under /{ns}/routers/ that did not decode, each time one is read: each names no router process",
            float(self.shim.orphans.records_refused if self.shim.orphans else 0),
        )
        yield _counter("heartbeats", "Heartbeat chunks sent", float(svc.heartbeats if svc else 0))
        yield _counter("chunks_held", "Chunks held back to coalesce under load", float(svc.held_chunks if svc else 0))
        yield _counter(
            "chunks_unsent",
            "Response chunks NATS refused (an outage that filled its reconnect buffer), kept for routers to ask "
            "for again",
            float(svc.chunks_unsent if svc else 0),
        )
        cap = svc.max_legs if svc else None
        yield _gauge("max_inflight_legs", "Legs served at once, more are refused (0: no bound)", float(cap or 0))

    def _credit(self) -> Iterator[Metric]:
        c = self.shim.credit
        yield _counter(
            "prefix_credit_predicted_tokens",
            "Prompt tokens the KV events promised the engine would reuse, over the judged windows",
            float(c.predicted_total),
        )
        yield _counter(
            "prefix_credit_reused_tokens",
            "Prompt tokens the engine reused (its own count) over the same windows",
            float(c.reused_total),
        )
        yield _gauge(
            "prefix_credit_short", "1 while the engine reuses far less than its KV events promise", float(c.short)
        )

    def _probe(self) -> Iterator[Metric]:
        probe = self.shim.probe
        yield _counter(
            "endpoint_probes",
            "Endpoint probe requests sent the engine (one block + 1 prompt tokens, one output token each)",
            float(probe.sent - probe.alive),
        )
        yield _counter(
            "alive_requests",
            "One-token requests sent an engine taken for hung, with nothing left to run, to tell whether it serves "
            "again, or one that reports nothing until it has served a request (a fresh TensorRT-LLM) (one prompt "
            "token, one output token each)",
            float(probe.alive),
        )
        yield _counter(
            "endpoint_probes_confirmed", "Endpoint probes whose block showed on the KV events", float(probe.confirmed)
        )
        yield _counter(
            "kv_transfers_failed",
            "KV pulls the engine failed without failing their request (its vllm:nixl_num_failed_transfers, less "
            "the legs seen failing) since the shim started",
            float(self.shim.transfers.total),
        )


def render_metrics(shim: WorkerShim) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ShimCollector(shim))
    return generate_latest(registry)
