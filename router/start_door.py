"""The front door while the router starts: it listens before NATS and etcd are reached.

NATS is retried for as long as it is down (docs/deployment.md, "Starting before NATS or etcd is
up"). A router that opened its listener only once NATS and then etcd had answered left `/health`
unanswered all that while, so Kubernetes' liveness probe killed a router that was rightly waiting,
again and again (CrashLoopBackOff) for as long as NATS was down.

`StartDoor.open()` binds the listening sockets at once (a port it cannot have is refused before
anything else, naming --http-port or --http-host) and answers on them:

- `/health` 200 with the router's own `health()`: the process is alive and trying;
- `/ready` 503 with the router's own `readiness()`, whose problems name what it waits for;
- `/metrics` as always;
- any other request an OpenAI 503 with `Retry-After: 1` naming the same, counted as
  `endpoint="starting"` (a fixed label, as `draining`).

`hand_over(runner)` then serves the router's own app on the same sockets: a connection that comes
meanwhile waits in the kernel's backlog, none is refused. As the shim does (worker_shim.shim), the
listener opens first; unlike the shim's `/health`, which says whether it serves, the router's says
only that it lives, and `/ready` whether it serves.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from protocol.errors import listen_error
from router.api_errors import ApiError, FrontDoorRunner, json_response, openai_errors
from router.metrics import CONTENT_TYPE, RouterMetrics
from runtime import LISTEN_BACKLOG

__all__ = ["StartDoor"]

CLOSE_S = 1.0  # for the connections the start door still holds to close at the hand-over


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets as asyncio's create_server binds them (each address `host` resolves to,
    IPv6 ones IPv6-only, SO_REUSEADDR); ConfigError naming the flag when one cannot be had."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise listen_error(host, port, exc) from exc
    return sockets


class StartDoor:
    """`open()` once; then `hand_over(runner)` or `close()` (either safe after the other)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        health: Callable[[], dict[str, Any]],
        readiness: Callable[[], tuple[bool, dict[str, Any]]],
        waiting: Callable[[], str],
        metrics: RouterMetrics,
    ) -> None:
        self.host = host
        self.port = port
        self._health = health
        self._readiness = readiness
        self._waiting = waiting
        self._metrics = metrics
        self._sockets: list[socket.socket] = []
        self._runner: web.AppRunner | None = None

    async def open(self) -> str:
        """Listens and answers; the URL of the first address (a wildcard host as it is bound)."""
        self._sockets = _listen(self.host, self.port)
        app = web.Application(middlewares=[openai_errors(self._metrics)])
        app.router.add_get("/health", self._on_health)
        app.router.add_get("/ready", self._on_ready)
        app.router.add_get("/metrics", self._on_metrics)
        app.router.add_route("*", "/{path:.*}", self._on_request)
        self._runner = runner = FrontDoorRunner(app, access_log=None, shutdown_timeout=CLOSE_S)
        await runner.setup()
        # A duplicate of each socket: stopping this site closes it, and the router's app is served
        # on the original (hand_over).
        for sock in self._sockets:
            await web.SockSite(runner, sock.dup(), backlog=LISTEN_BACKLOG).start()
        host, port = self._sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def hand_over(self, runner: web.AppRunner) -> None:
        """Serves `runner`'s app on the sockets from now on; this door's connections are closed."""
        door, self._runner = self._runner, None
        assert door is not None, "hand_over() before open()"
        for site in list(door.sites):
            await site.stop()  # the duplicate closes; the socket listens on, its backlog kept
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()
        await door.cleanup()

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()

    def _starting(self) -> str:
        waiting = self._waiting()
        return f"the router is starting: {waiting}" if waiting else "the router is starting"

    async def _on_health(self, _request: web.Request) -> web.Response:
        return json_response(self._health())

    async def _on_ready(self, _request: web.Request) -> web.Response:
        ready, body = self._readiness()
        return json_response({"ready": ready, **body}, status=200 if ready else 503)

    async def _on_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=await self._metrics.render_off_loop(), headers={"Content-Type": CONTENT_TYPE})

    async def _on_request(self, _request: web.Request) -> web.Response:
        self._metrics.count_request("starting", 503)
        # Closed: a body left unread must not be taken for the next request.
        return ApiError(503, f"{self._starting()}: send the request again", retry_after_s=1, close=True).response()
