"""The front door's `Expect` header, one rule for every request.

aiohttp answers an Expect before any middleware runs: a `100 Continue` at once, a plain-text 417
for anything else, ahead of the API key, the drain and an unknown route's 404, and in no count.
Here nothing is answered then: `hold` is the expect handler of every route (`ExpectRoutes`, the
system route of an unknown route or a wrong method included). Instead:

- `100-continue`: the 100 goes out when a handler reads the body (`send_continue`), so a request
  refused before that (401, 503, 404, 405, 413, 400) gets its refusal, not a 100 asking for a body
  only to throw it away; a route that reads no body answers without one.
- anything else: the `expectations` middleware, after the API key and the drain, answers an OpenAI
  JSON 417, counted in requests_total as its endpoint's answer. An unknown route or a wrong method
  gets its 404 or 405 instead: what the client must fix first.

HTTP/1.0 has no 100: its Expect is ignored, as aiohttp does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import HttpVersion11, web
from aiohttp.abc import AbstractView
from aiohttp.typedefs import Handler
from aiohttp.web_urldispatcher import AbstractRoute, MatchInfoError, UrlMappingMatchInfo

from router.api_errors import ApiError
from router.metrics import RouterMetrics

__all__ = ["UNCOUNTED", "ExpectRoutes", "expectations", "expects_continue", "send_continue"]

_ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]

UNCOUNTED = "expect"  # the requests_total label of a 417 on a route whose answers it does not count


async def hold(request: web.Request) -> None:
    """An expect handler that answers nothing: the decision is `expectations`' or the handler's."""


class _Unrouted(MatchInfoError):
    """aiohttp's match for an unknown route or a wrong method, whose Expect is held as a route's is
    (aiohttp's system route takes no expect handler)."""

    __slots__ = ()

    @property
    def expect_handler(self) -> _ExpectHandler:
        return hold


class ExpectRoutes(web.UrlDispatcher):
    """aiohttp's router, every route holding its Expect: each added by `add_route` or `add_get` (and
    so `add_post`, ...) unless given an expect handler of its own, and the system route of an
    unknown route or a wrong method (`_Unrouted`)."""

    @classmethod
    def install(cls, app: web.Application) -> None:
        """Before any route is added."""
        # aiohttp builds an app's router itself (its `router=` argument is deprecated): this only
        # swaps in the methods below, the class holding no state of its own.
        app.router.__class__ = cls

    def add_route(
        self,
        method: str,
        path: str,
        handler: Handler | type[AbstractView],
        *,
        name: str | None = None,
        expect_handler: _ExpectHandler | None = None,
    ) -> AbstractRoute:
        return super().add_route(method, path, handler, name=name, expect_handler=expect_handler or hold)

    def add_get(
        self, path: str, handler: Handler, *, name: str | None = None, allow_head: bool = True, **kwargs: Any
    ) -> AbstractRoute:
        # aiohttp's add_get adds its GET and HEAD routes to the resource itself, not by add_route
        kwargs.setdefault("expect_handler", hold)
        return super().add_get(path, handler, name=name, allow_head=allow_head, **kwargs)

    async def resolve(self, request: web.Request) -> UrlMappingMatchInfo:
        match = await super().resolve(request)
        if isinstance(match, MatchInfoError):
            return _Unrouted(match.http_exception)
        return match


def _unmet(request: web.Request) -> str | None:
    """The request's Expect when it is one the router cannot meet (anything but 100-continue)."""
    expect = request.headers.get("Expect", "")
    if request.version != HttpVersion11 or not expect or expect.lower() == "100-continue":
        return None
    return expect


def expectations(metrics: RouterMetrics, endpoints: Mapping[str, str]) -> Callable[..., Any]:
    """The 417 for an Expect other than 100-continue, on every route, as its answer: counted under
    `endpoints[path]` for the paths whose answers requests_total counts, else as `UNCOUNTED`. The
    innermost middleware: the API key's 401 and the drain's 503 come first."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        match = request.match_info
        if match.http_exception is None and (expect := _unmet(request)) is not None:
            resource = match.route.resource
            endpoint = endpoints.get(resource.canonical, UNCOUNTED) if resource is not None else UNCOUNTED
            metrics.count_request(endpoint, 417)
            return ApiError(417, f"unsupported Expect: {expect!r}; only 100-continue is", "Expect").response()
        response: web.StreamResponse = await handler(request)
        return response

    return check


def expects_continue(request: web.Request) -> bool:
    """Whether the client waits for a 100 Continue before it sends the body."""
    return request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue"


async def send_continue(request: web.Request) -> None:
    """The 100 Continue `hold` held back, now that the body is wanted."""
    if expects_continue(request):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # no answer has started: what the parser's errors check
