"""The HTTP API, as vLLM's OpenAI server answers it (routes, status codes, bodies, SSE framing).

vLLM routes: POST /v1/completions, POST /v1/chat/completions (engine_sim/generate_api.py),
GET /v1/models, GET /health, GET and POST /ping (SageMaker's, /health's answer), GET /load
(requests in flight, with --enable-server-load-tracking), GET /metrics, POST /reset_prefix_cache,
GET /version, GET /kv_event_sources (each data-parallel rank's KV events config; this engine's one
rank), POST /tokenize, POST /detokenize; with `runtime_lora_updating` (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), POST /v1/load_lora_adapter and /v1/unload_lora_adapter. The JSON
routes (completions, chat, tokenize, detokenize, LoRA) take only `Content-Type: application/json`,
as vLLM's (http_context.json_body). A CORS preflight gets the answer of vLLM's CORS middleware,
which by its default allows no origin.

The sim's own routes (not in vLLM; under /sim/ so they never clash):
- POST /sim/kv_pull: a decode sim in another process finished reading pinned KV, or gave it up
  (engine_sim/disagg.py);
- POST /sim/kv_heartbeat: a decode sim in another process still holds these requests: their
  leases run on (engine_sim/disagg.py);
- POST /sim/faults: change fault knobs live (engine_sim/faults.py); `{"crash": true}` or
  `{"restart": true}` act at once (202);
- GET /sim/state: engine id, blocks in use, prefill tokens computed, queue lengths, event seq, faults;
  `?prefixes=1` adds `cached_block_prefixes` (token ids of every cached block's whole prefix);
  `?canonical=1` adds `cached_canonical_hashes` (each cached block's canonical hash, once: what a
  router's index should hold for this engine; linear in the cache, where prefixes are quadratic).

Text is encoded with the built-in tokenizer (protocol.tokenizer), chat messages through its ChatML
template. A client disconnect cancels the handler (aiohttp handler cancellation) and aborts the
request in the engine.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from engine_sim import openai_format as fmt
from engine_sim.errors import SimRequestError
from engine_sim.generate_api import chat_completions, completions
from engine_sim.http_context import SERVER_KEY, check_model, error_response, json_body, json_response
from engine_sim.metrics import CONTENT_TYPE, render_metrics
from engine_sim.openai_request import (
    DetokenizeRequest,
    TokenizeRequest,
    check_generation_prompt,
    check_mm_kwargs,
    check_request_template,
    check_token_bounds,
    encode_text,
    parse_body,
    render_chat,
)
from protocol.tokenizer import BuiltinTokenizer

if TYPE_CHECKING:
    from engine_sim.lora import LoraAdapters
    from engine_sim.server import SimServer

__all__ = ["build_app"]

_tokenizer = BuiltinTokenizer()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    srv = request.app[SERVER_KEY]
    try:
        body = parse_body(await json_body(request), TokenizeRequest)
        check_model(srv, body.model)
        if body.messages is not None:
            add_generation_prompt = check_generation_prompt(body.add_generation_prompt, body.continue_final_message)
            check_request_template(body.chat_template, body.chat_template_kwargs)
            check_mm_kwargs(body.mm_processor_kwargs, body.media_io_kwargs)
            text = render_chat(body.messages, add_generation_prompt=add_generation_prompt,
                               continue_final_message=body.continue_final_message, model=srv.config.model)  # fmt: skip
        else:
            assert body.prompt is not None  # parse_body refuses a body with neither, as vLLM's union
            text = body.prompt
        # add_special_tokens: the built-in tokenizer has no special tokens to add (no BOS, like GPT-2's).
        tokens = encode_text(text)
    except SimRequestError as exc:
        return error_response(exc)
    strs = [_tokenizer.piece(t) for t in tokens] if body.return_token_strs else None
    return json_response(fmt.tokenize_response(tokens, srv.config.max_model_len, strs))


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: ids past the vocabulary decode to nothing, as its tokenizer skips them
    (`{"tokens": [999999]}` is `{"prompt": ""}`); only ids out of the body's bounds are a 400."""
    srv = request.app[SERVER_KEY]
    try:
        body = parse_body(await json_body(request), DetokenizeRequest)
        check_token_bounds(body.tokens)
        check_model(srv, body.model)
    except SimRequestError as exc:
        return error_response(exc)
    vocab = _tokenizer.vocab_size
    return json_response({"prompt": _tokenizer.decode(t for t in body.tokens if t < vocab)})


async def models(request: web.Request) -> web.Response:
    srv = request.app[SERVER_KEY]
    cfg = srv.config
    loras = list(srv.loras)
    return json_response(fmt.models_response(cfg.model, cfg.max_model_len, loras, cfg.aliases, cfg.root))


class _LoadLora(msgspec.Struct):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


async def _lora_update(request: web.Request, update: Callable[[LoraAdapters, _LoadLora], str]) -> web.Response:
    """vLLM's run-time adapter loading and unloading (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    the success text, or vLLM's error. The sim loads no weights, so any path is taken."""
    try:
        body = parse_body(await json_body(request), _LoadLora)
        return web.Response(text=update(request.app[SERVER_KEY].loras, body))
    except SimRequestError as exc:
        return error_response(exc)


async def load_lora_adapter(request: web.Request) -> web.Response:
    return await _lora_update(
        request, lambda loras, body: loras.load(body.lora_name, body.lora_path, body.load_inplace)
    )


async def unload_lora_adapter(request: web.Request) -> web.Response:
    return await _lora_update(request, lambda loras, body: loras.unload(body.lora_name))


async def health(request: web.Request) -> web.Response:
    delay = request.app[SERVER_KEY].faults.health_delay_s
    if delay > 0:
        await asyncio.sleep(delay)
    return web.Response(status=200)


async def load(request: web.Request) -> web.Response:
    """vLLM's server_load_metrics: 0 unless counted (--enable-server-load-tracking)."""
    return json_response({"server_load": request.app[SERVER_KEY].server_load})


async def kv_event_sources(request: web.Request) -> web.Response:
    return json_response(request.app[SERVER_KEY].event_sources())


async def version(request: web.Request) -> web.Response:
    return json_response({"version": fmt.VLLM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    body = render_metrics(request.app[SERVER_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM serves this only with VLLM_SERVER_DEV_MODE=1; the sim always does (bench/overhead.py
    and the tests reset caches through it)."""
    ok = request.app[SERVER_KEY].runner.reset_prefix_cache()
    return json_response({"success": ok})


async def _kv_message(request: web.Request) -> dict[str, Any] | int:
    """The JSON object a peer engine sent to a KV route, or the status that refuses it: 400 for a
    body that is not a JSON object (a bad body, not a message for another engine), 404 for a
    message to another engine."""
    try:
        body = msgspec.json.decode(await request.read())
    except msgspec.DecodeError:
        return 400
    if not isinstance(body, dict):
        return 400
    if body.get("remote_engine_id") not in (None, request.app[SERVER_KEY].engine.engine_id):
        return 404
    return body


async def kv_pull(request: web.Request) -> web.Response:
    srv = request.app[SERVER_KEY]
    body = await _kv_message(request)
    if isinstance(body, int):
        return json_response({"released": False}, body)
    if not isinstance(body.get("remote_request_id"), str):  # a list or dict would not even hash
        return json_response({"released": False}, 400)
    ok = srv.runner.release_pin(body["remote_request_id"], body.get("remote_block_ids"))
    return json_response({"released": ok}, 200 if ok else 404)


async def kv_heartbeat(request: web.Request) -> web.Response:
    srv = request.app[SERVER_KEY]
    body = await _kv_message(request)
    if isinstance(body, int):
        return json_response({"renewed": 0}, body)
    ids = body.get("remote_request_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return json_response({"renewed": 0}, 400)
    return json_response({"renewed": srv.runner.renew_pins(ids)})


class _FaultsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    crash_after: int | None = None
    hang_after: int | None = None
    hang: bool | None = None
    slowdown: float | None = None
    health_delay_s: float | None = None
    drop_event_fraction: float | None = None
    crash: bool = False
    restart: bool = False


async def faults(request: web.Request) -> web.Response:
    srv = request.app[SERVER_KEY]
    try:
        body = msgspec.json.decode(await request.read() or b"{}", type=_FaultsBody)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return json_response(fmt.error_body(str(exc), "BadRequestError", None, 400), 400)
    f = srv.faults
    for name in ("crash_after", "hang_after", "slowdown", "drop_event_fraction", "health_delay_s"):
        value = getattr(body, name)
        if value is not None:
            setattr(f, name, value)
    if body.hang is not None:
        f.hang = body.hang
    if body.crash:
        srv.crash_soon()
        return json_response(f.snapshot(), 202)
    if body.restart:
        srv.restart_soon()
        return json_response(f.snapshot(), 202)
    return json_response(f.snapshot())


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
    if request.query.get("canonical"):
        out["cached_canonical_hashes"] = eng.cached_canonical_hashes()
    return json_response(out)


def build_app(server: SimServer) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20, middlewares=[_track_transports, _cors_preflight, _route_errors])
    app[SERVER_KEY] = server
    app.on_response_prepare.append(_vllm_headers)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    # FastAPI's GET routes take no HEAD (405, `allow: GET`); /metrics is a mounted Prometheus app,
    # which answers HEAD
    app.router.add_get("/v1/models", models, allow_head=False)
    app.router.add_get("/health", health, allow_head=False)
    app.router.add_get("/ping", health, allow_head=False)  # first, as vLLM registers it (see _route_errors)
    app.router.add_post("/ping", health)
    app.router.add_get("/load", load, allow_head=False)
    app.router.add_get("/version", version, allow_head=False)
    app.router.add_get("/kv_event_sources", kv_event_sources, allow_head=False)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    if server.config.runtime_lora_updating:  # vLLM serves these only then
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/sim/kv_pull", kv_pull)
    app.router.add_post("/sim/kv_heartbeat", kv_heartbeat)
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


@web.middleware
async def _route_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An unknown route or a wrong method as FastAPI answers them: JSON `{"detail": ...}`, and a
    307 to the path without (or with) a trailing slash where that one is a route (Starlette's
    redirect_slashes: `/v1/models/` goes to `/v1/models`)."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        resp = json_response({"detail": "Method Not Allowed"}, 405)
        # Starlette names the methods of the path's first route: /ping's GET, not its POST too
        resp.headers["Allow"] = "GET" if request.path == "/ping" else ", ".join(sorted(exc.allowed_methods))
        return resp
    except web.HTTPNotFound:
        path = request.path
        if path != "/":
            other = path.rstrip("/") if path.endswith("/") else path + "/"
            match = await request.app.router.resolve(request.clone(rel_url=other))
            if match.http_exception is None or match.http_exception.status == 405:
                return web.Response(
                    status=307, headers={"Location": str(request.url.with_path(other, keep_query=True))}
                )
        return json_response({"detail": "Not Found"}, 404)


# Starlette's CORSMiddleware as vLLM configures it by default (allowed_origins [], methods and
# headers "*"): a preflight never passes, for its origin.
_CORS_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
_PREFLIGHT_VARY = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, Access-Control-Request-Private-Network"
)


@web.middleware
async def _cors_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An OPTIONS with `Origin` and `Access-Control-Request-Method`, on any path, is answered by
    vLLM's CORS middleware before routing: 400 text "Disallowed CORS " and each failure (the origin
    always, the method if not one of Starlette's, private-network access if asked)."""
    headers = request.headers
    if request.method != "OPTIONS" or "Origin" not in headers or "Access-Control-Request-Method" not in headers:
        return await handler(request)
    failures = ["origin"]
    if headers["Access-Control-Request-Method"] not in _CORS_METHODS:
        failures.append("method")
    if "Access-Control-Request-Private-Network" in headers:
        failures.append("private-network")
    resp = web.Response(status=400, text="Disallowed CORS " + ", ".join(failures))
    resp.headers["Vary"] = _PREFLIGHT_VARY
    resp.headers["Access-Control-Allow-Methods"] = ", ".join(_CORS_METHODS)
    resp.headers["Access-Control-Max-Age"] = "600"
    if "Access-Control-Request-Headers" in headers:  # all headers allowed: the request's are mirrored
        resp.headers["Access-Control-Allow-Headers"] = headers["Access-Control-Request-Headers"]
    return resp


async def _vllm_headers(request: web.Request, response: web.StreamResponse) -> None:
    """What vLLM's middleware adds to every answer: `vary: Origin` (Starlette's CORS middleware,
    which by vLLM's default allows no origin; a preflight's answer has its own), and with
    --enable-request-id-headers X-Request-Id, the request's own or a fresh uuid4 hex."""
    response.headers.setdefault("Vary", "Origin")
    if request.app[SERVER_KEY].config.enable_request_id_headers:
        rid = request.headers.get("X-Request-Id")
        response.headers["X-Request-Id"] = rid if rid is not None else uuid.uuid4().hex
