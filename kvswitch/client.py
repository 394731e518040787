"""A streaming OpenAI `/v1/completions` client that times each request.

It sends the prompt as token ids (or, with `text_prompts`, as the built-in tokenizer's text for
those ids, which encodes back to the same ids: for routers that only take text, such as
sglang-router) with `ignore_eos` and `max_tokens` = the wanted output length, so output lengths are
exact, and records, on the client's monotonic clock:
- `ttft_s`: from sending the request to the first chunk carrying text;
- `itl_s`: the gap before each later chunk carrying text (servers stream one token per chunk; a
  chunk carrying several tokens counts as one gap);
- `e2e_s`: until the stream ends, or, for a failed request, until it failed (the error answer read,
  the timeout, the error in the stream), so a run's duration counts every request's end;
- `output_tokens`: `usage.completion_tokens` when the server sends usage, else the chunks counted;
- `decode_worker` / `prefill` / `outcome`: the router's `x-kvswitch-decode-worker`,
  `x-kvswitch-prefill` (`bypass`, `remote` or `agg`) and `x-kvswitch-outcome` (the conditional
  disaggregation decision, e.g. `bypass_isl`) response headers; None when absent (a bare engine, a
  peer router).
- `server_ms`: the router's `Server-Timing` response header as {name: ms} (`parse`, `route`,
  `worker`: see docs/router.md); empty when absent.
A failed request is a result with `ok=False` and the reason, never an exception: a malformed
answer (a chunk that is not what OpenAI's streaming API sends, an error body that is not UTF-8) too,
named with the request and the server, since `bench replay --url` takes any OpenAI server.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp.http_exceptions import HttpProcessingError

from protocol.tokenizer import BuiltinTokenizer

__all__ = [
    "DECODE_WORKER_HEADER",
    "OUTCOME_HEADER",
    "PREFILL_HEADER",
    "Completion",
    "CompletionClient",
    "discover_model",
    "parse_server_timing",
]

DECODE_WORKER_HEADER = "x-kvswitch-decode-worker"
PREFILL_HEADER = "x-kvswitch-prefill"
OUTCOME_HEADER = "x-kvswitch-outcome"


class Completion(msgspec.Struct, kw_only=True):
    ok: bool
    status: int = 0
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = msgspec.field(default_factory=list)
    e2e_s: float | None = None
    decode_worker: str | None = None
    prefill: str | None = None
    outcome: str | None = None
    server_ms: dict[str, float] = msgspec.field(default_factory=dict)


def parse_server_timing(value: str | None) -> dict[str, float]:
    """`Server-Timing` (W3C) as {metric: dur in ms}; metrics without a readable `dur` are left out."""
    out: dict[str, float] = {}
    for metric in (value or "").split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, dur = param.partition("=")
            if name and key.strip() == "dur":
                with contextlib.suppress(ValueError):
                    out[name] = float(dur.strip().strip('"'))
    return out


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model] | None = None


async def discover_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model `GET {url}/v1/models` lists; a RuntimeError naming the URL when it lists
    none or its answer is not a model list."""
    models_url = f"{url.rstrip('/')}/v1/models"
    async with session.get(models_url) as resp:
        body = await resp.read()  # whatever its content type: some routers answer JSON as text/plain
    if resp.status != 200:
        raise RuntimeError(f"GET {models_url}: HTTP {resp.status}: {body[:200].decode(errors='replace')}")
    try:
        models = msgspec.json.decode(body, type=_Models).data
    except msgspec.DecodeError as exc:
        raise RuntimeError(f"GET {models_url}: not a model list ({exc}): {body[:200]!r}") from None
    if not models:
        raise RuntimeError(f"{models_url} lists no model; pass --model")
    return models[0].id


class _Choice(msgspec.Struct):
    text: str | None = None
    token_ids: list[int] | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None
    prompt_tokens: int | None = None


class _Chunk(msgspec.Struct):
    """What the client reads of a streamed chunk: anything else in it is the server's business."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = msgspec.UNSET  # an error event (the server's own shape)


_read_chunk = msgspec.json.Decoder(_Chunk)


class CompletionClient:
    """Sends one completion at a time per call; share one instance (and its aiohttp session) across
    the concurrent requests of a replay."""

    def __init__(
        self, session: aiohttp.ClientSession, model: str, *, timeout_s: float = 600.0, text_prompts: bool = False
    ) -> None:
        self.session = session
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._tokenizer = BuiltinTokenizer() if text_prompts else None

    async def complete(self, url: str, prompt: list[int], max_tokens: int, *, request_id: str) -> Completion:
        body = {
            "model": self.model,
            "prompt": self._tokenizer.decode(prompt) if self._tokenizer is not None else prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.monotonic()
        try:
            async with self.session.post(
                f"{url.rstrip('/')}/v1/completions",
                json=body,
                headers={"X-Request-Id": request_id},
                timeout=self.timeout,
            ) as resp:
                result = Completion(
                    ok=False,
                    status=resp.status,
                    prompt_tokens=len(prompt),
                    decode_worker=resp.headers.get(DECODE_WORKER_HEADER),
                    prefill=resp.headers.get(PREFILL_HEADER),
                    outcome=resp.headers.get(OUTCOME_HEADER),
                    server_ms=parse_server_timing(resp.headers.get("Server-Timing")),
                )
                if resp.status != 200:
                    # Read as bytes: a proxy's error page need not be UTF-8.
                    result.error = f"HTTP {resp.status}: {(await resp.read())[:300].decode(errors='replace')}"
                else:
                    await self._read_stream(resp, result, start, where=f"(request {request_id}, {url})")
        except (aiohttp.ClientError, TimeoutError) as exc:
            # aiohttp's total timeout raises a bare TimeoutError, no text: say which one fired.
            detail = str(exc) or (f"client timeout {self.timeout.total:g} s" if isinstance(exc, TimeoutError) else "")
            result = Completion(ok=False, prompt_tokens=len(prompt), error=f"{type(exc).__name__}: {detail}")
        except HttpProcessingError as exc:  # a line past aiohttp's limit: not a ClientError
            error = f"malformed answer: {type(exc).__name__}: {exc.message} (request {request_id}, {url})"
            result = Completion(ok=False, prompt_tokens=len(prompt), error=error)
        if result.e2e_s is None:  # failed before the stream's end: it ends now
            result.e2e_s = time.monotonic() - start
        return result

    async def _read_stream(self, resp: aiohttp.ClientResponse, result: Completion, start: float, where: str) -> None:
        last: float | None = None
        chunks = 0
        usage_tokens: int | None = None
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = _read_chunk.decode(data)
            except (msgspec.DecodeError, RecursionError) as exc:  # not JSON or UTF-8, a shape not ours, too deep
                result.error = f"malformed SSE chunk: {exc}: {data[:100]!r} {where}"
                return
            if chunk.error is not msgspec.UNSET:
                result.error = f"stream error: {chunk.error}"
                return
            now = time.monotonic()
            if any(c.text or c.token_ids for c in chunk.choices or ()):
                chunks += 1
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
            if chunk.usage is not None and chunk.usage.completion_tokens is not None:
                usage_tokens = chunk.usage.completion_tokens
                result.prompt_tokens = chunk.usage.prompt_tokens or result.prompt_tokens
        result.e2e_s = time.monotonic() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        if result.ttft_s is None:
            result.error = "stream ended without a token"
            return
        if not done and usage_tokens is None:
            # vLLM's stream always ends with its usage chunk (asked for) and [DONE]: one without
            # either was cut short, however cleanly its connection closed
            result.error = f"stream ended without [DONE] or its usage, after {chunks} chunks {where}"
            return
        result.ok = True
