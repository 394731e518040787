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
from typing import TYPE_CHECKING

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
    def request(self, name: str, headers: Mapping[str, str]) -> Iterator[Span]:
        """A server span, child of the client's traceparent header when it sent one (`headers` may
        be aiohttp's case-insensitive mapping as it is: no copy per request). Its status is the
        caller's (`answered`): an exception through it is no error when it is a client that left."""
        parent = _PROPAGATOR.extract(headers)
        with self._tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, record_exception=False, set_status_on_exception=False
        ) as span:
            yield span

    @staticmethod
    def named(span: Span, request_id: str, engine_request_id: str) -> None:
        """The router's id (its logs, NATS) and the engine's (the client's X-Request-Id when given),
        so one finds the other."""
        span.set_attributes({"kvswitch.request_id": request_id, "kvswitch.engine_request_id": engine_request_id})

    @staticmethod
    def model(span: Span, model: str) -> None:
        span.set_attribute("kvswitch.model", model)

    @staticmethod
    def answered(span: Span, code: int, why: str = "", *, broke: bool = False) -> None:
        """The response's status code; the span's status ERROR, with `why`, for a 5xx or a stream
        that `broke` after its 200 went out. A 4xx (the client's fault) or a client that left (499)
        is no error of a server span (OpenTelemetry's HTTP semantic conventions)."""
        span.set_attribute("http.response.status_code", code)
        if code >= 500 or broke:
            span.set_status(Status(StatusCode.ERROR, why or None))

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
