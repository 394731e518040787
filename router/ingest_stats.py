"""Counters and per-worker sync state of the KV event ingest (router.kv_ingest). Plain data: the
ingest mutates it, readers only read. router.metrics exports every counter below on /metrics
(`kvswitch_router_kv_*`); /debug/index reads `workers`."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["IngestStats", "SyncState", "WorkerSync"]


class SyncState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # added; waiting for the first full state from the shim
    SYNCED = "synced"  # every batch up to last_seq applied, no gap open
    REPAIRING = "repairing"  # a gap or epoch change is being repaired through kvstate


@dataclass
class WorkerSync:
    """Where the index stands for one worker: the shim's (epoch, last_seq) applied so far."""

    state: SyncState = SyncState.BOOTSTRAPPING
    epoch: int | None = None
    last_seq: int = 0
    buffered: int = 0  # live batches held back while repairing
    repairs: int = 0


@dataclass
class IngestStats:
    batches_applied: int = 0
    events_applied: int = 0
    malformed: int = 0  # payloads that did not decode, or named another worker than the subject
    events_unknown: dict[str, int] = field(default_factory=dict)  # events of a newer type skipped (router.newer_kinds)
    duplicates: int = 0  # seq <= last_seq: already applied
    gaps: int = 0  # seq > last_seq + 1 seen live: a repair was started
    epoch_changes: int = 0
    repairs_batches: int = 0  # repairs answered with the missed batches
    repairs_dumps: int = 0  # repairs (and bootstraps) answered with a full dump
    repair_timeouts: int = 0  # kvstate requests that got no (complete) answer in time
    repair_failures: Counter[str] = field(default_factory=Counter)  # failed kvstate requests by FailureKind
    dropped_unknown: int = 0  # batches of a worker that never registered (or already left)
    unknown_held: int = 0  # batches waiting for their worker to register
    dropped_overflow: int = 0  # held batches dropped past a worker's bound or the shared byte budget
    dropped_impossible: int = 0  # held batches a repair reply showed the shim never sent
    dropped_stale_session: int = 0  # batches held before their worker registered, of an earlier session's epoch
    digest_mismatches: int = 0  # load-report digests that disagreed with the index at the same seq
    digest_unfixed: int = 0  # workers whose digest disagreed right after a dump taken for it, until it agrees
    digest_lags: int = 0  # load-report digests that stayed ahead of the index: lost last batches
    over_budget: int = 0  # batches dropped before decoding, past their sender's budget (router.sender_budget)
    worker_over_budget: Counter[str] = field(default_factory=Counter)  # the same, by registered worker
    last_lag_s: float = 0.0  # receive time - batch.ts of the last live batch applied
    workers: dict[str, WorkerSync] = field(default_factory=dict)
