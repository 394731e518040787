"""Traces across processes: a request's spans from the router and the shim reach a real OTLP
receiver under one trace id, each leg a child of the request and the shim's span a child of its leg."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from kvswitch.cluster import ClusterSpec, LocalCluster
from tests.runtime.otlp_receiver import OtlpReceiver, ReceivedSpan


def _post(url: str, body: dict[str, object]) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        return int(resp.status)


def test_one_trace_from_the_router_through_nats_to_the_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        cluster = LocalCluster(
            ClusterSpec(prefill=1, decode=1, routers=1, speedup=20.0, router_args=["--disagg", "always"])
        )
        try:
            cluster.start()
            cluster.wait_ready(timeout=90)
            assert (
                _post(
                    cluster.router_urls[0] + "/v1/completions",
                    {"model": "sim-llama", "prompt": list(range(1, 80)), "max_tokens": 3},
                )
                == 200
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len({s.service for s in receiver.snapshot()}) < 2:
                time.sleep(0.1)
        finally:
            cluster.stop()  # the processes flush their last spans as they drain
        spans = receiver.snapshot()
    (request,) = [s for s in spans if s.service == "kvswitch-router" and s.name.startswith("POST")]
    legs = {s.attributes["kvswitch.role"]: s for s in spans if s.name.startswith("kvswitch leg")}
    assert set(legs) == {"prefill", "decode"}
    shim_spans = [s for s in spans if s.service == "kvswitch-shim"]
    assert {s.trace_id for s in [request, *legs.values(), *shim_spans]} == {request.trace_id}
    assert all(leg.parent_span_id == request.span_id for leg in legs.values())
    by_parent: dict[str, list[ReceivedSpan]] = {}
    for s in shim_spans:
        by_parent.setdefault(s.parent_span_id, []).append(s)
    assert {leg.span_id for leg in legs.values()} <= set(by_parent), "each leg has a shim span under it"
