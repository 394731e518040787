"""The async shell around the BlockIndex: KV event batches from {ns}.kv.* in, index updates out.

Ordering rules, per worker (DESIGN.md: (worker, epoch, seq) orders every event a shim sends):

- The index holds a worker's state as of (epoch, last_seq). A live batch with seq == last_seq + 1
  of that epoch is applied; seq <= last_seq is a duplicate and dropped; seq > last_seq + 1 opens a
  gap: live batches are held back and a repair starts (router.gap_repair). Another epoch is
  repaired with a full dump. A gap seen while the KV subscriptions switch (a quarantine's start or
  end) is held without a repair until the switch ends: nats-py gives each subscription its own
  queue, and the old one's may still hold the batches between, behind a flood, as the new one
  hands over later ones (until 2026-12-07 an honest worker was taken out of routing to repair
  batches on their way). The batch that closes it applies the held ones; a gap left then is a loss.
- The worker is the authority on its own state. A repair reply says where the shim stands,
  (epoch, seq), and carries the missed batches or a full dump; once it is applied, every held
  batch that arrived before the request went out and contradicts it (another epoch, or a seq
  beyond the shim's own) is impossible: forged, or from a shim that no longer exists. It is
  dropped, counted, and an ERROR names the worker once per episode: until a repair of it drops
  none (a flood of forged batches is a repair, and such a drop, after another: one line, not one a
  repair), capped the same way as the lines below. One forged batch costs one repair, never a
  repair loop. Held batches after the reply's seq are then applied in order; if a gap
  remains, the repair goes on. A replay that stops short of the shim's own seq is malformed
  (counted, said once per worker: applied, a full dump next): the worker is out of routing until
  the dump is in (until 2026-12-07, with no batch held, it was synced at the seq the replay stopped at).
- A worker is bootstrapped (a full dump) when the registry adds it. While it bootstraps or repairs,
  only it is out of routing (router.eligibility); every other worker routes as usual.
- The digest check: each load report carries the shim's (kv_epoch, kv_seq, kv_blocks, kv_xor). At
  the same (epoch, seq) the index's digest of that worker must match; a report ahead of the index
  whose seq the index has not reached `behind_grace_s` later, nor once a barrier on the KV
  subscriptions begun since has ended (router.sender_subscriptions: all nats-server had sent them
  went through the handler), means the last batches were lost. Either starts a repair. (An index
  that trails every report by a few batches, as its own queue drains, reaches each seq watched in
  time and has lost nothing; batches seconds late behind a flood's or a backlog on their own
  connection, while the reports come on another, are late, not lost: until 2026-12-07 the grace
  alone judged them, and an honest worker beside a flooding one was taken out of routing to
  repair what was still on its way, on a loaded machine.) A digest that disagrees is a
  WARNING once per worker until it agrees again (each resync it takes counted in
  `digest_mismatches`), at most NAMED_AT_MOST workers named per window and the
  rest counted (router.fleet_lines). A digest that disagrees again at the first comparison after
  the dump taken for a disagreement (with only well-formed batches applied since, the index is the
  shim's own state) means the shim's digest and its dump disagree (another build computing it
  otherwise): no dump fixes that, so it is not taken on every report. The worker's disagreements
  are left alone for `digest_backoff_min_s`, doubling after each dump that does not help up to
  `digest_backoff_max_s`, until its digest agrees; an ERROR once per worker until then (capped the
  same way), counted in `stats.digest_unfixed`. It stays routable: its index is as fresh as a dump
  can make it.
  So does the index holding a seq of the shim's epoch that the shim's reports, made after it sent
  that seq (their `ts` against the batch's, or the reply's arrival for a dump), stay below for
  `behind_grace_s` of the shim's clock: a reply claimed a seq the shim never sent, and every real
  batch would read as a duplicate for good. That takes a full dump, and a WARNING capped the same
  way. Reports made before are only late (they come through another queue than the batches, which
  an overloaded router drains behind), never a contradiction.
- One worker cannot grow a replica's memory without bound: its held batches are bounded in count
  and bytes (and all workers' together, with those of unknown workers, in bytes); past a bound
  they are dropped (counted, and a WARNING once until the worker is synced, capped the same way:
  a fleet whose repairs all fail fills every bound) and a full dump catches up; the reply to a
  request already out holds those up to its seq, and only those after it are asked again (a replay
  from its seq). Its index entries
  are bounded by
  `min_entry_limit` (the router's --index-limit-per-worker, 4 M entries by default, ~170 MB of
  index), or `CAPACITY_SLACK` times its KV capacity (WorkerInfo / LoadReport `kv_total_blocks`)
  when that is more, but no more than `MAX_CLAIMED_ENTRIES` on the worker's own word. The floor is
  high because a KV connector's CPU or disk tier (native offloading, LMCache) holds blocks that
  `kv_total_blocks`, the GPU's count, does not: a bound from it alone would cut honest offloading
  workers out of routing. An engine reports its evictions, so an honest shim never passes the
  bound. A worker past it is cleared, counted and logged once as malformed (naming the flag that
  lifts the floor), and repaired with a full dump; a dump that would pass it is refused in
  router.gap_repair (the bound there is `reply_limit`).
- Batches may race ahead of the etcd watch: a batch of a worker not (yet) added waits up to
  `unknown_ttl_s` for `add_worker`; at most `unknown_limit` such batches are held in all (invented
  worker ids cannot grow a router's memory). Expired ones go when the next such batch comes, and
  whenever a registered worker's batch would not fit the shared byte budget, so stale ones never
  keep it from a worker under repair. Workers are only ever added by the registry, never by
  a batch, so a worker whose key is gone cannot be resurrected by its last events in flight.
  As a worker registers, its held batches past the TTL go first, then those of an epoch its name
  had when it last left (remembered for ENDED_S, the last ENDED_MAX names): an earlier session's
  (a stopping shim's last Cleared comes after its key's delete), dropped at DEBUG and counted, as
  no repair can show them forged. Until 2026-12-07 the bootstrap dropped them as forged: an ERROR
  on every restart under a fixed --worker-name. Those of any other epoch go to the bootstrap,
  which drops them as forged (an ERROR); only where the name left nothing remembered and the batch
  came before this router had heard the fleet (`fleet_listed`), or as the memory overflowed, they
  too are dropped at DEBUG: its session may have ended unseen. (The review of bc70a4c: every
  batch of another epoch held before its worker registered was dropped so, a forged one too.)
- A sender past its budget (router.sender_budget: batches and bytes a second, with bursts; the
  router's --kv-budget-* flags) has the rest dropped before decoding, counted for it, and its
  subject left unheard for a while (router.sender_subscriptions: one subscription per registered
  worker instead of {ns}.kv.* meanwhile), so nats-server sends the flood no more; a WARNING names
  it once per worker. The batches dropped are a gap of that worker alone: its index is repaired.
  Until 2026-12-07 one worker flooding its own subject queued every other worker's batches and
  kvstate replies behind the flood: every worker `repairing`, every request 503. Repairs ask on
  `requests_nc` (the router's kvstate connection), not on the connection the batches come on, so
  their replies never wait behind a flood either.
- Malformed payloads are counted, logged once per worker and kind (capped the same way) and dropped;
  they never reach the index. A batch of a newer schema is said in a slot of its own, so the line
  telling to upgrade is not swallowed by an earlier one of garbage. A sender with no record is
  logged so too, once in a while each and a bounded number at a time (router.fleet_lines.FirstSaid):
  until 2026-12-07 every such sender shared one entry, and only the first was ever named.
  A batch that decodes but holds a bad hash (packed bytes that are not whole u64s, an int out of
  range) is counted the same way; the events before the bad one are applied, the batch takes its
  seq, and the next load report's digest check repairs the difference. `on_events` is told a
  Cleared for it (the worker's pending prefixes end): until 2026-12-07 it was told nothing, and a
  pending entry for a block the batch evicted credited the worker until its TTL, past the dump.
- Events of a type this router does not know are a newer shim's (docs/decisions.md, "Kinds a newer
  kvswitch adds"): left out, counted by type, said once per worker (capped the same way); the
  rest of the batch is applied and takes its seq, and the next load report's digest check repairs
  any difference the skipped events made (the digest check above: one that still disagrees right
  after its dump backs off). Until 2026-12-07 the whole batch was malformed, its known events
  lost with it. They are counted and said as their batch is applied, never for a sender with no
  record nor for a batch dropped (a duplicate, one held and then dropped); until the review of
  e1d08bd, as they were decoded: any publisher on {ns}.kv.<name> took the counter's label values
  for good and a WARNING telling to upgrade.
- The index holds blocks of at most `MAX_WORKERS` (65,534) workers at once. One more holding
  none yet is refused: an ERROR, no entries, out of routing and not repaired until a worker leaves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import subjects
from protocol.errors import ProtocolError
from protocol.messages import (
    NEWER_SCHEMA,
    Cleared,
    KvEvent,
    KvEventBatch,
    KvStateChunk,
    KvStateRequest,
    LoadReport,
    Removed,
    Stored,
    decode_extensible,
)
from router.block_index import BlockIndex, IndexFullError
from router.fleet_lines import FirstSaid, FleetEpisodes, FleetLines, FleetLog
from router.gap_repair import LIMIT_HINT, FailureKind, FetchFailure, GapRepair
from router.ingest_stats import IngestStats, SyncState, WorkerSync
from router.lifecycle import PartStatus
from router.newer_kinds import NewerKinds, shown
from router.sender_budget import KvBudget, SenderBudget
from router.sender_subscriptions import QUARANTINE_S, SenderSubscriptions
from runtime import StopSteps, background, cancel_and_wait, guarded
from runtime.turns import Turns

__all__ = ["KvIngest"]

log = logging.getLogger(__name__)

# A worker's index entries may reach CAPACITY_SLACK x its kv_total_blocks (a hybrid model's hit-end
# keys count too), and at least MIN_ENTRY_LIMIT (4 M entries, ~170 MB of index) whatever it says.
CAPACITY_SLACK = 8
MIN_ENTRY_LIMIT = 1 << 22
# The most a worker's own kv_total_blocks can raise its bound to: 64 M entries, ~2.8 GB of index at
# ~41 B an entry (and the reply budget of router.gap_repair, 32 B an entry, with it). A worker that
# says more would otherwise lift both; only the operator's floor (min_entry_limit) goes past this.
MAX_CLAIMED_ENTRIES = 1 << 26
# How far a shim's clock may run ahead of this router's before the seq contradiction misreads it
# (hosts under NTP agree to milliseconds; router.clock_skew warns well before this).
CLOCK_ALLOWANCE_S = 10.0
# What holding a batch costs, about: its structs, and each hash as sent packed (8 B) or as a list
# (a Python int and its slot).
_BATCH_BYTES = 256
_EVENT_BYTES = 96
_LISTED_HASH_BYTES = 40
Skipped = Mapping[str, int]
"""A batch's events of types this router does not know, left out of it: how many of each type."""
_NONE_SKIPPED: Skipped = MappingProxyType({})
_Held = tuple[int, KvEventBatch, Skipped]  # a batch held for a repair: (arrival no., it, its Skipped)
# How long, and for how many names, the epochs of a worker that left are remembered: its earlier
# session's last batches, held as it registers again, are dropped quietly, not as forged.
ENDED_S = 600.0
ENDED_MAX = 1024


class _Ended(NamedTuple):
    at: float  # when it left
    epochs: frozenset[int]  # its record's and its index's


class _Behind(NamedTuple):
    seq: int  # what a report showed, ahead of the index
    since: float  # when it was seen
    barrier: int  # KV barriers begun by then: only a later one's end shows the batches lost


@dataclass(eq=False)
class _Worker:
    name: str
    sync: WorkerSync
    registered_epoch: int
    kv_total_blocks: int | None = None  # its KV capacity, as its record or load reports say
    entry_limit: int = MIN_ENTRY_LIMIT  # the most index entries it may have (see _capacity)
    reported_blocks: int | None = None  # the blocks its shim says it holds (LoadReport.kv_blocks, the last one)
    held: list[_Held] = field(default_factory=list)  # awaiting a repair
    held_bytes: int = 0  # _held_size of `held`
    overflow_logged: bool = False  # held batches dropped and said so since it was last synced
    impossible_said: bool = False  # batches its shim never sent dropped and said so, until a repair drops none
    over_budget_said: bool = False  # its batches past its budget said so (once while it is registered)
    digest_said: bool = False  # its digest's disagreement said, until the digest agrees again
    digest_repair: bool = False  # the repair open is for a digest disagreement
    digest_dumped: bool = False  # that repair's dump is in, and its digest has not been compared since
    digest_unfixed: bool = False  # its digest disagreed right after such a dump, and has not agreed since
    digest_backoff_s: float = 0.0  # how long its disagreements are left alone after that (0: not at all)
    digest_held_until: float = -math.inf  # and till when
    want_dump: bool = True
    why: str = "waiting for the shim's first full state"
    asked_at: int = 0  # arrival no. of the last batch received before the current request went out
    # (epoch, highest seq) of the batches dropped past a bound since the current request went out;
    # dropped_epochs: of more than one epoch
    dropped: tuple[int, int] | None = None
    dropped_epochs: bool = False
    sent_ts: float = math.inf  # shim time of what brought the index to its seq (see _check_ahead)
    behind: _Behind | None = None  # the seq a report showed ahead of the index, until the index reaches it
    reported: tuple[int, int] = (0, 0)  # (kv_epoch, kv_seq) of its last report ahead of the index
    ahead: tuple[int, float] | None = None  # (index seq the shim's later reports have not reached, since report ts)


class KvIngest:
    """Keeps `index` equal to what every registered worker's shim holds.

    Owns its subscriptions (router.sender_subscriptions) and the repair loops (router.gap_repair),
    not the NATS connections: batches come on `nc`, kvstate requests go on `requests_nc` (`nc`
    when None). `stop()` is idempotent. `on_events(worker, events)` sees every applied event (the
    pending prefixes confirm against it), and a Cleared where a batch's bad hash leaves the worker's
    state unknown. `budget`: each sender's (router.sender_budget).
    """

    def __init__(
        self,
        nc: Client,
        ns: str,
        index: BlockIndex,
        *,
        requests_nc: Client | None = None,
        budget: SenderBudget | None = None,
        quarantine_s: float = QUARANTINE_S,
        request_timeout_s: float = 2.0,
        fetch_timeout_s: float = 30.0,
        retry_max_s: float = 2.0,
        unknown_ttl_s: float = 5.0,
        unknown_limit: int = 10_000,
        held_limit: int = 10_000,
        held_bytes_limit: int = 32 << 20,
        held_total_bytes_limit: int = 512 << 20,
        behind_grace_s: float = 1.0,
        barrier_timeout_s: float = 10.0,
        digest_backoff_min_s: float = 2.0,
        digest_backoff_max_s: float = 64.0,
        min_entry_limit: int = MIN_ENTRY_LIMIT,
        max_kvstate_in_flight: int = 32,
        on_events: Callable[[str, list[KvEvent]], None] = lambda worker, events: None,
        clock: Callable[[], float] = time.monotonic,
        fleet_log: FleetLog | None = None,
    ) -> None:
        self._turns = Turns()
        self._ns = subjects.validate_namespace(ns)
        self._workers: dict[str, _Worker] = {}
        self.index = index
        self.min_entry_limit = min_entry_limit
        self.stats = IngestStats()
        self.status = PartStatus.NEW
        self.budget = budget or KvBudget().budget()
        self.subscriptions = SenderSubscriptions(
            nc,
            subjects.kv_all(self._ns),
            functools.partial(subjects.kv, self._ns),
            guarded(self._on_msg, "the KV event handler"),
            self._workers.keys,  # every registered worker: a quarantine leaves the others heard
            what="KV event",
            quarantine_s=quarantine_s,
            clock=clock,
            on_switched=self._switched,
        )
        self._switch_gaps: set[str] = set()  # workers whose gap waits for the switch under way to end
        self.repairs = GapRepair(
            requests_nc or nc,
            self._ns,
            self,
            request_timeout_s=request_timeout_s,
            fetch_timeout_s=fetch_timeout_s,
            retry_max_s=retry_max_s,
            max_in_flight=max_kvstate_in_flight,
            fleet_log=fleet_log,
        )
        self._unknown_ttl_s = unknown_ttl_s
        self._unknown_limit = unknown_limit
        self._held_limit = held_limit
        self._held_bytes_limit = held_bytes_limit
        self._held_total_bytes_limit = held_total_bytes_limit
        self._held_total = 0  # bytes of every worker's held batches and of those of unknown workers
        self._behind_grace_s = behind_grace_s
        self._barrier_timeout_s = barrier_timeout_s
        self._barrier: asyncio.Task[None] | None = None  # the KV barrier under way (_catch_up)
        self._barriers_begun = self._barriers_ended = 0  # the number of the last one begun, and ended
        self._behind_judged: set[str] = set()  # workers whose batches behind a report wait on it
        self._barrier_late_said = False  # a barrier did not end in time, said, and none has since
        self._digest_backoff_min_s = digest_backoff_min_s
        self._digest_backoff_max_s = digest_backoff_max_s
        self._digest_lines = FleetLines(
            log,
            logging.WARNING,
            "their KV digests disagree with the index; resyncing (one cause for many workers: their shims' "
            "digests or this router's index; every resync is counted in kvswitch_router_kv_digest_mismatches_total)",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._unfixed_lines = FleetLines(
            log,
            logging.ERROR,
            "their KV digests still disagree right after a full dump; each stays routable, dumped again with a "
            "backoff (one cause for many workers: shims of another kvswitch build, whose digest this router computes "
            'otherwise: docs/deployment.md, "Upgrades"; kvswitch_router_kv_digest_unfixed_workers counts them)',
            clock=clock,
            fleet_log=fleet_log,
        )
        self._ahead_lines = FleetLines(
            log,
            logging.WARNING,
            "their KV index is at a seq their shims have not reached; resyncing (one cause for many workers: their "
            "shims or this router's index; every resync is counted in kvswitch_router_kv_digest_mismatches_total)",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._malformed_lines = FleetLines(
            log,
            logging.WARNING,
            "dropping malformed KV events (one cause for many workers: shims of a build whose events this router "
            "cannot read; every payload counted in kvswitch_router_kv_malformed_total)",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._short_replay_lines = FleetLines(  # one broken shim build, the fleet of it at once
            log,
            logging.WARNING,
            "their KV replays were applied but stop short of their shims' own seq; a full dump of each is next, "
            "each out of routing until it is in (a shim build that replays part of what it sent; each counted in "
            "kvswitch_router_kv_malformed_total)",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._newer_lines = FleetLines(  # shims upgraded before the routers: each of them at once
            log,
            logging.WARNING,
            "KV events of types this router does not know, skipped: shims of a newer kvswitch than this router "
            '(upgrade the routers first: docs/deployment.md, "Upgrades"; counted in '
            "kvswitch_router_kv_events_unknown_total)",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._newer_kinds = NewerKinds(self.stats.events_unknown)
        self._capacity_lines = FleetLines(  # a fleet sharing one large offload tier goes past together
            log,
            logging.WARNING,
            f"holding more blocks than their KV capacity allows, their entries dropped ({LIMIT_HINT})",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._overflow_lines = FleetLines(  # a fleet whose kvstate goes unanswered fills every bound
            log,
            logging.WARNING,
            "dropped held KV batches past a bound on batches held while they repair; a reply, a replay or a full dump "
            "catches up each "
            "(one cause for many workers at once: their repairs failing alike, as gap repair's lines say; "
            'kvswitch_router_kv_dropped_total{reason="overflow"} counts each)',
            clock=clock,
            fleet_log=fleet_log,
        )
        self._impossible_lines = FleetLines(  # a fleet whose ids another process took, or one forger of many
            log,
            logging.ERROR,
            "dropped held KV batches their shims never sent: forged, or from processes that no longer hold these "
            "worker ids (logged once until a repair of each drops none; "
            'kvswitch_router_kv_dropped_total{reason="impossible"} counts each)',
            clock=clock,
            fleet_log=fleet_log,
        )
        self._over_budget_lines = FleetLines(
            log,
            logging.WARNING,
            "KV batches over their senders' budget dropped, their subjects unheard for a while and their indexes "
            "repaired (one cause for many workers: something other than their shims publishing on their subjects; "
            "counted in kvswitch_router_kv_over_budget_total)",
            clock=clock,
            fleet_log=fleet_log,
        )
        self._agrees_lines = FleetLines(
            log,
            logging.INFO,
            "KV digests agree with the index again (their shims' and this router's)",
            clock=clock,
            fleet_log=fleet_log,
        )
        # an unfixed digest's ERROR, then its agreeing again: capped alike, but for those named unfixed
        self._unfixed = FleetEpisodes(self._unfixed_lines, self._agrees_lines)
        self._on_events = on_events
        self._clock = clock
        self._unsynced: set[str] = set()  # workers bootstrapping or repairing: `synced` in O(1)
        # batches of workers with no record: (arrival time, size, batch, its events of unknown types)
        self._unknown: dict[str, deque[tuple[float, int, KvEventBatch, Skipped]]] = {}
        self._ended: OrderedDict[str, _Ended] = OrderedDict()  # workers that left, by name, oldest first
        # Batches of a name with nothing in _ended that came before this are not judged forged as it
        # registers: an earlier session may have ended before this router heard the fleet, or been forgotten
        self._heard_from = math.inf
        # Kinds of malformed (or newer) input logged, per registered worker (forgotten when it
        # leaves: a worker back under its name is logged again) and, bounded, per sender with none
        self._said = FirstSaid(self._workers.__contains__, clock=clock)
        self._refused: dict[str, None] = {}  # workers the full index had no slot for, oldest first
        self._arrivals = 0
        self._synced = asyncio.Event()
        self._synced.set()

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.status is not PartStatus.NEW:
            raise RuntimeError(f"KvIngest.start() called while {self.status.value}")
        await self.subscriptions.start()
        self.status = PartStatus.RUNNING
        for worker in self._workers.values():
            self.repairs.ensure(worker.name)

    async def stop(self) -> None:
        if self.status is PartStatus.STOPPED:
            return
        self.status = PartStatus.STOPPED
        steps = StopSteps()  # each run though one before it was cut: the subscriptions and repairs were left running
        if self._barrier is not None:
            with steps:
                await cancel_and_wait(self._barrier)
        with steps:
            await self.subscriptions.stop()  # what it cannot unsubscribe (a draining connection) goes with it
        with steps:
            await self.repairs.stop()
        steps.end()

    # --- the worker set (driven by the registry) -------------------------------------------------

    def fleet_listed(self) -> None:
        """The registry has applied its first listing of the workers: a worker that leaves from now
        on is remembered, so a batch of another epoch held for a name that left nothing is forged."""
        if self._heard_from == math.inf:
            self._heard_from = self._clock()

    def add_worker(self, worker: str, epoch: int, kv_total_blocks: int | None = None) -> None:
        """`worker` registered (or its record changed): bootstrap it if new, resync on a new epoch.
        `kv_total_blocks` (its record's) bounds its index entries."""
        known = self._workers.get(worker)
        if known is not None:
            self._capacity(known, kv_total_blocks)
            if epoch != known.registered_epoch:
                known.registered_epoch = epoch
                if known.sync.epoch != epoch and known.sync.state is SyncState.SYNCED:
                    self.stats.epoch_changes += 1
                    self._open_repair(known, dump=True, why=f"its record names a new epoch {epoch:x}")
            return
        sync = WorkerSync()
        state = _Worker(name=worker, sync=sync, registered_epoch=epoch, entry_limit=self.min_entry_limit)
        self._capacity(state, kv_total_blocks)
        self._workers[worker] = state
        self._unsynced.add(worker)
        self.stats.workers[worker] = sync
        now = self._clock()
        ended = self._ended.pop(worker, None)
        if ended is not None and now - ended.at > ENDED_S:
            ended = None
        self._expire_unknown(now)  # expiry runs only as batches come: the held may be past their time
        stale: list[KvEventBatch] = []
        for arrived, size, batch, skipped in self._unknown.pop(worker, ()):
            self._held_total -= size
            self.stats.unknown_held -= 1
            if batch.epoch != epoch and (
                batch.epoch in ended.epochs if ended is not None else arrived < self._heard_from
            ):  # an earlier session's, sent before this registration: no repair can show it forged
                stale.append(batch)
            else:  # this session's, or forged: the bootstrap judges it
                self._hold(state, batch, skipped)
        if stale:
            self._dropped_stale(worker, epoch, stale)
        self._synced.clear()
        self.subscriptions.workers_changed()
        if self.status is PartStatus.RUNNING:
            self.repairs.ensure(worker)

    def _dropped_stale(self, worker: str, epoch: int, stale: list[KvEventBatch]) -> None:
        """Batches of `worker` held before it registered, of an epoch its name had as it left (or
        of another than its record's, where it left nothing remembered: add_worker): an earlier
        session's (a stopping shim's last Cleared comes after its key's delete; a crashed shim's
        last batches). Until 2026-12-07 they went to the new registration's repair, which
        dropped them as forged with an ERROR on every restart under a fixed --worker-name."""
        self.stats.dropped_stale_session += len(stale)
        log.debug(
            "worker %s registered at epoch %x: dropped %d KV batches held from before it registered, of another "
            "session (%s)",
            worker,
            epoch,
            len(stale),
            ", ".join(f"epoch {b.epoch:x} seq {b.seq}" for b in stale[:3]),
        )

    def remove_worker(self, worker: str) -> None:
        """`worker` left: its entries go at once and its repair, if any, stops."""
        state = self._workers.pop(worker, None)
        if state is not None:
            self._remember(state)
            self._set_held(state, [])
            if state.digest_unfixed:
                self.stats.digest_unfixed -= 1
                self._unfixed.forget(worker)
        self._unsynced.discard(worker)
        unknown = self._unknown.pop(worker, ())
        self.stats.unknown_held -= len(unknown)
        self._held_total -= sum(size for _, size, _, _ in unknown)
        self.stats.workers.pop(worker, None)
        self._said.forget(worker)
        self.index.clear(worker)
        self._on_events(worker, [Cleared()])
        self.repairs.cancel(worker)
        self._refused.pop(worker, None)
        self.stats.worker_over_budget.pop(worker, None)
        self.subscriptions.workers_changed()
        if self._refused and not self.index.full and self.status is PartStatus.RUNNING:
            oldest = next(iter(self._refused))  # the slot it left goes to the worker refused longest
            del self._refused[oldest]
            self.repairs.ensure(oldest)
        self._refresh_synced()

    def _remember(self, state: _Worker) -> None:
        """The epochs `state`'s worker had as it left, for its name's return (add_worker)."""
        now, ended = self._clock(), self._ended
        epochs = {state.registered_epoch} | ({state.sync.epoch} if state.sync.epoch is not None else set())
        ended[state.name] = _Ended(now, frozenset(epochs))
        ended.move_to_end(state.name)
        while now - next(iter(ended.values())).at > ENDED_S:  # the one just left stays
            ended.popitem(last=False)
        if len(ended) > ENDED_MAX:  # forgotten while its last batches may still come: none judged forged
            ended.popitem(last=False)
            self._heard_from = max(self._heard_from, now + self._unknown_ttl_s)

    # --- readiness -------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        """Every added worker bootstrapped, with no gap open."""
        return not self._unsynced

    def sync_state(self, worker: str) -> tuple[str, str] | None:
        """None when the index is synced with `worker`, else (state, why)."""
        state = self._workers.get(worker)
        if state is None:
            return ("bootstrapping", "not yet known to the KV ingest")
        if state.sync.state is SyncState.SYNCED:
            return None
        failures = self.repairs.failures(worker)
        why = state.why + (f"; {failures} failed kvstate requests in a row" if failures else "")
        return (state.sync.state.value, why)

    async def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.synced:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._synced.wait(), left)
            except TimeoutError:
                return False
        return True

    def _refresh_synced(self) -> None:
        if self.synced:
            self._synced.set()
        else:
            self._synced.clear()

    # --- live batches ----------------------------------------------------------------------------

    async def _on_msg(self, msg: Msg) -> None:
        sender = msg.subject.rpartition(".")[2]
        if not self.budget.admit(sender, self._clock(), len(msg.data)):  # before decoding: a flood costs a lookup
            self._over_budget(sender, msg.subject)
            return
        await self._turns.take()  # nats-py hands a backlog over without yielding: a turn every slice
        self._on_payload(sender, msg.data)

    def _over_budget(self, sender: str, subject: str) -> None:
        """A batch of `sender` past its budget, dropped: counted, the sender quarantined, and named
        once per registered worker (a sender with no record, once a quarantine). Dropped batches
        are a gap of that worker alone: its index is repaired (its kvstate answers on the requests
        connection, whatever comes on this subject)."""
        self.stats.over_budget += 1
        state = self._workers.get(sender)
        quarantined = self.subscriptions.quarantine(sender)
        if state is None:
            if not quarantined:
                return
        else:
            self.stats.worker_over_budget[sender] += 1
            if state.sync.state is SyncState.SYNCED:
                self._open_repair(state, dump=False, why="KV batches past its budget dropped")
            if state.over_budget_said:
                return
            state.over_budget_said = True
        budget = self.budget
        self._over_budget_lines.say(
            sender,
            "KV batches from worker %s come faster than %g a second or %g MiB a second (bursts of %g, %g MiB; a "
            "shim seals about 200 a second): the rest dropped unread, its index repaired, and %s unheard for %g s, "
            "twice as long each time it floods again up to %g s (logged once per worker, counted in "
            "kvswitch_router_kv_over_budget_total); something other "
            "than its shim publishes there, or its engine emits more than the router's --kv-budget-* flags allow",
            sender,
            budget.rate_per_s,
            budget.bytes_per_s / (1 << 20),
            budget.burst,
            budget.bytes_burst / (1 << 20),
            subject,
            self.subscriptions.quarantine_s,
            self.subscriptions.quarantine_max_s,
        )

    def _on_payload(self, subject_worker: str, data: bytes) -> None:
        """One payload from {ns}.kv.{subject_worker}: decode at the edge, then order and apply."""
        try:
            batch, skipped = decode_extensible(data, KvEventBatch)
            if batch.worker != subject_worker:
                raise ProtocolError("KvEventBatch", f"names worker {batch.worker!r} on {subject_worker!r}'s subject")
        except ProtocolError as exc:
            # a newer schema's line in a slot of its own: one telling to upgrade is never swallowed
            self._malformed(subject_worker, exc, "newer schema" if exc.kind == NEWER_SCHEMA else "payload")
            return
        state = self._workers.get(batch.worker)
        if state is None:
            self._hold_unknown(batch, skipped)
            return
        sync = state.sync
        if sync.state is not SyncState.SYNCED:
            self._hold(state, batch, skipped)
        elif batch.epoch != sync.epoch:
            self.stats.epoch_changes += 1
            self._hold(state, batch, skipped)
            self._open_repair(state, dump=True, why=f"a batch of unknown epoch {batch.epoch:x}")
        elif batch.seq <= sync.last_seq:
            self.stats.duplicates += 1
        elif batch.seq > sync.last_seq + 1:
            self._hold(state, batch, skipped)
            if self.subscriptions.switching and not state.want_dump:  # want_dump: held past a bound, dropped
                # The old subscription's queue may still hold the batches between (_switched).
                self._switch_gaps.add(state.name)
            else:
                self.stats.gaps += 1
                self._open_repair(state, dump=False, why=f"gap: seq {batch.seq} after {sync.last_seq}")
        else:
            if self._apply(batch, state, skipped) and state.held:
                self._drain_held(state)  # those held across a switch that follow it now
            self.stats.last_lag_s = max(0.0, time.time() - batch.ts)

    def _switched(self) -> None:
        """A change of the KV subscriptions ended: every batch its old ones held went through
        `_on_msg`. A gap held meanwhile that remains was a loss: repaired."""
        gaps, self._switch_gaps = self._switch_gaps, set()
        for name in gaps:
            state = self._workers.get(name)
            if state is not None and state.sync.state is SyncState.SYNCED and state.held:
                self.stats.gaps += 1
                seq = min(batch.seq for _, batch, _ in state.held)
                self._open_repair(state, dump=False, why=f"gap: seq {seq} after {state.sync.last_seq}")

    def _newer(self, worker: str, skipped: Skipped) -> None:
        """Events of types this router does not know, left out of a batch of registered `worker`'s
        as it is applied."""
        self._newer_kinds.add(skipped)
        if self._said("newer", worker):
            self._newer_lines.say(
                worker,
                "worker %s sends KV events of type %s, which this router does not know: its shim runs a newer "
                "kvswitch than this router. They are skipped, the rest of each batch applied, and the KV digest "
                "check repairs any difference they make; upgrade the routers first (docs/deployment.md, "
                '"Upgrades"). Logged once per worker, counted in kvswitch_router_kv_events_unknown_total',
                worker,
                shown(skipped),
            )

    def _malformed(self, worker: str, exc: Exception, kind: str) -> None:
        self.stats.malformed += 1
        if self._said(kind, worker):
            (self._capacity_lines if kind == "capacity" else self._malformed_lines).say(
                worker, "dropping malformed KV events from worker %s (logged once per worker and kind): %s", worker, exc
            )

    def _apply(self, batch: KvEventBatch, state: _Worker, skipped: Skipped = _NONE_SKIPPED) -> bool:
        """Apply `batch` to `state`'s worker (never to the worker the batch names: a repair reply's
        batch could name another); `skipped`: its events of types this router does not know, left
        out of it. False when the worker then holds more than it can (see `_over_capacity`): its
        entries are gone and a full dump is next."""
        worker = state.name
        try:
            self.index.apply(worker, batch.events)
        except IndexFullError as exc:
            self._refuse(state, exc)
            return False
        except ValueError as exc:
            # A hash out of range, or packed bytes that are not whole u64s: checked by the index, so
            # the well-formed batches pay nothing. The batch still takes its seq; the events before
            # the bad one are in, and the next load report's digest check repairs the difference.
            self._malformed(worker, exc, "hash")
            state.digest_dumped = False  # the index now differs from the shim's by this batch: not the shim's digest
            # What the batch left the worker holding is unknown until that dump, which leaves
            # pending entries alone: end them now, or one for a block it evicted outlives the dump.
            self._on_events(worker, [Cleared()])
        else:
            self._on_events(worker, batch.events)
        state.sync.last_seq, state.sent_ts = batch.seq, _shim_time(batch.ts)
        self.stats.batches_applied += 1
        self.stats.events_applied += len(batch.events)
        if skipped:
            self._newer(worker, skipped)
        held = self.index.count(worker)
        if held <= state.entry_limit:
            return True
        self._over_capacity(state, held)
        return False

    def _over_capacity(self, state: _Worker, held: int) -> None:
        """An engine reports its evictions, so an honest shim never holds more blocks than its
        capacity allows; a worker past it would grow every replica's index without bound. Its
        entries go (they cannot be trusted), it is counted and logged once, and a dump follows."""
        self.index.clear(state.name)
        limit, total = state.entry_limit, state.kv_total_blocks
        why = f"it claims {held} blocks, more than its KV capacity allows ({limit}; kv_total_blocks {total})"
        self._malformed(state.name, ProtocolError("KvEventBatch", f"{why}; {LIMIT_HINT}"), "capacity")
        self._open_repair(state, dump=True, why=why)
        state.why = why

    def _refuse(self, state: _Worker, exc: IndexFullError) -> None:
        """The index holds blocks of as many workers as it can (router.block_index.MAX_WORKERS) and
        this one holds none: it stays out of routing with no entries, and unrepaired (a repair would
        fetch its dump again and again), until a worker leaves. An ERROR each time, not "malformed"."""
        why = f"{exc}; out of routing until a worker leaves"
        log.error("%s", why)
        self._refused[state.name] = None  # before _open_repair: its repair loop must not run
        self._open_repair(state, dump=True, why=why)
        state.why = why

    def _hold(self, state: _Worker, batch: KvEventBatch, skipped: Skipped) -> None:
        size = _held_size(batch)
        if self._held_total + size > self._held_total_bytes_limit:
            self._expire_unknown(self._clock())  # stale batches of unknown workers must not keep the budget
        over_total = self._held_total + size > self._held_total_bytes_limit
        if len(state.held) >= self._held_limit or state.held_bytes + size > self._held_bytes_limit or over_total:
            # Too far behind to replay, or too many bytes held (a worker that never answers kvstate
            # would otherwise keep all it sends): drop what is held and let a full dump catch up.
            dropped = len(state.held)
            self.stats.dropped_overflow += dropped
            lost = [held for _, held, _ in state.held]
            self._set_held(state, [])
            state.want_dump = True
            others_full = self._held_total + size > self._held_total_bytes_limit  # the others' fill the budget
            if others_full:
                self.stats.dropped_overflow += 1
                dropped += 1
                lost.append(batch)
            self._note_dropped(state, lost)
            self._overflowed(state, dropped, "all workers'" if over_total else "its own")
            if others_full:
                return
        self._arrivals += 1
        state.held.append((self._arrivals, batch, skipped))
        state.held_bytes += size
        self._held_total += size
        state.sync.buffered = len(state.held)

    def _note_dropped(self, state: _Worker, lost: list[KvEventBatch]) -> None:
        """Keep where the batches dropped past a bound reach, for the reply to a request already out
        (repair_reply: it covers them, or a replay or a dump follows)."""
        for batch in lost:
            if state.dropped is None:
                state.dropped = (batch.epoch, batch.seq)
            elif batch.epoch != state.dropped[0]:
                state.dropped, state.dropped_epochs = (batch.epoch, batch.seq), True
            else:
                state.dropped = (batch.epoch, max(batch.seq, state.dropped[1]))

    def _overflowed(self, state: _Worker, dropped: int, whose: str) -> None:
        """A WARNING for the first overflow of a repair: the rest until it is synced again only count."""
        if state.overflow_logged:
            return
        state.overflow_logged = True
        self._overflow_lines.say(
            state.name,
            "worker %s: dropped %d held KV batches, past %s bound on batches held while it repairs (%d batches, "
            "%d MiB a worker; %d MiB all workers); the reply to the request out, a replay from its seq or a full "
            "dump catches up, and again while the bound stays full (logged once until it is synced; "
            'kvswitch_router_kv_dropped_total{reason="overflow"} counts each)',
            state.name,
            dropped,
            whose,
            self._held_limit,
            self._held_bytes_limit >> 20,
            self._held_total_bytes_limit >> 20,
        )

    def _set_held(self, state: _Worker, held: list[_Held]) -> None:
        self._held_total -= state.held_bytes
        state.held = held
        state.held_bytes = sum(_held_size(batch) for _, batch, _ in held)
        self._held_total += state.held_bytes
        state.sync.buffered = len(held)

    def _hold_unknown(self, batch: KvEventBatch, skipped: Skipped) -> None:
        now = self._clock()
        self._expire_unknown(now)
        size = _held_size(batch)
        if self.stats.unknown_held >= self._unknown_limit or self._held_total + size > self._held_total_bytes_limit:
            self.stats.dropped_unknown += 1
            return
        queue = self._unknown.get(batch.worker)
        if queue is None:
            queue = self._unknown[batch.worker] = deque()
        queue.append((now, size, batch, skipped))
        self.stats.unknown_held += 1
        self._held_total += size

    def _expire_unknown(self, now: float) -> None:
        for worker in [w for w, q in self._unknown.items() if now - q[0][0] > self._unknown_ttl_s]:
            queue = self._unknown[worker]
            while queue and now - queue[0][0] > self._unknown_ttl_s:
                self._held_total -= queue.popleft()[1]
                self.stats.dropped_unknown += 1
                self.stats.unknown_held -= 1
            if not queue:
                del self._unknown[worker]

    # --- digest check ------------------------------------------------------------------------------

    def check_digest(self, report: LoadReport) -> None:
        """Compare a load report's KV digest with the index (see the module docstring)."""
        state = self._workers.get(report.worker)
        if state is None:
            return
        self._capacity(state, report.kv_total_blocks)
        state.reported_blocks = report.kv_blocks
        if not report.kv_epoch or state.sync.state is not SyncState.SYNCED:
            return
        sync = state.sync
        if report.kv_epoch != sync.epoch or report.kv_seq > sync.last_seq:
            state.ahead = None
            state.reported = (report.kv_epoch, report.kv_seq)
            self._judge_behind(state)
            if state.behind is None:
                state.behind = _Behind(report.kv_seq, self._clock(), self._barriers_begun)
            return
        state.behind = None
        if report.kv_seq < sync.last_seq:
            self._check_ahead(state, report)
            return
        state.ahead = None
        count, xor = self.index.digest(report.worker)
        dumped, state.digest_dumped = state.digest_dumped, False
        if (count, xor) == (report.kv_blocks, report.kv_xor):
            self._digest_agrees(state)
            return
        now = self._clock()
        if dumped:
            self._digest_unfixed(state, report, count, xor, now)
            return
        if now < state.digest_held_until:
            return  # backing off: the last dump did not make it agree, and the next may not either
        self.stats.digest_mismatches += 1
        if not state.digest_said:  # once per episode, though each disagreement not held back resyncs
            state.digest_said = True
            self._digest_lines.say(
                report.worker,
                "KV digest of worker %s disagrees at seq %d: index %d blocks xor %x, shim %d xor %x; resyncing",
                report.worker,
                sync.last_seq,
                count,
                xor,
                report.kv_blocks,
                report.kv_xor,
            )
        self._open_repair(state, dump=True, why="its KV digest disagrees with the index")
        state.digest_repair = True

    def _digest_unfixed(self, state: _Worker, report: LoadReport, count: int, xor: int, now: float) -> None:
        """The first digest compared after a dump taken for a disagreement disagrees again: the
        index is the shim's own dump plus its own well-formed batches since, so the shim's digest
        and its KV state disagree, and another dump would not help. Backing off, not dumping on
        every report; the worker stays routable on the dump's state (see the module docstring)."""
        state.digest_backoff_s = min(
            2 * state.digest_backoff_s or self._digest_backoff_min_s, self._digest_backoff_max_s
        )
        state.digest_held_until = now + state.digest_backoff_s
        if state.digest_unfixed:
            return
        state.digest_unfixed = True
        self.stats.digest_unfixed += 1
        self._unfixed.began(
            state.name,
            "KV digest of worker %s still disagrees right after a full dump (seq %d: index %d blocks xor %x, shim "
            "%d xor %x): its shim's digest and its own KV dump disagree (another kvswitch build? docs/deployment.md, "
            '"Upgrades"); it stays routable on its dump\'s state and is dumped again at most every %gs, doubling '
            "to %gs, until its digest agrees (logged once until then)",
            state.name,
            state.sync.last_seq,
            count,
            xor,
            report.kv_blocks,
            report.kv_xor,
            state.digest_backoff_s,
            self._digest_backoff_max_s,
        )

    def _digest_agrees(self, state: _Worker) -> None:
        state.digest_said = False
        state.digest_backoff_s, state.digest_held_until = 0.0, -math.inf
        if state.digest_unfixed:
            state.digest_unfixed = False
            self.stats.digest_unfixed -= 1
            self._unfixed.ended(state.name, "KV digest of worker %s agrees with the index again", state.name)

    def _judge_behind(self, state: _Worker) -> None:
        """Its index behind the seq its reports showed: the watch ends once the index reaches that
        seq, and the batches up to it are lost once `behind_grace_s` has passed and a KV barrier
        begun since has ended (all that nats-server had sent the KV subscriptions by then went
        through the handler): until then they may be on their way behind others, a flood's or a
        backlog's, while the reports come on a connection of their own."""
        behind, sync = state.behind, state.sync
        if behind is None or sync.state is not SyncState.SYNCED:
            return
        epoch, seq = state.reported
        if epoch == sync.epoch and sync.last_seq >= behind.seq:
            state.behind = None  # the index reached the seq watched so far: it trails, it lost nothing
            return
        if self._clock() - behind.since < self._behind_grace_s:
            return
        if self._barriers_ended <= behind.barrier:
            self._behind_judged.add(state.name)
            self._catch_up()
            return
        self.stats.digest_lags += 1
        why = f"its shim is at epoch {epoch:x} seq {seq}, the index at seq {sync.last_seq}"
        self._open_repair(state, dump=epoch != sync.epoch, why=f"lost batches: {why}")

    def _barrier_late(self) -> None:
        if not self._barrier_late_said:  # once until one ends in time
            self._barrier_late_said = True
            log.warning(
                "KV batches reach this router more than %gs late (what NATS had sent its KV subscriptions was not "
                "all handled in that time): its index trails its workers, and batches behind their load reports "
                "are judged lost only once they catch up",
                self._barrier_timeout_s,
            )

    def _catch_up(self) -> None:
        """A KV barrier (SenderSubscriptions.caught_up), unless one is under way; at its end every
        worker waiting on it is judged again."""
        if self.status is not PartStatus.RUNNING or (self._barrier is not None and not self._barrier.done()):
            return
        self._barriers_begun += 1
        self._barrier = background(
            self._caught_up(self._barriers_begun),
            "router-kv-barrier",
            "batches behind load reports are judged lost at the next report past the grace",
        )

    async def _caught_up(self, number: int) -> None:
        in_time = await self.subscriptions.caught_up(self._barrier_timeout_s, on_late=self._barrier_late)
        if in_time and self._barrier_late_said:
            self._barrier_late_said = False
            log.info("KV batches reach this router in time again")
        self._barriers_ended = number
        self._barrier = None  # ended: a worker judged again below may need the next one
        waiting, self._behind_judged = self._behind_judged, set()
        for name in waiting:
            if (state := self._workers.get(name)) is not None:
                self._judge_behind(state)

    def _check_ahead(self, state: _Worker, report: LoadReport) -> None:
        """A report below the index's seq. Judged on the shim's clock, never on arrival: load
        reports and batches come through separate queues, and an overloaded router drains one
        behind the other. A report the shim made before it sent that seq (ts not after `sent_ts`)
        is only late. One made after it and still below contradicts the index; if the shim's
        reports keep doing so for `behind_grace_s` of its clock, a reply claimed a seq the shim
        never sent, and every real batch would read as a duplicate for good: take a full dump."""
        seq, shim_seq = state.sync.last_seq, report.kv_seq
        if state.ahead is not None and shim_seq >= state.ahead[0]:
            state.ahead = None  # the shim reached the seq watched so far
        if report.ts <= state.sent_ts:
            return
        if state.ahead is None:
            state.ahead = (seq, report.ts)
        elif report.ts - state.ahead[1] >= self._behind_grace_s:
            self.stats.digest_mismatches += 1
            self._ahead_lines.say(
                state.name,
                "KV index of worker %s is at seq %d, which its shim has not reached in %.1fs of its reports "
                "(it is at %d); resyncing",
                state.name,
                seq,
                report.ts - state.ahead[1],
                shim_seq,
            )
            self._open_repair(state, dump=True, why=f"its shim is at seq {shim_seq}, the index at a later {seq}")

    # --- repair (router.gap_repair drives these) --------------------------------------------------

    def _open_repair(self, state: _Worker, *, dump: bool, why: str) -> None:
        if state.sync.state is SyncState.SYNCED:
            state.sync.state = SyncState.REPAIRING
            state.why = why
            self._unsynced.add(state.name)
        state.want_dump = state.want_dump or dump
        state.behind = state.ahead = None
        self._synced.clear()
        if self.status is PartStatus.RUNNING:
            self.repairs.ensure(state.name)

    def needs_repair(self, worker: str) -> bool:
        state = self._workers.get(worker)
        return (
            state is not None
            and state.sync.state is not SyncState.SYNCED
            and worker not in self._refused
            and self.status is PartStatus.RUNNING
        )

    def repair_request(self, worker: str) -> KvStateRequest:
        state = self._workers[worker]
        state.asked_at = self._arrivals
        # Batches dropped before now were sent before the reply: a dump (want_dump) covers them.
        state.dropped, state.dropped_epochs = None, False
        if state.want_dump:
            return KvStateRequest(since_seq=0, epoch=None)
        return KvStateRequest(since_seq=state.sync.last_seq, epoch=state.sync.epoch)

    def _capacity(self, state: _Worker, kv_total_blocks: int | None) -> None:
        """Take the worker's KV capacity, when one is said, and the entry limit it gives."""
        if kv_total_blocks:
            state.kv_total_blocks = kv_total_blocks
            claimed = min(CAPACITY_SLACK * kv_total_blocks, MAX_CLAIMED_ENTRIES)
            state.entry_limit = max(self.min_entry_limit, claimed)

    def reply_limit(self, worker: str) -> int:
        state = self._workers.get(worker)
        return self.min_entry_limit if state is None else state.entry_limit

    def reply_size(self, worker: str) -> int:
        """The blocks a dump of `worker` may carry: its last load report's count, or before any (a
        router starting beside a worker whose offload tier holds millions) its index bound."""
        state = self._workers.get(worker)
        if state is None:
            return 0
        size = state.entry_limit if state.reported_blocks is None else state.reported_blocks
        return max(0, min(size, state.entry_limit))

    def repair_failed(self, worker: str, failure: FetchFailure) -> None:
        state = self._workers.get(worker)
        if state is None:
            return
        self.stats.repair_failures[failure.kind] += 1
        if failure.kind is FailureKind.CRASHED:
            state.want_dump = True  # what the crash left of the worker's entries is unknown: all of it next
        elif failure.kind in (FailureKind.MALFORMED, FailureKind.OVER_CAPACITY):
            # over capacity: the batches' own capacity line and cause (an offload tier), not a build's
            self._malformed(worker, failure, "capacity" if failure.kind is FailureKind.OVER_CAPACITY else "repair")
            state.want_dump = True  # never the same since_seq again
        elif failure.kind is FailureKind.TIMED_OUT:
            self.stats.repair_timeouts += 1
            # A replay that timed out may never get through (over NATS's max_payload): not again.
            state.want_dump = True

    def repair_reply(self, worker: str, chunks: list[KvStateChunk]) -> None:
        state = self._workers.get(worker)
        if state is None:
            return
        sync, first = state.sync, chunks[0]
        if first.dump:
            # Chunk by chunk: no set of a whole worker's hashes (16k per worker, 1,000 workers at a
            # replica's bootstrap). Pending prefixes are left alone: they stand for requests in
            # flight, which a dump of what is cached says nothing about.
            self.index.clear(worker)
            try:
                for chunk in chunks:
                    self.index.store(worker, chunk.hashes)
            except IndexFullError as exc:
                self._refuse(state, exc)
                return
            sync.epoch, sync.last_seq = first.epoch, first.seq
            # The shim sent this seq by the time its reply came, on this router's clock: a report it
            # makes later is at it. CLOCK_ALLOWANCE_S keeps a shim whose clock runs ahead from
            # reading its late reports as later; one whose clock lags is caught that much later.
            state.sent_ts = time.time() + CLOCK_ALLOWANCE_S
            state.want_dump = False
            state.digest_dumped, state.digest_repair = state.digest_repair, False
            self.stats.repairs_dumps += 1
        elif first.epoch != sync.epoch:
            state.want_dump = True  # asked for batches of an epoch the shim no longer has
            return
        else:
            self.stats.repairs_batches += 1
            for chunk in chunks:
                for batch in chunk.batches:
                    if batch.epoch == sync.epoch and batch.seq == sync.last_seq + 1 and not self._apply(batch, state):
                        return  # past its capacity: cleared, and a dump is next
            if sync.last_seq < first.seq:
                # The replay did not reach the shim's own seq: a broken shim. Out of routing until
                # its full state is in (with nothing held, it was synced at the seq it stopped at).
                # Its own kind: under a garbled reply's ("repair"), a worker that sent one never said it.
                gap = f"stops at seq {sync.last_seq}, short of its own seq {first.seq}"
                self.stats.malformed += 1
                if self._said("short replay", worker):
                    self._short_replay_lines.say(
                        worker,
                        "applied worker %s's KV replay, which %s; a full dump is next, the worker out of routing "
                        "until it is in (logged once per worker)",
                        worker,
                        gap,
                    )
                state.want_dump = True
                state.why = f"its replay {gap}: a full dump is next"
                return
        if not self._covers_dropped(state, first.epoch, first.seq):
            # Not synced: a dump taken for a digest disagreement keeps its mark for the dump or
            # replay that completes it (check_digest: a disagreement right after it backs off).
            state.digest_repair, state.digest_dumped = state.digest_dumped or state.digest_repair, False
            return
        self._drop_contradicted(state, first.epoch, first.seq)
        if self._drain_held(state):
            if state.digest_repair:  # a replay completed the dump taken for a disagreement
                state.digest_dumped, state.digest_repair = True, False
            if sync.state is not SyncState.SYNCED:
                sync.repairs += 1
            sync.state = SyncState.SYNCED
            state.why = ""
            state.overflow_logged = False
            self._unsynced.discard(worker)
            self._refresh_synced()

    def _covers_dropped(self, state: _Worker, shim_epoch: int, shim_seq: int) -> bool:
        """Whether a reply at the shim's (epoch, seq) holds the batches dropped past a bound since
        the request went out: those up to its seq are in it (the shim's state at that seq). Those
        after it are lost: a replay from its seq next, or a dump where another epoch's were dropped.
        Synced without them, the worker would be routed on that hole until its next batch showed a
        gap; dumped again for what the reply holds, it never synced under lasting pressure."""
        if state.dropped is None:
            return True
        epoch, seq = state.dropped
        if state.dropped_epochs or epoch != shim_epoch:
            state.want_dump = True
            state.why = "held KV batches of another epoch dropped past a bound while it repaired: a full dump is next"
            return False
        state.want_dump = False  # the drop's: the reply's seq says what is missing
        if seq > shim_seq:
            state.why = (
                f"held KV batches up to seq {seq} dropped past a bound while it repaired, its reply at seq "
                f"{shim_seq}: a replay is next"
            )
            return False
        return True

    def _drop_contradicted(self, state: _Worker, epoch: int, seq: int) -> None:
        """Held batches that arrived before the request and contradict the shim's answer."""
        kept: list[_Held] = []
        impossible: list[KvEventBatch] = []
        for held in state.held:
            arrival, batch, _ = held
            if arrival <= state.asked_at and (batch.epoch != epoch or batch.seq > seq):
                impossible.append(batch)
            else:
                kept.append(held)
        if not impossible:
            state.impossible_said = False  # the episode is over: a repair found none
            return
        self._set_held(state, kept)
        self.stats.dropped_impossible += len(impossible)
        if state.impossible_said:
            return  # one line an episode: a flood of forged batches was one a repair (audit of 2026-12-07)
        state.impossible_said = True
        shown = ", ".join(f"epoch {b.epoch:x} seq {b.seq}" for b in impossible[:3])
        self._impossible_lines.say(
            state.name,
            "worker %s: dropped %d KV batches its shim never sent (it is at epoch %x seq %d; dropped: %s): "
            "forged, or from a process that no longer holds this worker id (logged once until a repair of it "
            'drops none; kvswitch_router_kv_dropped_total{reason="impossible"} counts each)',
            state.name,
            len(impossible),
            epoch,
            seq,
            shown,
        )

    def _drain_held(self, state: _Worker) -> bool:
        """Apply held batches that follow last_seq. True when none is left waiting on a gap."""
        sync = state.sync
        held = state.held
        current = sorted((hb for hb in held if hb[1].epoch == sync.epoch), key=lambda hb: hb[1].seq)
        later = [hb for hb in held if hb[1].epoch != sync.epoch]  # arrived after the request: a newer epoch
        for i, (_, batch, skipped) in enumerate(current):
            if batch.seq <= sync.last_seq:
                self.stats.duplicates += 1
            elif batch.seq == sync.last_seq + 1:
                if not self._apply(batch, state, skipped):  # past its capacity: cleared, and a dump is next
                    self._set_held(state, current[i + 1 :] + later)
                    return False
            else:
                self._set_held(state, current[i:] + later)
                state.why = f"gap: seq {batch.seq} after {sync.last_seq}"
                return False
        self._set_held(state, later)
        if later:
            state.want_dump = True
            state.why = f"a batch of a newer epoch {later[-1][1].epoch:x}"
            return False
        return True


def _held_size(batch: KvEventBatch) -> int:
    """About what holding `batch` costs in memory."""
    size = _BATCH_BYTES + _EVENT_BYTES * len(batch.events)
    for event in batch.events:
        if isinstance(event, Stored | Removed):
            hashes = event.hashes
            size += len(hashes) if isinstance(hashes, bytes) else _LISTED_HASH_BYTES * len(hashes)
    return size


def _shim_time(ts: float) -> float:
    """A batch's shim timestamp, as `sent_ts`: one not finite, or further ahead of this router's
    clock than any honest shim's, is taken as now (a forged future one would switch the seq
    contradiction off until the shim's clock caught up)."""
    now = time.time()
    return ts if math.isfinite(ts) and ts <= now + CLOCK_ALLOWANCE_S else now
