"""What the adapters of HTTP-served engines share: one aiohttp session to the engine, its health
probe and short GETs of its status endpoints, mapped to EngineError.

The session has no connection limit: streams of concurrent requests must not queue behind each
other (the request service bounds the legs in flight by the open-file limit instead). Status reads
and the health probe get a short total timeout (one health probe past it runs on, for up to half
the stall limit more, so that a late answer still shows the engine alive: `silence`, the stall
watchdog's); generation calls get
none (only a connect timeout), as a long generation is not a fault. A probe the shim cannot make
for want of a file descriptor (EMFILE, ENFILE) is the shim's fault: it says nothing of the engine.
Such an episode that lasts `busy_limit_s` makes the probe say DOWN: the shim cannot serve, and the
worker deregisters.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from protocol import ConfigError
from protocol.client_errors import essence
from protocol.messages import ENGINE_UTILITY_ENDPOINTS
from runtime import StopSteps, cancel_and_wait
from worker_shim.adapters.base import EngineAdapter, EngineError, EngineHealth, ModelCard
from worker_shim.adapters.openai_http import model_cards, post_utility
from worker_shim.config import ShimConfig

__all__ = ["NETWORK_ERRORS", "PROBE_TIMEOUT", "HttpEngineAdapter", "utf8_text"]

PROBE_TIMEOUT_S = 2.0
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
_SESSION_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=5.0, sock_connect=5.0)
# An idle pooled connection is dropped before vLLM's uvicorn closes it (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
# 5 s): with aiohttp's 15 s, a leg sent on one the engine was closing that moment failed as
# engine_unavailable (ServerDisconnectedError), the request never read by the engine.
POOL_KEEPALIVE_S = 4.0
# What a connection to the engine can fail with, short of a well-formed HTTP answer.
NETWORK_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
# A /health answered so: a server is there, but serves no such route (an OpenAI base URL, `.../v1`,
# given for the engine's): no wait cures it.
WRONG_ROUTE = frozenset({404, 405})

log = logging.getLogger(__name__)


def _out_of_fds(exc: BaseException | None) -> bool:
    """The error, or one it was raised from, says this process (EMFILE) or the host (ENFILE) has
    no file descriptor left."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FDS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _unreached(exc: BaseException) -> bool:
    """The engine could not be reached for a question: refused, unreachable, reset. Not a timeout
    (a loaded engine's), a close without reset (a pooled connection dropped) or the shim's own want
    of a file descriptor."""
    return isinstance(exc, OSError) and not isinstance(exc, TimeoutError) and not _out_of_fds(exc)


def _retrieved(probe: asyncio.Task[int]) -> None:
    if not probe.cancelled():
        probe.exception()  # a late probe's failure says nothing: the next probe answers for the engine


def utf8_text(body: bytes, url: str) -> str:
    """`body`, the answer from `url`, as text; EngineError (502 `engine_protocol`) naming the first
    byte that is not UTF-8. A bare decode raised UnicodeDecodeError, whose repr holds the whole
    body: a traceback and 21 KB of /metrics a line, at each load poll and each session's start."""
    try:
        return body.decode()
    except UnicodeDecodeError as exc:
        raise EngineError(502, "engine_protocol", f"{url} is not UTF-8 text (byte {exc.start})") from None


class HttpEngineAdapter(EngineAdapter):
    """Owns the session: `open()` creates it, `close()` closes it (safe to call twice)."""

    def __init__(self, config: ShimConfig) -> None:
        super().__init__(config)
        self.base = config.engine_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._health = EngineHealth.DOWN  # what the last probe that reached the engine found
        self._out_of_fds_since: float | None = None  # probes fail for want of a descriptor since (logged once)
        self._fds_down = False  # that went on past busy_limit_s: DOWN (logged once)
        self._health_status: int | None = None  # the HTTP status of the last probe answered
        self._late: asyncio.Task[int] | None = None  # a health probe left to finish past its timeout
        # ... within this: while it runs newer late probes are cancelled, so one whose request was lost
        # (a silently dead connection) must end well within the stall limit for theirs to count.
        self._late_limit = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S + config.stall_limit_s / 2)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("adapter not open")
        return self._session

    async def open(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=POOL_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(timeout=_SESSION_TIMEOUT, connector=connector)

    async def close(self) -> None:
        """The late health probe is reaped, then the session closed, though a cancellation cut the
        reap (a cancelled close): until 2026-12-08 that cut skipped the close, the session left open."""
        late, self._late = self._late, None
        session, self._session = self._session, None
        steps = StopSteps()
        if late is not None:
            with steps:
                await cancel_and_wait(late)
        if session is not None:
            with steps:
                await session.close()
        steps.end()

    async def health(self) -> EngineHealth:
        """The engine's health; a probe the shim could not make (out of file descriptors) repeats
        the last probe's answer, with an ERROR: the engine is not to blame. Past busy_limit_s of
        that it is DOWN: the shim's legs fail too, and an engine that died meanwhile goes unseen.
        A probe unanswered within PROBE_TIMEOUT is BUSY, and one such probe at a time is left to
        finish, for up to half the stall limit more: a loaded engine answers late, a frozen one
        never (`silence`)."""
        probe = asyncio.create_task(self._probe_health())
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                status: int | None = await asyncio.shield(probe)
            health = EngineHealth.UP if status == 200 else EngineHealth.DOWN
        except asyncio.CancelledError:
            probe.cancel()
            raise
        except TimeoutError:
            self._leave_late(probe)
            health, status = EngineHealth.BUSY, None
        except NETWORK_ERRORS as exc:
            if _out_of_fds(exc):
                return self._cannot_probe(exc)
            health, status = EngineHealth.DOWN, None
        self._health, self._out_of_fds_since, self._fds_down = health, None, False
        self._health_status = status
        return health

    async def _probe_health(self) -> int:
        with self.silence.asking(_unreached):
            async with self.session.get(self.base + "/health", timeout=self._late_limit) as resp:
                self.silence.answered()
                await resp.read()  # read to the end so the connection is reused
                return resp.status

    def _leave_late(self, probe: asyncio.Task[int]) -> None:
        """`probe`, past its timeout, runs on unless one left before still does; its end is nobody's."""
        probe.add_done_callback(_retrieved)
        if self._late is not None and not self._late.done():
            probe.cancel()
        else:
            self._late = probe

    async def misdirected(self) -> ConfigError | None:
        """The last health probe was answered 404 or 405: a server listens at --engine-url, but
        serves no /health there. Where the URL has a path, the /health of the URL without it is
        probed once and its answer said."""
        if self._health_status not in WRONG_ROUTE:
            return None
        status, kind = self._health_status, self.kind
        said = f"{self.base}/health answers {status}: a server is there, but not the {kind} engine's API"
        parts = urlsplit(self.base)
        if not parts.path:
            return ConfigError("engine_url", self.config.engine_url, f"{said} (is --engine-url the engine's URL?)")
        root = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        try:
            async with self.session.get(root + "/health", timeout=PROBE_TIMEOUT) as resp:
                await resp.read()
                answer = f"answers {resp.status}"
        except NETWORK_ERRORS:
            answer = "does not answer"
        advice = f"give --engine-url {root}" if answer == "answers 200" else f"is --engine-url {root}?"
        return ConfigError(
            "engine_url",
            self.config.engine_url,
            f"{said}. --engine-url is the engine's own URL, without a path such as its OpenAI base URL's /v1 "
            f"(the shim adds the paths); {root}/health {answer}: {advice}",
        )

    def _cannot_probe(self, exc: BaseException) -> EngineHealth:
        now, limit = time.monotonic(), self.config.busy_limit_s
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if self._out_of_fds_since is None:
            self._out_of_fds_since = now
            log.error(
                "the shim is out of file descriptors (%r; open-file limit %d, hard %d): it cannot probe the "
                "engine at %s, whose health it takes as last seen (%s) for up to %.0fs (--busy-limit-s); lower "
                "--max-inflight-legs or raise the limit",
                exc,
                soft,
                hard,
                self.base,
                self._health.value,
                limit,
            )
        if now - self._out_of_fds_since < limit:
            return self._health
        if not self._fds_down:
            self._fds_down = True
            log.error(
                "the shim has been out of file descriptors for %.0fs (open-file limit %d, hard %d): the shim, not "
                "the engine at %s, cannot serve; it reports the engine down, so the worker deregisters until a "
                "probe reaches the engine again; lower --max-inflight-legs or raise the limit",
                now - self._out_of_fds_since,
                soft,
                hard,
                self.base,
            )
        return EngineHealth.DOWN

    async def served_models(self) -> dict[str, ModelCard] | None:
        """The engine's /v1/models by id; None when it cannot say."""
        try:
            return model_cards(await self.fetch("/v1/models"))
        except EngineError:
            return None

    async def call(self, endpoint: str, body: dict[str, Any]) -> bytes:
        if endpoint not in ENGINE_UTILITY_ENDPOINTS.get(self.kind, ()):
            return await super().call(endpoint, body)
        return await post_utility(self.session, f"{self.base}/{endpoint}", body)

    async def fetch(self, path: str, method: str = "GET", timeout: aiohttp.ClientTimeout = PROBE_TIMEOUT) -> bytes:
        """The body of a 200 answer from `path`; EngineError for any other status or no answer."""
        try:
            with self.silence.asking(_unreached):
                async with self.session.request(method, self.base + path, timeout=timeout) as resp:
                    self.silence.answered()
                    if resp.status != 200:
                        raise EngineError(resp.status, "engine_error", f"{self.base}{path} answered {resp.status}")
                    return await resp.read()
        except NETWORK_ERRORS as exc:
            raise EngineError(503, "engine_unavailable", essence(exc, self.base + path)) from exc

    async def fetch_text(self, path: str) -> str:
        """fetch()'s body as UTF-8 text (utf8_text)."""
        return utf8_text(await self.fetch(path), self.base + path)
