"""The router's one listener, open before NATS and etcd are reached: the start door, then its app.

NATS is retried for as long as it is down (docs/deployment.md, "Starting before NATS or etcd is
up"). A router that opened its listener only once NATS and then etcd had answered left `/health`
unanswered all that while, so Kubernetes' liveness probe killed a router that was rightly waiting,
again and again (CrashLoopBackOff) for as long as NATS was down.

`StartDoor.open()` binds the listening sockets at once (a port it cannot have is refused before
anything else, naming --http-port or --http-host) and serves on them the server the router keeps
for its whole life (its keep-alive `--idle-timeout-s`, its parse errors as OpenAI JSON), whose
requests the door answers until the router's app is ready:

- `/health` (and `/ping`) 200 with the router's own `health()`: the process is alive and trying;
- `/ready` 503 with the router's own `readiness()`, whose problems name what it waits for;
- `/metrics` as always;
- a wrong method on one of these the router's app's 405, its `Allow` the app's (router.routes);
- any other request an OpenAI 503 with `Retry-After: 1` naming the same, counted as
  `endpoint="starting"` (a fixed label, as `draining`).

An `Expect` changes none of these: no 100 goes before them, and no 417 instead of them.

`hand_over(app)` then gives every request read from then on to the router's app, on the same
server and the same connections: none is refused or cut at the switch (until 2026-12-06 the app got
a server of its own and the door's connections were closed, a request sent on one just after the
switch answered by a reset). As the shim does (worker_shim.shim), the listener opens first; unlike
the shim's `/health`, which says whether it serves, the router's says only that it lives, and
`/ready` whether it serves.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from protocol.errors import bind_sockets, listen_error
from router.api_errors import ApiError, FrontDoorRunner, json_response, openai_errors
from router.client_connections import ClientConnections
from router.expectations import ExpectRoutes
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.request_path import starting
from router.routes import add_routes
from runtime.fd_limit import fd_limit

__all__ = ["StartDoor"]

CLOSE_S = 1.0  # for the listener's connections to close once the drain is over
_APP = web.RequestKey("kvswitch.app", web.Application)  # the app that read a request: its handler too


def _listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets as asyncio's create_server makes them (protocol.errors.bind_sockets);
    ConfigError naming the flag when one cannot be had."""
    sockets: list[socket.socket] = []
    try:
        sockets = bind_sockets(host, port)
        for sock in sockets:
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise listen_error(host, port, exc) from exc
    return sockets


class _Switch(FrontDoorRunner):
    """One server whose requests go to the door's app until `to(app)`, then to `app`: each request
    to the app current when it was read, a connection opened before the switch included."""

    def __init__(
        self, door: web.Application, *, metrics: RouterMetrics, connections: ClientConnections, **kwargs: Any
    ) -> None:
        super().__init__(door, metrics=metrics, connections=connections, **kwargs)
        self._capped = connections
        self._now = door
        self._then: web.Application | None = None

    async def to(self, app: web.Application) -> None:
        # Started as AppRunner starts its own app.
        app._set_loop(asyncio.get_running_loop())
        app.on_startup.freeze()
        await app.startup()
        app.freeze()
        self._then = self._now = app

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.request_factory = self._make_request
        server.request_handler = self._handle
        return server

    def _make_request(self, *args: Any) -> web.BaseRequest:
        app = self._now
        request = app._make_request(*args)
        request[_APP] = app  # read by the door just before the switch, answered by the door
        return request

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        connection = request.protocol
        refusal = self._capped.on_request(connection, request.path)
        if refusal is not None:  # a connection past the cap: router.client_connections
            return refusal
        try:
            response = await request[_APP]._handle(request)  # type: ignore[arg-type]
        finally:
            self._capped.on_response(connection)
        if self._capped.refused(connection):  # a probe answered past the cap: the connection goes after it
            response.force_close()
        return response

    async def shutdown(self) -> None:
        await super().shutdown()
        if self._then is not None:
            await self._then.shutdown()

    async def _cleanup_server(self) -> None:
        if self._then is not None:
            await self._then.cleanup()
        await super()._cleanup_server()


class StartDoor:
    """`open()` once; then `hand_over(app)`, after which the runner is the caller's and `close()`
    does nothing, or `close()`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        health: Callable[[], dict[str, Any]],
        readiness: Callable[[], tuple[bool, dict[str, Any]]],
        waiting: Callable[[], str],
        metrics: RouterMetrics,
        idle_timeout_s: float,
    ) -> None:
        self.host = host
        self.port = port
        self._health = health
        self._readiness = readiness
        self._waiting = waiting
        self._metrics = metrics
        self._idle_timeout_s = idle_timeout_s
        self._runner: _Switch | None = None

    async def open(self) -> str:
        """Listens and answers; the URL of the first address (a wildcard host as it is bound)."""
        connections = ClientConnections(fd_limit(), self._metrics)
        sockets = _listen(self.host, self.port, connections.backlog)
        app = web.Application(middlewares=[openai_errors(self._metrics), self._not_yet])
        # An Expect is held and never answered (router.expectations, without its 417): the door's
        # answer is the one a request gets, its 503 ahead of any 417 as the drain's is, no 100 before it.
        ExpectRoutes.install(app)
        # The app's methods on these paths (router.routes): a wrong one is the app's 405, not a 503
        door = {"/health": self._on_health, "/ping": self._on_health, "/ready": self._on_ready}
        add_routes(app, {**door, "/metrics": self._on_metrics})
        # The router's server from the start: the door's connections are its own. The drain itself
        # is the router's (http_api.Drain); aiohttp's own waits twice its timeout per connection.
        self._runner = runner = _Switch(
            app,
            metrics=self._metrics,
            connections=connections,
            handler_cancellation=True,
            shutdown_timeout=CLOSE_S,
            access_log=None,
            keepalive_timeout=self._idle_timeout_s,
        )
        try:
            await runner.setup()
            for sock in sockets:
                await web.SockSite(runner, sock, backlog=connections.backlog).start()
        except BaseException:
            for sock in sockets:  # those a site holds are closed again by close(): no harm
                sock.close()
            raise
        host, port = sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def hand_over(self, app: web.Application) -> web.AppRunner:
        """Gives `app` every request read from now on; the runner is the caller's to clean up."""
        runner, self._runner = self._runner, None
        assert runner is not None, "hand_over() before open()"
        try:
            await runner.to(app)
        except BaseException:
            await runner.cleanup()
            raise
        return runner

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def _starting(self) -> str:
        return starting(self._waiting())

    async def _on_health(self, _request: web.Request) -> web.Response:
        return json_response(self._health())

    async def _on_ready(self, _request: web.Request) -> web.Response:
        ready, body = self._readiness()
        return json_response({"ready": ready, **body}, status=200 if ready else 503)

    async def _on_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=await self._metrics.render_off_loop(), headers={"Content-Type": CONTENT_TYPE})

    @web.middleware
    async def _not_yet(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A path the door does not serve, which the router's app may: a 503 until the app takes over
        (a wrong method on one of the door's paths is the app's 405, aiohttp's, as on the app)."""
        unrouted = request.match_info.http_exception
        if unrouted is None or unrouted.status != 404:
            return await handler(request)
        self._metrics.count_request("starting", 503)
        # Closed: a body left unread must not be taken for the next request.
        return ApiError(503, f"{self._starting()}: send the request again", retry_after_s=1, close=True).response()
