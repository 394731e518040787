"""The OpenAI-compatible front door (aiohttp): /v1/completions, /v1/chat/completions (stream and
not), /v1/models, /health, /ready, /metrics, /debug/route (the decision a request would get) and
/debug/index (per worker: sync state, (epoch, seq) and the digest of what the index holds).

Response bodies and SSE follow vLLM 0.32 byte for byte where it matters to clients (see
/work/shared/fixtures/vllm-0.32): `data: {json}\\n\\n` events, a usage-only chunk when
`stream_options.include_usage` is set, and `data: [DONE]`. Every routed response carries
`x-kvswitch-decode-worker` and `x-kvswitch-prefill: bypass|remote|agg` headers (and a `kvswitch`
object in non-stream bodies) naming where the request really went, after any retry or fallback.

Errors are OpenAI-style `{"error": {"message", "type", "param", "code"}}`: bad input 400, unknown
model 404, queue full 429 with Retry-After, no worker 503, a worker failure 502, a deadline 504.
A client that disconnects cancels its request on the worker (the handler is cancelled, and
leaving the dispatch stream cancels the leg).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from protocol import ResponseChunk, SamplingParams
from router.admission import Overloaded
from router.api_keys import ApiKeys
from router.dispatch import Job, LegError
from router.metrics import CONTENT_TYPE
from router.planner import PlanError
from router.request_path import RequestPath, Unknown
from router.tokenization import IncrementalDetokenizer, PromptTokenizer, TokenizerError

__all__ = ["ApiError", "ParsedRequest", "make_app", "parse_request"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions; chat gets CHAT_MAX_TOKENS
CHAT_MAX_TOKENS = 256
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class ApiError(Exception):
    def __init__(self, code: int, message: str, param: str | None = None, *, retry_after_s: int | None = None) -> None:
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.code, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return _json_response(self.body(), status=self.code, headers=headers)


_JSON = msgspec.json.Encoder()
_DECODE_JSON = msgspec.json.Decoder()


def _json_response(obj: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    # msgspec instead of aiohttp's json.dumps: several times faster, and UTF-8 unescaped as vLLM writes it
    return web.Response(body=_JSON.encode(obj), status=status, headers=headers, content_type="application/json")


@dataclass(slots=True)
class ParsedRequest:
    chat: bool
    model: str | None
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    annotations: list[str]


def _opt(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", name)
    if not isinstance(value, kind):
        raise ApiError(400, f"'{name}' has the wrong type: {type(value).__name__}", name)
    return value


def _prompt(raw: Any) -> str | list[int]:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        if any(t < 0 for t in raw):
            raise ApiError(400, "token ids must be >= 0", "prompt")
        return list(raw)
    if isinstance(raw, list) and len(raw) == 1:
        return _prompt(raw[0])
    if isinstance(raw, list) and len(raw) > 1:
        raise ApiError(400, "batched prompts are not supported: send one prompt per request", "prompt")
    raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids", "prompt")


def parse_request(body: Any, *, chat: bool) -> ParsedRequest:
    """Validate an OpenAI request body; ApiError(400) naming the parameter for anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of message objects", "messages")
    else:
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", "prompt")
        prompt = _prompt(body["prompt"])
    if _opt(body, "n", int, 1) != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    default_max = CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS
    max_tokens = _opt(body, "max_completion_tokens", int, None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _opt(body, "max_tokens", int, default_max)
    if max_tokens < 1:
        raise ApiError(400, f"'max_tokens' must be >= 1, got {max_tokens}", "max_tokens")
    temperature = float(_opt(body, "temperature", (int, float), 1.0))
    top_p = float(_opt(body, "top_p", (int, float), 1.0))
    if temperature < 0:
        raise ApiError(400, f"'temperature' must be >= 0, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    stop = _opt(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    stop_ids = _opt(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) for t in stop_ids):
        raise ApiError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
    stream_options = _opt(body, "stream_options", dict, {})
    annotations = _opt(body, "annotations", list, [])
    if not all(isinstance(a, str) for a in annotations):
        raise ApiError(400, "'annotations' must be a list of strings", "annotations")
    return ParsedRequest(
        chat=chat,
        model=_opt(body, "model", str, None),
        prompt=prompt,
        messages=messages,
        sampling=SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=_opt(body, "seed", int, None),
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=bool(_opt(body, "ignore_eos", bool, False)),
        ),
        stream=bool(_opt(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        annotations=annotations,
    )


async def _json_body(request: web.Request) -> Any:
    try:
        return _DECODE_JSON.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", "body") from exc


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(obj) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


class _Formatter:
    """Builds OpenAI bodies and chunks for one request."""

    def __init__(self, parsed: ParsedRequest, model: str, request_id: str) -> None:
        self.chat = parsed.chat
        self.model = model
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.object = "chat.completion" if parsed.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def delta(self, text: str, finish: str | None, *, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if finish is not None and not text:
                delta = {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    def full(self, text: str, finish: str | None, usage: dict[str, int], route: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        return {**self._head(self.object), "choices": [choice], "usage": usage, "kvswitch": route}


def _usage(prompt_tokens: int, completion_tokens: int, final: ResponseChunk | None) -> dict[str, int]:
    if final is not None and final.usage is not None:
        prompt_tokens = final.usage.prompt_tokens or prompt_tokens
        completion_tokens = final.usage.completion_tokens or completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _route_info(job: Job) -> dict[str, Any]:
    return {
        "decode_worker": job.plan.decode.worker,
        "prefill": str(job.path),
        "prefill_worker": job.plan.prefill.worker if job.transfer is not None and job.plan.prefill else None,
        "outcome": str(job.outcome),
        "attempts": job.attempts,
    }


def _route_headers(job: Job, request_id: str) -> dict[str, str]:
    return {
        "x-kvswitch-decode-worker": job.plan.decode.worker,
        "x-kvswitch-prefill": str(job.path),
        "x-kvswitch-outcome": str(job.outcome),
        "x-request-id": request_id,
    }


def _leg_error(exc: LegError) -> ApiError:
    """The client's view of a failed leg: the engine's own words for a request it refused, a
    generic one for the rest (worker ids and internal errors stay in the router's log)."""
    if exc.refused:
        return ApiError(exc.code, exc.message)
    code = exc.code if exc.code in (503, 504) else 502
    what = {503: "no worker could serve the request", 504: "the request's deadline passed"}
    return ApiError(code, what.get(code, "the worker failed while serving the request"))


def _is_text(parsed: ParsedRequest) -> bool:
    """The prompt needs the router's tokenizer (chat always; completions unless token ids)."""
    return parsed.chat or not isinstance(parsed.prompt, list)


CLIENT_CLOSED = 499  # nginx's code for a client that left before the answer: counted, never sent


class _Handlers:
    def __init__(
        self,
        path: RequestPath,
        tokenizer: PromptTokenizer,
        *,
        health: Callable[[], dict[str, Any]],
        readiness: Callable[[], tuple[bool, dict[str, Any]]],
        index_state: Callable[[], dict[str, Any]],
        started_at: float,
    ) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self._health = health
        self._readiness = readiness
        self._index_state = index_state
        self.started_at = started_at

    async def debug_index(self, request: web.Request) -> web.Response:
        return _json_response(self._index_state())

    async def health(self, request: web.Request) -> web.Response:
        return _json_response(self._health())

    async def ready(self, request: web.Request) -> web.Response:
        ready, body = self._readiness()
        return _json_response({"ready": ready, **body}, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.path.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        created = int(self.started_at)
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "kvswitch", "root": m, "parent": None}
            for m in self.path.models()
        ]
        return _json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def debug_route(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            parsed = parse_request(body, chat=isinstance(body, dict) and "messages" in body)
            model, tokens = self._tokens(parsed)
            try:
                return _json_response(self.path.explain(model, tokens, text=_is_text(parsed)))
            except PlanError as exc:
                raise ApiError(exc.code, exc.message) from exc
        except ApiError as exc:
            return exc.response()

    def _tokens(self, parsed: ParsedRequest) -> tuple[str, list[int]]:
        try:
            model = self.path.resolve_model(parsed.model)
        except Unknown as exc:
            raise ApiError(exc.code, str(exc), "model") from exc
        try:
            if parsed.chat:
                assert parsed.messages is not None
                return model, self.tokenizer.encode_chat(parsed.messages)
            assert parsed.prompt is not None
            prompt = parsed.prompt
            return model, prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        except TokenizerError as exc:
            raise ApiError(400, str(exc), "messages" if parsed.chat else "prompt") from exc

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        status = 500
        try:
            body = await _json_body(request)
            parsed = parse_request(body, chat=chat)
            model, tokens = self._tokens(parsed)
            request_id = uuid.uuid4().hex
            with self.path.tracer.request(
                f"POST /v1/{'chat/' if chat else ''}completions", request.headers, **{"kvswitch.model": model}
            ) as span:
                try:
                    job = await self.path.open(
                        request_id, model, tokens, parsed.sampling, parsed.annotations, span, text=_is_text(parsed)
                    )
                except PlanError as exc:
                    raise ApiError(exc.code, exc.message) from exc
                except Overloaded as exc:
                    raise ApiError(429, str(exc), retry_after_s=exc.retry_after_s) from exc
                try:
                    fmt = _Formatter(parsed, model, request_id)
                    if parsed.stream:
                        resp = await self._stream(request, job, fmt, parsed, len(tokens))
                    else:
                        resp = await self._whole(job, fmt, len(tokens))
                finally:
                    self.path.release(job)  # a no-op once its stream ended
                status = resp.status
                return resp
        except ApiError as exc:
            status = exc.code
            return exc.response()
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        except ConnectionResetError:  # the client left while we wrote to it
            status = CLIENT_CLOSED
            raise web.HTTPException() from None
        finally:
            self.path.metrics.count_request(endpoint, status)

    async def _whole(self, job: Job, fmt: _Formatter, isl: int) -> web.Response:
        detok = IncrementalDetokenizer(self.tokenizer)
        parts: list[str] = []
        final: ResponseChunk | None = None
        n = 0
        try:
            async for chunk in self.path.stream(job):
                n += len(chunk.token_ids)
                parts.append(detok.push(chunk.token_ids, final=chunk.final))
                if chunk.final:
                    final = chunk
        except LegError as exc:
            raise _leg_error(exc) from exc
        finish = final.finish_reason if final is not None else None
        body = fmt.full("".join(parts), finish, _usage(isl, n, final), _route_info(job))
        return _json_response(body, headers=_route_headers(job, fmt.id))

    async def _stream(
        self, request: web.Request, job: Job, fmt: _Formatter, parsed: ParsedRequest, isl: int
    ) -> web.StreamResponse:
        detok = IncrementalDetokenizer(self.tokenizer)
        chunks = self.path.stream(job)
        try:
            first = await anext(chunks)
        except LegError as exc:
            raise _leg_error(exc) from exc
        except StopAsyncIteration:
            raise ApiError(502, "the worker ended the stream without a chunk") from None
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_route_headers(job, fmt.id)}
        resp = web.StreamResponse(status=200, headers=headers)
        try:
            await resp.prepare(request)
        except BaseException:
            await chunks.aclose()
            raise
        n, final = 0, None
        chunk: ResponseChunk | None = first
        # The events one worker chunk produces go out in one write (one send, one drain).
        out: list[bytes] = [_sse(fmt.delta("", None, first=True))] if fmt.chat else []  # vLLM opens with the role
        try:
            while chunk is not None:
                n += len(chunk.token_ids)
                text = detok.push(chunk.token_ids, final=chunk.final)
                finish = chunk.finish_reason if chunk.final else None
                if chunk.final:
                    final = chunk
                if text or finish is not None:
                    out.append(_sse(fmt.delta(text, finish)))
                if chunk.final:
                    break
                if out:
                    await resp.write(b"".join(out))
                    out.clear()
                chunk = await anext(chunks, None)
            if parsed.include_usage:
                out.append(_sse(fmt.usage_chunk(_usage(isl, n, final))))
        except LegError as exc:
            out.append(_sse(_leg_error(exc).body()))
        finally:
            await chunks.aclose()
        out.append(_SSE_DONE)
        await resp.write_eof(b"".join(out))
        return resp


_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no key


def _auth_middleware(keys: ApiKeys) -> Callable[..., Any]:
    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS and not keys.allows(request.headers.get("Authorization")):
            return ApiError(401, "a valid API key is required: send `Authorization: Bearer <key>`").response()
        response: web.StreamResponse = await handler(request)
        return response

    return check


def make_app(
    path: RequestPath,
    tokenizer: PromptTokenizer,
    *,
    api_keys: ApiKeys | None = None,
    health: Callable[[], dict[str, Any]],
    readiness: Callable[[], tuple[bool, dict[str, Any]]],
    index_state: Callable[[], dict[str, Any]],
    started_at: float,
) -> web.Application:
    h = _Handlers(path, tokenizer, health=health, readiness=readiness, index_state=index_state, started_at=started_at)
    middlewares = [_auth_middleware(api_keys)] if api_keys is not None else []
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ready", h.ready)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/v1/models", h.models)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/debug/route", h.debug_route)
    app.router.add_get("/debug/index", h.debug_index)
    return app
