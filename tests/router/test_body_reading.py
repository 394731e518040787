"""How the front door reads a JSON route's body, against vLLM 0.32 (engine_sim answers as it
does): a body that does not decode as its Content-Encoding says (until 2026-12-07 a 500 and two
ERROR tracebacks); a body in an encoding other than UTF-8 that vLLM reads (until 2026-12-07 the
router's own 400); a body sent as another media type, refused on a connection that stays open
for a request pipelined behind it (until 2026-12-07 the connection closed and that one was lost)."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging

import aiohttp
import pytest

from router.http_api import HttpLimits
from tests.router.conftest import MODEL, Cluster
from tests.router.test_slow_readers import counted

_BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/debug/route"])
async def test_a_body_that_does_not_decode_as_its_content_encoding_is_a_400(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with caplog.at_level(logging.DEBUG):
        async with http.post(router.url + path, data=_BODY, headers=headers) as r:  # labelled gzip, sent plain
            assert r.status == 400
            error = (await r.json())["error"]
            assert error["code"] == 400 and error["param"] == "body", error
            assert "could not be decoded" in error["message"] and "gzip" in error["message"], error
            assert r.headers["Connection"] == "close"  # the parser is done with this connection
        async with http.post(router.url + path, data=gzip.compress(_BODY), headers=headers) as r:
            assert r.status == 200, await r.text()
    said = [rec for rec in caplog.records if rec.name.startswith(("router", "aiohttp"))]
    assert not [rec.getMessage() for rec in said if rec.levelno >= logging.WARNING]  # the client's fault
    if path == "/v1/completions":
        assert counted(router, 400) == 1 and counted(router, 500) == 0


_ENCODINGS = ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]


@pytest.mark.parametrize("encoding", _ENCODINGS)
async def test_a_json_body_in_an_encoding_vllm_detects_is_read_as_vllm_reads_it(
    cluster: Cluster, http: aiohttp.ClientSession, encoding: str
) -> None:
    """vLLM reads a body with json.loads of its bytes, which takes a UTF-8 BOM and UTF-16 or UTF-32
    with or without one (the "-sig" and BOM-less codecs here); the router said "JSON is malformed:
    invalid character (byte 0)". Served, and malformed, each answers as the engine does directly."""
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    sim = cluster.workers[0].sim.url
    json_type = {"Content-Type": "application/json"}
    plain = {"model": MODEL, "prompt": "hi there é", "max_tokens": 2}
    async with http.post(sim + "/tokenize", data=json.dumps(plain).encode(), headers=json_type) as r:
        expected = await r.json()
    answers = []
    for url in (router.url, sim):
        async with http.post(url + "/tokenize", data=json.dumps(plain).encode(encoding), headers=json_type) as r:
            assert (r.status, await r.json()) == (200, expected), url
        malformed = json.dumps({"model": MODEL, "prompt": "hi"}).replace('"hi"', '"hi" oops')
        async with http.post(url + "/v1/completions", data=malformed.encode(encoding), headers=json_type) as r:
            answers.append((r.status, await r.json()))
    assert answers[0] == answers[1] and answers[0][0] == 400, answers
    offset = malformed.index("oops")  # in characters, as vLLM's, not in the body's bytes
    assert answers[0][1]["error"]["param"] == f"body.{offset}", answers
    async with http.post(router.url + "/v1/completions", data=json.dumps(plain).encode(encoding),
                         headers=json_type) as r:  # fmt: skip
        assert r.status == 200, await r.text()


@pytest.mark.parametrize("encoding", ["utf-8", *_ENCODINGS])
async def test_the_routers_own_refusal_of_a_body_names_a_place_in_the_clients_bytes(
    cluster: Cluster, http: aiohttp.ClientSession, encoding: str
) -> None:
    """JSON vLLM reads and the router refuses (NaN, a raw lone surrogate), in any encoding vLLM
    detects: a UTF-16 or UTF-32 body's NaN was quoted at its byte in the router's UTF-8 copy
    ("invalid character (byte 58)"), and a raw lone surrogate, read as UTF-8 there, got words about
    other bytes ("object keys must be strings (byte 1)"; a UTF-8 body's, "Invalid UTF-8 encoded string")."""
    router = await cluster.add_router()
    json_type = {"Content-Type": "application/json"}
    nan = json.dumps({"model": MODEL, "prompt": "h\u00e9 \U0001f600", "temperature": float("nan")}, ensure_ascii=False)
    lone = json.dumps({"model": MODEL, "prompt": "h\u00e9"}, ensure_ascii=False).replace("\u00e9", "\u00e9\ud800")
    for text, at, said in ((nan, "NaN", "invalid character"), (lone, "\ud800", "a lone surrogate, U+D800")):
        body = text.encode(encoding, "surrogatepass")
        offset = len(text[: text.index(at)].encode(encoding, "surrogatepass"))  # the BOM's bytes included
        async with http.post(router.url + "/v1/completions", data=body, headers=json_type) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["param"] == "body" and error["message"].endswith(f"{said} (byte {offset})"), (encoding, error)


async def _pipelined(url: str, requests: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The heads and bodies of the answers to `requests`, sent at once on one connection, as
    many as came before it closed (or 5 s passed)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    answers: list[tuple[bytes, bytes]] = []
    try:
        writer.write(b"".join(requests))
        await writer.drain()
        async with asyncio.timeout(5):
            while len(answers) < len(requests):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break  # closed
                length = next(
                    int(h.split(b":")[1]) for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:")
                )
                answers.append((head, await reader.readexactly(length)))
    finally:
        writer.close()
    return answers


def _post(body: bytes, content_type: str, **headers: str) -> bytes:
    lines = {"Host": "x", "Content-Type": content_type, "Content-Length": str(len(body)), **headers}
    return (
        b"POST /v1/completions HTTP/1.1\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in lines.items()).encode()
        + b"\r\n"
        + body
    )


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
async def test_a_body_of_another_media_type_is_refused_and_the_connection_serves_the_next(
    cluster: Cluster, content_type: str
) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    for url in (router.url, cluster.workers[0].sim.url):
        answers = await _pipelined(url, [_post(_BODY, content_type), _post(_BODY, "application/json")])
        assert [head.split(b" ", 2)[1] for head, _ in answers] == [b"400", b"200"], (url, answers)
        assert b"Unsupported Media Type" in answers[0][1]
        assert b"connection: close" not in answers[0][0].lower(), url


async def test_a_body_of_another_media_type_left_unread_closes_the_connection(cluster: Cluster) -> None:
    """Over the limit, or one the client sends only after a 100 Continue, the body is not read."""
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never", config={"http_limits": HttpLimits(max_body_bytes=1024)})
    over = [_post(b"x" * 1025, "text/plain"), _post(b"{}", "application/json")]
    # the client sends its 10 bytes only after a 100 Continue: nothing can follow on the connection
    waiting = [_post(b"", "text/plain", Expect="100-continue").replace(b"Length: 0", b"Length: 10")]
    for sent in (over, waiting):
        answers = await _pipelined(router.url, sent)
        assert len(answers) == 1 and answers[0][0].startswith(b"HTTP/1.1 400 "), answers
        assert b"connection: close" in answers[0][0].lower()


async def test_a_body_fastapi_decodes_as_json_over_the_limit_or_late_is_the_413_or_408(cluster: Cluster) -> None:
    """A body sent as application/*+json is read before its media-type 400, as FastAPI reads it:
    one over --max-body-bytes is the 413, one that does not arrive the 408, each closing (until
    2026-12-07 the media-type 400)."""
    await cluster.add_worker("agg")
    limits = HttpLimits(max_body_bytes=1024, body_timeout_s=0.5)
    router = await cluster.add_ready_router(disagg="never", config={"http_limits": limits})
    over = _post(b"x" * 1025, "application/vnd.api+json")
    late = _post(b"", "application/vnd.api+json").replace(b"Length: 0", b"Length: 10")  # never sent
    for sent, status in ((over, b"413"), (late, b"408")):
        answers = await _pipelined(router.url, [sent])
        assert len(answers) == 1 and answers[0][0].startswith(b"HTTP/1.1 " + status + b" "), answers
        assert b"connection: close" in answers[0][0].lower()
