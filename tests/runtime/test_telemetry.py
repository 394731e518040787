"""The OTEL_* environment a router or shim exports its spans by: a value it cannot export with is
refused at startup, naming the variable and what is allowed, and the exporter's failures are said
once, then at most every 30 s with a count (2026-12-06 audit: `localhost:4318` was taken, and an
ERROR logged twice a second for ever)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import pytest

from runtime import configure_logging, run_service
from runtime.telemetry import TracingConfigError, tracer_provider
from tests.runtime.otlp_receiver import OtlpReceiver

ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
EXPORTER = "OTEL_TRACES_EXPORTER"


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENDPOINT, TRACES_ENDPOINT, PROTOCOL, TRACES_PROTOCOL, EXPORTER):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def stderr_logging() -> Iterator[None]:
    """The services' logging (configure_logging), to the test's captured stderr, while it lasts."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", "text")
        yield
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def refused(capsys: pytest.CaptureFixture[str]) -> str:
    """What run_service says of a service it refuses to start: one line, status 2."""
    ran: list[bool] = []

    async def main(stop: asyncio.Event) -> int:
        ran.append(True)
        return 0

    assert run_service(main, service="kvswitch-test") == 2 and not ran
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (ENDPOINT, "localhost:4318"),  # no scheme: the audit's
        (ENDPOINT, "collector:4318"),  # read as a URL of scheme "collector"
        (ENDPOINT, "grpc://collector:4317"),
        (ENDPOINT, "http://"),  # no host
        (ENDPOINT, "http://collector:port"),
        (TRACES_ENDPOINT, "/v1/traces"),
    ],
)
def test_an_endpoint_that_is_no_http_url_with_a_host_is_refused_naming_the_variable(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(name, value)
    allowed = "allowed: an http:// or https:// URL with a host, such as http://collector:4318"
    with pytest.raises(TracingConfigError) as err:
        tracer_provider("kvswitch-test")
    assert str(err.value) == f"invalid {name} = {value!r}: {allowed}"
    assert refused(capsys) == f"kvswitch: invalid {name} = {value!r}: {allowed}"


def test_the_traces_endpoint_is_the_one_checked_when_both_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENDPOINT, "localhost:4318")  # not used for traces: the exporter takes the other
    monkeypatch.setenv(TRACES_ENDPOINT, "https://collector.example/v1/traces")
    provider = tracer_provider("kvswitch-test")
    assert provider is not None
    provider.shutdown()


def test_a_refused_endpoint_does_not_show_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENDPOINT, "ftp://user:secret@collector:4318/x")
    with pytest.raises(TracingConfigError, match=r"'ftp://<redacted>@collector:4318/x'") as err:
        tracer_provider("kvswitch-test")
    assert "secret" not in str(err.value)


def test_a_failed_export_is_said_once_not_at_every_batch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with OtlpReceiver() as receiver, stderr_logging():
        monkeypatch.setenv(TRACES_ENDPOINT, receiver.url + "/nowhere")  # a 404, every batch
        provider = tracer_provider("kvswitch-test")
        assert provider is not None
        tracer = provider.get_tracer("test")
        for _ in range(3):
            with tracer.start_as_current_span("s"):
                pass
            provider.force_flush()
        provider.shutdown()
        assert receiver.requests == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "opentelemetry" in line]
    assert len(said) == 1 and "Failed to export spans batch code: 404" in said[0], said


@pytest.mark.parametrize(
    ("settings", "exports"),
    [
        ({}, False),
        ({ENDPOINT: "http://collector:4318"}, True),
        ({EXPORTER: "otlp"}, True),  # to the SDK's default, http://localhost:4318
        ({EXPORTER: "OTLP", TRACES_PROTOCOL: "http/protobuf"}, True),
        ({EXPORTER: "none", ENDPOINT: "http://collector:4318"}, False),
        ({EXPORTER: "none", ENDPOINT: "localhost:4318", PROTOCOL: "grpc"}, False),  # not exporting: not read
    ],
)
def test_traces_are_exported_as_the_standard_environment_says(
    settings: dict[str, str], exports: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    provider = tracer_provider("kvswitch-test")
    assert (provider is not None) is exports
    if provider is not None:
        provider.shutdown()


@pytest.mark.parametrize(
    ("settings", "name", "allowed"),
    [
        ({EXPORTER: "zipkin"}, EXPORTER, "allowed values: otlp, none"),
        ({EXPORTER: "otlp,console", ENDPOINT: "http://collector:4318"}, EXPORTER, "allowed values: otlp, none"),
        ({PROTOCOL: "grpc", ENDPOINT: "http://collector:4317"}, PROTOCOL, "only http/protobuf is built in"),
        ({TRACES_PROTOCOL: "http/json", EXPORTER: "otlp"}, TRACES_PROTOCOL, "only http/protobuf is built in"),
        # the signal's own wins, as the SDK reads it
        ({TRACES_PROTOCOL: "grpc", PROTOCOL: "http/protobuf", EXPORTER: "otlp"}, TRACES_PROTOCOL, "only"),
    ],
)
def test_an_exporter_or_protocol_not_built_in_is_refused_naming_the_variable(
    settings: dict[str, str],
    name: str,
    allowed: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for variable, value in settings.items():
        monkeypatch.setenv(variable, value)
    expected = f"invalid {name} = {settings[name]!r}: {allowed}"
    with pytest.raises(TracingConfigError) as err:
        tracer_provider("kvswitch-test")
    assert err.value.variable == name and str(err.value).startswith(expected)
    assert refused(capsys).startswith(f"kvswitch: {expected}")
