"""The shim's /health and /metrics show the engine's health as its load reports carry it: routers
exclude a worker whose reports say the engine fails, and the shim used to answer 200 "serving"
with nothing about it (one WARNING in the log at the first failed poll). Also where the shim's
HTTP server cannot listen: a bad --http-host is named as such, not as --http-port."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import nats
import pytest

from engine_sim.server import SimServer
from kvswitch.servers import free_port
from protocol import ConfigError, LoadReport, decode_msg, subjects
from protocol.config import EtcdSettings, NatsSettings
from runtime import SHOWN_CHARS
from runtime.nats_flush import flush
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_http_server import health, scrape
from tests.worker_shim.test_silent_failures import FaultyProxy
from worker_shim import ShimConfig, WorkerShim
from worker_shim.adapters import EngineError
from worker_shim.load_reporter import LoadReporter

ENGINE_HEALTHY = ("kvswitch_shim_engine_healthy", ())
SERVING = ("kvswitch_shim_serving", ())


def polls_failed(kind: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("kvswitch_shim_load_polls_failed_total", (("kind", kind),))


def _without(text: str, prefix: str) -> str:
    return "\n".join(line for line in text.splitlines() if prefix not in line) + "\n"


async def test_health_and_metrics_show_the_engine_failing_while_routers_are_told(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    nc = await nats.connect(nats_url)
    reports: list[LoadReport] = []

    async def on(msg: Any) -> None:
        reports.append(decode_msg(msg.data, LoadReport))

    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url)
        async with shim:
            await wait_for(shim.registered.is_set, what="registered")
            assert shim.worker_id is not None
            await nc.subscribe(subjects.load(ns, shim.worker_id), cb=on)
            await flush(nc)
            url = shim.http.url
            status, body = await health(url)
            assert status == 200 and body["engine_healthy"] is True and body["engine_error"] == ""
            assert (await scrape(url))[ENGINE_HEALTHY] == 1

            # Every load poll fails (the engine's /metrics lost its load series): routers exclude it.
            proxy.rewrite["/metrics"] = lambda b: _without(b.decode(), "vllm:num_requests_").encode()
            await wait_for(lambda: bool(reports) and not reports[-1].healthy, what="an unhealthy load report")
            status, body = await health(url)
            # Still registered and serving (the status code keeps its meaning), the engine failing said.
            assert status == 200 and body["status"] == "serving"  # was all /health said
            error = str(body["engine_error"])
            assert body["engine_healthy"] is False
            assert error.startswith("engine_protocol (502): ") and "vllm:num_requests_running" in error
            m = await scrape(url)
            assert m[ENGINE_HEALTHY] == 0 and m[SERVING] == 1
            # Each failed poll counted by its kind (until 2026-12-07 only the gauge said anything).
            assert m[polls_failed("engine_protocol")] >= 1
            assert m[polls_failed("engine_unavailable")] == m[polls_failed("engine_error")] == 0

            del proxy.rewrite["/metrics"]  # the polls work again
            await wait_for(lambda: reports[-1].healthy, what="a healthy load report")
            status, body = await health(url)
            assert status == 200 and body["engine_healthy"] is True and body["engine_error"] == ""
            assert (await scrape(url))[ENGINE_HEALTHY] == 1
    await nc.close()


async def test_before_registration_no_load_report_speaks_for_the_engine(ns: str, nats_url: str, etcd_url: str) -> None:
    cfg = ShimConfig(engine="vllm", model="m", engine_url=f"http://127.0.0.1:{free_port()}", namespace=ns)
    async with WorkerShim(cfg, NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url])) as shim:
        status, body = await health(shim.http.url)
        assert status == 503 and body["status"] == "waiting_engine"
        assert body["engine_healthy"] is None and body["engine_error"] == ""
        m = await scrape(shim.http.url)
        assert m[ENGINE_HEALTHY] == 0 and m[SERVING] == 0


class _Failing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def load(self) -> Any:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "said"),
    [
        (EngineError(503, "engine_unavailable", "x" * 1000), "engine_unavailable (503): xxx"),
        (ValueError("a count that does not parse"), "ValueError('a count that does not parse')"),
    ],
)
async def test_the_last_poll_error_is_kept_short(
    nats_url: str, ns: str, exc: Exception, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On /health and in the log line alike (until 2026-12-07 the line held all of it: a
    UnicodeDecodeError's repr, a whole 21 KB /metrics)."""
    nc = await nats.connect(nats_url)
    reporter = LoadReporter(nc, ns, "w1", _Failing(exc), lambda: 0, 100, period_s=0.05, poll_s=0.02)  # type: ignore[arg-type]
    reporter.start()
    try:
        await wait_for(lambda: not reporter.healthy, what="a failed poll")
        assert reporter.error.startswith(said) and len(reporter.error) <= SHOWN_CHARS
        assert reporter.report().healthy is False
    finally:
        await reporter.stop()
        await nc.close()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "worker_shim.load_reporter"]
    assert line.endswith(reporter.error) and len(line) <= SHOWN_CHARS + 60, line


async def test_a_metrics_body_that_is_not_utf8_is_a_short_warning_and_an_engine_protocol_error(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit's bad_engine_proxy.py `nonutf8`: a bare decode raised UnicodeDecodeError, an ERROR
    with a traceback and the whole body in one 21,269-character line. Now it is the engine's fault,
    said once in a short WARNING, and counted."""
    async with (
        SimServer(sim_config()) as sim,
        FaultyProxy(sim.url).running() as proxy,
        shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url) as shim,
    ):
        await wait_for(shim.registered.is_set, what="registered")
        caplog.clear()
        proxy.rewrite["/metrics"] = lambda b: b"\xff\xfe" + b
        await wait_for(lambda: shim.load_polls_failed["engine_protocol"] >= 3, what="three failed polls")
        status, body = await health(shim.http.url)
        assert status == 200 and body["engine_healthy"] is False  # still serving; routers leave it out
        assert body["engine_error"] == f"engine_protocol (502): {proxy.url}/metrics is not UTF-8 text (byte 0)"
        assert (await scrape(shim.http.url))[polls_failed("engine_protocol")] >= 3
    said = [r for r in caplog.records if r.name.startswith("worker_shim") and r.levelno >= logging.WARNING]
    (warning,) = [r for r in said if r.name == "worker_shim.load_reporter"]
    assert warning.getMessage() == f"load poll failed: {body['engine_error']}" and warning.exc_info is None
    assert all(r.levelno == logging.WARNING and len(r.getMessage()) < 1000 for r in said), said


# --- where the shim's HTTP server cannot listen ---------------------------------------------------


async def _start(host: str, port: int = 0) -> ConfigError:
    cfg = ShimConfig(engine="vllm", model="m", http_host=host, http_port=port)
    shim = WorkerShim(cfg, NatsSettings(servers=["nats://127.0.0.1:1"]), EtcdSettings(endpoints=["http://127.0.0.1:1"]))
    with pytest.raises(ConfigError) as err:
        await shim.start()
    await shim.stop()
    return err.value


async def test_a_host_it_cannot_listen_on_is_named_as_http_host() -> None:
    # was: "invalid http_port (--http-port, KVSWITCH_HTTP_PORT) = 0: cannot listen on bogus.invalid: ..."
    err = await _start("bogus.invalid")
    assert (err.setting, err.value) == ("http_host", "bogus.invalid")
    assert str(err).startswith("invalid http_host (--http-host, KVSWITCH_HTTP_HOST) = 'bogus.invalid': cannot listen")
    err = await _start("192.0.2.1")  # TEST-NET-1: resolves, but is no address of this machine
    assert (err.setting, err.value) == ("http_host", "192.0.2.1") and "cannot assign requested address" in str(err)


async def test_a_port_taken_is_still_named_as_http_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = await _start("127.0.0.1", port)
    assert (err.setting, err.value) == ("http_port", port) and "cannot listen on 127.0.0.1" in str(err)
    assert f"port {port} is held by pid {os.getpid()} (" in str(err) and "choose another --http-port" in str(err)
