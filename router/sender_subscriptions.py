"""The subscriptions a kind of per-worker message comes on (load reports, KV event batches), and
the quarantine of a sender past its budget.

A budget (router.sender_budget) drops a flooding sender's excess for a dict lookup each, but every
message still crosses the socket and is parsed by nats-py, about 10 µs each: a Python publisher
sends faster than a router reads (isolation audit of 2026-12-06: 80,000 load reports a second
against some 75,000; of 2026-12-07: 100 MB/s of KV batches), so the other workers' messages queued
behind the flood in the socket and were read seconds late. Only nats-server can stop sending them:
a sender past its budget is quarantined for `quarantine_s`, while which the router hears one
subscription per registered worker (`one(worker)`), the quarantined ones left out, instead of the
wildcard (`all_subject`). Once no sender is quarantined, the wildcard again. A sender that floods
on lets through one budget's burst at each lapse, and each switch stalls a replica (~1.3 s of
probes at each lapse, review of 2026-12-07): one quarantined again within as long as its last
quarantine after it lapsed is quarantined twice as long, up to `quarantine_max_s` (8 times
`quarantine_s`: a lapse every 2 minutes, not every 15 s), a WARNING saying each doubling once; one
quiet that long starts again from `quarantine_s`. Messages of senders with no record are not
heard meanwhile, nor a worker's in the moment between its registration and its subscription: a
load report is superseded by the next one; a KV batch missed so shows as a gap at the next one, or
to the digest check of its load reports, and is repaired (router.kv_ingest), as one lost on the
way is.

One task makes every change, in order: each change subscribes before it unsubscribes, unsubscribes
`SWITCH_OVERLAP_S` after the new subscriptions are written to the socket, and without loss
(runtime.nats_unsubscribe: every message the server sent the old subscription before its UNSUB goes
through the handler), so no message of a worker heard before and after is missed (those of the
overlap come twice: a load report again changes nothing, a KV batch again is a duplicate). nats-py's
own `unsubscribe()` dropped the messages queued or in flight for the subscription it removed: 0 to 3
of an honest worker's at each switch (review of 2026-12-07). With the UNSUB sent right behind the
SUB, nats-server itself lost one now and then: it matches a message against the subscriptions, then
delivers it to each one not closed meanwhile, so a message matched before the SUB and delivered
after the UNSUB went to neither (a burst on 8 connections at each of 10 switches: some lost in 5
of 12 runs). No PONG is awaited before the UNSUB: the server's PONG comes behind everything it
sends the connection first, so under a flood the quarantine took hold only once the router had read
the backlog (0.2-0.7 s and 144k-264k flood messages after `quarantine()`, review of 2026-12-07).
None is made while the connection is down: nats-py queues a SUB made then and sends it on
reconnect, while an unsubscribe then only forgets it here, so a subscription made and dropped
within an outage stayed at nats-server, unseen (review of 2026-12-06: a worker that left during
the outage was heard again, and the wildcard beside the per-worker ones, the quarantine undone).
The changes wait for `reconnected()`.

`caught_up()` is a barrier on what comes: it returns once every message nats-server sent these
subscriptions before the call went through the handler (a PING's PONG, then the messages queued
ahead of it handled). A worker's KV batches and its load reports come on separate connections, and a
report naming a batch the router has not applied proves the batch lost only past it: a flood on the
KV connection (isolation audit of 2026-12-07) held an honest worker's batches 2 s behind its reports
on a loaded machine, and they were judged lost and the worker taken out of routing to repair them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import FlushTimeoutError

from discovery.watch import keep_following
from runtime import StopSteps, background, cancel_and_wait
from runtime.nats_flush import flush, write_queued
from runtime.nats_unsubscribe import unsubscribe

__all__ = ["QUARANTINE_MAX_FACTOR", "QUARANTINE_S", "SenderSubscriptions"]

log = logging.getLogger(__name__)

QUARANTINE_S = 15.0
QUARANTINE_MAX_FACTOR = 8
SWITCH_OVERLAP_S = 0.1  # both heard at a switch, from the new subscriptions written to the socket


@dataclass(slots=True)
class _Counted:
    """A subscription held, and its messages handed to the handler and through it (caught_up)."""

    sub: Subscription
    begun: int = 0
    done: int = 0


class SenderSubscriptions:
    def __init__(
        self,
        nc: Client,
        all_subject: str,
        one: Callable[[str], str],
        handler: Callable[[Msg], Awaitable[None]],
        workers: Callable[[], Iterable[str]],
        *,
        what: str,
        quarantine_s: float = QUARANTINE_S,
        clock: Callable[[], float] = time.monotonic,
        on_switched: Callable[[], None] = lambda: None,
    ) -> None:
        """`all_subject`: the wildcard every worker's subject `one(worker)` matches; `workers`: the
        registered workers' ids, whose subjects are heard while a sender is quarantined; `what`: the
        messages, as its task's failures name them; `on_switched`: called as each change ends (see
        `switching`)."""
        self._nc = nc
        self._all_subject = all_subject
        self._one = one
        self._what = what
        self._handler = handler
        self._workers = workers
        self.quarantine_s = quarantine_s
        self.quarantine_max_s = QUARANTINE_MAX_FACTOR * quarantine_s
        self._clock = clock
        self._on_switched = on_switched
        self._switching = False
        self._all: Subscription | None = None  # all_subject, while no sender is quarantined
        self._each: dict[str, Subscription] = {}  # by worker, while one is
        self._until: dict[str, float] = {}  # quarantined senders: until when
        # each sender's last quarantine, (its length, until when), kept until as long after it lapsed
        self._last: dict[str, tuple[float, float]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.quarantines = 0  # senders quarantined, each time
        self._counted: dict[int, _Counted] = {}  # by subscription id, until it is dropped (caught_up)
        self._progress = asyncio.Event()  # set as the handler is through with a message

    async def start(self) -> None:
        self._all = await self._subscribe(self._all_subject)
        self._task = background(  # a change that raises (NATS away) is an ERROR, and tried again
            keep_following(self._follow, f"the {self._what} subscriptions (router.sender_subscriptions)"),
            f"router-{self._what.replace(' ', '-')}-subscriptions",
            "senders past their budget are no longer quarantined, nor heard again, until the router restarts",
        )

    @property
    def task(self) -> asyncio.Task[None] | None:
        """Its loop, while started: its owner's readiness names it should it end (runtime.ended)."""
        return self._task

    def quarantine(self, sender: str) -> bool:
        """Leave `sender`'s subject unheard for `quarantine_s` from now, or twice its last quarantine
        when that lapsed no longer ago than it lasted (once: a message of it still queued changes
        nothing). Whether it was heard until now."""
        now = self._clock()
        until = self._until.get(sender)
        if until is not None and until > now:
            return False
        length = self.quarantine_s
        if (last := self._last.get(sender)) is not None and now - last[1] <= last[0]:
            length = min(2 * last[0], self.quarantine_max_s)
            if length > last[0]:
                log.warning(
                    "%s sender %s floods again %.0f s after its quarantine of %g s lapsed: unheard for %g s now "
                    "(doubling while it goes on, up to %g s; said once a doubling)",
                    self._what,
                    sender,
                    now - last[1],
                    last[0],
                    length,
                    self.quarantine_max_s,
                )
        # Anyone may publish on any name: only the floods of the last few minutes are remembered.
        self._last = {s: last for s, last in self._last.items() if now - last[1] <= last[0]}
        self._last[sender] = (length, now + length)
        self._until[sender] = now + length
        self.quarantines += 1
        self._changed.set()
        return True

    @property
    def switching(self) -> bool:
        """Whether a change is under way. Meanwhile a worker's messages may come out of order: the
        old subscription and the new one each have their own queue and task in nats-py, and the old
        one's may hold an earlier message (behind a flood) as the new one hands over later ones.
        Once the change ends, every message of the subscriptions it dropped went through the
        handler, and `on_switched` is called."""
        return self._switching

    def quarantined_for(self, sender: str) -> float | None:
        """The seconds `sender` is unheard for yet; None when it is heard."""
        until, now = self._until.get(sender), self._clock()
        return until - now if until is not None and until > now else None

    def quarantined(self) -> dict[str, float]:
        """The senders unheard now, with the seconds left."""
        now = self._clock()
        return {s: until - now for s, until in self._until.items() if until > now}

    def reconnected(self) -> None:
        """The connection is back (its reconnected callback): make the changes held meanwhile."""
        self._changed.set()

    def workers_changed(self) -> None:
        """A worker registered or left: while some sender is quarantined, its subject is heard or no longer."""
        if self._until:
            self._changed.set()

    async def stop(self) -> None:
        # Each step though the one before was cut: a stop cancelled again while it waits on the task
        # (RouterService.stop, in a cancelled start's cleanup) left every subscription held.
        steps = StopSteps()
        if self._task is not None:
            with steps:
                await cancel_and_wait(self._task)
        for sub in [*self._each.values(), *([self._all] if self._all is not None else [])]:
            with steps, contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._all, self._each = None, {}
        self._counted = {}
        self._progress.set()
        steps.end()

    async def caught_up(self, timeout: float, on_late: Callable[[], None] | None = None) -> bool:
        """Whether every message nats-server sent these subscriptions before this call has gone
        through the handler within about `timeout` s (twice at worst). Without `on_late` the wait
        gives up then (False); with it, `on_late` is called once then and the wait goes on to the
        end, however long a steady backlog makes it (False too). A connection down, or dropping
        meanwhile, has its queued messages handled and no more waited for: what the server had not
        delivered then never comes."""
        loop = asyncio.get_running_loop()
        in_time = True

        def said_late() -> None:
            nonlocal in_time
            in_time = False
            if on_late is not None:
                on_late()

        late = loop.call_later(timeout, said_late) if on_late is not None else None
        try:
            while self._nc.is_connected:
                try:
                    await flush(self._nc, math.ceil(timeout))  # the server wrote all it sent before to the socket
                    break
                except FlushTimeoutError:
                    if late is None and self._nc.is_connected:
                        return False
                    await asyncio.sleep(min(1.0, timeout))  # no hot loop should a flush fail at once
                except NatsError:
                    break  # closed or dropped meanwhile
            # The PONG was read after those messages: each is in its subscription's queue, or handled.
            # A subscription dropped meanwhile had its queue handled first (runtime.nats_unsubscribe).
            due = {sid: c.begun + c.sub.pending_msgs for sid, c in self._counted.items()}
            try:
                async with asyncio.timeout(timeout if late is None else None):
                    while due := {sid: n for sid, n in due.items() if (c := self._counted.get(sid)) and c.done < n}:
                        self._progress.clear()
                        await self._progress.wait()
            except TimeoutError:
                return False
            return in_time
        finally:
            if late is not None:
                late.cancel()

    async def _subscribe(self, subject: str) -> Subscription:
        sub = await self._nc.subscribe(subject, cb=self._handle)
        self._counted[sub._id] = _Counted(sub)  # private: the id its messages carry
        return sub

    async def _unsubscribe(self, subs: list[Subscription]) -> None:
        try:
            await unsubscribe(subs)  # forgotten at the end whatever comes: none is waited for any more
        finally:
            for sub in subs:
                self._counted.pop(sub._id, None)
            self._progress.set()

    async def _handle(self, msg: Msg) -> None:
        counted = self._counted.get(msg.sid)
        if counted is not None:
            counted.begun += 1
        try:
            await self._handler(msg)
        finally:
            if counted is not None:
                counted.done += 1
            self._progress.set()

    async def _follow(self) -> None:
        while True:
            self._changed.clear()
            wait: float | None = None  # while the connection is down: until reconnected()
            if self._nc.is_connected:
                self._switching = True
                try:
                    await self._settle()
                finally:  # one that raised too: a gap held for it is judged now, not held on
                    self._switching = False
                    self._on_switched()
                wait = max(0.0, min(self._until.values(), default=self._clock() + 3600.0) - self._clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._changed.wait()

    async def _settle(self) -> None:
        now = self._clock()
        for sender in [s for s, until in self._until.items() if until <= now]:
            del self._until[sender]
        added = False
        if not self._until:
            if self._all is None:
                self._all = await self._subscribe(self._all_subject)
                added = True
            heard: set[str] = set()
        else:
            heard = set(self._workers()) - self._until.keys()
        for worker in heard - self._each.keys():
            self._each[worker] = await self._subscribe(self._one(worker))
            added = True
        left = self._each.keys() - heard
        wildcard = self._all if self._until else None  # unheard while a sender is quarantined
        if not left and wildcard is None:
            return
        if added:
            # nats-server matches a message, then delivers it, skipping a subscription closed in
            # between: a message matched before the new SUB and delivered after the old UNSUB right
            # behind it was lost. The UNSUB goes SWITCH_OVERLAP_S after the SUBs are on the socket;
            # the server reads a connection's commands in order. No PONG is awaited: under a flood
            # it comes behind the whole backlog (0.2-0.7 s, the flood heard meanwhile).
            try:
                await write_queued(self._nc)
            except NatsError as exc:  # down or frozen: unsubscribed all the same; a gap is repaired
                log.debug(
                    "%s subscriptions' switch: the SUBs not written (%r): the overlap is not assured", self._what, exc
                )
            await asyncio.sleep(SWITCH_OVERLAP_S)
        gone = [self._each.pop(worker) for worker in left]
        if wildcard is not None:
            gone.append(wildcard)
            self._all = None
        await self._unsubscribe(gone)
