"""OpenAI-style errors: `ApiError` and its JSON `{"error": {"message", "type", "param", "code"}}`,
the client's view of a planning or a leg failure, and aiohttp's own answers (its parser's errors,
unknown routes, wrong methods, anything a handler did not expect) in the same JSON.

Bad input 400, unknown route 404, wrong method 405, body not sent in time 408, body or prompt too
large 413, an Expect other than 100-continue 417, headers too large 431, queue full 429 with
Retry-After, an engine's 429 on every worker tried 429 with the engine's Retry-After, worker failure
502, no worker 503 with Retry-After (an engine's 408 too), deadline 504. Worker ids and internal
exception text stay in the router's log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from protocol.vllm_errors import (
    UNSUPPORTED_MEDIA_TYPE,
    VALIDATION_ERROR,
    Detail,
    json_invalid_error,
    validation_message,
    validation_param,
)
from router.client_buffers import bound_unsent
from router.leg import LegError
from router.metrics import RouterMetrics
from router.planner import PlanError
from router.request_path import NO_WORKER_RETRY_S
from router.routes import ALLOW

if TYPE_CHECKING:
    from router.client_connections import ClientConnections

__all__ = [
    "NO_LOCAL_PREFILL_WHY",
    "ApiError",
    "FrontDoorRunner",
    "json_response",
    "leg_error",
    "not_json",
    "openai_errors",
    "plan_error",
    "prompt_too_long",
    "unsupported_media_type",
    "validation_failed",
]

log = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    417: "ExpectationFailedError",
    414: "RequestTooLargeError",
    429: "RateLimitError",
    431: "RequestTooLargeError",
    499: "ClientClosedRequest",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class ApiError(Exception):
    def __init__(
        self,
        code: int,
        message: str,
        param: str | None = None,
        *,
        retry_after_s: int | None = None,
        close: bool = False,
        body: bytes = b"",
        kind: str | None = None,
    ) -> None:
        self.code = code
        self.kind = kind or _ERROR_TYPES.get(code, "InternalServerError")
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.close = close  # the connection cannot be reused (a body left half read)
        self.own_body = body  # an engine's own error body, passed on as it is
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        payload = self.own_body or _JSON.encode(self.body())
        resp = web.Response(body=payload, status=self.code, headers=headers, content_type="application/json")
        if self.close:
            resp.force_close()
        return resp


_JSON = msgspec.json.Encoder()


def json_response(obj: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    # msgspec instead of aiohttp's json.dumps: several times faster, and UTF-8 unescaped as vLLM writes it
    return web.Response(body=_JSON.encode(obj), status=status, headers=headers, content_type="application/json")


def prompt_too_long(limit: int, count: int) -> ApiError:
    """vLLM 0.32's 400 for a prompt of `count` token ids past a context of `limit` (its renderer's
    words, "at least" for limit + 1 as for text, which it tokenizes only that far). vLLM says it
    after its checks of the sampling parameters: a request that fails one of those too gets this."""
    shown = f"at least {count}" if count == limit + 1 else str(count)
    message = (
        f"This model's maximum context length is {limit} tokens. However, your prompt contains {shown} input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        f"prompt. (parameter=input_tokens, value={count})"
    )
    return ApiError(400, message, "input_tokens")


def plan_error(exc: PlanError) -> ApiError:
    """No worker can take the request now: a worker excluded for a while, or one not registered
    yet, may be back in seconds, so clients that honour Retry-After try again; not where nothing
    but a new configuration ends it (PlanError.transient)."""
    retry = exc.code == 503 and exc.transient
    return ApiError(exc.code, exc.message, retry_after_s=NO_WORKER_RETRY_S if retry else None)


def leg_error(exc: LegError, *, streaming: bool = False) -> ApiError:
    """The client's view of a failed leg: the engine's own answer for a request it refused, why
    for a client that read too slowly, a generic one for the rest (worker ids and internal errors
    stay in the router's log). `streaming`: after the stream's first event, where a worker was
    serving it: a worker gone or silent then is a 502, the worker failed, not a 503 "no worker
    could" (the message until 2026-12-06, the code, and so requests_total's, until its second session)."""
    if exc.refused or exc.slow_reader:
        return ApiError(exc.code, exc.message, body=exc.body)
    if exc.nats_lost:  # the router's own state, as a request planned during the outage is told
        return ApiError(503, exc.message, retry_after_s=NO_WORKER_RETRY_S)
    if exc.busy and exc.code == 429:
        # Every worker tried turned it away for now: the engine's 429 with its own Retry-After.
        # Until 2026-12-06 a 502 "the worker failed", never retried on another worker.
        # Its own JSON body where it sent one; else ours (its text may be a proxy's HTML page).
        message = exc.message if exc.body else "the engine turned the request away: too many requests"
        return ApiError(429, message, retry_after_s=exc.retry_after_s, body=exc.body)
    code = 503 if exc.busy else exc.code if exc.code in (503, 504) else 502
    if streaming and code == 503:  # a worker was serving it: it failed (502), not "no worker could" (503)
        return ApiError(502, _MIDWAY)
    what = {503: "no worker could serve the request", 504: "the request's deadline passed"}
    message = what.get(code, "the worker failed while serving the request")
    if exc.no_local_prefill:  # the prefill's failure, and the decode worker's, are in the router's log
        message = NO_LOCAL_PREFILL_WHY
    # A worker gone, silent or draining passes as one planning finds excluded does: retry later.
    retry = NO_WORKER_RETRY_S if code == 503 else None
    return ApiError(code, message, retry_after_s=retry)


_MIDWAY = "the worker serving the request failed while streaming it"
NO_LOCAL_PREFILL_WHY = "no prefill worker could serve the request for a decode worker that cannot prefill locally"


# vLLM 0.32 serves these; kvswitch does not route them (docs/router.md, "Endpoints").
_ENGINE_ONLY = (
    "/v1/responses", "/v1/messages", "/v1/embeddings", "/v1/score", "/v1/rerank", "/v2/rerank", "/rerank",
    "/score", "/pooling", "/classify", "/v1/audio/", "/v1/realtime", "/invocations",
    "/v1/chat/completions/", "/v1/completions/", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
)  # fmt: skip


def _no_route(path: str) -> str:
    """A 404's message; a vLLM endpoint the router does not route is named as one, so a client
    pointed at the router learns where to send it."""
    if path.startswith(_ENGINE_ONLY):
        return (
            f"no route {path}: kvswitch routes /v1/completions and /v1/chat/completions (and answers "
            "/v1/models, /tokenize and /detokenize); send other vLLM endpoints to an engine directly"
        )
    return f"no route {path}"


def openai_errors(metrics: RouterMetrics) -> Callable[..., Any]:
    @web.middleware
    async def answer(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """aiohttp's own answers (unknown route, wrong method, body too large) and anything a
        handler did not expect, as OpenAI JSON."""
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if request.match_info.http_exception is not None:  # no route: one label, never the raw path
                metrics.count_request("unrouted", exc.status)
            what = {404: _no_route(request.path), 405: f"{request.method} is not allowed on {request.path}"}
            err = ApiError(exc.status, what.get(exc.status, exc.reason), close=exc.status == 413)
            resp = err.response()
            if exc.status == 405 and "Allow" in exc.headers:
                # vLLM's Allow where it is not the path's methods: set here, so no route matches a wrong method
                allow = ALLOW.get(request.path)
                resp.headers["Allow"] = ",".join(allow) if allow else exc.headers["Allow"]
            return resp
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return ApiError(500, "the router failed to handle the request").response()

    return answer


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering what its parser refuses as OpenAI JSON:
    oversized header lines or too many headers are 431, an oversized request line 414, the rest
    400. (aiohttp answers these in plain text before any middleware runs.) Each is counted as
    `endpoint="unparsed"`, a fixed label (no route was read); until 2026-12-07 none was counted."""

    def _make_error_handler(self, err_info: Any) -> Callable[[BaseRequest], Awaitable[web.StreamResponse]]:
        # aiohttp's handler for a request its parser refused: the one place those pass, and only those
        answer = super()._make_error_handler(err_info)
        metrics = cast(_JsonErrorServer, self._manager).metrics

        async def counted(request: BaseRequest) -> web.StreamResponse:
            response = await answer(request)
            metrics.count_request("unparsed", response.status)
            return response

        return counted

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("an answer is on its way already: the connection is dropped")
        if isinstance(exc, LineTooLong):
            status = 414 if _request_line(exc) else 431
            text = "the request line is too long" if status == 414 else "a request header is too large"
        elif isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower():
            status, text = 431, "too many request headers"
        elif isinstance(exc, BadHttpMessage):
            status, text = 400, f"malformed HTTP request: {exc.message}"
        else:
            if status >= 500:
                log.error("HTTP connection error", exc_info=exc)
            text = "the router failed to handle the request" if status >= 500 else (message or "bad request")
        resp = ApiError(status, text, close=True).response()
        return resp


def _request_line(exc: LineTooLong) -> bool:
    """Whether the line over aiohttp's limit is the request line, not a header: its text says
    neither ("Got more than 8190 bytes when reading: ..." for both; until 2026-12-07 the router
    looked there for "request line", so an over-long URL was a 431), what it carries does. The C
    parser (llhttp) gives the URL gathered in its bytearray buffer, a header's name or value as
    bytes (a value may start with '/' and hold no ':'); the Python parser (AIOHTTP_NO_EXTENSIONS)
    the whole line, the request line starting with its method and a space, a header line with its
    name and a ':'."""
    line = exc.args[0]
    return isinstance(line, bytearray) or (isinstance(line, bytes) and _METHOD_SP.match(line) is not None)


_METHOD_SP = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ ")  # RFC 9110's token, then the request line's space


class _JsonErrorServer(web.Server):
    client_connections: ClientConnections | None = None  # FrontDoorRunner's: told of each connection
    metrics: RouterMetrics  # FrontDoorRunner's: counts what the parser refused

    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        bound_unsent(transport)  # what its kernel holds unsent (router.client_buffers)
        if self.client_connections is not None:
            self.client_connections.made(handler)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        if self.client_connections is not None:
            self.client_connections.lost(handler)


class FrontDoorRunner(web.AppRunner):
    """An AppRunner whose connections answer HTTP parse errors as OpenAI JSON (431, 414, 400), and
    close `lingering_s` after answering a request whose body was left unread (aiohttp's default
    waits 10 s for the rest of it: a client that stopped sending would hold the connection). Each
    connection is told to `connections`, which caps them (router.client_connections)."""

    def __init__(
        self,
        app: web.Application,
        *,
        metrics: RouterMetrics,
        lingering_s: float = 1.0,
        connections: ClientConnections | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, lingering_time=lingering_s, **kwargs)
        self._metrics = metrics
        self._client_connections = connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # aiohttp builds the Server itself; this only swaps its handler class
        cast(_JsonErrorServer, server).client_connections = self._client_connections
        cast(_JsonErrorServer, server).metrics = self._metrics
        return server


def validation_failed(details: Sequence[Detail], *, close: bool = False) -> ApiError:
    """vLLM's 400 for a body its pydantic model refuses, as its validation handler writes it
    (protocol.vllm_errors): type "Bad Request", `param` the first error's location."""
    return ApiError(400, validation_message(details), validation_param(details), close=close, kind=VALIDATION_ERROR)


def _json_invalid(raw: bytes, *, close: bool = False) -> ApiError | None:
    """vLLM's 400 for a body the stdlib's json.loads (FastAPI's reader) refuses: FastAPI's
    json_invalid error, the decoder's offset and words; None where it reads it."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as err:
        return validation_failed([json_invalid_error(err.pos, err.msg)], close=close)
    except (ValueError, RecursionError):  # not in a JSON encoding, or nested past Python's limit
        pass
    return None


def not_json(raw: bytes, why: object) -> ApiError:
    """A body msgspec could not decode: vLLM's 400 where the stdlib refuses it too; the router's own,
    saying `why`, where only msgspec does (NaN, Infinity, 1e400, which vLLM reads and the router
    could not send on as JSON)."""
    return _json_invalid(raw) or ApiError(400, f"the body is not valid JSON: {why}", "body")


def unsupported_media_type(*, close: bool, decoded: bytes = b"") -> ApiError:
    """vLLM's 400, in its body, for a body on a JSON route sent as another media type. `decoded`: a
    body FastAPI decodes as JSON before that check (protocol.vllm_errors.JsonMediaType.DECODED),
    whose decode error comes instead where it has one."""
    if decoded and (invalid := _json_invalid(decoded, close=close)) is not None:
        return invalid
    return validation_failed([UNSUPPORTED_MEDIA_TYPE], close=close)
