"""How the front door reads a JSON route's body, against vLLM 0.32 (engine_sim answers as it
does): a body that does not decode as its Content-Encoding says (until 2026-12-07 a 500 and two
ERROR tracebacks)."""

from __future__ import annotations

import gzip
import json
import logging

import aiohttp
import pytest

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
