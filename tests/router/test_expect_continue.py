"""`Expect: 100-continue` on the JSON routes: the 100 goes out when the router reads the body, so a
request it refuses before that gets its refusal, not a 100 asking for a body it will throw away
(client-fault audit: aiohttp's default expect handler sent the 100 at once, before a 413 for a
Content-Length over the limit and before a 400 for a media type that is not JSON). Any other
Expect is a JSON 417 on every route, after the API key, the drain and an unknown route's 404
(router.expectations; until 2026-12-07 aiohttp's text 417 everywhere but the JSON routes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from router.expectations import UNCOUNTED
from router.http_api import HttpLimits
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster
from tests.router.test_slow_readers import counted

LIMIT = 4096


async def _first_answer(
    router: RouterService, path: str, headers: dict[str, str], body: bytes | None, method: str = "POST"
) -> tuple[bytes, dict[str, Any] | bytes]:
    """The first answer (status line and headers, then its JSON body, or its raw body) to a request
    whose head goes out with `Expect: 100-continue`: a 100 Continue, unless `body` is given, which is then
    sent and the answer to it returned."""
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        lines = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "x", "Expect": "100-continue", **headers}.items())
        writer.write(f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 100 ") and body is not None:
                writer.write(body)
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 100 "):
                return head, b""
            length = next(
                int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")
            )
            raw = await reader.readexactly(length)
    finally:
        writer.close()
    return head, json.loads(raw)


async def _router(cluster: Cluster, **kwargs: Any) -> RouterService:
    await cluster.add_worker("agg")
    return await cluster.add_ready_router(config={"http_limits": HttpLimits(max_body_bytes=LIMIT)}, **kwargs)


def _error(got: tuple[bytes, dict[str, Any] | bytes], code: int) -> dict[str, Any]:
    head, body = got
    assert head.startswith(b"HTTP/1.1 %d " % code), head
    assert isinstance(body, dict), body
    error: dict[str, Any] = body["error"]
    assert error["code"] == code, error
    return error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/debug/route"])
async def test_a_body_over_the_limit_is_413_before_any_100(cluster: Cluster, path: str) -> None:
    router = await _router(cluster)
    headers = {"Content-Type": "application/json", "Content-Length": str(LIMIT + 1)}
    got = await _first_answer(router, path, headers, None)  # before: 100 Continue
    error = _error(got, 413)
    assert error["param"] == "body" and str(LIMIT) in error["message"]
    assert b"connection: close" in got[0].lower()  # its body never came: the connection is done


async def test_a_body_that_is_not_json_is_400_before_any_100(cluster: Cluster) -> None:
    router = await _router(cluster)
    headers = {"Content-Type": "text/plain", "Content-Length": "10"}
    got = await _first_answer(router, "/v1/completions", headers, None)  # before: 100 Continue
    error = _error(got, 400)
    assert "Only 'application/json' is allowed" in error["message"]
    assert counted(router, 400) == 1  # counted as the same refusal without the Expect is


async def test_a_request_without_its_api_key_is_401_before_any_100(cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("sk-right\n")
    router = await _router(cluster, api_keys_file=str(tmp_path / "keys"))
    headers = {"Content-Type": "application/json", "Content-Length": "10"}
    got = await _first_answer(router, "/v1/completions", headers, None)  # before: 100 Continue
    assert "API key" in _error(got, 401)["message"]


async def test_a_request_the_router_takes_gets_100_then_its_answer(cluster: Cluster) -> None:
    router = await _router(cluster)
    body = json.dumps({"model": MODEL, "prompt": "hi there", "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    assert (await _first_answer(router, "/v1/completions", headers, None))[0].startswith(b"HTTP/1.1 100 Continue")
    head, answer = await _first_answer(router, "/v1/completions", headers, body)
    assert head.startswith(b"HTTP/1.1 200 ") and isinstance(answer, dict) and answer["choices"], (head, answer)


async def test_an_expectation_other_than_100_continue_is_417_in_openai_json(cluster: Cluster) -> None:
    router = await _router(cluster)
    headers = {"Expect": "200-ok", "Content-Type": "application/json", "Content-Length": "2"}
    got = await _first_answer(router, "/v1/completions", headers, None)  # before: aiohttp's text
    error = _error(got, 417)
    assert error["type"] == "ExpectationFailedError" and "200-ok" in error["message"]
    assert counted(router, 417) == 1  # as its endpoint's answer, as a 413 or a 400 is (before: in no count)


async def test_an_unsupported_expectation_without_its_api_key_is_401_not_417(cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("sk-right\n")
    router = await _router(cluster, api_keys_file=str(tmp_path / "keys"))
    headers = {"Expect": "200-ok", "Content-Type": "application/json", "Content-Length": "2"}
    got = await _first_answer(router, "/v1/completions", headers, None)  # before: 417, ahead of the key check
    assert "API key" in _error(got, 401)["message"]
    assert counted(router, 417) == 0


def _count(router: RouterService, endpoint: str, code: int) -> float:
    labels = {"endpoint": endpoint, "code": str(code)}
    return router.metrics.registry.get_sample_value("kvswitch_router_requests_total", labels) or 0.0


# Every route the router serves, with the requests_total label its 417 counts under.
_ROUTES = [
    ("GET", "/health", UNCOUNTED), ("GET", "/ready", UNCOUNTED), ("GET", "/metrics", UNCOUNTED),
    ("GET", "/v1/models", UNCOUNTED), ("GET", "/version", UNCOUNTED), ("GET", "/debug/index", UNCOUNTED),
    ("GET", "/debug/workers", UNCOUNTED), ("POST", "/debug/route", UNCOUNTED),
    ("POST", "/v1/completions", "completions"), ("POST", "/v1/chat/completions", "chat"),
    ("POST", "/tokenize", "tokenize"), ("POST", "/detokenize", "detokenize"),
]  # fmt: skip


async def test_an_unsupported_expectation_is_a_counted_json_417_on_every_route(cluster: Cluster) -> None:
    router = await _router(cluster)
    for method, path, _ in _ROUTES:
        body = {"Content-Type": "application/json", "Content-Length": "2"} if method == "POST" else {}
        got = await _first_answer(router, path, {"Expect": "200-ok", **body}, None, method)  # before: text, GETs
        assert "200-ok" in _error(got, 417)["message"], path
    # before: only the JSON routes' 417s, each as its endpoint's answer
    assert {e: _count(router, e, 417) for _, _, e in _ROUTES} == {
        "completions": 1,
        "chat": 1,
        "tokenize": 1,
        "detokenize": 1,
        UNCOUNTED: 8,
    }


async def test_an_unknown_route_or_a_wrong_method_is_its_404_or_405_whatever_its_expectation(cluster: Cluster) -> None:
    router = await _router(cluster)
    for expect in ("200-ok", "100-continue"):
        headers = {"Expect": expect, "Content-Type": "application/json", "Content-Length": "2"}
        # before: a text 417, or a 100 Continue asking for a body the 404 throws away
        error = _error(await _first_answer(router, "/v1/nothing", headers, None), 404)
        assert "no route /v1/nothing" in error["message"]
        _error(await _first_answer(router, "/v1/completions", {"Expect": expect}, None, "GET"), 405)
    assert _count(router, "unrouted", 404) == 2 and _count(router, "unrouted", 405) == 2
    assert all(_count(router, endpoint, 417) == 0 for endpoint in ("completions", UNCOUNTED))


async def test_a_wrong_method_on_ping_is_its_405_saying_allow_get_whatever_its_expectation(cluster: Cluster) -> None:
    """/ping's 405 says `Allow: GET` (router.routes.ALLOW); until 2026-12-07 a catch-all route said it,
    a matched route, so an unsupported Expect was answered first: a 417 counted as endpoint="expect"."""
    router = await _router(cluster)
    for method in ("PUT", "DELETE"):
        for expect in ("foo", "100-continue"):
            got = await _first_answer(router, "/ping", {"Expect": expect}, None, method)
            _error(got, 405)
            assert b"\r\nallow: get\r\n" in got[0].lower(), (method, expect, got[0])
    assert _count(router, "unrouted", 405) == 4 and _count(router, UNCOUNTED, 417) == 0


async def test_an_unsupported_expectation_without_an_api_key_is_401_on_any_route(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "keys").write_text("sk-right\n")
    router = await _router(cluster, api_keys_file=str(tmp_path / "keys"))
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/nothing")):
        got = await _first_answer(router, path, {"Expect": "200-ok"}, None, method)  # before: a text 417
        assert "API key" in _error(got, 401)["message"], path
    assert _count(router, "auth", 401) == 2 and _count(router, UNCOUNTED, 417) == 0
