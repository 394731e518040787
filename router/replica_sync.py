"""Router replicas share their bookings on {ns}.router.sync so they do not herd onto one worker.

Each replica books its own requests in its LoadView at once and queues the same facts (add,
prefill_done, free) for its peers; the queue goes out as one `RouterSync` message `flush_ms` after
its first entry. Entries from peers are booked under the peer's id; our own messages, which NATS
echoes back to us, are ignored.

Only registered routers' bookings count: with `discovery`, this watches /{ns}/routers/ and accepts
entries only from routers whose key is there (a forged or departed sender's are dropped and
counted, an unknown sender's first message logged); a peer's bookings go when its key disappears,
and a watch that crashes starts again.
Without discovery (tests, the virtual clock) every sender counts and the owner calls
`forget_router`. As a safety net against a lost `free` (NATS core is at-most-once), a peer's
bookings older than `peer_ttl_s` expire. Each expiry pass says at WARNING, once per peer with its
count (at most `_LOGGED_EXPIRED` peers named a pass, the rest in one line), the expired bookings
that still counted in their worker's load (a decode booking with no prefill_done, or anything else
LoadView.load still added): their free was lost, or their request ran longer than `peer_ttl_s`
(its --request-timeout above that). Those no longer counted (their first token came and a report
covers them: a long request's usual case) are only counted in
kvswitch_router_sync_peer_bookings_expired_total.

A lost release is not reconciled sooner: the sync carries only add, prefill_done and free, with
no snapshot or digest of a router's live bookings to compare on reconnect (DESIGN.md's
{ns}.router.sync), so a stale booking counts until it expires (docs/router.md, "Lost releases");
that needs a contract change.

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

A replica that has never sent anything publishes only while another router is registered: a lone
replica then pays no encode, publish and echo per flush window. Once it has sent, it always
publishes: a peer whose key went (a lost lease) keeps running with our bookings, and without our
frees would hold them for `peer_ttl_s`; with two replicas, no other key is there for that window.

With `peers`, the same watch hands every peer's RouterInfo to router.peer_settings, which warns
when a peer routes with other settings or runs another version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

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
    SyncEntry,
    decode_extensible,
    encode_msg,
    named_sender,
)
from router.fleet_lines import FleetLines, FleetLog
from router.lifecycle import PartStatus
from router.load_view import LoadView
from router.newer_kinds import NewerKinds, shown
from router.peer_settings import PeerSettings
from runtime import TickErrors, background, clipped, guarded
from runtime.turns import Turns

__all__ = ["ReplicaSync", "SyncStats"]

log = logging.getLogger(__name__)

_MAX_ENTRIES_PER_MESSAGE = 2000  # ~100 KB of msgpack, well under NATS's 1 MB default payload limit
_DEPARTED_MEMORY = 1024
_LOGGED_SENDERS = 64  # unregistered senders named in the log; a forger minting ids gets no more lines
_LOGGED_MALFORMED = 64  # (peer, slot)s whose malformed messages are logged, at a time
_LOGGED_EXPIRED = 8  # peers named in one expiry pass's WARNINGs; the rest share one line
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
        self._discovery = discovery
        self.peer_settings = peers
        self._pending: list[SyncEntry] = []
        self._wake = asyncio.Event()
        self._peers: set[str] = set()
        self._registered: set[str] | None = None  # None: not watching (no discovery), or no snapshot yet
        self._departed: deque[str] = deque(maxlen=_DEPARTED_MEMORY)
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
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if was_running and not self._nc.is_closed:
            await self._send()  # best effort: peers also forget us when our key goes
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._records.flush()  # a change held for its window's end, which no timer will say now

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
        if not self._sent and self._registered is not None and not self._registered - {self.router_id}:
            return  # no peer to tell: a router that registers later learns from its own requests on
        for i in range(0, len(entries), _MAX_ENTRIES_PER_MESSAGE):
            part = entries[i : i + _MAX_ENTRIES_PER_MESSAGE]
            try:
                await self._nc.publish(self._subject, encode_msg(RouterSync(router=self.router_id, entries=part)))
            except nats.errors.Error as exc:
                # Peers then miss these entries; their TTL and our key's lease bound the damage.
                self.stats.send_failures += 1
                log.warning("router sync: %d entries not sent (%s)", len(entries) - i, exc)
                return
            self._sent = True
            self.stats.messages_sent += 1
            self.stats.entries_sent += len(part)

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
        if peer == self.router_id:
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
        for e in sync.entries:
            self.stats.entries_received += 1
            if e.kind == "add":
                if (why := self._implausible(e)) is not None:
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

    def _implausible(self, e: SyncEntry) -> str | None:
        blocks = min(self.view.capacity(e.worker) or MAX_BOOKING, MAX_BOOKING)
        if e.tokens > MAX_BOOKING or e.blocks > blocks:
            return f"{e.tokens} tokens and {e.blocks} blocks on {e.worker} (at most {MAX_BOOKING} and {blocks})"
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
                "router sync: %d booking(s) of peer router %s got no release within %g s: its free was lost (e.g. "
                "published while NATS was down), or its request ran longer than that (--request-timeout above %g s); "
                "until now they counted in their worker's load",
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
