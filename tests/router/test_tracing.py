"""The request's SERVER span says what its client was told: where the request went after retries
and fallbacks, and how it ended (2026-12-06 audit). End to end against the session's real NATS and
etcd, the spans kept in memory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tests.router.conftest import MODEL, Cluster, complete
from tests.router.polling import until
from tests.router.test_slow_readers import clean, stalled_stream, writes_stuck


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    out = InMemorySpanExporter()
    yield out
    out.shutdown()


def _provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


async def _request_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    await until(lambda: any(s.name.startswith("POST") for s in exporter.get_finished_spans()), what="the span")
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")]
    return span


def _routed(span: ReadableSpan) -> dict[str, Any]:
    assert span.attributes is not None
    keys = ("decode_worker", "prefill_worker", "path", "outcome", "attempts")
    return {k: span.attributes[f"kvswitch.{k}"] for k in keys}


async def test_a_retried_requests_span_names_the_worker_that_served_it(
    cluster: Cluster, http: aiohttp.ClientSession, exporter: InMemorySpanExporter
) -> None:
    doomed = await cluster.add_worker("agg", crash_after=1)  # serves one request, then its engine dies
    alive = await cluster.add_worker("agg")
    router = await cluster.add_router(tracer_provider=_provider(exporter), disagg="never")
    await cluster.ready(router)
    prompt = list(range(800))
    # Warm the doomed worker's cache directly, so the router prefers it for this prompt.
    async with http.post(doomed.sim.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}):
        pass
    await until(lambda: len(router.index.worker_hashes(doomed.id)) >= 50, what="the prefix indexed")
    status, out, headers = await complete(http, router, prompt, max_tokens=3)
    assert (status, headers["x-kvswitch-decode-worker"], out["kvswitch"]["attempts"]) == (200, alive.id, 2), out
    span = await _request_span(exporter)
    assert _routed(span) == {
        "decode_worker": alive.id,
        "prefill_worker": "",
        "path": "agg",
        "outcome": out["kvswitch"]["outcome"],
        "attempts": 2,
    }
    # Each attempt's worker is its leg's.
    legs = [s for s in exporter.get_finished_spans() if s.name == "kvswitch leg agg"]
    assert [leg.attributes["kvswitch.worker"] for leg in legs if leg.attributes] == [doomed.id, alive.id]


async def test_a_fallen_back_requests_span_names_the_local_prefill(
    cluster: Cluster, http: aiohttp.ClientSession, exporter: InMemorySpanExporter
) -> None:
    await cluster.add_worker("prefill", hang_after=0)  # the prefill leg never answers
    d = await cluster.add_worker("decode")
    router = await cluster.add_router(tracer_provider=_provider(exporter), disagg="always", prefill_timeout_s=0.3)
    await cluster.ready(router)
    status, out, headers = await complete(http, router, list(range(200)))
    assert status == 200, out
    assert (headers["x-kvswitch-prefill"], out["kvswitch"]["outcome"]) == ("bypass", "fallback_prefill_failed")
    span = await _request_span(exporter)
    assert _routed(span) == {
        "decode_worker": d.id,
        "prefill_worker": "",
        "path": "bypass",
        "outcome": "fallback_prefill_failed",
        "attempts": 1,
    }


async def test_a_stream_that_fails_after_its_headers_is_an_error_span(
    cluster: Cluster, http: aiohttp.ClientSession, exporter: InMemorySpanExporter
) -> None:
    worker = await cluster.add_worker("agg")
    router = await cluster.add_router(tracer_provider=_provider(exporter), disagg="never")
    await cluster.ready(router)
    body = {"model": MODEL, "prompt": list(range(50)), "max_tokens": 30000, "stream": True, "ignore_eos": True}
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # tokens are flowing
        await worker.sim.crash()
        tail = (await resp.read()).decode()
    (event,) = [line for line in tail.splitlines() if '"error"' in line]
    error = json.loads(event.removeprefix("data: "))["error"]
    span = await _request_span(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == error["message"]
    assert span.attributes is not None  # the status the stream went out with, not its error event's code
    assert (span.attributes["http.response.status_code"], error["code"]) == (200, 502)


async def test_a_stream_its_client_stopped_reading_is_an_error_span(
    cluster: Cluster, exporter: InMemorySpanExporter
) -> None:
    await cluster.add_worker("agg", speedup=20.0)
    router = await cluster.add_router(tracer_provider=_provider(exporter), config={"request_timeout_s": 5.0})
    await cluster.ready(router)
    sock = await stalled_stream(router, 30_000)
    try:
        await until(lambda: writes_stuck(router), timeout=4.5, what="the router's writes to the client stuck")
        await until(lambda: clean(router), timeout=7.0, what="the request ended at its 5 s deadline")
        span = await _request_span(exporter)
    finally:
        sock.close()
    assert span.status.status_code is StatusCode.ERROR
    assert "stopped reading its stream" in (span.status.description or "")


CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"model": MODEL, "max_tokens": 2}, 400),  # refused as it is parsed: no prompt
        ({"model": "nope", "prompt": [1, 2, 3]}, 404),  # a model this router does not serve
        ({"prompt": [1, 2, 3]}, 503),  # its --model, which no worker serves (yet, or any more)
    ],
)
async def test_a_request_refused_before_it_is_routed_has_its_span(
    cluster: Cluster, http: aiohttp.ClientSession, exporter: InMemorySpanExporter, body: dict[str, Any], code: int
) -> None:
    await cluster.add_worker("agg")
    config = {"model": "other"} if code == 503 else {}
    router = await cluster.add_router(tracer_provider=_provider(exporter), config=config)
    await until(lambda: len(router.registry.workers()) == 1, what="the worker seen")  # not ready with --model other
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    async with http.post(router.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == code
        message = (await resp.json())["error"]["message"]
    span = await _request_span(exporter)
    assert span.name == "POST /v1/completions" and span.attributes is not None
    assert span.parent is not None and span.parent.span_id == int(CLIENT_SPAN, 16)
    assert span.context.trace_id == int(CLIENT_TRACE, 16)
    assert span.attributes["http.response.status_code"] == code
    assert ("kvswitch.request_id" in span.attributes) is (code != 400)  # a body that parses gets its ids
    # OpenTelemetry's HTTP conventions: a 4xx is the client's fault, no error of the server's span.
    if code >= 500:
        assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, message)
    else:
        assert span.status.status_code is StatusCode.UNSET
