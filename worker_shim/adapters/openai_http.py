"""The OpenAI-style `/v1/completions` call that vLLM and TensorRT-LLM share: token-id prompts,
SSE streaming, usage, and error bodies mapped to EngineError.

Token ids come back per choice in `token_ids` (vLLM's `return_token_ids`, TensorRT-LLM's default
for token-id prompts); an engine that sends none is a protocol error, never silently empty output.
Cancelling the coroutine closes the connection, which both engines treat as an abort.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec

from protocol import Usage
from worker_shim.adapters.base import EngineError

__all__ = ["post_completion", "usage_from"]

_json = msgspec.json.Decoder()


def usage_from(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        cached_tokens=int(cached or 0),
    )


def _error_from(status: int, body: bytes) -> EngineError:
    message = body.decode(errors="replace")[:500]
    try:
        data = _json.decode(body)
        err = data.get("error", data) if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            message = str(err["message"])
        elif isinstance(data, dict) and data.get("message"):
            message = str(data["message"])
    except msgspec.DecodeError:
        pass
    kind = "engine_rejected" if 400 <= status < 500 else "engine_error"
    return EngineError(status, kind, message)


class _Result:
    __slots__ = ("finish_reason", "last", "token_ids", "usage")

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.usage = Usage()
        self.token_ids: list[int] = []
        self.last: dict[str, Any] = {}


def _take_choice(result: _Result, data: dict[str, Any]) -> list[int]:
    """Folds one response object into `result`; returns the new token ids."""
    if "error" in data and not data.get("choices"):
        err = data["error"]
        code = int(err.get("code") or 500) if isinstance(err, dict) else 500
        raise _error_from(code, msgspec.json.encode(data))
    choices = data.get("choices") or []
    toks: list[int] | None = None
    if choices:
        choice = choices[0]
        toks = choice.get("token_ids")
        if toks is None and choice.get("text"):
            raise EngineError(502, "engine_protocol", "the engine returned text without token_ids")
        if toks:
            result.token_ids.extend(toks)
        if choice.get("finish_reason") is not None:
            result.finish_reason = str(choice["finish_reason"])
    if data.get("usage"):
        result.usage = usage_from(data["usage"])
    result.last = data
    return list(toks) if choices and toks else []


async def post_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    on_tokens: Callable[[list[int]], Awaitable[None]] | None,
) -> tuple[_Result, dict[str, Any]]:
    """POST `body` to `url`; streams when body["stream"]. Returns the result and the final JSON object."""
    try:
        async with session.post(url, data=msgspec.json.encode(body), headers=headers) as resp:
            if resp.status != 200:
                raise _error_from(resp.status, await resp.read())
            result = _Result()
            if not body.get("stream"):
                data = _json.decode(await resp.read())
                if not isinstance(data, dict):
                    raise EngineError(502, "engine_protocol", "the completion response is not a JSON object")
                _take_choice(result, data)
                return result, data
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = _json.decode(payload)
                if isinstance(data, dict):
                    toks = _take_choice(result, data)
                    if toks and on_tokens is not None:
                        await on_tokens(toks)
            return result, result.last
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        raise EngineError(503, "engine_unavailable", f"{url}: {exc!r}") from exc
    except msgspec.DecodeError as exc:
        raise EngineError(502, "engine_protocol", f"{url} sent malformed JSON: {exc}") from exc
