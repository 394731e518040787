"""The OpenAI-style HTTP calls that vLLM, TensorRT-LLM and SGLang serve: request bodies, SSE
streaming, usage, and error bodies mapped to EngineError.

Two kinds of leg:
- pass-through (`leg.endpoint` set): the client's own request goes to the engine's
  `/v1/completions` or `/v1/chat/completions` with only what the shim must force (`model`, the
  routed token ids as a completions prompt, `stream`, the P/D fields; a prefill leg one token,
  `n` 1, a `min_tokens` clamped to 1, and an unstreamed leg no `stream_options`, each only where the
  client's value is one the engine takes: one it refuses goes as it is, for the engine to refuse at
  once). The
  engine's answer comes back byte for byte: each SSE payload, or the whole body. Nothing is added
  to count tokens (vLLM's `return_token_ids` would change what it answers: an echo of a token-id
  prompt comes back empty with it), so an event counts the token ids it carries, else one token per
  choice with output in it; a chat `echo` (the last message's content, streamed before any output)
  is no output.
- token ids (`leg.endpoint` ""): the router's older leg, a token-id completion built from
  `SamplingParams`, its ids back per choice in `token_ids`; an engine that sends none is a
  protocol error, never silently empty output.

A streamed answer is whole only at its `[DONE]`: a clean EOF before it is a 502 `engine_protocol`,
a connection lost after the 200 a `StreamCut` (503 `engine_unavailable`, as one lost before it).
An engine's 429 keeps its Retry-After (EngineError.retry_after_s). Cancelling the coroutine
closes the connection, which these engines treat as an abort.
"""

from __future__ import annotations

import codecs
import contextlib
import datetime
import email.utils
import math
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

import aiohttp
import msgspec

from protocol import Usage
from protocol.client_errors import essence
from protocol.messages import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, RETRY_AFTER_MAX_S, lax_bool, lax_int
from worker_shim.adapters.base import EngineError, LegRequest, ModelCard, OnOutput

__all__ = [
    "ENDPOINT_PATHS",
    "UTILITY_TIMEOUT",
    "Result",
    "StreamCut",
    "error_from",
    "line_batches",
    "model_cards",
    "pass_through_body",
    "post_completion",
    "post_utility",
    "retry_after_s",
    "usage_from",
]

_json = msgspec.json.Decoder()
_DEFAULT_MAX_TOKENS = 16  # vLLM's completion max_tokens when the client gives none
_encode = msgspec.json.Encoder()
_T = TypeVar("_T")


class _WholeChoice(msgspec.Struct):
    """What `_fold` reads of a whole answer's choice; UNSET where the answer has no such field."""

    token_ids: Any = msgspec.UNSET
    text: Any = msgspec.UNSET
    finish_reason: Any = msgspec.UNSET
    disaggregated_params: Any = msgspec.UNSET  # TensorRT-LLM's context-only leg


class _Whole(msgspec.Struct):
    """What the shim reads of a whole (non-streamed) answer: every other field (`logprobs`,
    `prompt_logprobs`: almost all of a long prompt's answer with logprobs, 193 MB for 130k tokens at
    prompt_logprobs 20) is skipped unbuilt. Decoded into Python objects, it cost 1.8 s on the shim's
    loop and 1.5 GB; skipped, 0.13 s and nothing but the fields."""

    choices: list[_WholeChoice] | msgspec.UnsetType = msgspec.UNSET
    usage: Any = msgspec.UNSET
    error: Any = msgspec.UNSET
    kv_transfer_params: Any = msgspec.UNSET  # vLLM's prefill leg


_whole = msgspec.json.Decoder(_Whole)


class _EventChoice(msgspec.Struct):
    """What `_fold` reads of a streamed event's choice (a completion's or a chat delta's)."""

    index: Any = msgspec.UNSET
    token_ids: Any = msgspec.UNSET
    text: Any = msgspec.UNSET
    delta: Any = msgspec.UNSET
    # Read only for whether it is empty (_has_output), where a choice has no text: a streamed echo of
    # a long prompt with `logprobs` carries the prompt's in the first event, and it has the text.
    logprobs: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    finish_reason: Any = msgspec.UNSET
    disaggregated_params: Any = msgspec.UNSET


class _Event(msgspec.Struct):
    """What the shim reads of a streamed SSE event; the event's bytes go on as they came. Every other
    field is skipped unbuilt: vLLM streams a prompt's `prompt_logprobs` in the first event (37 MB for
    32k tokens at 20), which decoded into Python objects held the shim's loop 0.5 s."""

    choices: list[_EventChoice] | msgspec.UnsetType = msgspec.UNSET
    usage: Any = msgspec.UNSET
    error: Any = msgspec.UNSET
    kv_transfer_params: Any = msgspec.UNSET


_event = msgspec.json.Decoder(_Event)
_SCHEMA_BYTES = 64 << 10  # a streamed event past this is read through _Event
_UTF8_PIECE = 256 << 10  # what _check_utf8 decodes at a time
ENDPOINT_PATHS = {ENDPOINT_COMPLETIONS: "/v1/completions", ENDPOINT_CHAT: "/v1/chat/completions"}
# A utility call is no generation, but tokenizing a long prompt with a chat template takes a while.
UTILITY_TIMEOUT = aiohttp.ClientTimeout(total=60.0)
# The longest SSE line read before its newline (here and on SGLang's /generate), the router's bound
# on one event (its MAX_ANSWER_BYTES): a streamed echo of a long prompt with logprobs is megabytes,
# but an engine or proxy that never ends its line was buffered until the request's deadline,
# growing all the while.
MAX_LINE_BYTES = 256 << 20


def usage_from(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_int(raw.get("prompt_tokens")),
        completion_tokens=_int(raw.get("completion_tokens")),
        cached_tokens=_count(cached),
    )


def model_cards(raw: bytes) -> dict[str, ModelCard] | None:
    """The cards of a /v1/models answer by id: `max_model_len` where vLLM's and SGLang's carry it
    (None where a card has no positive integer), `parent` where the card is a LoRA adapter's,
    `root` where it says; None when `raw` is no model list."""
    try:
        data = _json.decode(raw).get("data")
    except (msgspec.DecodeError, AttributeError):
        return None
    if not isinstance(data, list):
        return None
    cards: dict[str, ModelCard] = {}
    for card in data:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            value, parent, root = card.get("max_model_len"), card.get("parent"), card.get("root")
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            cards[card["id"]] = ModelCard(
                value if ok else None,
                parent if isinstance(parent, str) else None,
                root if isinstance(root, str) else None,
            )
    return cards


def _count(value: Any) -> int | None:
    """A count the engine gave (a non-negative int); None where it gave none."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _int(value: Any) -> int:
    return _count(value) or 0


def retry_after_s(value: str | None) -> int | None:
    """A Retry-After header in whole seconds (RFC 9110: delta-seconds, or an HTTP-date made a delay
    from now, rounded up), at most RETRY_AFTER_MAX_S; None where there is none or it is neither.
    Digits are ASCII ones ('²' is a digit to str.isdigit, and int() refuses it)."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return min(int(value), RETRY_AFTER_MAX_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if when.tzinfo is None:  # RFC 9110's IMF-fixdate is GMT; an obsolete form without a zone is too
        when = when.replace(tzinfo=datetime.UTC)
    return min(max(0, math.ceil((when - datetime.datetime.now(datetime.UTC)).total_seconds())), RETRY_AFTER_MAX_S)


def error_from(status: int, body: bytes, retry_after: str | None = None) -> EngineError:
    """An engine's error answer as an EngineError: its own message, for a 4xx its body as is, and
    its `Retry-After` header (a 429's: the router passes it on when no worker takes the request)."""
    message = body.decode(errors="replace")[:500]
    own = b""
    try:
        data = _json.decode(body)
        err = data.get("error", data) if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            message = str(err["message"])
        elif isinstance(data, dict) and data.get("message"):
            message = str(data["message"])
        if isinstance(data, dict) and 400 <= status < 500:
            own = body  # the engine's own refusal, for the client as it is
    except msgspec.DecodeError:
        pass
    kind = "engine_rejected" if 400 <= status < 500 else "engine_error"
    return EngineError(status, kind, message, own, retry_after_s=retry_after_s(retry_after))


def pass_through_body(leg: LegRequest, *, min_one: bool = False) -> dict[str, Any]:
    """The engine's body for a pass-through leg, P/D fields aside. `min_one`: a prefill leg asks
    for min_tokens 1 whatever the client sent (vLLM's: see vllm.engine_body)."""
    body = dict(leg.params)
    body["model"] = leg.model
    if leg.endpoint == ENDPOINT_COMPLETIONS and "prompt" not in body:
        body["prompt"] = leg.token_ids
    body["stream"] = leg.stream and not leg.prefill_only
    if not body["stream"] and not _refused_stream_options(leg.params):
        # unread on an answer not streamed; beside `stream` false vLLM refuses them, which the
        # client's truthy raw `stream` ("false") passed
        body.pop("stream_options", None)
    if leg.prefill_only:
        _one_token(body, leg, min_one)
    return body


def _refused_stream_options(params: dict[str, Any]) -> bool:
    """vLLM's stream_options validator on the client's raw values' truthiness: `{}` passes, and so
    does `"stream": "false"` (truthy text, that its model then reads as False)."""
    return bool(params.get("stream_options")) and not params.get("stream")


def _one_token(body: dict[str, Any], leg: LegRequest, min_one: bool) -> None:
    """A prefill leg's output is thrown away: one token, one choice, not streamed (pass_through_body,
    with stream_options as for any unstreamed leg). A value the engine refuses stays as the client
    sent it, so that the engine refuses the prefill leg at once, in the words it will refuse the
    decode leg with: rewritten into a valid one, it cost a whole remote prefill before that refusal
    (vLLM 0.32's checks: its request models' integer fields, SamplingParams._verify_args,
    TokenizeParams, the `stream_options` validator; engine_sim's copy of them judges these rules in
    tests/worker_shim/test_leg_params.py)."""
    chat = leg.endpoint == ENDPOINT_CHAT
    with contextlib.suppress(_Refused):
        if _int_field(body, "n", 1, nullable=chat) >= 1:  # a chat's n may be null, a completion's not
            body["n"] = 1
    try:
        # vLLM: a chat request's max_completion_tokens when given, else max_tokens (null: up to the
        # context); a completion's max_tokens, 16 when absent or null (normalize_null_max_tokens).
        # Its model reads each field, the one not used too.
        given = _int_field(body, "max_completion_tokens", None, nullable=True) if chat else None
        asked = _int_field(body, "max_tokens", None if chat else _DEFAULT_MAX_TOKENS, nullable=True)
        least = _int_field(body, "min_tokens", 0, nullable=False)
    except _Refused:
        return
    limit = given if given is not None else asked
    if limit is not None and not 1 <= limit <= (leg.max_model_len or limit):
        return
    # with no limit a chat's is the room its prompt leaves, less than the context
    if not 0 <= least <= (limit if limit is not None else leg.max_model_len or least):
        return
    body["max_tokens"] = 1
    if chat:
        body["max_completion_tokens"] = 1
    if min_one or least:
        # SGLang's and TensorRT-LLM's prefill samples the client's first token: it must not be an
        # EOS or stop either. One fits min_tokens <= max_tokens.
        body["min_tokens"] = 1
    elif "min_tokens" in body:
        body["min_tokens"] = 0  # the client's 0 as an int ("0", 0.0 and false are 0 to vLLM)


class _Refused(ValueError):
    """An integer field's value vLLM's request model refuses: the leg sends it as the client did."""


def _int_field(body: dict[str, Any], name: str, default: _T, *, nullable: bool) -> int | _T:
    """`body[name]` as vLLM 0.32's request model reads an integer field (protocol.messages.lax_int:
    "64", 64.0 and true are ints): `default` when absent, or null where the field takes a null. A
    null it types `int` (a completion's n, min_tokens) is refused as any unreadable value is."""
    if name not in body or (body[name] is None and nullable):
        return default
    value = lax_int(body[name])  # None for a null too
    if value is None:
        raise _Refused(name)
    return value


class StreamCut(EngineError):
    """A streamed answer whose connection failed after the engine's 200: cut mid-answer. A 503
    `engine_unavailable` as any lost connection; an adapter may know better (TensorRT-LLM's
    trtllm-serve cuts a streamed request that failed in its engine so, its 200 already sent)."""

    def __init__(self, url: str, exc: BaseException) -> None:
        super().__init__(503, "engine_unavailable", essence(exc, url))


class Result:
    __slots__ = ("body", "echo", "echoing", "finish_reason", "last", "token_ids", "usage")

    def __init__(self, echo: tuple[str, str] | None = None) -> None:
        self.finish_reason: str | None = None
        self.usage = Usage()
        self.token_ids: list[int] = []
        self.last: dict[str, Any] = {}
        self.body = b""
        self.echo = echo  # a streamed chat's echo to come: the last message's role and content (_chat_echo)
        self.echoing: set[Any] = set()  # the choices whose role chunk had that role: their next event is it


def _chat_echo(body: dict[str, Any]) -> tuple[str, str] | None:
    """The role and content of a chat request's last message when it asks for `echo`: vLLM 0.32
    streams that content back as a choice's first event after its role chunk, before any output,
    where the reply has the message's role (text parts joined by newlines, as its renderer does)."""
    messages = body.get("messages")
    if lax_bool(body.get("echo")) is not True or not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or not isinstance(last.get("role"), str):
        return None
    content = last.get("content")
    if isinstance(content, list):
        content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return (last["role"], content) if isinstance(content, str) and content else None


def _echoed(result: Result, choice: dict[str, Any]) -> bool:
    """`choice` is a streamed chat's echo (Result.echo), which is no output. Where the content
    differs from the message's (parts other than text), it counts, as before."""
    if result.echo is None or not isinstance(delta := choice.get("delta"), dict):
        return False
    index = choice.get("index")
    role = delta.get("role")
    if role is not None:
        if role == result.echo[0]:
            result.echoing.add(index)
        return False
    if index not in result.echoing:
        return False
    result.echoing.discard(index)
    return delta.get("content") == result.echo[1]


def _raise_error_event(data: dict[str, Any]) -> None:
    if "error" in data and not data.get("choices"):
        err = data["error"]
        code = err.get("code") if isinstance(err, dict) else None
        raise error_from(code if isinstance(code, int) and 400 <= code < 600 else 500, _encode.encode(data))


def _has_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    or delta.get("tool_calls"))  # fmt: skip
    if choice.get("text"):
        return True
    logprobs = choice.get("logprobs")
    return bool(_json.decode(logprobs) if isinstance(logprobs, msgspec.Raw) else logprobs)


def _whole_answer(raw: bytes) -> Any:
    """A whole answer as `_fold` reads it (`_read` with `_Whole`)."""
    return _read(raw, _whole)


def _read(raw: bytes, schema: msgspec.json.Decoder[Any]) -> Any:
    """An answer or a streamed event as `_fold` reads it: its fields in `schema` (`_Whole`,
    `_Event`) alone, as the plain decode has them, and the same error where it is not UTF-8. An
    error answer (small) and a shape the schema does not take (choices that are no list of objects,
    no object at all) are decoded whole, so that they read and fail as they always did."""
    try:
        answer = schema.decode(raw)
    except msgspec.ValidationError:
        return _json.decode(raw)
    if answer.error is not msgspec.UNSET and not answer.choices:
        return _json.decode(raw)  # an error answer: its whole body is the error's (_raise_error_event)
    _check_utf8(raw)
    data = _given(answer)
    if answer.choices is not msgspec.UNSET:
        data["choices"] = [_given(choice) for choice in answer.choices]
    return data


def _check_utf8(raw: bytes) -> None:
    """The plain decode's msgspec.DecodeError where `raw` is not UTF-8: the schema does not check the
    strings it skips, so invalid UTF-8 in one (a prompt's logprobs) went on to the client where a
    small event, decoded plainly, is a 502. Decoded a piece at a time: a 37 MB event decoded whole
    cost 18-52 ms (a str as large), in 256 KiB pieces 3-16 ms, in 1 MiB pieces 3-43 ms (a str of
    2 MiB or more where the text is not ASCII) (docs/worker_shim.md)."""
    view, at = memoryview(raw), 0
    while at < len(raw):
        try:
            # final for the last piece only: a character cut by a piece's edge is decoded with the next
            _, used = codecs.utf_8_decode(view[at : at + _UTF8_PIECE], "strict", at + _UTF8_PIECE >= len(raw))
        except UnicodeDecodeError:
            raise msgspec.DecodeError("Invalid UTF-8 encoded string") from None
        at += used


def _given(struct: msgspec.Struct) -> dict[str, Any]:
    return {k: v for k, v in msgspec.structs.asdict(struct).items() if v is not msgspec.UNSET}


def _fold(result: Result, data: dict[str, Any], *, require_ids: bool) -> int:
    """Folds one response object into `result`; returns how many output tokens it carries (the
    token ids of every choice; where a choice has none, one for a choice with output)."""
    _raise_error_event(data)
    count = 0
    choices = data.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        toks = choice.get("token_ids")
        if isinstance(toks, list):
            ids = [t for t in toks if isinstance(t, int)]
            result.token_ids.extend(ids)
            count += len(ids)
        elif require_ids and choice.get("text"):
            raise EngineError(502, "engine_protocol", "the engine returned text without token_ids")
        elif not _echoed(result, choice) and _has_output(choice):
            count += 1
        if choice.get("finish_reason") is not None:
            result.finish_reason = str(choice["finish_reason"])
    if data.get("usage"):
        result.usage = usage_from(data["usage"])
    result.last = data
    return count


def _fold_lines(
    result: Result, lines: list[bytes], *, pass_through: bool
) -> tuple[int, list[bytes], bool | EngineError | msgspec.DecodeError]:
    """Folds one read's SSE lines into `result`: the tokens they carry, their payloads, and True
    at `[DONE]`, or the error that stopped them (after the payloads before it)."""
    count, events = 0, list[bytes]()
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        # one copy of the payload, not two (a space after the colon, then the rest): a long prompt's
        # first event is tens of MB
        payload = (line[6:] if line.startswith(b"data: ") else line[5:]).strip()
        if payload == b"[DONE]":
            return count, events, True
        try:
            # The schema skips what the shim does not read, but costs a small event (every token's)
            # more than a plain decode (4.2-4.7 against 2.9-3.4 µs through _fold_lines): only a
            # large one, a prompt's logprobs, is read so.
            data = _read(payload, _event) if len(payload) > _SCHEMA_BYTES else _json.decode(payload)
            if not isinstance(data, dict):  # as a whole answer that is none (post_completion)
                raise EngineError(502, "engine_protocol", "a streamed event is not a JSON object")
            count += _fold(result, data, require_ids=not pass_through)
        except (EngineError, msgspec.DecodeError) as exc:
            return count, events, exc
        events.append(payload)
    return count, events, False


async def line_batches(content: aiohttp.StreamReader) -> AsyncGenerator[list[bytes], None]:
    """The stream's lines, each batch what one read brought (the last line may end at EOF without
    a newline); a line split over reads comes whole with the read that ends it. EngineError 502 for
    a line past MAX_LINE_BYTES."""
    partial: list[bytes] = []
    held = 0
    async for data in content.iter_any():
        held += len(data)
        if b"\n" not in data:
            partial.append(data)
            if held > MAX_LINE_BYTES:
                raise EngineError(502, "engine_protocol", f"an SSE line over {MAX_LINE_BYTES} bytes without a newline")
            continue
        # only this read is split, and the line it ends joined to what came before it, once: a long
        # line (a long prompt's first event, tens of MB) was joined whole, then copied again by the split
        head, *lines, rest = data.split(b"\n")
        lines.insert(0, b"".join([*partial, head]) if partial else head)
        partial = [rest] if rest else []
        held = len(rest)
        yield lines
    if partial:
        yield [b"".join(partial)]


async def post_utility(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], *, timeout: aiohttp.ClientTimeout = UTILITY_TIMEOUT
) -> bytes:
    """POST `body` to a utility route (/tokenize, /detokenize); the engine's 200 answer as it is,
    else EngineError carrying the engine's own refusal."""
    try:
        headers = {"Content-Type": "application/json"}  # vLLM requires it
        async with session.post(url, data=_encode.encode(body), headers=headers, timeout=timeout) as resp:
            raw = await resp.read()
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        raise EngineError(503, "engine_unavailable", essence(exc, url)) from exc
    if resp.status != 200:
        raise error_from(resp.status, raw, resp.headers.get("Retry-After"))
    return raw


async def post_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    on_output: OnOutput | None,
    *,
    pass_through: bool = False,
) -> Result:
    """POST `body` to `url`; streams when body["stream"]. A pass-through call hands the SSE
    payloads of each read to `on_output` with the number of tokens they carry, and keeps a whole
    answer's bytes in `Result.body`; a token-id call hands over the new ids."""
    try:
        async with session.post(url, data=_encode.encode(body), headers=headers) as resp:
            if resp.status != 200:
                raise error_from(resp.status, await resp.read(), resp.headers.get("Retry-After"))
            result = Result(_chat_echo(body) if pass_through and body.get("stream") else None)
            if not body.get("stream"):
                raw = await resp.read()
                data = _whole_answer(raw)
                if not isinstance(data, dict):
                    raise EngineError(502, "engine_protocol", "the completion response is not a JSON object")
                _fold(result, data, require_ids=not pass_through)
                if pass_through:
                    result.body = raw
                return result
            done = False
            try:
                async with contextlib.aclosing(line_batches(resp.content)) as batches:
                    async for lines in batches:
                        seen = len(result.token_ids)
                        count, events, end = _fold_lines(result, lines, pass_through=pass_through)
                        if on_output is not None:  # what came before a failure goes out first
                            if pass_through and events:
                                await on_output(count, events, [])
                            elif not pass_through and count:
                                await on_output(count, [], result.token_ids[seen:])
                        if isinstance(end, Exception):
                            raise end
                        if end:
                            done = True
                            break
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
                raise StreamCut(url, exc) from exc
            if not done:
                # vLLM, SGLang and TensorRT-LLM end every stream they finish with [DONE] (after an
                # error event too; one that fails otherwise drops the connection): a clean EOF
                # without it is a cut answer (the engine or a proxy ended it early), whatever
                # finish_reason came. Taken as a success, it reached the client as a whole answer,
                # only shorter: with n=2 and one choice unfinished, or the usage event asked for
                # and never sent (until 2026-12-06 one finish_reason was enough).
                raise EngineError(502, "engine_protocol", f"{url}: the stream ended without [DONE]")
            return result
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        raise EngineError(503, "engine_unavailable", essence(exc, url)) from exc
    except msgspec.DecodeError as exc:
        raise EngineError(502, "engine_protocol", f"{url} sent malformed JSON: {exc}") from exc
