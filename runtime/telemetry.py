"""OpenTelemetry export for a long-running process: OTLP over HTTP when the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, nothing otherwise.

The exporter reads the rest of the standard OTEL_* environment itself (headers, timeout,
certificate). Spans are batched off the event loop by the SDK's exporter thread; `shutdown()`
flushes them when the process drains, so the last requests' spans are not lost on SIGTERM.
"""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

__all__ = ["configure_tracing"]

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def configure_tracing(service: str) -> TracerProvider | None:
    """Install a global tracer provider that exports to the configured OTLP endpoint, naming this
    process `service` (unless OTEL_SERVICE_NAME says otherwise); None when no endpoint is set."""
    if not any(os.environ.get(v) for v in _ENDPOINT_VARS):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    return provider
