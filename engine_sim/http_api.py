"""The HTTP API, as vLLM's OpenAI server answers it (routes, status codes, bodies, SSE framing).

vLLM routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, POST /reset_prefix_cache, GET /version.

The sim's own routes (not in vLLM; under /sim/ so they never clash):
- POST /sim/kv_pull: a decode sim in another process finished reading pinned KV (engine_sim/disagg.py);
- POST /sim/faults: change fault knobs live (engine_sim/faults.py); `{"crash": true}` or
  `{"restart": true}` act at once (202);
- GET /sim/state: engine id, blocks in use, prefill tokens computed, queue lengths, event seq, faults;
  `?prefixes=1` adds `cached_block_prefixes` (token ids of every cached block's whole prefix).

Prompts: `prompt` may be text, a list of token ids, or a list of either; text is encoded with the
built-in tokenizer (protocol.tokenizer) and chat messages go through its ChatML template. A client
disconnect cancels the handler (aiohttp handler cancellation) and aborts the request in the engine.
`X-Request-Id` names the request (`cmpl-{id}`; `cmpl-{id}-{i}` per prompt of a batch) and is echoed.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from engine_sim import openai_format as fmt
from engine_sim.errors import PromptTooLongError, SimRequestError
from engine_sim.metrics import CONTENT_TYPE, render_metrics
from engine_sim.openai_format import SSE_DONE, ChatBody, CompletionBody, Output, StopText, sse
from engine_sim.request import SimRequest
from engine_sim.runner import RequestStream, StreamClosed
from protocol.tokenizer import BuiltinTokenizer, apply_chat_template

if TYPE_CHECKING:
    from engine_sim.server import SimServer

__all__ = ["SERVER_KEY", "build_app"]

SERVER_KEY: web.AppKey[SimServer] = web.AppKey("sim_server", object)  # type: ignore[arg-type]
_tokenizer = BuiltinTokenizer()
_json = msgspec.json.Encoder()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(obj), status=status, content_type="application/json")


def _error(exc: SimRequestError) -> web.Response:
    return _json_response(fmt.error_body(exc.message, exc.kind, exc.param, exc.status), exc.status)


class _Prompt(msgspec.Struct):
    token_ids: list[int]
    from_text: bool


class _Job:
    """One generate call: its prompts, sampling and what the client asked to get back."""

    def __init__(self, srv: SimServer, body: CompletionBody | ChatBody, prompts: list[_Prompt], base_id: str) -> None:
        self.srv = srv
        self.body = body
        self.prompts = prompts
        self.base_id = base_id
        self.head = fmt.Head(base_id, int(time.time()), srv.config.model, srv.fingerprint)
        self.stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        self.want_ids = bool(body.return_token_ids)
        self.streams: list[RequestStream] = []

    def max_tokens(self, prompt_len: int) -> int:
        room = self.srv.config.max_model_len - prompt_len
        asked = self.body.max_tokens
        if isinstance(self.body, ChatBody) and self.body.max_completion_tokens is not None:
            asked = self.body.max_completion_tokens
        if asked is not None and asked < 1:
            raise SimRequestError(f"max_tokens must be at least 1, got {asked}.", param="max_tokens")
        return room if asked is None else min(asked, room)

    def submit(self) -> None:
        params = self.body.kv_transfer_params or {}
        remote_decode = bool(params.get("do_remote_decode"))
        remote_prefill = params if params.get("do_remote_prefill") else None
        for i, p in enumerate(self.prompts):
            rid = self.base_id if len(self.prompts) == 1 else f"{self.base_id}-{i}"
            req = SimRequest(
                rid,
                p.token_ids,
                max_tokens=1 if remote_decode else self.max_tokens(len(p.token_ids)),
                stop_token_ids=frozenset(self.body.stop_token_ids or ()),
                seed=self.body.seed,
                remote_decode=remote_decode,
                remote_prefill=remote_prefill,
            )
            self.streams.append(self.srv.runner.submit(req))

    def abort_unfinished(self) -> None:
        for s in self.streams:
            if not s.finished:
                self.srv.runner.abort(s.request_id)


def _validate_prompt(srv: SimServer, prompt: _Prompt) -> None:
    limit = srv.config.max_model_len
    n = len(prompt.token_ids)
    if n >= limit:
        # vLLM encodes text truncated to limit + 1 tokens, so for text it can only say "at least".
        if prompt.from_text:
            raise PromptTooLongError(limit, limit + 1, at_least=True)
        raise PromptTooLongError(limit, n, at_least=False)
    if n == 0:
        raise SimRequestError("The prompt cannot be empty.", param="prompt")


def _parse_prompts(raw: Any) -> list[_Prompt]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(raw, str):
        return [_Prompt(_tokenizer.encode(raw), True)]
    if is_ids(raw) and raw:
        return [_Prompt(list(raw), False)]
    if isinstance(raw, list) and raw:
        out = []
        for item in raw:
            if isinstance(item, str):
                out.append(_Prompt(_tokenizer.encode(item), True))
            elif is_ids(item):
                out.append(_Prompt(list(item), False))
            else:
                break
        else:
            return out
    raise SimRequestError(
        "prompt must be a string, a list of token ids, or a list of strings or token-id lists", param="prompt"
    )


def _check_ids(srv: SimServer, prompts: list[_Prompt]) -> None:
    vocab = _tokenizer.vocab_size
    for p in prompts:
        bad = next((t for t in p.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise SimRequestError(f"Token id {bad} is out of vocabulary", param="prompt")
        _validate_prompt(srv, p)


def _request_id(request: web.Request) -> str:
    return request.headers.get("X-Request-Id") or secrets.token_hex(8)


def _check_model(srv: SimServer, model: str | None) -> None:
    if model is not None and model != srv.config.model:
        raise SimRequestError(
            f"The model `{model}` does not exist. Valid aliases: {srv.config.model}",
            status=404,
            kind="NotFoundError",
            param="model",
        )


async def _admit(request: web.Request, kind: type[CompletionBody] | type[ChatBody]) -> tuple[SimServer, Any]:
    srv: SimServer = request.app[SERVER_KEY]
    body = fmt.parse_body(await request.read(), kind)
    _check_model(srv, body.model)
    if body.n != 1:
        raise SimRequestError("the simulated engine supports n=1 only", param="n")
    return srv, body


def _fault_gate(srv: SimServer, request: web.Request) -> bool:
    """Count the request against the fault knobs; True when the engine just crashed under it."""
    if srv.faults.note_request() == "crash":
        srv.crash_soon()
        if request.transport is not None:
            request.transport.abort()
        return True
    return False


async def _serve(
    request: web.Request,
    kind: type[CompletionBody] | type[ChatBody],
    id_prefix: str,
    prompts_of: Callable[[Any], list[_Prompt]],
    respond: Callable[[web.Request, _Job], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """Admit and submit one generate call, then `respond`; the engine requests end with the call."""
    try:
        srv, body = await _admit(request, kind)
        prompts = prompts_of(body)
        _check_ids(srv, prompts)
        if _fault_gate(srv, request):
            return web.Response(status=500)
        job = _Job(srv, body, prompts, f"{id_prefix}-{_request_id(request)}")
        job.submit()
    except SimRequestError as exc:
        return _error(exc)
    try:
        return await respond(request, job)
    except StreamClosed:
        return _engine_gone(request)
    finally:
        job.abort_unfinished()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, CompletionBody, "cmpl", lambda body: _parse_prompts(body.prompt), _respond_completion)


async def _respond_completion(request: web.Request, job: _Job) -> web.StreamResponse:
    if job.body.stream:
        return await _stream_completion(request, job)
    return await _complete(request, job)


def _engine_gone(request: web.Request) -> web.Response:
    if request.transport is not None:
        request.transport.abort()  # a dead engine drops its connections; it sends no error body
    return web.Response(status=500)


class _Piece(msgspec.Struct, gc=False):
    """One generated token and what its chunk carries (text possibly ""); `last` ends the choice."""

    token: int
    out: Output
    last: bool


async def _steps(job: _Job, i: int, stop: StopText) -> AsyncIterator[list[_Piece]]:
    """Prompt i's tokens, one list per engine step, detokenised through `stop`. A stop string
    ends the choice there and aborts the engine request (vLLM stops generating at once)."""
    stream = job.streams[i]
    while new := await stream.next_tokens():
        pieces = []
        for k, t in enumerate(new):
            text = stop.add(_tokenizer.decode([t]))
            last = stop.stop_reason is not None or (stream.finished and k == len(new) - 1)
            finish = "stop" if stop.stop_reason is not None else (stream.finish_reason if last else None)
            if last:
                text += stop.finish()
            out = Output(text, finish, stop.stop_reason, [t] if job.want_ids else None)
            pieces.append(_Piece(t, out, last))
            if stop.stop_reason is not None:
                job.srv.runner.abort(stream.request_id, "stop")
                break
        yield pieces
        if stop.stop_reason is not None:
            return


async def _collect(job: _Job, i: int) -> tuple[int, Output]:
    """Run prompt i to the end: how many tokens it generated and the whole choice."""
    stop = StopText(job.stops)
    ids: list[int] = []
    async for pieces in _steps(job, i, stop):
        ids.extend(p.token for p in pieces)
    finish = "stop" if stop.stop_reason is not None else job.streams[i].finish_reason
    return len(ids), Output(stop.text, finish, stop.stop_reason, ids if job.want_ids else None)


async def _complete(request: web.Request, job: _Job) -> web.StreamResponse:
    results = await asyncio.gather(*(_collect(job, i) for i in range(len(job.prompts))))
    choices = [
        fmt.completion_choice(i, out, job.prompts[i].token_ids if job.want_ids else None)
        for i, (_, out) in enumerate(results)
    ]
    n_in = sum(len(p.token_ids) for p in job.prompts)
    n_out = sum(n for n, _ in results)
    body = fmt.completion_response(job.head, choices, fmt.usage(n_in, n_out), job.streams[0].kv_transfer_params)
    return _with_id(_json_response(body), request)


def _with_id(resp: web.StreamResponse, request: web.Request) -> web.StreamResponse:
    if "X-Request-Id" in request.headers:
        resp.headers["X-Request-Id"] = request.headers["X-Request-Id"]
    return resp


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    _with_id(resp, request)
    await resp.prepare(request)
    return resp


async def _stream_completion(request: web.Request, job: _Job) -> web.StreamResponse:
    resp = await _open_sse(request)
    counts = [0] * len(job.prompts)

    async def pump(i: int) -> None:
        stop = StopText(job.stops)
        first = True
        async for pieces in _steps(job, i, stop):
            counts[i] += len(pieces)
            buf = bytearray()
            for p in pieces:
                if p.out.text or p.last or job.want_ids:
                    prompt_ids = job.prompts[i].token_ids if job.want_ids and first else None
                    buf += sse(fmt.completion_chunk(job.head, i, p.out, prompt_ids))
                    first = False
            await resp.write(bytes(buf))

    await asyncio.gather(*(pump(i) for i in range(len(job.prompts))))
    n_in = sum(len(p.token_ids) for p in job.prompts)
    return await _end_sse(resp, job, "text_completion", fmt.usage(n_in, sum(counts), details=False))


async def _end_sse(resp: web.StreamResponse, job: _Job, obj: str, usage: dict[str, Any]) -> web.StreamResponse:
    """The usage chunk when the client asked for it, then [DONE]."""
    opts = job.body.stream_options
    if opts is not None and opts.include_usage:
        await resp.write(sse(fmt.usage_chunk(job.head, obj, usage)))
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


def _chat_prompts(body: ChatBody) -> list[_Prompt]:
    if not isinstance(body.messages, list) or not body.messages:
        raise SimRequestError("messages must be a non-empty list", param="messages")
    try:
        text = apply_chat_template(body.messages, add_generation_prompt=body.add_generation_prompt)
    except (ValueError, AttributeError) as exc:
        raise SimRequestError(str(exc), param="messages") from exc
    return [_Prompt(_tokenizer.encode(text), True)]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, ChatBody, "chatcmpl", _chat_prompts, _respond_chat)


async def _respond_chat(request: web.Request, job: _Job) -> web.StreamResponse:
    if job.body.stream:
        return await _stream_chat(request, job)
    n_out, out = await _collect(job, 0)
    prompt_ids = job.prompts[0].token_ids
    body = fmt.chat_response(
        job.head,
        out,
        prompt_ids if job.want_ids else None,
        fmt.usage(len(prompt_ids), n_out),
        job.streams[0].kv_transfer_params,
    )
    return _with_id(_json_response(body), request)


async def _stream_chat(request: web.Request, job: _Job) -> web.StreamResponse:
    resp = await _open_sse(request)
    n_out = 0
    prompt_ids = job.prompts[0].token_ids
    await resp.write(sse(fmt.chat_first_chunk(job.head, prompt_ids if job.want_ids else None)))
    async for pieces in _steps(job, 0, StopText(job.stops)):
        n_out += len(pieces)
        buf = bytearray()
        for p in pieces:
            if p.out.text or p.last:
                buf += sse(fmt.chat_chunk(job.head, p.out))
        await resp.write(bytes(buf))
    return await _end_sse(resp, job, "chat.completion.chunk", fmt.usage(len(prompt_ids), n_out, details=False))


async def models(request: web.Request) -> web.Response:
    srv = request.app[SERVER_KEY]
    cfg = srv.config
    return _json_response(fmt.models_response(cfg.model, srv.created, cfg.max_model_len, srv.perm_id))


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return _json_response({"version": fmt.VLLM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    body = render_metrics(request.app[SERVER_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    ok = request.app[SERVER_KEY].runner.reset_prefix_cache()
    return _json_response({"success": ok})


async def kv_pull(request: web.Request) -> web.Response:
    srv = request.app[SERVER_KEY]
    try:
        body = msgspec.json.decode(await request.read())
    except msgspec.DecodeError:
        return _json_response({"released": False}, 400)
    if not isinstance(body, dict) or body.get("remote_engine_id") not in (None, srv.engine.engine_id):
        return _json_response({"released": False}, 404)
    ok = srv.runner.release_pin(body.get("remote_request_id"), body.get("remote_block_ids"))
    return _json_response({"released": ok}, 200 if ok else 404)


class _FaultsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    crash_after: int | None = None
    hang_after: int | None = None
    hang: bool | None = None
    slowdown: float | None = None
    drop_event_fraction: float | None = None
    crash: bool = False
    restart: bool = False


async def faults(request: web.Request) -> web.Response:
    srv = request.app[SERVER_KEY]
    try:
        body = msgspec.json.decode(await request.read() or b"{}", type=_FaultsBody)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _json_response(fmt.error_body(str(exc), "BadRequestError", None, 400), 400)
    f = srv.faults
    for name in ("crash_after", "hang_after", "slowdown", "drop_event_fraction"):
        value = getattr(body, name)
        if value is not None:
            setattr(f, name, value)
    if body.hang is not None:
        f.hang = body.hang
    if body.crash:
        srv.crash_soon()
        return _json_response(f.snapshot(), 202)
    if body.restart:
        srv.restart_soon()
        return _json_response(f.snapshot(), 202)
    return _json_response(f.snapshot())


async def state(request: web.Request) -> web.Response:
    srv = request.app[SERVER_KEY]
    eng = srv.engine
    out: dict[str, Any] = {
        "engine_id": eng.engine_id,
        "role": srv.config.role,
        "num_gpu_blocks": eng.pool.num_blocks,
        "block_size": eng.block_size,
        "blocks_in_use": eng.num_blocks_in_use,
        "prefill_tokens_computed": eng.prefill_tokens_computed,
        "running": len(eng.running),
        "waiting": len(eng.waiting),
        "pinned": len(eng.pins),
        "event_seq": srv.event_seq,
        "faults": srv.faults.snapshot(),
    }
    if request.query.get("prefixes"):
        out["cached_block_prefixes"] = eng.cached_block_prefixes()
    return _json_response(out)


def build_app(server: SimServer) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20, middlewares=[_track_transports])
    app[SERVER_KEY] = server
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/sim/kv_pull", kv_pull)
    app.router.add_post("/sim/faults", faults)
    app.router.add_get("/sim/state", state)
    return app


@web.middleware
async def _track_transports(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Remember open connections so a crash can cut them all at once."""
    srv = request.app[SERVER_KEY]
    transport = request.transport
    if transport is not None:
        srv.open_transports.add(transport)
    try:
        return await handler(request)
    finally:
        if transport is not None:
            srv.open_transports.discard(transport)
