"""The shim's own HTTP server: `GET /health` (JSON) and `GET /metrics` (Prometheus text).

/health answers 200 while the shim serves (registered with etcd) and 503 otherwise; its body says
why either way. Port 0 picks a free port; `url` is what the shim registers as WorkerInfo.shim_url
(a wildcard host is advertised as this machine's hostname).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

__all__ = ["ShimHttpServer"]


class ShimHttpServer:
    """`start()` binds, `stop()` (safe twice) closes."""

    def __init__(
        self,
        host: str,
        port: int,
        health: Callable[[], tuple[bool, dict[str, Any]]],
        metrics: Callable[[], bytes],
    ) -> None:
        self.host = host
        self.port = port
        self._health = health
        self._metrics = metrics
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._on_health)
        app.router.add_get("/metrics", self._on_metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        bound = runner.addresses[0][1]
        host = socket.gethostname() if self.host in ("", "0.0.0.0", "::") else self.host
        if ":" in host:
            host = f"[{host}]"
        self.port = bound
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _on_health(self, _request: web.Request) -> web.Response:
        serving, body = self._health()
        return web.json_response(body, status=200 if serving else 503)

    async def _on_metrics(self, _request: web.Request) -> web.Response:
        # generate_latest writes the 0.0.4 text format (the router's /metrics names it too);
        # CONTENT_TYPE_LATEST names 1.0.0 with the pinned prometheus_client 0.26.
        return web.Response(body=self._metrics(), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
