"""The OpenAI-style HTTP calls that vLLM, TensorRT-LLM and SGLang serve: request bodies, SSE
streaming, usage, and error bodies mapped to EngineError.

Two kinds of leg:
- pass-through (`leg.endpoint` set): the client's own request goes to the engine's
  `/v1/completions` or `/v1/chat/completions` with only what the shim must force (`model`, the
  routed token ids as a completions prompt, `stream`, the P/D fields; a prefill leg one token,
  `n` 1, no `min_tokens` or `stream_options`). The engine's answer comes back as it is: each SSE
  payload, or the whole body. To count output tokens a stream asks for `return_token_ids` (vLLM,
  SGLang); when the client did not ask for them, each event gets them taken out again, as the
  engine writes an event it was not asked for ids in (vLLM: null, SGLang: absent).
- token ids (`leg.endpoint` ""): the router's older leg, a token-id completion built from
  `SamplingParams`, its ids back per choice in `token_ids`; an engine that sends none is a
  protocol error, never silently empty output.

Cancelling the coroutine closes the connection, which these engines treat as an abort.
"""

from __future__ import annotations

import enum
from typing import Any

import aiohttp
import msgspec

from protocol import Usage
from protocol.messages import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from worker_shim.adapters.base import EngineError, LegRequest, OnOutput

__all__ = ["ENDPOINT_PATHS", "Result", "TokenIds", "pass_through_body", "post_completion", "usage_from"]

_json = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()
ENDPOINT_PATHS = {ENDPOINT_COMPLETIONS: "/v1/completions", ENDPOINT_CHAT: "/v1/chat/completions"}


class TokenIds(enum.Enum):
    """How an engine writes the token ids of an event it was not asked for them in."""

    NULL = "null"  # vLLM: `token_ids: null`, `prompt_token_ids: null`
    ABSENT = "absent"  # SGLang: the keys are left out
    UNASKED = "unasked"  # the engine sends them unasked (TensorRT-LLM for token-id prompts): leave as sent


def usage_from(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_int(raw.get("prompt_tokens")),
        completion_tokens=_int(raw.get("completion_tokens")),
        cached_tokens=_int(cached),
    )


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _error_from(status: int, body: bytes) -> EngineError:
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
    return EngineError(status, kind, message, own)


def pass_through_body(leg: LegRequest, token_ids: TokenIds) -> tuple[dict[str, Any], bool]:
    """The engine's body for a pass-through leg (P/D fields aside), and whether the shim asked for
    token ids the client did not."""
    body = dict(leg.params)
    body["model"] = leg.model
    if leg.endpoint == ENDPOINT_COMPLETIONS and "prompt" not in body:
        body["prompt"] = leg.token_ids
    if leg.prefill_only:
        # The prefill leg's output is thrown away: one token, one choice, nothing streamed.
        body.update(max_tokens=1, stream=False, n=1)
        if leg.endpoint == ENDPOINT_CHAT:
            body["max_completion_tokens"] = 1
        body.pop("min_tokens", None)
        body.pop("stream_options", None)
        return body, False
    body["stream"] = leg.stream
    forced = leg.stream and token_ids is not TokenIds.UNASKED and body.get("return_token_ids") is not True
    if forced:
        body["return_token_ids"] = True
    return body, forced


class Result:
    __slots__ = ("body", "finish_reason", "last", "token_ids", "usage")

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.usage = Usage()
        self.token_ids: list[int] = []
        self.last: dict[str, Any] = {}
        self.body = b""


def _raise_error_event(data: dict[str, Any]) -> None:
    if "error" in data and not data.get("choices"):
        err = data["error"]
        code = err.get("code") if isinstance(err, dict) else None
        raise _error_from(code if isinstance(code, int) and 400 <= code < 600 else 500, _encode.encode(data))


def _fold(result: Result, data: dict[str, Any], *, require_ids: bool) -> list[int]:
    """Folds one response object into `result`; returns its output token ids (every choice)."""
    _raise_error_event(data)
    out: list[int] = []
    choices = data.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        toks = choice.get("token_ids")
        if isinstance(toks, list):
            out.extend(t for t in toks if isinstance(t, int))
        elif require_ids and choice.get("text"):
            raise EngineError(502, "engine_protocol", "the engine returned text without token_ids")
        if choice.get("finish_reason") is not None:
            result.finish_reason = str(choice["finish_reason"])
    if data.get("usage"):
        result.usage = usage_from(data["usage"])
    result.token_ids.extend(out)
    result.last = data
    return out


def _strip_ids(data: dict[str, Any], how: TokenIds) -> None:
    """Takes the token ids the shim asked for out of one event, as the engine would have left them."""
    holders = [data, *(c for c in data.get("choices") or () if isinstance(c, dict))]
    for holder in holders:
        for key in ("token_ids", "prompt_token_ids"):
            if key in holder:
                if how is TokenIds.NULL:
                    holder[key] = None
                else:
                    del holder[key]


async def post_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    on_output: OnOutput | None,
    *,
    pass_through: bool = False,
    strip: TokenIds | None = None,
) -> Result:
    """POST `body` to `url`; streams when body["stream"]. A pass-through call hands each SSE
    payload to `on_output` (with `strip`: the forced token ids taken out) and keeps a whole
    answer's bytes in `Result.body`."""
    try:
        async with session.post(url, data=_encode.encode(body), headers=headers) as resp:
            if resp.status != 200:
                raise _error_from(resp.status, await resp.read())
            result = Result()
            if not body.get("stream"):
                raw = await resp.read()
                data = _json.decode(raw)
                if not isinstance(data, dict):
                    raise EngineError(502, "engine_protocol", "the completion response is not a JSON object")
                _fold(result, data, require_ids=not pass_through)
                if pass_through:
                    result.body = raw
                return result
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = _json.decode(payload)
                if not isinstance(data, dict):
                    continue
                toks = _fold(result, data, require_ids=not pass_through)
                if on_output is None:
                    continue
                if pass_through:
                    if strip is not None:
                        _strip_ids(data, strip)
                        payload = _encode.encode(data)
                    await on_output(toks, payload)
                elif toks:
                    await on_output(toks, None)
            return result
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        raise EngineError(503, "engine_unavailable", f"{url}: {exc!r}") from exc
    except msgspec.DecodeError as exc:
        raise EngineError(502, "engine_protocol", f"{url} sent malformed JSON: {exc}") from exc
