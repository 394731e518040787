"""What aiohttp's parser refuses for its line limit (8190 bytes), under both of its parsers: an
over-long request line is a 414, an over-long header a 431, each OpenAI JSON counted as
`endpoint="unparsed"` (router.api_errors, `FrontDoorRunner`). aiohttp's text names neither
("Got more than 8190 bytes when reading: ..."): until 2026-12-07 the router looked there for
"request line", so an over-long URL was a 431 and no 414 was ever sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Which parser aiohttp uses is settled when it is imported: each run is a process of its own.
_SERVE = textwrap.dedent(
    """
    import asyncio, json
    from aiohttp import web
    from aiohttp.http_parser import HttpRequestParser, HttpRequestParserPy
    from router.api_errors import FrontDoorRunner
    from router.metrics import RouterMetrics, StateFigures

    REQUESTS = {
        "url": b"GET /v1/models?q=" + b"a" * 9000 + b" HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n",
        "header": b"GET /v1/models HTTP/1.1\\r\\nHost: x\\r\\nX-Big: " + b"x" * 9000 + b"\\r\\n\\r\\n",
        "path-like header": b"GET /v1/models HTTP/1.1\\r\\nX-Path: /" + b"x" * 9000 + b"\\r\\n\\r\\n",
        "header name": b"GET /v1/models HTTP/1.1\\r\\nX-" + b"x" * 9000 + b": 1\\r\\n\\r\\n",
    }

    async def main():
        metrics = RouterMetrics(StateFigures)
        runner = FrontDoorRunner(web.Application(), metrics=metrics)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        got = {"python_parser": HttpRequestParser is HttpRequestParserPy}
        for name, raw in REQUESTS.items():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            head = (await reader.readuntil(b"\\r\\n\\r\\n")).decode()
            length = int(next(h.split(":")[1] for h in head.split("\\r\\n") if h.lower().startswith("content-length:")))
            got[name] = json.loads(await reader.readexactly(length))["error"]
            writer.close()
        sample = metrics.registry.get_sample_value
        got["counted"] = {c: sample("kvswitch_router_requests_total", {"endpoint": "unparsed", "code": c})
                          for c in ("414", "431")}
        await runner.cleanup()
        print(json.dumps(got))

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("python_parser", [False, True], ids=["c-parser", "python-parser"])
def test_an_overlong_request_line_is_414_and_an_overlong_header_431(python_parser: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIOHTTP_NO_EXTENSIONS"}
    if python_parser:
        env["AIOHTTP_NO_EXTENSIONS"] = "1"
    root = Path(__file__).resolve().parents[2]  # where `router` imports from
    run = subprocess.run([sys.executable, "-c", _SERVE], env=env, cwd=root, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["python_parser"] is python_parser  # the parser this case is about
    assert got["url"]["code"] == 414 and got["url"]["message"] == "the request line is too long"  # before: 431
    for header in ("header", "path-like header", "header name"):
        assert got[header]["code"] == 431 and got[header]["message"] == "a request header is too large", header
    assert got["counted"] == {"414": 1.0, "431": 3.0}
