"""The methods each of the router's routes answers: one table, read by the router's app
(http_api.make_app) and by the start door (router.start_door), so that a wrong method on a path both
serve gets the same 405 and `Allow` from each.

A GET route does not answer HEAD, as vLLM's (FastAPI's) do not: a 405 saying `Allow: GET`. /metrics
does, as Prometheus's app does on vLLM. /ping is vLLM's SageMaker liveness route, GET and POST, whose
405 says `Allow: GET` (ALLOW).
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from aiohttp.typedefs import Handler

__all__ = ["ALLOW", "METHODS", "PROBES", "PROBES_NAMED", "add_routes"]

METHODS: Mapping[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/ping": ("GET", "POST"),
    "/ready": ("GET",),
    "/metrics": ("GET", "HEAD"),
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/tokenize": ("POST",),
    "/detokenize": ("POST",),
    "/version": ("GET",),
    "/debug/route": ("POST",),
    "/debug/index": ("GET",),
    "/debug/workers": ("GET",),
}

ALLOW: Mapping[str, tuple[str, ...]] = {"/ping": ("GET",)}
"""A wrong method's `Allow` where it is not the path's METHODS: vLLM's /ping is two FastAPI routes,
GET's first, and FastAPI's 405 names the first route's methods alone (vLLM 0.32, PUT or HEAD /ping).
Set on aiohttp's 405 by the error middleware (router.api_errors.openai_errors), not by a catch-all
route: that would be a matched route, whose wrong method the `Expect` check would answer first."""

# Probes and scrapers: answered with no API key, through the drain, at the client-connection cap
# (router.client_connections) and by the start door.
PROBES = frozenset({"/health", "/ping", "/ready", "/metrics"})


def _named(paths: list[str]) -> str:
    return f"{', '.join(paths[:-1])} and {paths[-1]}"


PROBES_NAMED = _named([path for path in METHODS if path in PROBES])  # as messages name them, in METHODS' order


def add_routes(app: web.Application, handlers: Mapping[str, Handler]) -> None:
    """Each path of `handlers` (one of METHODS') on `app`, answering the methods METHODS gives it."""
    for path, handler in handlers.items():
        for method in METHODS[path]:
            # add_route, never add_get: aiohttp's add_get adds a HEAD route of its own
            app.router.add_route(method, path, handler)
