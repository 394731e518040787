"""The OpenAI-compatible front door (aiohttp): /v1/completions, /v1/chat/completions (stream and
not), /v1/models, vLLM's /tokenize and /detokenize (answered by a worker's engine), /version (the
router's), /health, /ready, /metrics, /debug/route (the decision a request would get) and
/debug/index (per worker: sync state, (epoch, seq) and the digest of what the index holds).

The client's request goes to the engine as the client wrote it, and the engine's answer comes
back as the engine wrote it. The router tokenizes the prompt only to route it (block hashes,
prefix match, accounting). A completions prompt reaches the engine as the very token ids that
were routed, unless its answer depends on the text (an echo, a FIM `suffix`, a truncation with
no side, which vLLM's tokenizer applies keeping the BOS): then as its text. A chat request
reaches it as its messages, which the engine renders with the template the router's tokenizer
fingerprint matched. The router validates only the fields it
reads, refuses the ones only it may set (`kv_transfer_params`, `disaggregated_params`, the
bootstrap triple, `ec_transfer_params`, and the transfer handles in `vllm_xargs`; a null, which the
engines read as unset, is no handle: taken), and passes everything else on. So stop strings, `n`, `echo`, logprobs,
penalties, tools, `response_format`, usage details and the engine's own 400s are the engine's.
It writes the engine's SSE payloads out unchanged; a whole answer gets one thing added, the
`kvswitch` route object. Batched prompts go to one worker, routed by the first prompt.

Every routed response carries `x-kvswitch-decode-worker`, `x-kvswitch-prefill: bypass|remote|agg`
and `x-kvswitch-outcome` headers naming where the request really went, after any retry or
fallback, and `Server-Timing` (`parse`, `route`, `worker`, in ms) saying where its time went.
Every answer, errors included, carries `x-request-id` as vLLM's --enable-request-id-headers sets
it: the client's X-Request-Id, else a routed answer's `id`, else a fresh one. Not aiohttp's own
400/414/431 to a request that does not parse as HTTP, which no handler sees (nor does vLLM's).

Every error is OpenAI JSON `{"error": {"message", "type", "param", "code"}}`: bad input 400,
unknown route 404, wrong method 405, body not sent in time 408, body or prompt too large 413,
headers too large 431, queue full 429 with Retry-After, worker failure 502, no worker 503 with
Retry-After, deadline 504. That includes what aiohttp answers before a handler runs: its parser's errors
(`FrontDoorRunner`), unknown routes and methods. Worker ids and internal exception text stay in
the router's log. A client that disconnects cancels its request on the worker.

A streaming client that stops reading holds its request no longer than its deadline: each write
waits at most until then, and then the connection is aborted (counted 504). One that reads slower
than its worker writes falls behind by at most router.dispatch.MAX_QUEUED_BYTES: then its leg is
cancelled and the stream ends with a 408 error event.

Draining (`Drain`, on SIGTERM): the listener stays open while the requests in flight finish; a new
request (anything but /health, /ready and /metrics) is a 503 with Retry-After and Connection:
close. Those still running when the drain ends are cut: a stream gets a final 503 error event and
`[DONE]`, any other request a 503, and their legs are cancelled on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from protocol import GenerateRequest, SamplingParams, asks_prompt_logprobs, lax_bool
from protocol.messages import (
    ANNOTATION_BYPASS,
    ENDPOINT_CHAT,
    ENDPOINT_COMPLETIONS,
    ENDPOINT_DETOKENIZE,
    ENDPOINT_TOKENIZE,
    ENGINE_HEADERS,
    lax_int,
)
from protocol.version import BUILD
from router.admission import Overloaded
from router.api_keys import ApiKeys
from router.dispatch import Job, LegError
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.planner import PlanError
from router.request_context import RequestShape
from router.request_path import NO_WORKER_RETRY_S, RequestPath, Unknown
from router.tokenization import ChatOptions, Tokenization, TokenizerError, UntrustedTemplate

__all__ = [
    "ApiError",
    "Drain",
    "FrontDoorRunner",
    "HttpLimits",
    "ParsedRequest",
    "keep_specials_truncated",
    "make_app",
    "parse_request",
    "prompt_ids",
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
    414: "RequestTooLargeError",
    429: "RateLimitError",
    431: "RequestTooLargeError",
    499: "ClientClosedRequest",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}
# Set by the router for the engine, never by a client: transfer handles name hosts the engine
# would pull KV from. A null is none: vLLM 0.32 (like TensorRT-LLM and SGLang) reads it as unset
# (CompletionRequest.to_sampling_params passes on only a truthy one), so it is taken, and dropped;
# so is an empty vLLM handle.
# ec_transfer_params: the encoder-cache handle, which the router never sets.
_ROUTER_ONLY = (
    "kv_transfer_params", "disaggregated_params", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "ec_transfer_params",
)  # fmt: skip
# vLLM 0.32 takes transfer handles from `vllm_xargs` too (v1/request.py reads them from extra_args).
_HANDLES = ("kv_transfer_params", "ec_transfer_params")
# vLLM 0.32 reads it from `vllm_xargs` (v1/request.py); "full" re-announces a prefix-cache hit's
# blocks as new BlockStored events, with no BlockRemoved to match, so the shim's counts keep them
# after eviction. Only its default, "incremental", is safe.
_REPORT_MODE = "kv_cache_report_mode"


def _names_nothing(name: str, value: Any) -> bool:
    """Whether a router-only field names nothing: a null, or for vLLM's handles an empty object,
    which vLLM 0.32 passes on only when truthy (CompletionRequest.to_sampling_params)."""
    return value is None or (name in _HANDLES and value == {})


_TOKEN_ID_LIMIT = 2**32  # canonical block hashes pack ids as u32
_TokenIds = list[Annotated[int, msgspec.Meta(ge=0, lt=_TOKEN_ID_LIMIT)]]
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1  # what a msgpack integer holds


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
    ) -> None:
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.close = close  # the connection cannot be reused (a body left half read)
        self.own_body = body  # an engine's own error body, passed on as it is
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.code, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        payload = self.own_body or _JSON.encode(self.body())
        resp = web.Response(body=payload, status=self.code, headers=headers, content_type="application/json")
        if self.close:
            resp.force_close()
        return resp


_JSON = msgspec.json.Encoder()
_DECODE_JSON = msgspec.json.Decoder()


def _json_response(obj: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    # msgspec instead of aiohttp's json.dumps: several times faster, and UTF-8 unescaped as vLLM writes it
    return web.Response(body=_JSON.encode(obj), status=status, headers=headers, content_type="application/json")


# --- parsing ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class ParsedRequest:
    """A validated request: what routing reads, and `params`, the body for the engine."""

    chat: bool
    model: str | None
    prompts: list[str | list[int]]  # completions: one per prompt of a batch; chat: none
    messages: list[dict[str, Any]] | None
    chat_options: ChatOptions | None
    add_special_tokens: bool
    # (tokens to keep, side) when the router can apply it; side None: the tokenizer's (left for
    # generation, as vLLM loads it), and a text prompt keeps its special tokens
    truncate: tuple[int, str | None] | None
    stream: bool
    max_tokens: int | None  # None: a chat request with no limit (vLLM then generates to the context's end)
    annotations: list[str]
    params: dict[str, Any] = field(default_factory=dict)
    shape: RequestShape = field(default_factory=RequestShape)
    engine_tokenizes: bool = False  # the engine gets the text: its answer depends on the text itself
    # truncate_prompt_tokens -1, vLLM's "the context": (tokens held back for output, side), resolved
    # into `truncate` from the model's max_model_len (prompt_ids); the context less one token, the
    # whole context when no output is asked for (its TokenizeParams.max_truncation_tokens)
    truncate_to_context: tuple[int, str | None] | None = None


_KINDS: dict[type | tuple[type, ...], str] = {
    bool: "a boolean",
    int: "an integer",
    str: "a string",
    list: "a list",
    dict: "an object",
    (int, float): "a number",
}


def _opt(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """`body[name]` as `kind`. Integers and booleans are read as vLLM's pydantic models read them
    (so as engine_sim does): 512.0, "512" and " 512 " are 512, true is 1 ("1e3" and 3.5 are not);
    "true", "yes" and 1 are True."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    if kind is bool and (flag := lax_bool(value)) is not None:  # "yes", "on", "t", 1, ... as pydantic reads them
        return flag
    if kind is int and (number := lax_int(value)) is not None:
        if not _INT_MIN <= number <= _UINT_MAX:  # text holds any size; _check_ints sees ints only
            raise ApiError(400, f"'{name}' is out of the 64-bit integer range", name)
        return number
    raise ApiError(400, f"'{name}' must be {_KINDS.get(kind, kind)}, got {type(value).__name__}", name)


def _valid_ids(raw: list[Any]) -> list[int] | None:
    """`raw` as token ids when every one is an integer in [0, 2^32), else None. In C: a Python
    loop over a 4 k-token prompt cost the router 0.9 ms of every request."""
    try:
        return msgspec.convert(raw, _TokenIds)
    except msgspec.ValidationError:
        return None


def _token_ids(raw: list[Any], param: str) -> list[int]:
    """`raw` as token ids, read as vLLM's pydantic model reads them: 2.0, "2" and true are ids too
    (lax_int), one by one in Python only when the strict reading in C fails."""
    ids = _valid_ids(raw)
    if ids is not None:
        return ids
    ids = []
    for t in raw:
        tid = lax_int(t)
        if tid is None or not 0 <= tid < _TOKEN_ID_LIMIT:
            raise ApiError(400, f"token ids must be integers in [0, 2^32), got {t!r}", param)
        ids.append(tid)
    return ids


# vLLM's words (its InputProcessor's; it names no parameter, the router names the prompt)
_EMPTY_PROMPT = "The decoder prompt cannot be empty"


def _prompts(raw: Any) -> list[str | list[int]]:
    """vLLM's prompt forms: a string, token ids, or a non-empty list of strings or of token-id
    lists, picked as its pydantic union picks: all strings are texts (["1", "2"] too), all lists
    are id lists, lists among other things are refused (vLLM 0.32 too), and anything else is one
    prompt of ids ([1, "2"] is [1, 2])."""
    if raw == "":  # vLLM's validator refuses it before rendering (a BOS alone would be served)
        raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(raw, str):
        return [raw]
    if raw == []:
        raise ApiError(400, "You must pass at least one prompt", "prompt")  # vLLM's renderer's words
    if isinstance(raw, list):
        ids = _valid_ids(raw)
        if ids is not None:
            return [ids]
        if all(isinstance(item, str) for item in raw):
            return list(raw)
        if all(isinstance(item, list) for item in raw):
            batch: list[str | list[int]] = []
            for item in raw:
                if not item:
                    raise ApiError(400, _EMPTY_PROMPT, "prompt")
                batch.append(_token_ids(item, "prompt"))
            return batch
        if any(isinstance(item, list) for item in raw):  # ["text", [6, 7, 8]]
            raise ApiError(400, "a batch of prompts must be all strings or all token-id lists", "prompt")
        return [_token_ids(raw, "prompt")]
    raise ApiError(
        400,
        "'prompt' must be a string, a non-empty list of token ids, or a list of strings or token-id lists",
        "prompt",
    )


def _check_ints(params: Mapping[str, Any]) -> None:
    """Top-level integers must fit a 64-bit field (deeper ones are caught when the leg is sent)."""
    for name, value in params.items():
        if isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value <= _UINT_MAX:
            raise ApiError(400, f"'{name}' is out of the 64-bit integer range", name)


def _chat_options(body: Mapping[str, Any]) -> ChatOptions:
    given = _opt(body, "chat_template_kwargs", dict, {})
    if not all(isinstance(k, str) for k in given):
        raise ApiError(400, "'chat_template_kwargs' keys must be strings", "chat_template_kwargs")
    # vLLM 0.32's merge (build_chat_params, then ChatParams.with_defaults): the client's kwargs
    # without their null or "auto" values; the top-level values that are set override them,
    # except `tools`, where the kwargs' win; the kwargs' special tokens override the tokenizer's.
    kwargs = {k: v for k, v in given.items() if k not in _RENDER_ARGS and v not in _UNSET}
    if "messages" in kwargs:  # vLLM's 400: its template gets `messages` twice
        raise ApiError(
            400,
            "jinja2.environment.Template.render() got multiple values for keyword argument 'messages'",
            "chat_template_kwargs",
        )
    raw_tools = kwargs.pop("tools", None)
    documents = kwargs.pop("documents", None)
    documents = _opt(body, "documents", list, documents)
    effort = body.get("reasoning_effort")
    if effort not in _UNSET:
        kwargs["reasoning_effort"] = effort
    if effort is not None and "enable_thinking" not in given:
        kwargs["enable_thinking"] = effort != "none"
    return ChatOptions(
        add_generation_prompt=_opt(body, "add_generation_prompt", bool, True),
        continue_final_message=_opt(body, "continue_final_message", bool, False),
        tools=_opt(body, "tools", list, None),
        tool_choice=body.get("tool_choice"),
        raw_tools=raw_tools,
        documents=documents,
        chat_template=_request_template(body, given),
        chat_template_kwargs=kwargs,
        add_special_tokens=_opt(body, "add_special_tokens", bool, False),
    )


def _request_template(body: Mapping[str, Any], kwargs: Mapping[str, Any]) -> str | None:
    """The client's own chat template: vLLM takes one in chat_template_kwargs as the request's too,
    and refuses it alike. Both given would leave one unused: refused rather than one dropped."""
    own: str | None = _opt(body, "chat_template", str, None)
    in_kwargs: str | None = _opt(kwargs, "chat_template", str, None)
    if own is not None and in_kwargs is not None:
        raise ApiError(400, "give the chat template once: 'chat_template' or 'chat_template_kwargs'", "chat_template")
    return own if own is not None else in_kwargs


# Kwargs the router passes by its own fields: the request's flags always override them (vLLM's
# too), and a template in the kwargs is the request's template.
_RENDER_ARGS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template"})
_UNSET = (None, "auto")  # vLLM's merge_kwargs skips these values


def parse_request(body: Any, *, chat: bool) -> ParsedRequest:
    """Validate what the router reads of an OpenAI request body; ApiError(400) naming the
    parameter for anything wrong. Everything else goes to the engine unread."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in _ROUTER_ONLY:
        if not _names_nothing(name, body.get(name)):
            raise ApiError(400, f"'{name}' is set by the router, not by clients", name)
    xargs = body.get("vllm_xargs")
    for name in _HANDLES:
        if isinstance(xargs, dict) and not _names_nothing(name, xargs.get(name)):
            raise ApiError(
                400, f"'vllm_xargs.{name}' is a transfer handle, set by the router, not by clients", "vllm_xargs"
            )
    if isinstance(xargs, dict) and xargs.get(_REPORT_MODE, "incremental") != "incremental":
        raise ApiError(
            400,
            f'\'vllm_xargs.{_REPORT_MODE}\' must be "incremental", got {xargs[_REPORT_MODE]!r}: under "full" vLLM '
            "announces a cache hit's blocks again but removes them once, so kvswitch's index would keep them after "
            "eviction",
            "vllm_xargs",
        )
    _check_ints(body)
    messages = options = None
    prompts: list[str | list[int]] = []
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of message objects", "messages")
        options = _chat_options(body)
    else:
        # vLLM prefills the embeddings as prompts of their own, ahead of `prompt`: a batch whose
        # first prompt the router cannot see (an empty list is no embeddings to vLLM).
        if body.get("prompt_embeds") not in (None, []):
            raise ApiError(
                400,
                "kvswitch routes text or token-id prompts, not 'prompt_embeds': send embeddings to an engine directly",
                "prompt_embeds",
            )
        if body.get("prompt") is None:
            raise ApiError(400, "'prompt' is required (the router routes text or token ids, not embeddings)", "prompt")
        prompts = _prompts(body["prompt"])
    max_tokens = _opt(body, "max_completion_tokens", int, None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _opt(body, "max_tokens", int, None)
    n = _opt(body, "n", int, 1)
    truncate = _opt(body, "truncate_prompt_tokens", int, None)
    side = _opt(body, "truncation_side", str, None)
    annotations = _opt(body, "annotations", list, [])
    if not all(isinstance(a, str) for a in annotations):
        raise ApiError(400, "'annotations' must be a list of strings", "annotations")
    stream_options = _opt(body, "stream_options", dict, {})
    _opt(stream_options, "include_usage", bool)
    # The router's own fields the client sent as null (none other passed the refusal above) are
    # none: not passed on, as the adapters set them per leg. A null in vllm_xargs goes on as sent:
    # vLLM 0.32 refuses it there itself (its values are strings, numbers or lists).
    params = {k: v for k, v in body.items() if k != "annotations" and k not in _ROUTER_ONLY}
    return ParsedRequest(
        chat=chat,
        model=_opt(body, "model", str, None),
        prompts=prompts,
        messages=messages,
        chat_options=options,
        add_special_tokens=_opt(body, "add_special_tokens", bool, not chat),
        truncate=(truncate, side) if truncate is not None and truncate > 0 else None,
        stream=_opt(body, "stream", bool, False),
        # vLLM's defaults: completions 16 tokens (a null too: its normalize_null_max_tokens), chat
        # no limit. Booking 16 for chat would tell routing that every such request is short.
        max_tokens=max_tokens if max_tokens is not None and max_tokens > 0 else (None if chat else 16),
        # vLLM echoes a text prompt as written and a FIM `suffix` needs the text; a truncation with
        # no side keeps the prompt's special tokens (its tokenizer truncates): ids would lose them.
        engine_tokenizes=not chat
        and (
            lax_bool(body.get("echo")) is True
            or body.get("suffix") is not None
            or (truncate is not None and side is None)
        ),
        annotations=annotations,
        params=params,
        truncate_to_context=None if truncate is None or truncate >= 0 else (_held_for_output(max_tokens, chat), side),
        # Read without validating: the engine judges these fields, and a wrong value the engine
        # refuses costs nothing on the local path.
        shape=RequestShape(
            sequences=max(len(prompts), 1) * max(n, 1),
            prompt_logprobs=asks_prompt_logprobs(body, chat=chat),
            cache_salt=salt if isinstance(salt := body.get("cache_salt"), str) else "",
            beam_search=lax_bool(body.get("use_beam_search")) is True,
            priority=(lax_int(given) or 0) if (given := body.get("priority")) is not None else 0,
        ),
    )


def _header_priority(headers: Mapping[str, str]) -> int | None:
    """X-Vllm-Priority, which vLLM takes over the body's `priority`; None when absent or no
    integer (the engine refuses that request itself)."""
    value = headers.get("X-Vllm-Priority")
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def _held_for_output(max_tokens: int | None, chat: bool) -> int:
    """The tokens vLLM holds back from a truncation to the context: one when the request asks for
    output (its max_output_tokens: a completion's max_tokens, 16 when null; a chat request's
    max_completion_tokens else max_tokens, 0 when neither), none when it does not."""
    asked = max_tokens if max_tokens is not None else (0 if chat else 16)
    return 1 if asked else 0


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


def _route_headers(job: Job, ids: _Ids, timing: _Timing) -> dict[str, str]:
    return {
        "x-kvswitch-decode-worker": job.plan.decode.worker,
        "x-kvswitch-prefill": str(job.path),
        "x-kvswitch-outcome": str(job.outcome),
        "x-request-id": ids.header,
        "Server-Timing": timing.header(time.perf_counter()),
    }


def _with_route(parts: list[bytes], route: dict[str, Any]) -> bytes:
    """The engine's JSON object, in the pieces it came in, with the router's `kvswitch` member added
    as its last one: one copy of the body (trimmed, sliced and concatenated whole, it was copied five
    times on the loop: 0.42 s for 150 MB)."""
    body = list(parts)
    _rstrip(body)
    if not body or not body[-1].endswith(b"}"):
        raise ApiError(502, "the worker's answer is not a JSON object")
    body[-1] = body[-1][:-1]
    _rstrip(body)
    sep = b"" if body and body[-1].endswith(b"{") else b","
    return b"".join([*body, sep, b'"kvswitch":', _JSON.encode(route), b"}"])


def _prompt_too_long(limit: int, count: int) -> ApiError:
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


def _rstrip(parts: list[bytes]) -> None:
    """The whitespace that ends the bytes `parts` make, off them (a piece left empty dropped)."""
    while parts:
        if last := parts[-1].rstrip():
            parts[-1] = last
            return
        parts.pop()


def _plan_error(exc: PlanError) -> ApiError:
    """No worker can take the request now: a worker excluded for a while, or one not registered
    yet, may be back in seconds, so clients that honour Retry-After try again; not where nothing
    but a new configuration ends it (PlanError.transient)."""
    retry = exc.code == 503 and exc.transient
    return ApiError(exc.code, exc.message, retry_after_s=NO_WORKER_RETRY_S if retry else None)


def _leg_error(exc: LegError, *, streaming: bool = False) -> ApiError:
    """The client's view of a failed leg: the engine's own answer for a request it refused, why
    for a client that read too slowly, a generic one for the rest (worker ids and internal errors
    stay in the router's log). `streaming`: after the stream's first event, where a worker was
    serving it, not "no worker could" (what a crashed engine mid-stream was told until 2026-12-06)."""
    if exc.refused or exc.slow_reader:
        return ApiError(exc.code, exc.message, body=exc.body)
    if exc.nats_lost:  # the router's own state, as a request planned during the outage is told
        return ApiError(503, exc.message, retry_after_s=NO_WORKER_RETRY_S)
    code = exc.code if exc.code in (503, 504) else 502
    what = {503: _MIDWAY if streaming else "no worker could serve the request", 504: "the request's deadline passed"}
    # A worker gone, silent or draining passes as one planning finds excluded does: retry later.
    retry = NO_WORKER_RETRY_S if code == 503 else None
    return ApiError(code, what.get(code, "the worker failed while serving the request"), retry_after_s=retry)


_MIDWAY = "the worker serving the request failed while streaming it"
_UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"
# vLLM's body for it (its validation handler: "1 validation error:" and the error, type "Bad Request").
_UNSUPPORTED_MEDIA_TYPE_BODY = _JSON.encode(
    {"error": {"message": f"1 validation error:\n  {_UNSUPPORTED_MEDIA_TYPE}", "type": "Bad Request", "param": None,
               "code": 400}}
)  # fmt: skip


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

    async def finish(self, limit_s: float) -> int:
        """Refuse new requests, let those in flight run up to `limit_s`, then cut the rest; how many
        were cut."""
        self.draining = True
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
        return cut

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
        started_at: float,
        bad_records: Callable[[str | None], list[dict[str, Any]]],
        drain: Drain,
    ) -> None:
        self.path = path
        self.tokenization = tokenization
        self.limits = limits
        self._health = health
        self._readiness = readiness
        self._index_state = index_state
        self._tokenizer_report = tokenizer_report
        self.started_at = started_at
        self._bad_records = bad_records
        self.drain = drain

    async def debug_index(self, request: web.Request) -> web.Response:
        return _json_response(self._index_state())

    async def health(self, request: web.Request) -> web.Response:
        return _json_response(self._health())

    async def ready(self, request: web.Request) -> web.Response:
        ready, body = self._readiness()
        if refusals := self.path.planner.text_refusals(self.path.default_model):
            body = {**body, "warnings": [*body["warnings"], *refusals]}
        if self._tokenizer_report is not None:
            body = {**body, "tokenizer": self._tokenizer_report()}
        return _json_response({"ready": ready, **body}, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.path.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

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
        return _json_response({"object": "list", "data": data})

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
        try:
            body = await self._json_body(request)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            model = self._model(_opt(body, "model", str, None))
            try:
                raw = await self.path.call(model, endpoint, body)
            except PlanError as exc:
                raise _plan_error(exc) from exc
            except LegError as exc:
                raise _leg_error(exc) from exc
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
        return _json_response({"version": BUILD})

    async def debug_route(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            parsed = parse_request(body, chat=isinstance(body, dict) and "messages" in body)
            try:
                model = self._model(parsed.model)
            except ApiError as exc:
                return self._with_bad_records(exc, parsed.model)
            routed, _ = await self._tokens(parsed, model)
            try:
                explained = self.path.explain(model, routed, text=_is_text(parsed), shape=parsed.shape)
            except PlanError as exc:
                return self._with_bad_records(_plan_error(exc), model)
            # records refused in etcd are no registered workers, so the planner never sees them
            explained["excluded"] += self._bad_records(model)
            return _json_response(explained)
        except ApiError as exc:
            return exc.response()

    def _with_bad_records(self, exc: ApiError, model: str | None) -> web.Response:
        """A model with no worker, or none to route to, may be one whose records etcd holds but
        were refused: listed beside the error as on an answer."""
        bad = self._bad_records(model)
        if not bad:
            return exc.response()
        return _json_response({**exc.body(), "excluded": bad}, status=exc.code)

    # --- reading the request ------------------------------------------------------------------

    async def _json_body(self, request: web.Request) -> Any:
        # vLLM's validate_json_request guards its JSON routes: any other media type (none included)
        # is a 400, before the body is read. It is also what keeps a web page from having a browser
        # post a text/plain body here, which needs no CORS preflight.
        if request.headers.get("Content-Type", "").lower().split(";", 1)[0] != "application/json":
            # Its body unread, the connection cannot serve another request.
            raise ApiError(400, _UNSUPPORTED_MEDIA_TYPE, body=_UNSUPPORTED_MEDIA_TYPE_BODY, close=request.can_read_body)
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"the request body is {request.content_length} bytes, over the limit of {limit}",
                           "body", close=True)  # fmt: skip
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {self.limits.body_timeout_s:g}s", "body", close=True
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes", "body", close=True) from None
        try:
            return _DECODE_JSON.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", "body") from exc
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply", "body") from None

    def _model(self, name: str | None) -> str:
        try:
            return self.path.resolve_model(name)
        except Unknown as exc:
            param = "model" if exc.code < 500 else None  # a 503 is no fault of the name
            raise ApiError(exc.code, str(exc), param, retry_after_s=exc.retry_after_s) from exc

    async def _tokens(self, parsed: ParsedRequest, model: str) -> tuple[list[int], list[list[int]]]:
        # The model's context is looked up (a pass over its workers) only for a truncation to it.
        limit = self.path.max_model_len(model) if parsed.truncate_to_context is not None else None
        return await prompt_ids(self.tokenization, parsed, limit)

    def _leg(self, parsed: ParsedRequest, ids: _Ids, model: str, routed: list[int], prompts: list[list[int]],
             headers: Mapping[str, str]) -> GenerateRequest:  # fmt: skip
        params = parsed.params
        params["model"] = model
        limit = self._over_context(parsed, model, prompts)
        if not parsed.chat and not (parsed.engine_tokenizes and _is_text(parsed)) and limit is None:
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
        is refused here in vLLM's words (_prompt_too_long), its count the engine's own: sent, past
        ~349k ids it was NATS's 413 too."""
        limit = self.path.max_model_len(model)
        over = None if limit is None else next((len(p) for p in prompts if len(p) > limit), None)
        if limit is None or over is None:
            return None
        if not _is_text(parsed):
            raise _prompt_too_long(limit, over)
        return limit

    # --- one request ----------------------------------------------------------------------------

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        status = 500
        why = ""  # why it failed, for its span
        broke = False  # a stream that failed after its 200 went out
        sent: int | None = None  # the status a stream went out with; `status` is its outcome's
        timing = _Timing(time.perf_counter())
        # The span comes first: a request refused before it is routed (a 400, an unknown model) has
        # one too, what is known only later set on it then.
        with self.path.tracer.request(_SPAN_NAMES[chat], request.headers) as span:
            try:
                _check_passed_headers(request)
                body = await self._json_body(request)
                parsed = parse_request(body, chat=chat)
                if (priority := _header_priority(request.headers)) is not None:
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
                        leg, span, text=_is_text(parsed), shape=parsed.shape, max_tokens=parsed.max_tokens
                    )
                except PlanError as exc:
                    raise _plan_error(exc) from exc
                except Overloaded as exc:
                    raise ApiError(429, str(exc), retry_after_s=exc.retry_after_s) from exc
                timing.planned = time.perf_counter()
                try:
                    if parsed.stream:
                        resp, status, why = await self._stream(request, job, ids, timing)
                        sent = resp.status
                        broke = bool(why)  # the client got an error event, or nothing more
                    else:
                        resp = await self._whole(job, ids, timing)
                        status = resp.status
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

    async def _whole(self, job: Job, ids: _Ids, timing: _Timing) -> web.Response:
        parts: list[bytes] = []
        try:
            async for chunk in self.path.stream(job, timing.start):
                if chunk.body:
                    parts.append(chunk.body)
        except LegError as exc:
            raise _leg_error(exc) from exc
        body = _with_route(parts, _route_info(job))
        headers = _route_headers(job, ids, timing)
        return web.Response(body=body, headers=headers, content_type="application/json")

    async def _stream(
        self, request: web.Request, job: Job, ids: _Ids, timing: _Timing
    ) -> tuple[web.StreamResponse, int, str]:
        """The stream, the code it counts as: 200, or its error event's when it failed after its
        headers (their 200 went out before the failure), and why it failed then ("" if it did not)."""
        chunks = self.path.stream(job, timing.start)
        try:
            first = await anext(chunks)
        except LegError as exc:
            raise _leg_error(exc) from exc
        except StopAsyncIteration:
            raise ApiError(502, "the worker ended the stream without a chunk") from None
        headers = {
            "Content-Type": "text/event-stream; charset=utf-8",  # vLLM's (Starlette's) bytes
            "Cache-Control": "no-cache",
            **_route_headers(job, ids, timing),
        }
        resp = web.StreamResponse(status=200, headers=headers)
        try:
            await resp.prepare(request)
        except BaseException:
            await chunks.aclose()
            raise
        out: list[bytes] = []
        chunk = first
        failed: ApiError | None = None
        why = ""  # a worker's failure, said once at WARNING (a bug is said with its traceback)
        unread = False  # the client took nothing more before the deadline
        try:
            # The events one worker chunk carries go out in one write (one send, one drain).
            while True:
                out += [_sse_event(e) for e in chunk.events]
                if chunk.final:
                    break
                if out:
                    if not await _sent(request, b"".join(out), resp.write, job.deadline):
                        unread = True
                        break
                    out.clear()
                chunk = await anext(chunks)
        except LegError as exc:
            failed = _leg_error(exc, streaming=True)
            why = "" if exc.slow_reader else str(exc)  # that one the dispatcher said, at INFO
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
        finally:
            await chunks.aclose()
        if unread:
            _abort_unread(request, job)
            return resp, 504, _UNREAD
        if failed is not None:
            if why:
                rid = job.request.request_id
                log.warning(
                    "request %s: the stream failed after its first chunk (%s); the client got a %d error event",
                    rid,
                    why,
                    failed.code,
                    extra={"request_id": rid},
                )
            out.append(_sse_event(failed.own_body or _JSON.encode(failed.body())))
        out.append(_SSE_DONE)
        if not await _sent(request, b"".join(out), resp.write_eof, job.deadline):
            _abort_unread(request, job)
            return resp, 504, _UNREAD
        return (resp, 200, "") if failed is None else (resp, failed.code, failed.message)


_SPAN_NAMES = {False: "POST /v1/completions", True: "POST /v1/chat/completions"}
_UNREAD = "the client stopped reading its stream until the request's deadline: its connection was aborted"


def _abort_unread(request: web.Request, job: Job) -> None:
    """A stream its client stopped reading until the deadline: no error event can reach it, so the
    connection is aborted, after its leg was cancelled and its booking freed (chunks.aclose())."""
    if request.transport is not None:
        request.transport.abort()
    rid = job.request.request_id
    log.info(
        "request %s: the client stopped reading its stream and the request's deadline (--request-timeout) passed; "
        "its connection is aborted",
        rid,
        extra={"request_id": rid},
    )


async def prompt_ids(
    tok: Tokenization, parsed: ParsedRequest, max_model_len: int | None = None
) -> tuple[list[int], list[list[int]]]:
    """The routed prompt's ids (the first prompt of a batch) and every prompt's ids: those the
    engine computes (tests/router/test_vllm_render.py holds them to vLLM 0.32's own renderer).
    `max_model_len`, the model's, resolves a truncate_prompt_tokens of -1 as vLLM does; without it
    such a prompt is routed whole."""
    truncate = parsed.truncate
    if truncate is None and parsed.truncate_to_context is not None and max_model_len is not None:
        held, side = parsed.truncate_to_context
        truncate = (max(0, max_model_len - held), side)
    try:
        if parsed.chat:
            assert parsed.messages is not None and parsed.chat_options is not None
            ids = await tok.encode_chat(parsed.messages, parsed.chat_options)
            if truncate is not None:  # the template wrote the special tokens: plain ids
                ids = _truncated(ids, *truncate)
            if not ids:  # a template that renders nothing: vLLM's input processor refuses it, naming no parameter
                raise ApiError(400, _EMPTY_PROMPT)
            return ids, [ids]
        prompts = []
        offload = sum(len(p) for p in parsed.prompts if isinstance(p, str)) > tok.offload_chars
        for p in parsed.prompts:
            if isinstance(p, list):
                ids = p if truncate is None else _truncated(p, *truncate)
            elif truncate is not None and truncate[1] is None and parsed.add_special_tokens:
                ids = await keep_specials_truncated(tok, p, truncate[0], offload=offload)
            else:
                ids = await tok.encode(p, parsed.add_special_tokens, offload=offload)
                if truncate is not None:
                    ids = _truncated(ids, *truncate)
            prompts.append(ids)
    except UntrustedTemplate as exc:
        raise ApiError(400, exc.why, "chat_template") from exc
    except TokenizerError as exc:
        raise ApiError(400, str(exc), "messages" if parsed.chat else "prompt") from exc
    if not prompts[0]:
        raise ApiError(400, _EMPTY_PROMPT, "prompt")
    return prompts[0], prompts


async def keep_specials_truncated(tok: Tokenization, text: str, keep: int, *, offload: bool = False) -> list[int]:
    """vLLM's truncation with no side: its tokenizer keeps the last `keep` tokens *with* the
    special tokens it adds (a BOS stays first), where slicing the encoded ids would drop them."""
    marked = await tok.encode(text, True, offload=offload)
    bare = await tok.encode(text, False, offload=offload)
    added = len(marked) - len(bare)
    start = next((i for i in range(added + 1) if marked[i : i + len(bare)] == bare), None)
    # Not specials + text + specials, or nothing to cut: a plain slice, which can only cost a
    # routing guess (the engine gets the text and truncates it itself).
    if start is None or len(marked) <= keep:
        return _truncated(marked, keep, "left")
    body = bare[len(bare) - (keep - added) :] if keep > added else []
    return marked[:start] + body + marked[start + len(bare) :]


def _truncated(ids: list[int], keep: int, side: str | None) -> list[int]:
    """vLLM's slice: the first `keep` ids for side "right" (cut at the end), else the last `keep`
    (no side: the tokenizer's, "left" for generation)."""
    return ids[:keep] if side == "right" else ids[max(len(ids) - keep, 0) :]


def _is_text(parsed: ParsedRequest) -> bool:
    """The prompt needs the router's tokenizer (chat always; completions unless token ids)."""
    return parsed.chat or any(isinstance(p, str) for p in parsed.prompts)


# --- errors before a handler runs ---------------------------------------------------------------

_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no key


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
        elif keys is not None and path not in _OPEN_PATHS and not keys.allows(presented):
            metrics.count_request("auth", 401)
            return ApiError(401, "a valid API key is required: send `Authorization: Bearer <key>`").response()
        response: web.StreamResponse = await handler(request)
        return response

    return check


def _drain_gate(drain: Drain, metrics: RouterMetrics) -> Callable[..., Any]:
    @web.middleware
    async def gate(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """Refuses new work while draining; counts what runs, for the drain to wait on or cut."""
        if request.path in _OPEN_PATHS:
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


def _openai_errors(metrics: RouterMetrics) -> Callable[..., Any]:
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
                resp.headers["Allow"] = exc.headers["Allow"]
            return resp
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return ApiError(500, "the router failed to handle the request").response()

    return answer


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's --enable-request-id-headers on every answer, errors included: the client's
    X-Request-Id, else a fresh one, unless the handler named the answer (a routed one's `id`)."""
    if "x-request-id" not in response.headers:
        sent = request.headers.get("X-Request-Id")
        response.headers["x-request-id"] = sent if sent is not None else uuid.uuid4().hex


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering what its parser refuses as OpenAI JSON:
    oversized header lines or too many headers are 431, an oversized request line 414, the rest
    400. (aiohttp answers these in plain text before any middleware runs.)"""

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("an answer is on its way already: the connection is dropped")
        if isinstance(exc, LineTooLong):
            status = 414 if "status line" in str(exc).lower() or "request line" in str(exc).lower() else 431
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


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class FrontDoorRunner(web.AppRunner):
    """An AppRunner whose connections answer HTTP parse errors as OpenAI JSON (431, 414, 400), and
    close `lingering_s` after answering a request whose body was left unread (aiohttp's default
    waits 10 s for the rest of it: a client that stopped sending would hold the connection)."""

    def __init__(self, app: web.Application, *, lingering_s: float = 1.0, **kwargs: Any) -> None:
        super().__init__(app, lingering_time=lingering_s, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # aiohttp builds the Server itself; this only swaps its handler class
        return server


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
    tokenizer_report: Callable[[], dict[str, Any]] | None = None,
    started_at: float | None = None,
    bad_records: Callable[[str | None], list[dict[str, Any]]] = lambda model: [],
    drain: Drain | None = None,
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
        started_at=time.time() if started_at is None else started_at,
        bad_records=bad_records,
        drain=drain,
    )
    keyed = api_keys is not None or debug_keys is not None
    auth = [_auth_middleware(api_keys, debug_keys, path.metrics)] if keyed else []
    middlewares = [_openai_errors(path.metrics), *auth, _drain_gate(drain, path.metrics)]
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=middlewares)
    app.on_response_prepare.append(_echo_request_id)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ready", h.ready)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/v1/models", h.models)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/tokenize", h.tokenize)
    app.router.add_post("/detokenize", h.detokenize)
    app.router.add_get("/version", h.version)
    app.router.add_post("/debug/route", h.debug_route)
    app.router.add_get("/debug/index", h.debug_index)

    async def close_pool(_app: web.Application) -> None:
        tokenization.close()

    app.on_cleanup.append(close_pool)
    return app
