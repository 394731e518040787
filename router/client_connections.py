"""The router's client connections: counted, and capped below the open-file limit.

Each client connection holds a file descriptor. Past the process's open-file limit the accept of
the next one fails (EMFILE), and under uvloop libuv then accepts and closes every new connection at
once, with no callback and no log line: every client was reset, `/health` included, for as long
as ~1,000 idle keep-alive connections (1024 is systemd's default soft limit) or one slowloris
client held them (audit of 2026-12-07). The limit is raised to the hard one at start
(runtime.fd_limit); this module keeps the connections under it.

The cap: the limit less a quarter of it (at least FD_RESERVE), which is left for NATS, etcd, the
tokenizer's files and one accept burst. The check runs in the server's `connection_made`, the
first code an accepted connection reaches; uvloop calls it on the loop iteration after libuv
accepted, and libuv accepts all the listen backlog holds before it returns, so the listen backlog
is at most half the reserve (`backlog`): the descriptors never reach the limit.

At the cap a new connection first closes the connection idle longest (no request in flight: a
keep-alive connection waiting for its next request, or one that has not sent a whole request head),
as nginx reuses its idle keep-alive connections when out of worker_connections: a flood of idle
connections cannot keep a health probe or a client out. With none idle (every connection has a
request in flight) the new one is answered 503 (OpenAI JSON, `Connection: close`, `Retry-After`)
to its first request, and is the first to be closed for the next one. Each is counted
(`kvswitch_router_client_connections_shed_total{how}`); an episode of shedding is logged once at
WARNING when it starts, and at INFO when the connections fall back to three quarters of the cap.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from router.api_errors import ApiError
from router.metrics import RouterMetrics
from runtime import LISTEN_BACKLOG

__all__ = ["FD_RESERVE", "ClientConnections"]

log = logging.getLogger(__name__)

FD_RESERVE = 256  # the least left beside the cap
MIN_CAP = 64  # below it the limit is too low to serve: a WARNING says so


def _idle(handler: RequestHandler) -> bool:
    """No request in flight or queued: waiting for a request head, the first or the next one."""
    # aiohttp's own state (RequestHandler has no public one): pinned by pyproject's aiohttp range
    return not (handler._request_in_progress or handler._messages or handler._force_close or handler._close)


class ClientConnections:
    """The front door's connections, oldest request first: `made` at accept, `on_request` for each
    request read, `lost` at close. `cap` None: no limit on descriptors, no cap."""

    def __init__(self, limit: int | None, metrics: RouterMetrics) -> None:
        self.limit = limit
        reserve = FD_RESERVE if limit is None else max(FD_RESERVE, limit // 4)
        self.cap = None if limit is None else limit - reserve
        # A burst accepted before the first connection_made must fit in the reserve, beside NATS and etcd.
        self.backlog = min(LISTEN_BACKLOG, reserve // 2)
        self._open: dict[RequestHandler, None] = {}  # the connection idle longest first
        self._refused: set[RequestHandler] = set()
        self._shed = {how: metrics.client_connections_shed.labels(how) for how in ("idle_closed", "refused")}
        self._episode: tuple[float, int] | None = None  # shedding since, and the count then
        self._shed_count = 0
        metrics.client_connections.set_function(lambda: len(self._open))
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
        return len(self._open)

    def made(self, handler: RequestHandler) -> None:
        if self.cap is not None and len(self._open) >= self.cap:
            self._shed_one()
            if len(self._open) >= self.cap:
                self._refused.add(handler)
                self._count("refused")
        self._open[handler] = None

    def on_request(self, handler: RequestHandler) -> web.Response | None:
        """A request read on `handler`: the 503 to answer it with when its connection was refused."""
        if handler in self._refused:
            return ApiError(
                503,
                f"the router holds as many client connections as its open-file limit allows ({self.cap}), each with "
                "a request in flight: send the request again",
                retry_after_s=1,
                close=True,
            ).response()
        if self._open.pop(handler, False) is None:
            self._open[handler] = None  # to the end: most recently used
        return None

    def lost(self, handler: RequestHandler) -> None:
        self._open.pop(handler, None)
        self._refused.discard(handler)
        if self._episode is not None and self.cap is not None and len(self._open) <= self.cap * 3 // 4:
            since, count = self._episode
            self._episode = None
            log.info(
                "client connections back to %d of the cap of %d: %d shed in %.0fs",
                len(self._open),
                self.cap,
                self._shed_count - count,
                time.monotonic() - since,
            )

    def _shed_one(self) -> None:
        for old in self._open:
            if _idle(old):
                del self._open[old]  # closing: not counted again, nor found idle again
                self._refused.discard(old)
                old.force_close()
                self._count("idle_closed")
                return

    def _count(self, how: str) -> None:
        self._shed[how].inc()
        self._shed_count += 1
        if self._episode is None:
            self._episode = (time.monotonic(), self._shed_count - 1)
            log.warning(
                "client connections at the cap of %d (open-file limit %s): each new one closes the connection idle "
                "longest, or, none idle, is answered 503; kvswitch_router_client_connections_shed_total counts them",
                self.cap,
                self.limit,
            )
