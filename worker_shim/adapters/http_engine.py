"""What the adapters of HTTP-served engines share: one aiohttp session to the engine, its health
probe and short GETs of its status endpoints, mapped to EngineError.

The session has no connection limit: streams of concurrent requests must not queue behind each
other. Status reads and the health probe get a short total timeout; generation calls get none
(only a connect timeout), as a long generation is not a fault.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from worker_shim.adapters.base import EngineAdapter, EngineError, EngineHealth, ModelCard
from worker_shim.adapters.openai_http import model_cards, post_utility
from worker_shim.config import ShimConfig

__all__ = ["PROBE_TIMEOUT", "HttpEngineAdapter"]

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
_SESSION_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=5.0, sock_connect=5.0)
# What a connection to the engine can fail with, short of a well-formed HTTP answer.
_NETWORK_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


class HttpEngineAdapter(EngineAdapter):
    """Owns the session: `open()` creates it, `close()` closes it (safe to call twice)."""

    def __init__(self, config: ShimConfig) -> None:
        super().__init__(config)
        self.base = config.engine_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("adapter not open")
        return self._session

    async def open(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_SESSION_TIMEOUT, connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def health(self) -> EngineHealth:
        try:
            async with self.session.get(self.base + "/health", timeout=PROBE_TIMEOUT) as resp:
                await resp.read()  # read to the end so the connection is reused
                return EngineHealth.UP if resp.status == 200 else EngineHealth.DOWN
        except TimeoutError:
            return EngineHealth.BUSY
        except _NETWORK_ERRORS:
            return EngineHealth.DOWN

    async def served_models(self) -> dict[str, ModelCard] | None:
        """The engine's /v1/models by id; None when it cannot say."""
        try:
            return model_cards(await self.fetch("/v1/models"))
        except EngineError:
            return None

    async def call(self, endpoint: str, body: dict[str, Any]) -> bytes:
        path = self.utility_paths.get(endpoint)
        if path is None:
            return await super().call(endpoint, body)
        return await post_utility(self.session, self.base + path, body)

    async def fetch(self, path: str, method: str = "GET", timeout: aiohttp.ClientTimeout = PROBE_TIMEOUT) -> bytes:
        """The body of a 200 answer from `path`; EngineError for any other status or no answer."""
        try:
            async with self.session.request(method, self.base + path, timeout=timeout) as resp:
                if resp.status != 200:
                    raise EngineError(resp.status, "engine_error", f"{self.base}{path} answered {resp.status}")
                return await resp.read()
        except _NETWORK_ERRORS as exc:
            raise EngineError(503, "engine_unavailable", f"{self.base}{path}: {exc!r}") from exc
