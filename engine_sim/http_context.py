"""What every HTTP handler of the sim shares: the server behind the app, and vLLM's conventions for
JSON bodies (and the media type they must be sent as), errors, request ids, model names (the served
model or a LoRA adapter), and a crash under a request."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from engine_sim.errors import SimRequestError
from engine_sim.openai_format import error_body
from engine_sim.openai_request import check_json_media_type

if TYPE_CHECKING:
    from engine_sim.lora import LoraRequest
    from engine_sim.server import SimServer

__all__ = [
    "SERVER_KEY",
    "check_model",
    "engine_gone",
    "error_response",
    "fault_gate",
    "json_body",
    "json_response",
    "request_id",
]

SERVER_KEY: web.AppKey[SimServer] = web.AppKey("sim_server", object)  # type: ignore[arg-type]
_json = msgspec.json.Encoder()


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(obj), status=status, content_type="application/json")


async def json_body(request: web.Request) -> bytes:
    """The body of a route vLLM guards with validate_json_request; SimRequestError (its 400) unless
    sent as application/json."""
    raw = await request.read()
    check_json_media_type(request.headers.get("Content-Type", ""), raw)
    return raw


def error_response(exc: SimRequestError) -> web.Response:
    return json_response(error_body(exc.message, exc.kind, exc.param, exc.status), exc.status)


def request_id(request: web.Request, in_body: str | None = None) -> str:
    """vLLM's rule: the X-Request-Id header whenever sent (an empty one too), else the body's
    `request_id`, else a fresh one."""
    header = request.headers.get("X-Request-Id")
    if header is not None:
        return header
    return in_body if in_body is not None else secrets.token_hex(8)


def check_model(srv: SimServer, model: str | None) -> LoraRequest | None:
    """The LoRA adapter `model` names; None for the served model under any of its names (or no
    model); vLLM's 404 else, whose alias list names the served names alone, adapters or not
    (bs32/error_unknown_model.json)."""
    cfg = srv.config
    if not model or model == cfg.model or model in cfg.aliases:  # vLLM: "" names no model, as null
        return None
    lora = srv.loras.get(model)
    if lora is None:
        raise SimRequestError(
            f"The model `{model}` does not exist. Valid aliases: {', '.join((cfg.model, *cfg.aliases))}.",
            status=404,
            kind="NotFoundError",
            param="model",
        )
    return lora


def fault_gate(srv: SimServer, request: web.Request) -> bool:
    """Count the request against the fault knobs; True when the engine just crashed under it."""
    if srv.faults.note_request() == "crash":
        srv.crash_soon()
        if request.transport is not None:
            request.transport.abort()
        return True
    return False


def engine_gone(request: web.Request) -> web.Response:
    if request.transport is not None:
        request.transport.abort()  # a dead engine drops its connections; it sends no error body
    return web.Response(status=500)
