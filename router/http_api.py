"""The OpenAI-compatible front door (aiohttp): /v1/completions, /v1/chat/completions (stream and
not), /v1/models, vLLM's /tokenize and /detokenize (answered by a worker's engine), /version (the
router's), /health (and vLLM's /ping), /ready, /metrics, /debug/route (the decision a request would get),
/debug/index (per worker: sync state, (epoch, seq) and the digest of what the index holds) and
/debug/workers (every worker with whether it is routable and why not: /ready names only the first
of those left out, as a probe's answer must stay small and cheap at any fleet size).

The client's request goes to the engine as the client wrote it, and the engine's answer comes
back as the engine wrote it. The router tokenizes the prompt only to route it (block hashes,
prefix match, accounting). A completions prompt reaches the engine as the very token ids that
were routed, unless its answer depends on the text (an echo, a FIM `suffix`, a truncation with
no side, which vLLM's tokenizer applies keeping the BOS): then as its text. A chat request
reaches it as its messages, which the engine renders with the template the router's tokenizer
fingerprint matched. What the router reads of the body, and refuses, is router.request_parsing's.
It writes the engine's SSE payloads out unchanged; a whole answer may get one thing added, the
`kvswitch` route object. Batched prompts go to one worker, routed by the first prompt.

A routed response may carry its route: `x-kvswitch-decode-worker`, `x-kvswitch-prefill:
bypass|remote|agg` and `x-kvswitch-outcome` headers naming where the request really went, after
any retry or fallback, and the whole answer's `kvswitch` member; to whom is router.route_info's
(`--route-info`; with API keys, only operators by default). Every routed response carries
`Server-Timing` (`parse`, `route`, `worker`, in ms) saying where its time went.
Every answer, errors included, carries `x-request-id` as vLLM's --enable-request-id-headers sets
it: the client's X-Request-Id, else a routed answer's `id`, else a fresh one. Not aiohttp's own
400/414/431 to a request that does not parse as HTTP, which no handler sees (nor does vLLM's).

Every error is OpenAI JSON (router.api_errors), including what aiohttp answers before a handler
runs: its parser's errors (`FrontDoorRunner`), unknown routes and methods. An `Expect` is
router.expectations' on every route: an unsupported one is a 417 after the API key and the drain
(an unknown route's 404 and a wrong method's 405 come first), and a POST's `100-continue` gets its
100 only when the body is read, so a request refused before that never sends it. A client that
disconnects cancels its request on the worker.

A client that stops reading, its answer streamed or whole, holds its request no longer than its
deadline: each write waits at most until then, and then the connection is aborted (counted 504).
A whole answer is written in its handler, so it counts as answered only once its client took it,
and its request as in flight until then. A streaming client that reads slower than its worker
writes falls behind by at most router.dispatch.MAX_QUEUED_BYTES: then its leg is cancelled and the
stream ends with a 408 error event. All clients together are held to one budget
(router.client_buffers): past it, the stream furthest behind is cut alike, or the whole answer
furthest behind has its connection aborted (counted 408). A whole answer goes out in slices, so it
counts only what its client has not taken; one that would take the total over it while the others'
clients read is a 503 with Retry-After, one larger than it a 400 saying what the client can change.

Draining (`Drain`, on SIGTERM): the listener stays open while the requests in flight finish; a new
request (anything but /health, /ping, /ready and /metrics) is a 503 with Retry-After and Connection:
close. Those still running when the drain ends are cut: a stream gets a final 503 error event and
`[DONE]`, any other request a 503, and their legs are cancelled on the workers. A stream's client
has up to _CUT_S (1 s) to take what was queued for it, that error event and `[DONE]`; one that
reads no more in that time, or a stream cut in its last write or its chunks' close, has its
connection aborted (its head went out, so no 503 can follow), counted 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from protocol import GenerateRequest, ResponseChunk, SamplingParams
from protocol.client_errors import brief
from protocol.messages import (
    ANNOTATION_BYPASS,
    ENDPOINT_CHAT,
    ENDPOINT_COMPLETIONS,
    ENDPOINT_DETOKENIZE,
    ENDPOINT_TOKENIZE,
    ENGINE_HEADERS,
)
from protocol.version import BUILD
from protocol.vllm_errors import JsonMediaType, json_media_type
from router.admission import Overloaded
from router.api_errors import (
    ApiError,
    json_response,
    leg_error,
    openai_errors,
    plan_error,
    prompt_too_long,
    unsupported_media_type,
)
from router.api_keys import ApiKeys
from router.body_json import decode_json
from router.client_buffers import ROOM_RETRY_S, SLICE_BYTES, SPARE_BYTES, HeldAnswer
from router.dispatch import Job
from router.expectations import ExpectRoutes, expectations, expects_continue, send_continue
from router.leg import LegError
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.planner import PlanError
from router.request_parsing import (
    NOT_AN_OBJECT,
    ParsedRequest,
    check_hashable,
    header_priority,
    is_text,
    parse_request,
    prompt_ids,
    typed_field,
)
from router.request_path import RequestPath, Unknown
from router.route_info import route_info_mode, route_shown
from router.routes import PROBES, add_routes
from router.tokenization import Tokenization

__all__ = ["Drain", "HttpLimits", "make_app"]

log = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What the front door accepts: bodies up to `max_body_bytes` (else 413), sent within
    `body_timeout_s` (else 408); a connection that completes no request head for `idle_timeout_s`,
    first or next, is closed (aiohttp's keep-alive timer, which since 3.14.4 also runs from the
    connect: a client sending nothing, or its headers a byte at a time, held a socket for ever);
    prompt text above `offload_chars` is tokenized off the loop."""

    max_body_bytes: int = 16 * 1024 * 1024
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 75.0  # aiohttp's default keep-alive
    offload_chars: int = 32 * 1024

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 < self.body_timeout_s < math.inf:  # an infinity lets a client hold a connection forever
            raise ValueError(f"body_timeout_s must be a finite number of seconds > 0, got {self.body_timeout_s}")
        if not 0 < self.idle_timeout_s < math.inf:
            raise ValueError(f"idle_timeout_s must be a finite number of seconds > 0, got {self.idle_timeout_s}")


# --- answers ----------------------------------------------------------------------------------------


def _route_info(job: Job) -> dict[str, Any]:
    return {
        "decode_worker": job.plan.decode.worker,
        "prefill": str(job.path),
        "prefill_worker": job.prefill_worker,
        "outcome": str(job.outcome),
        "attempts": job.attempts,
    }


@dataclass(slots=True)
class _Timing:
    """Where a response's time went before its headers, on the router's clock (perf_counter)."""

    start: float
    parsed: float = 0.0  # body read, validated, tokenized
    planned: float = 0.0  # admitted and routed

    def header(self, answered: float) -> str:
        """W3C Server-Timing, in ms: `parse`, `route`, and `worker`: from the plan to the first
        chunk of a stream (or a whole answer's last), i.e. the NATS hop, the shim and the engine."""
        parse, route, worker = self.parsed - self.start, self.planned - self.parsed, answered - self.planned
        return f"parse;dur={parse * 1e3:.3f}, route;dur={route * 1e3:.3f}, worker;dur={worker * 1e3:.3f}"


@dataclass(slots=True, frozen=True)
class _Ids:
    """A request's ids: `request_id`, the router's own, unique, keys it on NATS, in bookings and in
    logs; `engine`, what the engine names its answer by (X-Request-Id on every leg), is the client's
    X-Request-Id or body `request_id` when it gave one, as vLLM takes them, else `request_id`."""

    request_id: str
    engine: str
    header: str  # x-request-id: the client's own, echoed, else the answer's `id` (cmpl-<engine>)

    @classmethod
    def of(cls, request: web.Request, body: Mapping[str, Any], *, chat: bool) -> _Ids:
        request_id = uuid.uuid4().hex
        sent = request.headers.get("X-Request-Id")
        in_body = body.get("request_id")
        engine = sent or (in_body if isinstance(in_body, str) and in_body else request_id)
        return cls(request_id, engine, sent or ("chatcmpl-" if chat else "cmpl-") + engine)


def _check_passed_headers(request: web.Request) -> None:
    """ApiError 400 for a header the engine gets that is not UTF-8 text: aiohttp hands bytes that are
    not as lone surrogates, which no message to the worker can carry (each such request was a 500
    with an ERROR traceback). vLLM reads header bytes as latin-1; the id the engine would be given is
    not the one the client sent either way, so it is refused, named."""
    for name in _PASSED_HEADERS:
        value = request.headers.get(name)
        if value is not None and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise ApiError(400, f"the {name} header is not UTF-8 text", name) from None


_PASSED_HEADERS = ("X-Request-Id", *ENGINE_HEADERS)


def _route_headers(job: Job, ids: _Ids, timing: _Timing, *, shown: bool) -> dict[str, str]:
    headers = {"x-request-id": ids.header, "Server-Timing": timing.header(time.perf_counter())}
    if shown:
        headers["x-kvswitch-decode-worker"] = job.plan.decode.worker
        headers["x-kvswitch-prefill"] = str(job.path)
        headers["x-kvswitch-outcome"] = str(job.outcome)
    return headers


def _with_route(parts: list[bytes], route: dict[str, Any] | None) -> list[bytes]:
    """The engine's JSON object, in the pieces it came in, with the router's `kvswitch` member added
    as its last one (`route`; none when None): no copy of the body but its last piece (trimmed,
    sliced and concatenated whole, it was copied five times on the loop: 0.42 s for 150 MB), and
    each piece can be let go once written (_slices)."""
    body = list(parts)
    _rstrip(body)
    if not body or not body[-1].endswith(b"}"):
        raise ApiError(502, "the worker's answer is not a JSON object")
    if route is None:
        return body
    body[-1] = body[-1][:-1]
    _rstrip(body)
    sep = b"" if body and body[-1].endswith(b"{") else b","
    return [*body, sep, b'"kvswitch":', _JSON.encode(route), b"}"]


def _slices(pieces: list[bytes]) -> Iterator[bytes | memoryview]:
    """A whole answer's `pieces` in writes of about SLICE_BYTES (small pieces joined, a large one
    cut), taken off the list as they go so that each piece is let go once written."""
    pieces.reverse()
    batch: list[bytes] = []
    batched = 0
    while pieces:
        piece = pieces.pop()
        if batched + len(piece) <= SLICE_BYTES:
            batch.append(piece)
            batched += len(piece)
            continue
        if batch:
            yield b"".join(batch)
            batch, batched = [], 0
        if len(piece) < SLICE_BYTES:
            batch, batched = [piece], len(piece)
            continue
        view = memoryview(piece)
        for at in range(0, len(view), SLICE_BYTES):
            yield view[at : at + SLICE_BYTES]
    if batch:
        yield b"".join(batch)


def _rstrip(parts: list[bytes]) -> None:
    """The whitespace that ends the bytes `parts` make, off them (a piece left empty dropped)."""
    while parts:
        if last := parts[-1].rstrip():
            parts[-1] = last
            return
        parts.pop()


def _sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


async def _sent(request: web.Request, data: bytes, write: Callable[[bytes], Awaitable[None]], deadline: float) -> bool:
    """Whether the client took `data`, written by `write`, before `deadline` (time.monotonic()): aiohttp's
    write waits for the socket to drain, which is forever for a client that stopped reading. It
    waits only while the protocol is paused (from over the high-water mark until under the low
    one): a write while it is not, that stays under the high mark, cannot wait and goes without a
    timer (one costs ~5 µs, on every streamed chunk)."""
    transport = request.transport
    if transport is not None and not request.protocol.writing_paused:
        _, high = transport.get_write_buffer_limits()
        if transport.get_write_buffer_size() + len(data) + _FRAMING <= high:
            await write(data)
            return True
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            await write(data)
    except TimeoutError:
        return False
    return True


async def _resumed(request: web.Request, deadline: float) -> bool:
    """Whether the transport's writing resumed (or its connection was lost) before `deadline`.
    Polled: aiohttp tells only its own drain waiter, which the cut left cancelled."""
    while request.transport is not None and request.protocol.writing_paused:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_RESUME_POLL_S)
    return True


_RESUME_POLL_S = 0.01  # only for a stream the drain cut, in its last second
_FRAMING = 32  # chunked encoding's size line and CRLFs around a write
_SSE_DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's code for a client that left before the answer: counted, never sent
_CUT_S = 1.0  # for the requests cut at the drain's end to write their last answer


class Drain:
    """The front door's drain (RouterService.stop). From `finish(limit_s)` on, new requests are
    refused (`refusal()`); it waits up to `limit_s` for those in flight, then cancels the rest,
    whose handlers answer 503 (`ended()` tells them it was the drain, not their client leaving)."""

    def __init__(self) -> None:
        self.draining = False
        self._running: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def finish(self, limit_s: float) -> tuple[int, int]:
        """Refuse new requests, let those in flight run up to `limit_s`, then cut the rest; how many
        finished on their own and how many were cut."""
        self.draining = True
        running = len(self._running)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                await self._idle.wait()
        self._cut = set(self._running)
        cut = len(self._cut)  # ended() takes each out of _cut as it answers
        for task in self._cut:
            task.cancel()
        if cut:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CUT_S):
                    await self._idle.wait()
        return running - cut, cut

    def ended(self) -> bool:
        """In a handler's `except CancelledError`: True when the drain cut it, which then goes on to
        answer (its cancellation undone); False when its client left."""
        task = asyncio.current_task()
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        task.uncancel()
        return True

    @staticmethod
    def refusal() -> web.Response:
        return ApiError(503, "the router is shutting down: send the request again", retry_after_s=1,
                        close=True).response()  # fmt: skip

    def enter(self, task: asyncio.Task[Any]) -> None:
        self._running.add(task)
        self._idle.clear()

    def leave(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if not self._running:
            self._idle.set()


SHUT_DOWN = "the router shut down before the request ended"


class _Handlers:
    def __init__(
        self,
        path: RequestPath,
        tokenization: Tokenization,
        limits: HttpLimits,
        *,
        health: Callable[[], dict[str, Any]],
        readiness: Callable[[], tuple[bool, dict[str, Any]]],
        index_state: Callable[[], dict[str, Any]],
        tokenizer_report: Callable[[], dict[str, Any]] | None,
        worker_listing: Callable[[], dict[str, Any]],
        started_at: float,
        unplanned: Callable[[str | None], list[dict[str, Any]]],
        drain: Drain,
        route_shown: Callable[[str | None], bool],
    ) -> None:
        self.path = path
        self.tokenization = tokenization
        self.limits = limits
        self._health = health
        self._readiness = readiness
        self._index_state = index_state
        self._tokenizer_report = tokenizer_report
        self._worker_listing = worker_listing
        self.started_at = started_at
        self._unplanned = unplanned
        self.drain = drain
        self._route_shown = route_shown
        self._failures = path.dispatcher.leg_failures(log)  # requests failed before their first output
        self._utility_failures = path.dispatcher.leg_failures(log, utility=True)  # and utility calls

    def _failed_before_output(self, rid: str, exc: LegError, *, utility: bool = False) -> ApiError:
        """The client's error for request `rid` (a completion's, or a /tokenize or /detokenize call's)
        whose leg failed before its first output, said once as a stream that fails after it is: at
        WARNING, at INFO for a request its engine refused (the client's fault, its answer the engine's
        own) or turned away for now (its 408 or 429, `busy`: the fleet is full, counted in
        kvswitch_router_engine_refusals_total, not a fault worth a WARNING per request). Until
        2026-12-07 neither was said anywhere, a 504 at the deadline included (a utility call's, only its
        retries). Not a slow reader, which the dispatcher said. A WARNING is said once per episode of
        its worker and kind (router.leg_failures): a dead engine fails every request sent to it.
        A `utility` call's are apart: its answer ends theirs, a generated token ends the others."""
        failed = leg_error(exc)
        msg = "request %s: failed before its first output (%s); the client got a %d"
        if exc.slow_reader:
            return failed
        if exc.refused or exc.busy:
            log.info(msg, rid, _leg_failure(exc), failed.code, extra={"request_id": rid})
        else:
            failures = self._utility_failures if utility else self._failures
            failures.failed(exc.worker, exc.kind, rid, msg, rid, _leg_failure(exc), failed.code)
        return failed

    async def debug_index(self, request: web.Request) -> web.Response:
        return json_response(self._index_state())

    async def debug_workers(self, request: web.Request) -> web.Response:
        return json_response(self._worker_listing())

    async def health(self, request: web.Request) -> web.Response:
        return json_response(self._health())

    async def ready(self, request: web.Request) -> web.Response:
        ready, body = self._readiness()
        if refusals := self.path.planner.text_refusals(self.path.default_model):
            body = {**body, "warnings": [*body["warnings"], *refusals]}
        if self._tokenizer_report is not None:
            body = {**body, "tokenizer": self._tokenizer_report()}
        return json_response({"ready": ready, **body}, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=await self.path.metrics.render_off_loop(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        created = int(self.started_at)
        data = []
        # Models, then the other names they are served under (root: the model, as vLLM's cards give
        # every served name the model's path), then LoRA adapters, whose `parent` names the model.
        names: list[tuple[str, str, str | None]] = [(m, m, None) for m in self.path.models()]
        names += [(a, m, None) for a, m in sorted(self.path.aliases().items())]
        names += [(a, a, m) for a, m in sorted(self.path.adapters().items())]
        # Only what a request may name here: not a name that resolves to several models (refused),
        # and with --model only that model's names.
        clashes, only = self.path.clashes(), self.path.default_model
        for m, root, parent in names:
            if m in clashes or (only is not None and only not in (m, parent or root)):
                continue
            card = {
                "id": m,
                "object": "model",
                "created": created,
                "owned_by": "kvswitch",
                "root": root,
                "parent": parent,
            }
            length = self.path.max_model_len(m)
            if length is not None:  # as vLLM's card has it
                card["max_model_len"] = length
            data.append(card)
        return json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._utility(request, ENDPOINT_TOKENIZE)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._utility(request, ENDPOINT_DETOKENIZE)

    async def _utility(self, request: web.Request, endpoint: str) -> web.Response:
        """vLLM's /tokenize or /detokenize, answered by a worker's engine: the router's tokenizer is
        there to route, and only the engine's says exactly what the engine will see."""
        status = 500
        rid = uuid.uuid4().hex  # the call's, in its retries' lines and its failure's
        try:
            body = await self._json_body(request)
            if not isinstance(body, dict):
                raise ApiError(400, NOT_AN_OBJECT)
            model = self._model(typed_field(body, "model", str, None))
            try:
                raw = await self.path.call(model, endpoint, body, request_id=rid)
            except PlanError as exc:
                raise plan_error(exc) from exc
            except LegError as exc:
                raise self._failed_before_output(rid, exc, utility=True) from exc
            status = 200
            return web.Response(body=raw, content_type="application/json")
        except ApiError as exc:
            status = exc.code
            return exc.response()
        except asyncio.CancelledError:
            if not self.drain.ended():
                status = CLIENT_CLOSED
                raise
            status = 503
            return ApiError(503, SHUT_DOWN, close=True).response()
        finally:
            self.path.metrics.count_request(endpoint, status)

    async def version(self, request: web.Request) -> web.Response:
        """The router's own build, release and wire (protocol.version.BUILD; vLLM's /version names the
        engine's: ask a worker for that)."""
        return json_response({"version": BUILD})

    async def debug_route(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            parsed = self._parse(body, chat=isinstance(body, dict) and "messages" in body)
            try:
                model = self._model(parsed.model)
            except ApiError as exc:
                return self._with_unplanned(exc, parsed.model)
            routed, _ = await self._tokens(parsed, model)
            try:
                explained = self.path.explain(model, routed, text=is_text(parsed), shape=parsed.shape)
            except PlanError as exc:
                return self._with_unplanned(plan_error(exc), model)
            # the planner never sees records refused in etcd, nor workers the registry does not route
            explained["excluded"] += self._unplanned(model)
            return json_response(explained)
        except ApiError as exc:
            return exc.response()
        except asyncio.CancelledError:  # its body read or its prompt's tokenizing cut
            if not self.drain.ended():
                raise
            return ApiError(503, SHUT_DOWN, close=True).response()

    def _with_unplanned(self, exc: ApiError, model: str | None) -> web.Response:
        """A model with no worker, or none to route to, may be one whose records etcd holds but
        were refused, or whose workers the registry does not route: listed beside the error as on
        an answer."""
        left_out = self._unplanned(model)
        if not left_out:
            return exc.response()
        return json_response({**exc.body(), "excluded": left_out}, status=exc.code)

    # --- reading the request ------------------------------------------------------------------

    async def _json_body(self, request: web.Request) -> Any:
        # vLLM's validate_json_request guards its JSON routes: any other media type (none included)
        # is a 400, but a body FastAPI decodes first (application/*+json) gets its decode error where
        # it has one (protocol.vllm_errors.json_media_type). It is also what keeps a web page from
        # having a browser post a text/plain body here, which needs no CORS preflight.
        media = json_media_type(request.headers.get("Content-Type", ""))
        if media is JsonMediaType.REFUSED:
            raise await self._not_json_type(request)
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"the request body is {request.content_length} bytes, over the limit of {limit}",
                           "body", close=True)  # fmt: skip
        await send_continue(request)
        raw = await self._read(request)
        if media is JsonMediaType.DECODED:
            raise unsupported_media_type(close=False, decoded=raw)
        if not raw:  # engine_sim's reading: no JSON object
            raise ApiError(400, NOT_AN_OBJECT)
        try:
            return decode_json(raw)
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply", "body") from None

    async def _read(self, request: web.Request) -> bytes:
        """The whole body, or the refusal of one over the limit, late or undecodable."""
        limit = self.limits.max_body_bytes
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {self.limits.body_timeout_s:g}s", "body", close=True
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes", "body", close=True) from None
        except web.RequestPayloadError as exc:
            # A client's fault (a body that does not decode as its Content-Encoding says, a broken
            # chunk): until 2026-12-07 a 500 and two ERROR tracebacks. The parser is done with this
            # connection; the body marked read, aiohttp does not read it again after the answer
            # (a "Unhandled exception" there) but closes the connection.
            request.content.feed_eof()
            why = getattr(exc.__cause__, "message", None) or str(exc)
            raise ApiError(400, f"the request body could not be decoded: {why}", "body", close=True) from None

    async def _not_json_type(self, request: web.Request) -> ApiError:
        """vLLM's 400 for a body sent as another media type. The body is read and dropped, so the
        connection serves the client's next request, as vLLM's does (until 2026-12-07 it closed:
        a request pipelined behind was lost); it closes where the body is not read: one over the
        limit, one the client sends only after a 100 Continue, or one that fails to arrive."""
        if not request.can_read_body:
            return unsupported_media_type(close=False)
        length = request.content_length
        if expects_continue(request) or (length is not None and length > self.limits.max_body_bytes):
            return unsupported_media_type(close=True)
        try:
            await self._read(request)
        except ApiError:
            return unsupported_media_type(close=True)
        return unsupported_media_type(close=False)

    def _parse(self, body: Any, *, chat: bool) -> ParsedRequest:
        """parse_request, refusing what vLLM alone refuses only where vLLM engines alone serve the
        model the body names."""
        named = body.get("model") if isinstance(body, dict) else None
        return parse_request(body, chat=chat, vllm_only=self.path.vllm_only(named))

    def _model(self, name: str | None) -> str:
        try:
            return self.path.resolve_model(name)
        except Unknown as exc:
            param = "model" if exc.code < 500 else None  # a 503 is no fault of the name
            raise ApiError(exc.code, str(exc), param, retry_after_s=exc.retry_after_s) from exc

    async def _tokens(self, parsed: ParsedRequest, model: str) -> tuple[list[int], list[list[int]]]:
        # The model's context is looked up (a pass over its workers) only for a truncation to it.
        limit = self.path.max_model_len(model) if parsed.truncate_to_context is not None else None
        routed, prompts = await prompt_ids(self.tokenization, parsed, limit)
        if not is_text(parsed):  # ids past u32, refused as truncated and after vLLM's length check
            try:
                check_hashable(prompts)
            except ApiError:
                self._over_context(parsed, model, prompts)
                raise
        return routed, prompts

    def _leg(self, parsed: ParsedRequest, ids: _Ids, model: str, routed: list[int], prompts: list[list[int]],
             headers: Mapping[str, str]) -> GenerateRequest:  # fmt: skip
        params = parsed.params
        params["model"] = model
        limit = self._over_context(parsed, model, prompts)
        if not parsed.chat and not (parsed.engine_tokenizes and is_text(parsed)) and limit is None:
            # The engine computes the very ids that were routed; one prompt rides in token_ids.
            # Some requests keep the client's text (ParsedRequest.engine_tokenizes): vLLM echoes a
            # text prompt as written but token ids as it decodes them, special tokens and all.
            if len(prompts) > 1:
                params["prompt"] = prompts
            else:
                params.pop("prompt", None)
        return GenerateRequest(
            request_id=ids.request_id,
            engine_request_id=ids.engine,
            model=model,
            token_ids=routed if limit is None else routed[: limit + 1],
            # The engine reads `params`; `sampling` is for engines driven by token ids alone.
            sampling=SamplingParams() if parsed.max_tokens is None else SamplingParams(max_tokens=parsed.max_tokens),
            stream=parsed.stream,
            annotations=[a for a in parsed.annotations if a != ANNOTATION_BYPASS],  # the router's alone
            endpoint=ENDPOINT_CHAT if parsed.chat else ENDPOINT_COMPLETIONS,
            params=params,
            headers={h: v for h in ENGINE_HEADERS if (v := headers.get(h)) is not None},
        )

    def _over_context(self, parsed: ParsedRequest, model: str, prompts: list[list[int]]) -> int | None:
        """The model's context when a prompt is longer, else None. A text prompt (a chat's too) is
        sent as the client's text, so the engine refuses it in its own words (vLLM tokenizes text
        only to max_model_len + 1 and says "at least" that many; as ids, it named the whole count
        the router had computed), its leg carrying only the routed ids the engine reads of it: all
        of them beside the text made a 150k-token prompt a 1 MB leg, NATS's 413. A token-id prompt
        is refused here in vLLM's words (prompt_too_long), its count the engine's own: sent, past
        ~349k ids it was NATS's 413 too."""
        limit = self.path.max_model_len(model)
        over = None if limit is None else next((len(p) for p in prompts if len(p) > limit), None)
        if limit is None or over is None:
            return None
        if not is_text(parsed):
            raise prompt_too_long(limit, over)
        return limit

    # --- one request ----------------------------------------------------------------------------

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        endpoint = ENDPOINT_CHAT if chat else ENDPOINT_COMPLETIONS  # the labels _COUNTED names
        status = 500
        why = ""  # why it failed, for its span
        broke = False  # an answer that failed after its 200 went out
        sent: int | None = None  # the status an answer's head went out with; `status` is its outcome's
        timing = _Timing(time.perf_counter())
        # The span comes first: a request refused before it is routed (a 400, an unknown model) has
        # one too, what is known only later set on it then.
        with self.path.tracer.request(_SPAN_NAMES[chat], request.headers) as span:
            try:
                _check_passed_headers(request)
                body = await self._json_body(request)
                parsed = self._parse(body, chat=chat)
                if (priority := header_priority(request.headers)) is not None:
                    parsed.shape = msgspec.structs.replace(parsed.shape, priority=priority)
                ids = _Ids.of(request, body, chat=chat)
                self.path.tracer.named(span, ids.request_id, ids.engine)
                model = self._model(parsed.model)
                self.path.tracer.model(span, model)
                routed, prompts = await self._tokens(parsed, model)
                timing.parsed = time.perf_counter()
                leg = self._leg(parsed, ids, model, routed, prompts, request.headers)
                try:
                    job = await self.path.open(
                        leg, span, text=is_text(parsed), shape=parsed.shape, max_tokens=parsed.max_tokens
                    )
                except PlanError as exc:
                    raise plan_error(exc) from exc
                except Overloaded as exc:
                    raise ApiError(429, str(exc), retry_after_s=exc.retry_after_s) from exc
                timing.planned = time.perf_counter()
                shown = self._route_shown(request.headers.get("Authorization"))
                try:
                    with self.path.serving():  # until its answer is written, not only generated
                        if parsed.stream:
                            resp, status, why = await self._stream(request, job, ids, timing, shown)
                            sent = resp.status
                            broke = bool(why)  # the client got an error event, or nothing more
                        else:
                            resp, body = await self._whole(job, ids, timing, shown)
                            status, why = await self._write_whole(request, job, resp, body)
                            sent, broke = resp.status, bool(why)  # its head went out before it failed
                finally:
                    self.path.release(job)  # a no-op once its stream ended
                    self.path.tracer.routed(span, job)
                return resp
            except ApiError as exc:
                status, why = exc.code, exc.message
                return exc.response()
            except asyncio.CancelledError:
                if not self.drain.ended():
                    status = CLIENT_CLOSED
                    raise
                status, why = 503, SHUT_DOWN
                return ApiError(503, SHUT_DOWN, close=True).response()
            except ConnectionResetError:  # the client left while we wrote to it
                status = CLIENT_CLOSED
                raise web.HTTPException() from None
            except Exception as exc:  # a bug: aiohttp answers 500 and logs it
                span.record_exception(exc)
                why = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                self.path.metrics.count_request(endpoint, status)
                self.path.tracer.answered(span, status if sent is None else sent, why, broke=broke)

    async def _whole(self, job: Job, ids: _Ids, timing: _Timing, shown: bool) -> tuple[web.StreamResponse, list[bytes]]:
        """The answer's head (its Content-Length set) and its body's pieces, for _write_whole."""
        parts: list[bytes] = []
        try:
            async for chunk in self.path.stream(job, timing.start):
                if chunk.body:
                    parts.append(chunk.body)
        except LegError as exc:
            raise self._failed_before_output(job.request.request_id, exc) from exc
        body = _with_route(parts, _route_info(job) if shown else None)
        resp = web.StreamResponse(headers=_route_headers(job, ids, timing, shown=shown))
        resp.content_type = "application/json"
        resp.content_length = sum(map(len, body))
        return resp, body

    async def _write_whole(
        self, request: web.Request, job: Job, resp: web.StreamResponse, body: list[bytes]
    ) -> tuple[int, str]:
        """Write a whole answer (its Content-Length kept) in the handler, as a stream's last write
        is: the code it counts as and why it failed. Returned unwritten, aiohttp wrote it after the
        handler had counted it a 200, waiting for the client for ever: one that stopped reading held
        its body (25 MB for 16k prompt_logprobs) past any deadline (client-fault audit).

        It is held under the replica's budget for its clients (router.client_buffers) from before
        its head goes out, and written in slices, each counted off as its client takes it: in one
        write it counted whole until its last byte was taken, so any answer over a stream's 8 MiB
        was the first cut over the budget, its client reading it or not (bufrev audit). Ended over
        the budget, it is aborted, counted 408 as a stream cut for its slow reader is."""
        buffers = self.path.dispatcher.buffers
        size = resp.content_length or 0
        if not buffers.fits(size):  # refused before its head goes out, and not retried as a 5xx is
            raise ApiError(
                400,
                f"the answer is {size} bytes, more than this router holds for all its clients at once "
                f"({buffers.budget} bytes, its operator's --client-buffer-mib, less {SPARE_BYTES} kept free): "
                "ask for fewer logprobs or prompt_logprobs or a smaller max_tokens, or stream it (stream=true)",
            )
        held = buffers.hold(size)  # released in the finally, however the handler ends
        try:
            if not await buffers.admit(held):
                raise ApiError(
                    503,
                    f"the router holds its budget of {buffers.budget} bytes for clients taking their "
                    f"answers (--client-buffer-mib), with no room for this one's {size} bytes",
                    retry_after_s=ROOM_RETRY_S,
                )
            # Always under a timer, not _sent's: the head waits for the first write, so a body
            # just under the high-water mark passed _sent's no-timer test and waited for ever.
            async with asyncio.timeout(job.deadline - time.monotonic()) as timer:
                held.watch(timer)
                await resp.prepare(request)
                for piece in _slices(body):
                    await resp.write(piece)  # over 64 KiB: waits for the transport to drain
                    buffers.taken(held, len(piece))
                await resp.write_eof()
            return 200, ""
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            if not self.drain.ended():
                raise
            if not resp.prepared:  # cut while admit made room for it: the drain's 503 can still go out
                raise ApiError(503, SHUT_DOWN, close=True) from None
            # Its head went out: no 503 can follow it, and a body cut short says less than none.
            _abort(request)
            return 503, SHUT_DOWN
        finally:
            buffers.release(held)
        if held.ended:
            return 408, _abort_over_budget(request, job, held, buffers.budget)
        return 504, _abort_unread(request, job, "answer")

    async def _stream(
        self, request: web.Request, job: Job, ids: _Ids, timing: _Timing, shown: bool
    ) -> tuple[web.StreamResponse, int, str]:
        """The stream, the code it counts as: 200, or its error event's when it failed after its
        headers (their 200 went out before the failure), and why it failed then ("" if it did not)."""
        chunks = self.path.stream(job, timing.start)
        try:
            first = await anext(chunks)
        except LegError as exc:
            raise self._failed_before_output(job.request.request_id, exc) from exc
        except StopAsyncIteration:
            raise ApiError(502, "the worker ended the stream without a chunk") from None
        headers = {
            "Content-Type": "text/event-stream; charset=utf-8",  # vLLM's (Starlette's) bytes
            "Cache-Control": "no-cache",
            **_route_headers(job, ids, timing, shown=shown),
        }
        resp = web.StreamResponse(status=200, headers=headers)
        try:
            await resp.prepare(request)
        except BaseException:
            await chunks.aclose()
            raise
        try:
            status, why = await self._streamed(request, job, resp, chunks, first)
        except asyncio.CancelledError:
            if not self.drain.ended():
                raise
            # Cut in its last write or its chunks' close, where no error event can follow: its head
            # went out, so no 503 can either (before, aiohttp wrote one as a second head).
            _abort(request)
            return resp, 503, SHUT_DOWN
        return resp, status, why

    async def _streamed(
        self,
        request: web.Request,
        job: Job,
        resp: web.StreamResponse,
        chunks: AsyncGenerator[ResponseChunk, None],
        first: ResponseChunk,
    ) -> tuple[int, str]:
        """The stream's events after its head, the code it counts as and why it failed (_stream)."""
        out: list[bytes] = []
        chunk = first
        failed: ApiError | None = None
        why = ""  # a worker's failure, said once at WARNING (a bug is said with its traceback)
        refused = False  # the engine refused the request (the client's fault): said at INFO
        unread = False  # the client took nothing more before the deadline
        cut_by: float | None = None  # cut by the drain's end: its last write's deadline (_CUT_S)
        try:
            # The events one worker chunk carries go out in one write (one send, one drain).
            while True:
                out += [_sse_event(e) for e in chunk.events]
                if chunk.final:
                    break
                if out:
                    # Queued as its write starts, before it waits for the client: a cut in that wait
                    # must not write them again before its error event.
                    data = b"".join(out)
                    out.clear()
                    if not await _sent(request, data, resp.write, job.deadline):
                        unread = True
                        break
                chunk = await anext(chunks)
        except LegError as exc:
            failed = leg_error(exc, streaming=True)
            why = "" if exc.slow_reader else _leg_failure(exc)  # that one the dispatcher said, at INFO
            refused = exc.refused  # not `busy`: a 429 or 408 after output cut the answer for load
        except StopAsyncIteration:
            failed = ApiError(502, "the worker ended the stream early")
            why = failed.message
        except ConnectionResetError:
            raise  # the client left (a write met its reset before its handler was cancelled): 499, _generate
        except Exception:
            log.exception("request %s: the stream failed", job.request.request_id)
            failed = ApiError(502, "the stream failed")
        except asyncio.CancelledError:
            if not self.drain.ended():
                raise
            failed = ApiError(503, SHUT_DOWN)
            cut_by = min(job.deadline, time.monotonic() + _CUT_S)
        finally:
            await chunks.aclose()
        if unread:
            return 504, _abort_unread(request, job, "stream")
        if failed is not None:
            if why:
                rid = job.request.request_id
                # An engine's refusal (SGLang's 400 for a sampling mask past its limit, after tokens)
                # is the client's, as one before the first output is: INFO, no worker fault. Its
                # 429 or 408 then is not: the answer was cut off for the engine's load.
                level = logging.INFO if refused else logging.WARNING
                log.log(
                    level,
                    "request %s: the stream failed after its first chunk (%s); the client got a %d error event",
                    rid,
                    why,
                    failed.code,
                    extra={"request_id": rid},
                )
            out.append(_sse_event(failed.own_body or _JSON.encode(failed.body())))
        out.append(_SSE_DONE)
        data = b"".join(out)
        if cut_by is not None:
            # A write the cut took leaves aiohttp's drain waiter cancelled until the transport's
            # writing resumes: the last write awaited it and raised the cut again at once, aborted
            # with its queued bytes lost, its client reading or not.
            if not (await _resumed(request, cut_by) and await _sent(request, data, resp.write_eof, cut_by)):
                _abort(request)  # its client took no more in the drain's grace
                return 503, SHUT_DOWN
        elif not await _sent(request, data, resp.write_eof, job.deadline):
            return 504, _abort_unread(request, job, "stream")
        return (200, "") if failed is None else (failed.code, failed.message)


_SPAN_NAMES = {False: "POST /v1/completions", True: "POST /v1/chat/completions"}


def _leg_failure(exc: LegError) -> str:
    """A failed leg for the log: its role, worker, kind and message."""
    return f"{exc.role or 'its'} leg on worker {exc.worker}: {exc.kind}: {brief(exc.message)}"


def _abort(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


def _abort_unread(request: web.Request, job: Job, what: str) -> str:
    """An answer (`what`: "stream" or "answer") its client stopped reading until the deadline: no
    error can reach it, so the connection is aborted, after its leg was cancelled and its booking
    freed (its chunks closed); why, for its span."""
    _abort(request)
    rid = job.request.request_id
    log.info(
        "request %s: the client stopped reading its %s and the request's deadline (--request-timeout) passed; "
        "its connection is aborted",
        rid,
        what,
        extra={"request_id": rid},
    )
    return f"the client stopped reading its {what} until the request's deadline: its connection was aborted"


def _abort_over_budget(request: web.Request, job: Job, held: HeldAnswer, budget: int) -> str:
    """A whole answer ended while it was written, as the replica's clients held more than its budget
    (router.client_buffers): its connection is aborted; why, for its span."""
    _abort(request)
    rid = job.request.request_id
    idle = time.monotonic() - held.taken_at
    why = (
        f"the client had {held.queued} bytes of its answer left to take and had taken none for {idle:.1f}s, the "
        f"furthest behind of the router's clients when they held more than its budget of {budget} bytes "
        "(--client-buffer-mib): its connection was aborted"
    )
    log.info("request %s: %s", rid, why, extra={"request_id": rid})
    return why


# --- errors before a handler runs ---------------------------------------------------------------


# The routes whose answers requests_total counts, by their label (the handlers count them).
_COUNTED = {
    "/v1/completions": ENDPOINT_COMPLETIONS,
    "/v1/chat/completions": ENDPOINT_CHAT,
    "/tokenize": ENDPOINT_TOKENIZE,
    "/detokenize": ENDPOINT_DETOKENIZE,
}


# Probes and scrapers (router.routes.PROBES) carry no key. The full fleet listing is /debug/workers,
# behind the operator key, not a query on /ready: at 1,000 workers it is ~0.3 MB and ms of the event
# loop per answer.


def _auth_middleware(keys: ApiKeys | None, debug_keys: ApiKeys | None, metrics: RouterMetrics) -> Callable[..., Any]:
    """API keys for the API; `/debug/*` takes only an operator key (`--debug-api-keys-file`), as its
    answers show which prefixes of every client's prompts the fleet holds; with API keys and no
    operator keys it is closed."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        path, presented = request.path, request.headers.get("Authorization")
        if path.startswith("/debug/"):
            if debug_keys is not None and not debug_keys.allows(presented):
                metrics.count_request("auth", 401)  # a fixed label: one per path would let clients mint series
                return ApiError(401, "/debug/* needs an operator key (--debug-api-keys-file)").response()
            if debug_keys is None and keys is not None:
                metrics.count_request("auth", 403)
                why = "/debug/* is closed: the router was started with API keys and no --debug-api-keys-file"
                return ApiError(403, why).response()
        elif keys is not None and path not in PROBES and not keys.allows(presented):
            metrics.count_request("auth", 401)
            return ApiError(401, "a valid API key is required: send `Authorization: Bearer <key>`").response()
        response: web.StreamResponse = await handler(request)
        return response

    return check


def _drain_gate(drain: Drain, metrics: RouterMetrics) -> Callable[..., Any]:
    @web.middleware
    async def gate(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """Refuses new work while draining; counts what runs, for the drain to wait on or cut."""
        if request.path in PROBES:
            response: web.StreamResponse = await handler(request)
            return response
        if drain.draining:
            metrics.count_request("draining", 503)  # a fixed label, as for auth
            return drain.refusal()
        task = asyncio.current_task()
        assert task is not None
        drain.enter(task)
        try:
            response = await handler(request)
            return response
        finally:
            drain.leave(task)

    return gate


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's --enable-request-id-headers on every answer, errors included: the client's
    X-Request-Id, else a fresh one, unless the handler named the answer (a routed one's `id`)."""
    if "x-request-id" not in response.headers:
        sent = request.headers.get("X-Request-Id")
        response.headers["x-request-id"] = sent if sent is not None else uuid.uuid4().hex


def make_app(
    path: RequestPath,
    tokenization: Tokenization,
    *,
    limits: HttpLimits | None = None,
    api_keys: ApiKeys | None = None,
    debug_keys: ApiKeys | None = None,
    health: Callable[[], dict[str, Any]],
    readiness: Callable[[], tuple[bool, dict[str, Any]]],
    index_state: Callable[[], dict[str, Any]],
    worker_listing: Callable[[], dict[str, Any]],
    tokenizer_report: Callable[[], dict[str, Any]] | None = None,
    started_at: float | None = None,
    unplanned: Callable[[str | None], list[dict[str, Any]]] = lambda model: [],
    drain: Drain | None = None,
    route_info: str | None = None,
) -> web.Application:
    limits = limits or HttpLimits()
    drain = drain or Drain()
    h = _Handlers(
        path,
        tokenization,
        limits,
        health=health,
        readiness=readiness,
        index_state=index_state,
        tokenizer_report=tokenizer_report,
        worker_listing=worker_listing,
        started_at=time.time() if started_at is None else started_at,
        unplanned=unplanned,
        drain=drain,
        route_shown=route_shown(route_info_mode(route_info, api_keys=api_keys is not None), debug_keys),
    )
    keyed = api_keys is not None or debug_keys is not None
    auth = [_auth_middleware(api_keys, debug_keys, path.metrics)] if keyed else []
    expect = expectations(path.metrics, _COUNTED)
    middlewares = [openai_errors(path.metrics), *auth, _drain_gate(drain, path.metrics), expect]
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=middlewares)
    app.on_response_prepare.append(_echo_request_id)
    ExpectRoutes.install(app)  # every route's Expect is router.expectations', never aiohttp's
    # Until 2026-12-07 aiohttp's HEAD route answered HEAD on every GET route (router.routes)
    add_routes(
        app,
        {
            "/health": h.health,
            "/ping": h.health,  # vLLM's SageMaker liveness route, /health's answer (until 2026-12-07 a 404)
            "/ready": h.ready,
            "/metrics": h.metrics,
            "/v1/models": h.models,
            "/v1/completions": h.completions,
            "/v1/chat/completions": h.chat,
            "/tokenize": h.tokenize,
            "/detokenize": h.detokenize,
            "/version": h.version,
            "/debug/route": h.debug_route,
            "/debug/index": h.debug_index,
            "/debug/workers": h.debug_workers,
        },
    )

    async def close_pool(_app: web.Application) -> None:
        tokenization.close()

    app.on_cleanup.append(close_pool)
    return app
