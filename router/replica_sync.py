"""Router replicas share their bookings on {ns}.router.sync so they do not herd onto one worker.

Each replica books its own requests in its LoadView at once and queues the same facts (add,
prefill_done, free) for its peers; the queue goes out as one `RouterSync` message `flush_ms` after
its first entry. Entries from peers are booked under the peer's id; our own messages, which NATS
echoes back to us, are ignored.

Only registered routers' bookings count: with `discovery`, this watches /{ns}/routers/ and accepts
entries only from routers whose key is there (a forged or departed sender's are dropped and
counted, an unknown sender's first message logged); a peer's bookings go when its key disappears,
and a watch that crashes starts again.
Without discovery (tests) every sender counts and the owner calls `forget_router`.

Lost messages heal within `snapshot_s` (docs/router.md, "Lost releases"). NATS core is
at-most-once: a `free` published while NATS was down is flushed on reconnect, before peers have
subscribed again, and each of them held the booking for `peer_ttl_s`. So every `snapshot_s` a
replica that publishes at all ends a flush with a snapshot of its own live bookings
(`RouterSync.snapshot`, an addition to DESIGN.md's sync: docs/decisions.md), taken as the flush's
entries leave the view and split over parts of at most `_PART_BOOKINGS`, fewer where a part would be
over the NATS server's max_payload (entries are split so too; an entry or booking over it alone is
left out, said once per request, and the rest goes out); NATS keeps one connection's order,
so a peer reads it after every entry sent before it. The peer books what it names and is missing
(a lost add), corrects what it holds in another state (a lost prefill_done), and, once every part
of it came in order, drops that router's bookings held at its part 0 that it left out and no add
named since (a lost free); a part missing or out of order drops nothing (counted), and the next
snapshot heals. Until a snapshot of the peer's has been read here whole and in order, what its
snapshots add is what this router came too late to hear: not a heal. The rest are counted by kind
and said at WARNING once per peer a snapshot period (at most `_LOGGED_EXPIRED` peers named, the rest
in one line): each is a message lost. A booking on a worker with no report here is not added: it
left here first, or its first report is on its way; a later snapshot's add of it is no heal either
(until the review of 599ce22 it was, and a router restarted into a healthy fleet WARNed of it).
Snapshot bookings are checked as entries are (malformed ones counted, said once per peer, dropped).

As the last safety net (a peer older than 2026-12-07 sends no snapshot), a peer's bookings that
neither a release nor a snapshot touched for `peer_ttl_s` expire: a snapshot naming a booking
starts its age again. Each expiry pass says at WARNING, once per peer with its count (at most
`_LOGGED_EXPIRED` peers named a pass, the rest in one line), the expired bookings that still
counted in their worker's load (a decode booking with no prefill_done, or anything else
LoadView.load still added). Those no longer counted (their first token came and a report covers
them: a long request's usual case) are only counted in
kvswitch_router_sync_peer_bookings_expired_total.

A peer's booking no request could make (more tokens than MAX_BOOKING, more blocks than the
worker's KV capacity as its load reports say, or than MAX_BOOKING) is malformed: counted, logged
once per peer, dropped. Kept, it would shun the worker for `peer_ttl_s`. Until 2026-12-06 one line
per process said the first peer's, and a second peer gone wrong was only a count. A message that
does not decode is named by its `router` field when that decodes (until 2026-12-07 none was named,
a newer peer's neither); a sender with no key here shares one line with every other such sender
(a forger mints names), before the first snapshot too (until the review of e1d08bd any name sent
then took a slot for good: 64 forged ones left a registered peer's faults unsaid). A sender's
name is shown quoted and cut (runtime.clipped): a line break in it cannot forge a line. A message
of a newer schema has its own once-slot per peer, apart from garbage, so the line telling to
upgrade is never swallowed by an earlier one.

An entry of a kind this router does not know is a newer peer's (docs/decisions.md, "Kinds a newer
kvswitch adds"): skipped, counted by kind, said once per peer; the message's other entries are
applied. Until 2026-12-07 the whole message was malformed: its frees lost, the bookings they would
have released held for `peer_ttl_s`.

A record under /{ns}/routers/ that does not decode is refused as if its key were absent: counted
in `stats.records_refused`, logged once per key while its reason stands and at most once a window
while it keeps changing (discovery.refused_records), the keys capped for the fleet
(router.fleet_lines). A peer whose good record turns bad is forgotten; a key that never held one
is no peer to forget (until 2026-12-07 each bad put counted a peer forgotten, and was a WARNING in
every router, uncapped).

A router whose lease was lost registers anew under a new id (`rename`): peers dropped the old id's
bookings with its key, and count the new id's from its registration on.

A replica that has never sent anything publishes only while another router is registered, its
snapshots too: a lone replica then pays no encode, publish and echo per flush window. Once it has sent, it always
publishes: a peer whose key went (a lost lease) keeps running with our bookings, and without our
frees would hold them for `peer_ttl_s`; with two replicas, no other key is there for that window.

With `peers`, the same watch hands every peer's RouterInfo to router.peer_settings, which warns
when a peer routes with other settings or runs another version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from discovery import Deleted, Discovery, Put, Snapshot, WatchEvent
from discovery.refused_records import RefusedRecords
from discovery.watch import keep_following
from protocol import subjects
from protocol.errors import ProtocolError
from protocol.messages import (
    NEWER_SCHEMA,
    RouterInfo,
    RouterSync,
    SyncBooking,
    SyncEntry,
    SyncSnapshot,
    decode_extensible,
    encode_msg,
    named_sender,
)
from router.fleet_lines import FleetLines, FleetLog
from router.lifecycle import PartStatus
from router.load_view import LoadView
from router.newer_kinds import NewerKinds, shown
from router.peer_settings import PeerSettings
from runtime import StopSteps, TickErrors, background, cancel_and_wait, clipped, guarded
from runtime.turns import Turns

__all__ = ["HEALED", "SYNC_SNAPSHOT_S", "SYNC_SNAPSHOT_S_RANGE", "ReplicaSync", "SyncStats"]

log = logging.getLogger(__name__)

_MESSAGE_ENTRIES = 2000
"""Entries in one message at most (~100 KB of msgpack): fewer where that is over the NATS server's
max_payload."""
_PART_BOOKINGS = 500
"""Bookings in one snapshot part at most (~50 KB): fewer where that is over the NATS server's
max_payload. A peer reads a part in well under a millisecond and gives its loop a turn between
messages (runtime.turns), so a large snapshot never holds a peer's loop for long."""
_T = TypeVar("_T", SyncEntry, SyncBooking)
_DEPARTED_MEMORY = 1024
_FORMER_IDS = 16  # this router's ids before its last renames: their echoes come within moments
_LOGGED_SENDERS = 64  # unregistered senders named in the log; a forger minting ids gets no more lines
_LOGGED_MALFORMED = 64  # (peer, slot)s whose malformed messages are logged, at a time
_LOGGED_EXPIRED = 8  # peers named in one expiry or heal pass's WARNINGs; the rest share one line
HEALED = ("added", "dropped", "state")
"""What a peer's snapshot healed: a booking it names that was missing here (its add lost), one it
leaves out that was held here (its free lost), one held here in another state (its prefill_done
lost)."""
SYNC_SNAPSHOT_S = 30.0
"""How often a replica sends its peers a snapshot of its live bookings (--sync-snapshot-s)."""
SYNC_SNAPSHOT_S_RANGE = (1.0, 300.0)
"""--sync-snapshot-s's bounds. A snapshot holds every live booking (~100 bytes each: 5,000 in flight
are 508 KB, read by every peer), so not more often than a second; at most half of `peer_ttl_s`
(600 s), so a live booking is named again before it expires even when one snapshot is lost."""
_HEALED_WORDS = {
    "added": "booking(s) added (their add was lost)",
    "dropped": "booking(s) dropped (their free was lost)",
    "state": "booking(s) corrected (a prefill_done or a new booking of theirs was lost)",
}
MAX_BOOKING = 2**31
"""Tokens or blocks beyond any request's: no model's context, no engine's KV cache holds as many."""


@dataclass
class SyncStats:
    """Every count is on /metrics (router.metrics, kvswitch_router_sync_*)."""

    messages_sent: int = 0
    entries_sent: int = 0
    entries_received: int = 0
    send_failures: int = 0
    malformed: int = 0  # messages that did not decode, entries the view refused, bookings no request makes
    entries_unknown: dict[str, int] = field(default_factory=dict)  # entries of a newer kind skipped, by kind
    records_refused: int = 0  # records under /{ns}/routers/ that did not decode, each time one is read
    routers_forgotten: int = 0
    bookings_expired: int = 0
    unregistered: int = 0  # messages from routers with no key in etcd: dropped
    departed: int = 0  # messages from routers whose key went: dropped
    snapshots_sent: int = 0  # of this router's bookings, each in one or more messages
    snapshots_taken: int = 0  # peers' snapshots that came whole and in order: each swept
    snapshots_incomplete: int = 0  # peers' snapshots with a part missing or out of order: nothing dropped
    healed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HEALED, 0))  # bookings, by HEALED
    too_large: int = 0  # this router's requests whose booking or entry alone is over max_payload: never sent


@dataclass(slots=True)
class _Sweep:
    """A peer's snapshot being read: `unseen` holds (request_id, worker) of the peer's bookings
    held here when its part 0 came that neither a part nor an add has named since; None once a
    part is missing or out of order (nothing is dropped)."""

    seq: int
    parts: int
    unseen: set[tuple[str, str]] | None
    next: int = 0  # the part expected next
    skipped: set[tuple[str, str]] = field(default_factory=set)  # not added: no report of the worker here


class _TooLarge(Exception):
    """A message with no entry or booking in it is over the NATS server's max_payload."""


def _unsent(entries: int, taken: tuple[int, list[bytes]] | None, first: int) -> str:
    """What a flush whose publish failed left unsent: `entries` entries and the snapshot `taken`
    from its part `first` on (its parts counted from 1 here; all of it where `first` <= 0)."""
    said = [f"{entries} entr{'y' if entries == 1 else 'ies'}"] if entries else []
    if taken is not None:
        bookings, payloads = taken
        parts = len(payloads)
        if first <= 0:
            said.append(f"a snapshot of {bookings} bookings ({sum(map(len, payloads))} bytes in {parts} messages)")
        else:
            which = f"part {parts}" if first == parts - 1 else f"parts {first + 1}-{parts}"
            unsent = sum(map(len, payloads[first:]))
            said.append(f"{which} of {parts} of a snapshot of {bookings} bookings ({unsent} bytes)")
    return " and ".join(said)


class ReplicaSync:
    def __init__(
        self,
        nc: Client,
        ns: str,
        router_id: str,
        view: LoadView,
        *,
        flush_ms: float = 2.0,
        peer_ttl_s: float = 600.0,
        snapshot_s: float = 30.0,
        discovery: Discovery | None = None,
        peers: PeerSettings | None = None,
        fleet_log: FleetLog | None = None,
    ) -> None:
        self._nc = nc
        self._ns = subjects.validate_namespace(ns)
        self._turns = Turns()
        self._subject = subjects.sync(self._ns)
        self.router_id = router_id
        self.view = view
        self.stats = SyncStats()
        self.status = PartStatus.NEW
        self._flush_s = flush_ms / 1000.0
        self._peer_ttl_s = peer_ttl_s
        if not 0 < snapshot_s < math.inf:  # NaN fails too
            raise ValueError(f"snapshot_s must be a number of seconds > 0, not {snapshot_s}")
        self._snapshot_s = snapshot_s
        self._snapshot_due = False  # the next flush ends with a snapshot of our bookings
        self._snapshot_seq = 0
        # our requests whose booking or entry was too large for any message, said; those still held
        self._too_large: set[str] = set()
        self._sweeps: dict[str, _Sweep] = {}
        self._caught_up: set[str] = set()  # peers one of whose snapshots was read whole: a later one's add heals
        # per peer, what its snapshots named on a worker with no report here, since its last whole one began
        self._skipped: dict[str, set[tuple[str, str]]] = {}
        self._healed: dict[str, dict[str, int]] = {}  # per peer, since the last heal pass
        self._discovery = discovery
        self.peer_settings = peers
        self._pending: list[SyncEntry] = []
        self._wake = asyncio.Event()
        self._peers: set[str] = set()
        self._registered: set[str] | None = None  # None: not watching (no discovery), or no snapshot yet
        self._departed: deque[str] = deque(maxlen=_DEPARTED_MEMORY)
        self._former_ids: deque[str] = deque(maxlen=_FORMER_IDS)
        # (peer, slot) of the malformed messages logged, until the peer goes; peer None: no key here
        self._malformed_logged: set[tuple[str | None, str]] = set()
        self._newer_kinds = NewerKinds(self.stats.entries_unknown)
        self._record_lines = FleetLines(
            log,
            logging.WARNING,
            f"router records under {subjects.routers_prefix(self._ns)} ignored (one cause for many keys at once: "
            "routers of a build whose records this router cannot read, or a writer other than the routers; counted "
            "in kvswitch_router_router_records_refused_total)",
            fleet_log=fleet_log,
            noun="keys",
        )
        self._records = RefusedRecords(self._record_lines.say, "router record under key %r ignored: %s")
        self._sent = False  # a peer may hold our bookings: every free must go out (module docstring)
        self._logged_senders: set[str] = set()
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_errors = TickErrors(log, "router sync: a flush (its bookings unsent; peers drop them at their TTL)")
        self._expire_errors = TickErrors(log, "router sync: expiring peers' stale bookings")

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.status is not PartStatus.NEW:
            raise RuntimeError(f"ReplicaSync.start() called while {self.status.value}")
        self._sub = await self._nc.subscribe(self._subject, cb=guarded(self._on_msg, "the replica sync handler"))
        self._tasks.append(
            background(self._flusher(), "sync-flush", "peers get no booking of this replica's until it restarts")
        )
        self._tasks.append(
            background(
                self._snapshots(),
                "sync-snapshot",
                "peers get no snapshot of this replica's bookings (a lost message of its heals at peer_ttl_s) until it "
                "restarts",
            )
        )
        self._tasks.append(
            background(
                self._expirer(), "sync-expire", "peers' stale bookings are not dropped until the router restarts"
            )
        )
        if (discovery := self._discovery) is not None:
            self._tasks.append(
                background(
                    keep_following(lambda: self._watch_routers(discovery), "the router watch"),
                    "sync-routers",
                    "peers that leave keep their bookings until the router restarts",
                )
            )
        self.status = PartStatus.RUNNING

    async def stop(self) -> None:
        """Send what is queued, then stop listening. Idempotent."""
        if self.status is PartStatus.STOPPED:
            return
        was_running = self.status is PartStatus.RUNNING
        self.status = PartStatus.STOPPED
        steps = StopSteps()  # each step runs though a stop cut the one before (RouterService.stop's)
        with steps:
            await cancel_and_wait(*self._tasks)  # its watch's etcd calls can lose a cancellation
        if was_running and not self._nc.is_closed:
            with steps:
                await self._send()  # best effort: peers also forget us when our key goes
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            with steps, contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._records.flush()  # a change held for its window's end, which no timer will say now
        self._say_healed()
        steps.end()

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """Its loops, each meant to run until stop(): its owner's readiness names one that ended."""
        return list(self._tasks)

    def registered(self, router: str) -> bool | None:
        """Whether `router` has a key in etcd now; None before the first snapshot (or without
        discovery)."""
        return None if self._registered is None else router in self._registered

    def rename(self, router_id: str) -> None:
        """Our id changed (a new registration): later messages go out under it."""
        # NATS echoes what we published under the old id just before: ours, never a peer's (booked
        # twice) nor a forger's (a WARNING where the old key's delete came first). "": a router's
        # id before its first registration, under which nothing went out.
        if self.router_id:
            self._former_ids.append(self.router_id)
        self.router_id = router_id
        if self.peer_settings is not None:
            self.peer_settings.gone(router_id)  # its key may have been read before we knew it was ours

    # --- our bookings --------------------------------------------------------------------------

    def add(self, request_id: str, worker: str, tokens: int, blocks: int) -> None:
        """Book `tokens` of prefill and `blocks` of decode on `worker`, here and on every peer."""
        self.view.book(request_id, worker, tokens, blocks)
        self._queue(SyncEntry(request_id=request_id, worker=worker, kind="add", tokens=tokens, blocks=blocks))

    def prefill_done(self, request_id: str, worker: str | None = None) -> None:
        """The request's prefill is done on `worker`, or with None on every worker it is booked on
        (sent as worker "", which is how an older peer reads any prefill_done: it ignores the field)."""
        self.view.prefill_done(request_id, worker=worker)
        self._queue(SyncEntry(request_id=request_id, worker=worker or "", kind="prefill_done"))

    def free(self, request_id: str) -> None:
        self.view.free(request_id)
        self._queue(SyncEntry(request_id=request_id, worker="", kind="free"))

    def forget_router(self, router: str) -> None:
        """`router` is gone: drop its bookings and ignore anything it still sends."""
        if router == self.router_id:
            return
        if router not in self._departed:
            self._departed.append(router)
        self._peers.discard(router)
        self._malformed_logged = {said for said in self._malformed_logged if said[0] != router}
        self._sweeps.pop(router, None)
        self._caught_up.discard(router)
        self._skipped.pop(router, None)
        self._healed.pop(router, None)
        dropped = self.view.forget_router(router)
        self.stats.routers_forgotten += 1
        if dropped:
            log.info("peer router %s is gone: dropped its %d bookings", router, dropped)

    def _queue(self, entry: SyncEntry) -> None:
        if self.status is PartStatus.STOPPED:
            return
        self._pending.append(entry)
        self._wake.set()

    async def _flusher(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._flush_s)  # gather what else arrives within the window
            self._wake.clear()
            try:
                await self._send()
            except Exception as exc:  # one flush's entries (a bug, bad data) must not end the bookings sent
                self._flush_errors(exc)

    async def _send(self) -> None:
        entries, self._pending = self._pending, []
        snapshot, self._snapshot_due = self._snapshot_due, False
        if not self._sent and self._registered is not None and not self._registered - {self.router_id}:
            return  # no peer to tell: a router that registers later learns our bookings from our first snapshot
        step = _MESSAGE_ENTRIES
        chunks = [entries[i : i + step] for i in range(0, len(entries), step)]
        # an entry too large for any message is left out (said), not the flush's other entries
        messages = [(payload, sent) for payload, sent in self._fitted(chunks, self._entries) if sent]
        # taken now, with no await since the swap: as these entries leave the view
        taken = self._snapshot() if snapshot else None
        messages += [(payload, 0) for payload in taken[1]] if taken is not None else []
        first_part = len(messages) - (len(taken[1]) if taken is not None else 0)  # the snapshot's part 0
        for i, (payload, sent) in enumerate(messages):
            try:
                await self._nc.publish(self._subject, payload)
            except nats.errors.Error as exc:
                # Peers then miss these entries; our next snapshot heals them (their TTL, an older peer's).
                self.stats.send_failures += 1
                unsent = sum(n for _, n in messages[i:])
                log.warning("router sync: %s not sent (%s)", _unsent(unsent, taken, i - first_part), exc)
                return
            self._sent = True
            self.stats.messages_sent += 1
            self.stats.entries_sent += sent
        if snapshot:
            self.stats.snapshots_sent += 1

    def _entries(self, part: int, parts: int, entries: list[SyncEntry]) -> bytes:
        return encode_msg(RouterSync(router=self.router_id, entries=entries))

    def _snapshot(self) -> tuple[int, list[bytes]]:
        """Our live bookings, and the next snapshot's messages stating them (one at least: an empty
        snapshot drops every booking of ours a peer still holds)."""
        self._snapshot_seq += 1
        seq, held, step = self._snapshot_seq, self.view.held(), _PART_BOOKINGS

        def part(part: int, parts: int, bookings: list[SyncBooking]) -> bytes:
            snapshot = SyncSnapshot(seq=seq, part=part, parts=parts, bookings=bookings)
            return encode_msg(RouterSync(router=self.router_id, entries=[], snapshot=snapshot))

        if self._too_large:  # said again only if booked anew
            self._too_large &= {booking.request_id for booking in held}
        chunks = [held[i : i + step] for i in range(0, len(held), step)] or [[]]
        return len(held), [payload for payload, _ in self._fitted(chunks, part)]

    def _fitted(self, chunks: list[list[_T]], encode: Callable[[int, int, list[_T]], bytes]) -> list[tuple[bytes, int]]:
        """Each chunk as `encode(part, parts, chunk)` and its length, those over the NATS server's
        max_payload split in halves until each fits (as dispatch refuses a leg over it: nats-py
        would refuse the publish). An entry or booking over it alone is left out (its part goes
        empty) and said: it cannot be sent, and the rest can."""
        limit = self._nc.max_payload
        while True:
            payloads = [encode(part, len(chunks), chunk) for part, chunk in enumerate(chunks)]
            over = {part for part, payload in enumerate(payloads) if len(payload) > limit}
            if not over:
                return [(payload, len(chunk)) for payload, chunk in zip(payloads, chunks, strict=True)]
            fitted: list[list[_T]] = []
            for part, chunk in enumerate(chunks):
                if part not in over:
                    fitted.append(chunk)
                elif len(chunk) > 1:
                    fitted += [chunk[: len(chunk) // 2], chunk[len(chunk) // 2 :]]
                elif chunk:
                    self._left_out(chunk[0], len(payloads[part]), limit)
                    fitted.append([])
                else:
                    raise _TooLarge(
                        f"a message of no entry is {len(payloads[part])} bytes, over the NATS server's payload "
                        f"limit of {limit} bytes (its max_payload setting)"
                    )
            chunks = fitted

    def _left_out(self, item: SyncEntry | SyncBooking, size: int, limit: int) -> None:
        """An entry or booking of ours too large for any message: peers never hear of the request
        (its add could not go either), so they do not count it in its worker's load. Said and
        counted once per request while it is held; the rest of its flush and snapshot go out."""
        if item.request_id in self._too_large:
            return
        self._too_large.add(item.request_id)
        self.stats.too_large += 1
        log.warning(
            "router sync: the booking of request %r on worker %r makes a message of %d bytes alone, over the NATS "
            "server's payload limit of %d bytes (its max_payload setting): not sent to peer routers, nor in "
            "snapshots, so they do not count it in that worker's load (the rest is sent; said once per request)",
            clipped(item.request_id),
            clipped(item.worker),
            size,
            limit,
        )

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(self._snapshot_s)
            self._snapshot_due = True
            self._wake.set()
            self._say_healed()

    # --- peers' bookings -----------------------------------------------------------------------

    async def _on_msg(self, msg: Msg) -> None:
        await self._turns.take()  # nats-py hands a backlog over without yielding: a turn every slice
        self._on_payload(msg.data)

    def _on_payload(self, data: bytes) -> None:
        try:
            sync, unknown = decode_extensible(data, RouterSync)
        except ProtocolError as exc:
            self._undecodable(data, exc)
            return
        peer = sync.router
        if peer == self.router_id or peer in self._former_ids:
            return
        if peer in self._departed:
            self.stats.departed += 1
            return
        if not self._counts(peer):
            self.stats.unregistered += 1
            if self._registered is not None:  # before the first snapshot every peer is unknown
                self._log_unregistered(peer, len(sync.entries))
            return
        self._peers.add(peer)
        if unknown:
            self._newer(peer, unknown)
        view = self.view
        sweep = self._sweeps.get(peer)
        unseen = sweep.unseen if sweep is not None else None
        for e in sync.entries:
            self.stats.entries_received += 1
            if e.kind == "add":
                if unseen is not None:
                    unseen.discard((e.request_id, e.worker))  # booked since the snapshot began: not its to drop
                if (why := self._implausible(e.worker, e.tokens, e.blocks)) is not None:
                    self._malformed(peer, f"booked {why}")
                    continue
                try:
                    view.book(e.request_id, e.worker, e.tokens, e.blocks, router=peer)
                except ValueError as exc:
                    self._malformed(peer, exc)
            elif e.kind == "prefill_done":
                view.prefill_done(e.request_id, router=peer, worker=e.worker or None)
            else:
                view.free(e.request_id, router=peer)
        if sync.snapshot is not None:
            self._take_snapshot(peer, sync.snapshot)

    def _take_snapshot(self, peer: str, snapshot: SyncSnapshot) -> None:
        """Book what a part of `peer`'s snapshot names as it states it; once a whole snapshot came
        in order, drop the peer's bookings held at its part 0 that it left out."""
        if not 0 <= snapshot.part < snapshot.parts:
            self._malformed(peer, f"snapshot part {snapshot.part} of {snapshot.parts}")
            return
        sweep = self._sweep(peer, snapshot)
        if sweep.unseen is not None:
            sweep.unseen.difference_update([(b.request_id, b.worker) for b in snapshot.bookings])
        # An add missing since a whole snapshot of the peer's was read here was lost; before, or of a
        # booking a snapshot named while its worker had no report here, this router was too late for it.
        heard = peer in self._caught_up
        skipped = self._skipped.get(peer, set())
        view = self.view
        for b, held in view.confirm_all(peer, self._plausible(peer, snapshot.bookings)):
            if held is None:
                key = (b.request_id, b.worker)
                if view.liveness(b.worker) is None:
                    sweep.skipped.add(key)  # it left here first, or its first report is on its way
                    self._skipped.setdefault(peer, skipped).add(key)
                    continue
                what = "added" if heard and key not in skipped else ""
            elif (held.tokens, held.blocks) != (b.tokens, b.blocks) or held.prefill_done > b.prefill_done:
                what = "state"
            else:  # held as stated but for its prefill_done
                view.prefill_done(b.request_id, router=peer, worker=b.worker)
                self._heal(peer, "state")
                continue
            try:
                view.book(b.request_id, b.worker, b.tokens, b.blocks, router=peer)
            except ValueError as exc:
                self._malformed(peer, exc)
                continue
            if b.prefill_done:
                view.prefill_done(b.request_id, router=peer, worker=b.worker)
            if what:
                self._heal(peer, what)
        if snapshot.part < snapshot.parts - 1:
            return
        del self._sweeps[peer]
        if sweep.unseen is not None:
            self._caught_up.add(peer)
            if sweep.skipped:
                self._skipped[peer] = sweep.skipped
            else:
                self._skipped.pop(peer, None)
            self.stats.snapshots_taken += 1
            if dropped := sum(view.drop(request_id, worker, router=peer) for request_id, worker in sweep.unseen):
                self._heal(peer, "dropped", dropped)

    def _plausible(self, peer: str, bookings: list[SyncBooking]) -> list[SyncBooking]:
        """`bookings` but those no request makes (`_implausible`), each counted malformed."""
        most = {worker: self._most_blocks(worker) for worker in {b.worker for b in bookings}}
        if all(b.tokens <= MAX_BOOKING and b.blocks <= most[b.worker] for b in bookings):  # one lookup a worker
            return bookings
        kept = []
        for b in bookings:
            if (why := self._implausible(b.worker, b.tokens, b.blocks)) is not None:
                self._malformed(peer, f"snapshot booked {why}")
            else:
                kept.append(b)
        return kept

    def _sweep(self, peer: str, snapshot: SyncSnapshot) -> _Sweep:
        """The sweep a part of `peer`'s snapshot belongs to, opened at its part 0; one whose parts
        do not all come in order is counted incomplete once, and drops nothing."""
        sweep = self._sweeps.get(peer)
        if snapshot.part == 0 or sweep is None or sweep.seq != snapshot.seq:
            if sweep is not None and sweep.unseen is not None:
                self.stats.snapshots_incomplete += 1  # its last part never came
            whole = snapshot.part == 0
            if not whole:
                self.stats.snapshots_incomplete += 1  # its part 0 never came
            sweep = _Sweep(snapshot.seq, snapshot.parts, self.view.keys(peer) if whole else None)
            self._sweeps[peer] = sweep
        elif sweep.unseen is not None and (snapshot.parts, snapshot.part) != (sweep.parts, sweep.next):
            self.stats.snapshots_incomplete += 1
            sweep.unseen = None
        sweep.next = snapshot.part + 1
        return sweep

    def _heal(self, peer: str, what: str, n: int = 1) -> None:
        self.stats.healed[what] += n
        healed = self._healed.setdefault(peer, dict.fromkeys(HEALED, 0))
        healed[what] += n

    def _say_healed(self) -> None:
        """Say what peers' snapshots healed since the last pass: once per peer, at most
        `_LOGGED_EXPIRED` peers named, the rest in one line. Each heal is a message lost."""
        healed, self._healed = self._healed, {}
        ranked = sorted(healed.items(), key=lambda item: (-sum(item[1].values()), item[0]))
        for peer, counts in ranked[:_LOGGED_EXPIRED]:
            log.warning(
                "router sync: snapshots of peer router %s healed %s: messages of its did not reach this router (e.g. "
                "published while NATS was down)",
                peer,
                ", ".join(f"{counts[what]} {_HEALED_WORDS[what]}" for what in HEALED if counts[what]),
            )
        if rest := ranked[_LOGGED_EXPIRED:]:
            log.warning(
                "router sync: snapshots of %d more peer routers healed %d more booking(s) (the same cause)",
                len(rest),
                sum(sum(counts.values()) for _, counts in rest),
            )

    def _counts(self, peer: str) -> bool:
        """Whether `peer`'s messages count: it has a key here (any sender, without discovery)."""
        return self._discovery is None or self.registered(peer) is True

    def _log_unregistered(self, peer: str, entries: int) -> None:
        if peer in self._logged_senders or len(self._logged_senders) >= _LOGGED_SENDERS:
            return
        self._logged_senders.add(peer)
        last = len(self._logged_senders) == _LOGGED_SENDERS
        log.warning(
            "dropping router sync from %s (%d entries): no key of its under %s in etcd (a forged "
            "sender, a router on this NATS registered in another etcd, or one registering this instant); logged "
            "once per sender%s, all counted in kvswitch_router_sync_unregistered_total",
            clipped(repr(peer)),  # any publisher's word: a 200 KB name or one holding a line break
            entries,
            subjects.routers_prefix(self._ns),
            ", and no further sender is named" if last else "",
        )

    def _most_blocks(self, worker: str) -> int:
        """The most blocks a booking on `worker` can hold: its KV capacity as its reports say."""
        return min(self.view.capacity(worker) or MAX_BOOKING, MAX_BOOKING)

    def _implausible(self, worker: str, tokens: int, blocks: int) -> str | None:
        most = self._most_blocks(worker)
        if tokens > MAX_BOOKING or blocks > most:
            return f"{tokens} tokens and {blocks} blocks on {worker} (at most {MAX_BOOKING} and {most})"
        return None

    def _undecodable(self, data: bytes, exc: ProtocolError) -> None:
        """A message that did not decode: named by its `router` field where that decodes, logged in
        the slot of its peer where it has a key here, else in the one of every other sender (before
        the first snapshot too: a forger's names must take no slot for good)."""
        named = named_sender(data, "router")
        peer = named if named is not None and self._counts(named) else None
        if named is None:
            sender = "a sender it does not name (its router field did not decode either)"
        elif peer is None:
            prefix = subjects.routers_prefix(self._ns)
            known = (
                f"which has no key under {prefix} here"
                if self._registered is not None
                else f"not yet read under {prefix}"
            )
            sender = f"router {clipped(repr(named))}, {known}"
        else:
            sender = f"router {named}"
        self._malformed(peer, exc, sender, newer=exc.kind == NEWER_SCHEMA)

    def _newer(self, peer: str, unknown: dict[str, int]) -> None:
        """Entries of kinds this router does not know, skipped from a message of registered `peer`."""
        self._newer_kinds.add(unknown)
        if (peer, "newer kind") in self._malformed_logged or len(self._malformed_logged) >= _LOGGED_MALFORMED:
            return
        self._malformed_logged.add((peer, "newer kind"))
        log.warning(
            "router sync from router %s holds entries of kind %s, which this router does not know: that router "
            "runs a newer kvswitch than this one. They are skipped and the message's other entries applied; "
            'upgrade this router (docs/deployment.md, "Upgrades"). Logged once per peer, counted in '
            "kvswitch_router_sync_entries_unknown_total",
            peer,
            shown(unknown),
        )

    def _malformed(self, peer: str | None, why: object, sender: str | None = None, *, newer: bool = False) -> None:
        """`peer`: the router that sent it, None for every sender with no key here (no name to
        trust); `sender` names it in the line (`peer` by default); `newer`: a newer schema, said in
        a slot of its own."""
        self.stats.malformed += 1
        logged, slot = self._malformed_logged, "newer schema" if newer else "malformed"
        if (peer, slot) in logged or len(logged) >= _LOGGED_MALFORMED:
            return
        logged.add((peer, slot))
        last = ", and no further peer is named until one goes" if len(logged) == _LOGGED_MALFORMED else ""
        log.warning(
            "dropping malformed router sync from %s (logged once per peer%s, all counted in "
            "kvswitch_router_sync_malformed_total): %s",
            sender or f"router {peer}",
            last,
            why,
        )

    async def _expirer(self) -> None:
        period = max(self._peer_ttl_s / 10.0, 0.05)
        while True:
            await asyncio.sleep(period)
            try:
                self._expire()
            except Exception as exc:  # a booking that breaks expire() must not keep every stale one
                self._expire_errors(exc)

    def _expire(self) -> None:
        """Drop peers' bookings older than `peer_ttl_s`; say, once per peer a pass, those that still
        counted on their worker (the rest misled no routing: a count is enough)."""
        expired = self.view.expire(self._peer_ttl_s)
        self.stats.bookings_expired += sum(e.bookings for e in expired.values())
        counted = sorted(
            ((peer, e.counted) for peer, e in expired.items() if e.counted), key=lambda item: (-item[1], str(item[0]))
        )
        for peer, count in counted[:_LOGGED_EXPIRED]:
            log.warning(
                "router sync: %d booking(s) of peer router %s got no release within %g s, and no snapshot of that "
                "router named them: it sends none (a kvswitch before 2026-12-07), and its free was lost (e.g. "
                "published while NATS was down) or its request ran longer than that (--request-timeout above %g s); "
                "or its snapshots stopped reaching this router. Until now they counted in their worker's load",
                count,
                peer,
                self._peer_ttl_s,
                self._peer_ttl_s,
            )
        if rest := counted[_LOGGED_EXPIRED:]:
            log.warning(
                "router sync: %d more booking(s) of %d more peer routers got no release within %g s (the same causes)",
                sum(count for _, count in rest),
                len(rest),
                self._peer_ttl_s,
            )

    def _refused(self, name: str, why: str) -> None:
        self.stats.records_refused += 1
        self._records.refused(name, why)

    async def _watch_routers(self, discovery: Discovery) -> None:
        async for event in discovery.watch_routers():
            self.on_routers_event(event)

    def on_routers_event(self, event: WatchEvent[RouterInfo]) -> None:
        """A change under the routers prefix: who may send bookings, and the peers' settings."""
        settings = self.peer_settings
        match event:
            case Snapshot(items=items, skipped=skipped):
                for name in self._records.names() - skipped.keys():
                    self._records.accepted(name)
                for name, why in skipped.items():
                    self._refused(name, why)
                self._registered = set(items)
                # A key put back after a delete may reach this watch only in a fresh Snapshot.
                for name in items.keys() & set(self._departed):
                    self._departed.remove(name)
                for peer in self._peers - items.keys():
                    self.forget_router(peer)
                if settings is not None:
                    settings.replace({name: info for name, info in items.items() if name != self.router_id})
            case Put(name=name, value=info):
                self._records.accepted(name)
                if self._registered is not None:
                    self._registered.add(name)
                with contextlib.suppress(ValueError):
                    self._departed.remove(name)
                if settings is not None and name != self.router_id:
                    settings.seen(name, info)
            case Deleted(name=name, why=why):
                if why:
                    self._refused(name, why)
                else:
                    self._records.accepted(name)
                if self._registered is not None:
                    if name not in self._registered and name not in self._peers:
                        return  # no record of it was ever taken: no peer to forget
                    self._registered.discard(name)
                self.forget_router(name)
                if settings is not None:
                    settings.gone(name)
