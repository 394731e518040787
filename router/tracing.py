"""OpenTelemetry: one server span per request carrying the routing decision, a client span per leg
(prefill, decode, agg) as its child, and each leg's W3C context handed to the shim in
GenerateRequest.trace so the worker's spans join the same trace under that leg.

The tracer comes from the provider given (tests pass one with an in-memory exporter) or the
global one, which an operator configures with the standard OTEL_* environment and an SDK
bootstrap; without either, spans are no-ops and `carrier()` is empty.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.disagg import RoutePlan

if TYPE_CHECKING:
    from router.dispatch import Job

__all__ = ["RequestTracer"]

_PROPAGATOR = TraceContextTextMapPropagator()


class RequestTracer:
    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._tracer = (provider or trace.get_tracer_provider()).get_tracer("kvswitch.router")

    @contextmanager
    def request(self, name: str, headers: Mapping[str, str], **attrs: Any) -> Iterator[Span]:
        """A server span, child of the client's traceparent header when it sent one (`headers` may
        be aiohttp's case-insensitive mapping as it is: no copy per request)."""
        parent = _PROPAGATOR.extract(headers)
        with self._tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attrs, record_exception=True
        ) as span:
            yield span

    @staticmethod
    def decision(span: Span, plan: RoutePlan, isl: int, cached_tokens: int) -> None:
        """The first plan's reasons; where the request went is `routed`'s, at its end."""
        span.set_attributes(
            {
                "kvswitch.reason": plan.reason,
                "kvswitch.isl": isl,
                "kvswitch.cached_tokens": cached_tokens,
                "kvswitch.decode_cost": plan.decode.cost,
            }
        )

    @staticmethod
    def routed(span: Span, job: Job) -> None:
        """Where the request really went, after retries and fallbacks (as its x-kvswitch-* headers
        and `kvswitch` member say): set when it ends. Each attempt's worker is its leg span's."""
        span.set_attributes(
            {
                "kvswitch.decode_worker": job.plan.decode.worker,
                "kvswitch.prefill_worker": job.prefill_worker or "",
                "kvswitch.path": str(job.path),
                "kvswitch.outcome": str(job.outcome),
                "kvswitch.attempts": job.attempts,
            }
        )

    def leg(self, role: str, worker: str, request_id: str) -> Span:
        """A leg's span, a child of the current (request) span; the caller ends it. Not made current:
        a leg lives in an async generator that may resume in another context."""
        return self._tracer.start_span(
            f"kvswitch leg {role}",
            kind=SpanKind.CLIENT,
            attributes={"kvswitch.role": role, "kvswitch.worker": worker, "kvswitch.request_id": request_id},
        )

    @staticmethod
    def failed(span: Span, message: str) -> None:
        span.set_status(Status(StatusCode.ERROR, message))

    @staticmethod
    def carrier(span: Span) -> dict[str, str]:
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        return out
