"""OpenTelemetry export for a long-running process: OTLP over HTTP (protobuf) when the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, or
`OTEL_TRACES_EXPORTER=otlp` asks for it (then to the SDK's default, http://localhost:4318), nothing
otherwise; `OTEL_TRACES_EXPORTER=none` turns it off whatever else is set.

The exporter reads the rest of the standard OTEL_* environment itself (headers, timeout,
certificate). Spans are batched off the event loop by the SDK's exporter thread; `shutdown()`
flushes them when the process drains, so the last requests' spans are not lost on SIGTERM.

What it cannot do is refused at startup (TracingConfigError), naming the variable: an exporter
other than otlp or none, a protocol other than http/protobuf (the only exporter installed), an
endpoint that is no http(s) URL with a host. Each was taken: grpc and none were ignored, and
`localhost:4318` failed every batch, twice a second, for the life of the process. The exporter's
failures are logged through runtime.RepeatedLines: the first, then at most every 30 s.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

__all__ = ["TracingConfigError", "configure_tracing", "tracer_provider"]

# Of each pair, the first set wins (the signal's own, then the general one), as the SDK reads them.
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_EXPORTERS = ("otlp", "none")


class TracingConfigError(ValueError):
    """An OTEL_* variable has a value this process cannot export with; names it and what is allowed."""

    def __init__(self, variable: str, value: str, allowed: str) -> None:
        self.variable = variable
        super().__init__(f"invalid {variable} = {_shown(value)!r}: {allowed}")


def tracer_provider(service: str) -> TracerProvider | None:
    """A tracer provider that exports to the configured OTLP endpoint, naming this process
    `service` (unless OTEL_SERVICE_NAME says otherwise); None when no export is asked for.
    TracingConfigError for a setting it cannot export by."""
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter and exporter not in _EXPORTERS:
        raise TracingConfigError(
            "OTEL_TRACES_EXPORTER", os.environ["OTEL_TRACES_EXPORTER"], f"allowed values: {', '.join(_EXPORTERS)}"
        )
    endpoint = _first_set(_ENDPOINT_VARS)
    if exporter == "none" or (endpoint is None and exporter != "otlp"):
        return None
    protocol = _first_set(_PROTOCOL_VARS)
    if protocol is not None and protocol[1].strip() != "http/protobuf":
        raise TracingConfigError(*protocol, "only http/protobuf is built in")
    if endpoint is not None:
        _check_endpoint(*endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=500))
    return provider


def configure_tracing(service: str) -> TracerProvider | None:
    """`tracer_provider(service)`, installed as the global one."""
    provider = tracer_provider(service)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider


def _first_set(variables: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of `variables` set (not empty), and its value."""
    return next(((v, value) for v in variables if (value := os.environ.get(v))), None)


def _check_endpoint(variable: str, value: str) -> None:
    try:
        url = urlsplit(value)
        ok = url.scheme in ("http", "https") and bool(url.hostname) and (url.port or 0) >= 0
    except ValueError:  # a port that is no number, or out of range
        ok = False
    if not ok:
        raise TracingConfigError(
            variable, value, "allowed: an http:// or https:// URL with a host, such as http://collector:4318"
        )


def _shown(value: str) -> str:
    """`value` without the user and password a URL may carry."""
    scheme, sep, rest = value.partition("://") if "://" in value else ("", "", value)
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return value
    return f"{scheme}{sep}<redacted>@{authority.rpartition('@')[2]}{slash}{path}"
