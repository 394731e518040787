"""The router's client connections: counted, and capped below the open-file limit.

Each client connection holds a file descriptor. Past the process's open-file limit the accept of
the next one fails (EMFILE), and under uvloop libuv then accepts and closes every new connection at
once, with no callback and no log line: every client was reset, `/health` included, for as long
as ~1,000 idle keep-alive connections (1024 is systemd's default soft limit) or one slowloris
client held them (audit of 2026-12-07). The limit is raised to the hard one at start
(runtime.fd_limit); this module keeps the connections under it.

The cap: the limit less a quarter of it (at least FD_RESERVE), which is left for NATS, etcd, the
tokenizer's files and accept bursts. The check runs in the server's `connection_made`, the first
code an accepted connection reaches; uvloop calls it on the loop iteration after libuv accepted,
and libuv accepts all the listen backlog holds before it returns, so the listen backlog is at most
half the reserve (`backlog`), and at most `backlog` refused connections are held beside the cap:
the descriptors never reach the limit.

Each connection is idle (no request in flight: waiting for its first or next request head) or
busy, kept apart in the order they became so. At the cap a new connection closes the connection
idle longest, as nginx reuses its idle keep-alive connections when out of worker_connections: a
flood of idle connections cannot keep a health probe or a client out. Idle means aiohttp's own
test, the one its keep-alive timeout closes by (waiting on its next request head): a candidate
not waiting after all (its request read this very loop turn, its answer still going out, not yet
started) goes to the back, and at most SHED_LOOK are looked at, so a new connection costs O(1).

With none idle (every connection has a request in flight) the new one is refused: its routed
requests are answered 503 (OpenAI JSON, `Connection: close`, `Retry-After`), while `router.routes.PROBES` are
answered as always and then closed, so a liveness probe or a scrape still gets through
(docs/router.md: `/health` answers 200 whenever the process does). A refused connection closes
after its answer; one that has sent no whole request head in REFUSED_HEAD_S is closed (`silent`),
and past `backlog` of them a new connection closes the refused one waiting longest for its head
once that has waited REFUSED_GRACE_S (`silent` too), or else is closed at once (`dropped`). One
that has sent its head is never shed for another. Until the review of 2026-12-07 a refused
connection that sent nothing was held to the idle timeout (75 s): 128 of them beside a cap of
connections with slow bodies had every new connection dropped, `/health` failing 15 probes of 15
in 75 s. Each is counted (`kvswitch_router_client_connections_shed_total{how}`, `refused` when the
503 is sent); an episode at the cap is logged once at WARNING when it starts, and at INFO when the
connections fall back to three quarters of the cap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from router.api_errors import ApiError
from router.metrics import CLIENT_SHED_HOW, RouterMetrics
from router.routes import PROBES, PROBES_NAMED
from runtime import LISTEN_BACKLOG

__all__ = ["FD_RESERVE", "REFUSED_GRACE_S", "REFUSED_HEAD_S", "SHED_LOOK", "ClientConnections"]

log = logging.getLogger(__name__)

FD_RESERVE = 256  # the least left beside the cap
MIN_CAP = 64  # below it the limit is too low to serve: a WARNING says so
SHED_LOOK = 4  # the most idle candidates one new connection looks at
# A refused connection's wait for its first request head: a client refused in a burst sends its request
# at once (a round trip); one that sends nothing would hold one of `backlog` places to the idle timeout.
REFUSED_HEAD_S = 2.0
# Past `backlog` refused ones, the one waiting longest for its head is closed for a new connection once
# it has waited this long: a burst's own connections, refused as they connect, get their round trip.
REFUSED_GRACE_S = 1.0


def _waiting(handler: RequestHandler) -> bool:
    """Waiting for a request head, its first or its next: aiohttp's own idle test
    (RequestHandler._process_keepalive, which closes such a connection at its keep-alive timeout)."""
    # aiohttp's private state (RequestHandler has no public one), pinned by pyproject's aiohttp range.
    # Not `_request_in_progress or _messages`: start() takes a request off `_messages` and creates its
    # task, which before Python 3.12 starts a loop turn later: both were false for a request read.
    waiter = handler._waiter
    return waiter is not None and not waiter.done() and not (handler._force_close or handler._close)


class ClientConnections:
    """The front door's connections: `made` at accept, `on_request` as each request starts,
    `on_response` as its handler returns, `lost` at close. `cap` None: no limit on descriptors,
    no cap. Admitted connections are idle (oldest first: the next to shed) or busy; refused ones
    are kept apart, those with no request head yet (`_unheard`, oldest first) on a timer."""

    def __init__(self, limit: int | None, metrics: RouterMetrics) -> None:
        self.limit = limit
        reserve = FD_RESERVE if limit is None else max(FD_RESERVE, limit // 4)
        self.cap = None if limit is None else limit - reserve
        # A burst accepted before the first connection_made, and the refused ones, each fit in half the
        # reserve, beside NATS and etcd.
        self.backlog = min(LISTEN_BACKLOG, reserve // 2)
        self._idle: OrderedDict[RequestHandler, None] = OrderedDict()  # idle longest first: O(1) at the front
        self._busy: dict[RequestHandler, None] = {}
        self._refused: set[RequestHandler] = set()
        # Refused, no request head yet: since when, and the timer that closes it (waited longest first).
        self._unheard: OrderedDict[RequestHandler, tuple[float, asyncio.TimerHandle]] = OrderedDict()
        self._shed = {how: metrics.client_connections_shed.labels(how) for how in CLIENT_SHED_HOW}
        self._episode: tuple[float, int] | None = None  # shedding since, and the count then
        self._shed_count = 0
        metrics.client_connections.set_function(self.__len__)
        metrics.client_connections_cap.set(float("inf") if self.cap is None else self.cap)
        if self.cap is not None and self.cap < MIN_CAP:
            log.warning(
                "the open-file limit (%d) leaves room for %d client connections: raise it (ulimit -n, "
                "systemd's LimitNOFILE, docker's --ulimit nofile)",
                limit,
                self.cap,
            )
            self.cap = max(self.cap, 1)

    def __len__(self) -> int:
        return len(self._idle) + len(self._busy) + len(self._refused)

    def made(self, handler: RequestHandler) -> None:
        if self.cap is None or len(self._idle) + len(self._busy) < self.cap:
            self._idle[handler] = None
            return
        self._at_cap()
        if self._shed_idle():
            self._idle[handler] = None
        elif len(self._refused) < self.backlog or self._shed_unheard():
            self._refuse(handler)
        else:  # the refused ones hold the rest of the room, each heard or within its grace: the newest goes
            handler.force_close()
            self._count("dropped")

    def on_request(self, handler: RequestHandler, path: str) -> web.Response | None:
        """A request starts on `handler`: the 503 to answer it with when its connection was refused
        and it is no probe."""
        if handler in self._refused:
            self._heard(handler)
            if path in PROBES:
                return None  # answered, then closed: `refused`
            self._count("refused")
            return ApiError(
                503,
                f"the router holds as many client connections as its open-file limit allows ({self.cap}), each with "
                "a request in flight: send the request again",
                retry_after_s=1,
                close=True,
            ).response()
        if self._idle.pop(handler, False) is None:  # not a connection lost meanwhile
            self._busy[handler] = None
        return None

    def on_response(self, handler: RequestHandler) -> None:
        """The request's handler returned (its answer may still be going out: `_waiting` says when it is done)."""
        if self._busy.pop(handler, False) is None:
            self._idle[handler] = None  # at the back: idle the shortest

    def refused(self, handler: RequestHandler) -> bool:
        """Made past the cap: whatever it is answered, it is closed after."""
        return handler in self._refused

    def lost(self, handler: RequestHandler) -> None:
        self._idle.pop(handler, None)
        self._busy.pop(handler, None)
        self._refused.discard(handler)
        self._heard(handler)
        admitted = len(self._idle) + len(self._busy)
        if self._episode is not None and self.cap is not None and admitted <= self.cap * 3 // 4:
            since, count = self._episode
            self._episode = None
            log.info(
                "client connections back to %d of the cap of %d: %d shed in %.0fs",
                admitted,
                self.cap,
                self._shed_count - count,
                time.monotonic() - since,
            )

    def _shed_idle(self) -> bool:
        """Closes the connection idle longest; False when none of the first SHED_LOOK is waiting."""
        for _ in range(min(SHED_LOOK, len(self._idle))):
            old, _none = self._idle.popitem(last=False)
            if _waiting(old):
                old.force_close()  # lost() finds it in neither dict
                self._count("idle_closed")
                return True
            self._idle[old] = None  # not waiting after all, and soon busy or waiting: to the back
        return False

    def _refuse(self, handler: RequestHandler) -> None:
        """Held apart: answered by on_request, then closed; closed at REFUSED_HEAD_S with no head."""
        timer = asyncio.get_running_loop().call_later(REFUSED_HEAD_S, self._unheard_too_long, handler)
        self._refused.add(handler)
        self._unheard[handler] = (time.monotonic(), timer)

    def _heard(self, handler: RequestHandler) -> None:
        entry = self._unheard.pop(handler, None)
        if entry is not None:
            entry[1].cancel()

    def _unheard_too_long(self, handler: RequestHandler) -> None:
        if handler in self._unheard and _waiting(handler):  # not waiting: its head read this turn, or closing
            self._close_unheard(handler)

    def _shed_unheard(self) -> bool:
        """Closes the refused connection waiting longest for its head once it has waited
        REFUSED_GRACE_S; False when it has not (or its head was read this very turn)."""
        if not self._unheard:
            return False
        old, (since, _timer) = next(iter(self._unheard.items()))
        if time.monotonic() - since < REFUSED_GRACE_S or not _waiting(old):
            return False
        self._close_unheard(old)
        return True

    def _close_unheard(self, handler: RequestHandler) -> None:
        self._heard(handler)
        self._refused.discard(handler)  # its place is free: lost() finds it in none
        handler.force_close()
        self._count("silent")

    def _at_cap(self) -> None:
        if self._episode is None:
            self._episode = (time.monotonic(), self._shed_count)
            log.warning(
                "client connections at the cap of %d (open-file limit %s): each new one closes the connection idle "
                "longest, or, none idle, is refused (503 to all but %s); "
                "kvswitch_router_client_connections_shed_total counts them",
                self.cap,
                self.limit,
                PROBES_NAMED,
            )

    def _count(self, how: str) -> None:
        self._shed[how].inc()
        self._shed_count += 1
