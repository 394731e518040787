"""OpenTelemetry in the shim: one span per leg, a child of the router's leg span (the W3C context in
GenerateRequest.trace), whose own context goes on to the engine in the request's headers, so an
engine that traces (vLLM with --otlp-traces-endpoint) joins the same trace under it.

The tracer comes from the global provider, which runtime.telemetry configures from the standard
OTEL_* environment; without one, spans are no-ops and the engine gets the router's context as is.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["LegTracer"]

_PROPAGATOR = TraceContextTextMapPropagator()


class LegTracer:
    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._tracer = (provider or trace.get_tracer_provider()).get_tracer("kvswitch.shim")

    def start(self, carrier: Mapping[str, str], role: str, worker: str, request_id: str) -> Span:
        """The leg's span, under the context the router sent; the caller ends it."""
        return self._tracer.start_span(
            f"kvswitch shim {role}",
            context=_PROPAGATOR.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"kvswitch.role": role, "kvswitch.worker": worker, "kvswitch.request_id": request_id},
        )

    @staticmethod
    def headers(span: Span, fallback: Mapping[str, str]) -> dict[str, str]:
        """W3C headers for the engine's request: the leg span's context, or the router's when the
        span records nothing (no tracer configured here)."""
        if not span.get_span_context().is_valid:
            return {k: v for k, v in fallback.items() if k in ("traceparent", "tracestate")}
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        return out

    @staticmethod
    def failed(span: Span, message: str) -> None:
        span.set_status(Status(StatusCode.ERROR, message))
