"""Faults that used to end a shim for good or leave it advertising a worker that cannot serve, with
no word: a /metrics, /kv_event_sources or /v1/models blip at a session's start, a /metrics without
the load series, a hung engine that still answers /health, a stop while NATS is down, and a stream
cut short without [DONE] (real nats, etcd and sim; the engine's answers altered by a proxy)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from aiohttp import web
from nats.aio.client import Client as Nats

from discovery import Discovery
from engine_sim import LoraModule
from engine_sim.server import SimServer
from kvswitch.servers import NatsServer, free_port
from protocol import (
    ConfigError,
    GenerateRequest,
    KvEventBatch,
    LoadReport,
    ResponseChunk,
    SamplingParams,
    TransferHandle,
    decode_msg,
    encode_msg,
    subjects,
)
from protocol.config import EtcdSettings
from protocol.messages import ENDPOINT_COMPLETIONS
from runtime import SHOWN_CHARS
from runtime.nats_flush import flush
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_shim_lifecycle import registered_workers
from worker_shim import ShimConfig, ShimStatus
from worker_shim import shim as shim_module
from worker_shim.adapters import EngineError
from worker_shim.adapters import sglang as sglang_adapter
from worker_shim.adapters import vllm as vllm_adapter
from worker_shim.cli import add_arguments, resolve_settings
from worker_shim.load_reporter import LoadReporter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class FaultyProxy:
    """An HTTP pass-through in front of a sim: `fail[path]` next answers to `path` are 503s,
    `rewrite[path]` changes a 200 answer's body, `delay[path]` seconds pass before a request to
    `path` goes on, and with `cut_after` N a streamed answer ends, cleanly, after its N-th event."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.fail: dict[str, int] = {}
        self.rewrite: dict[str, Callable[[bytes], bytes]] = {}
        self.delay: dict[str, float] = {}
        self.cut_after = 0
        self.url = ""
        self._session: aiohttp.ClientSession | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.rel_url.path
        await asyncio.sleep(self.delay.get(path, 0.0))
        if self.fail.get(path, 0) > 0:
            self.fail[path] -= 1
            return web.Response(status=503, text="unavailable")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        assert self._session is not None
        async with self._session.request(
            request.method, self.upstream + str(request.rel_url), data=await request.read(), headers=headers
        ) as up:
            if path in self.rewrite:
                return web.Response(status=up.status, body=self.rewrite[path](await up.read()))
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            await resp.prepare(request)
            events = 0
            async for line in up.content:
                await resp.write(line)
                events += line.startswith(b"data:")
                if self.cut_after and events >= self.cut_after:
                    break
            await resp.write_eof()
            return resp

    @asynccontextmanager
    async def running(self) -> AsyncIterator[FaultyProxy]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)
        async with aiohttp.ClientSession() as self._session:
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.url = f"http://127.0.0.1:{port}"
            try:
                yield self
            finally:
                await runner.cleanup()


async def registered_or_done(shim: shim_module.WorkerShim) -> None:
    await wait_for(lambda: shim.registered.is_set() or shim.done.is_set(), what="registered, or the shim ended")


# --- 1. a /metrics blip at a session's start -------------------------------------------------------


async def test_a_metrics_blip_at_the_start_is_a_failed_session_retried_not_a_dead_shim(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        proxy.fail["/metrics"] = 1  # the engine just came up, or one scrape was slow
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url)  # no --block-size
        with caplog.at_level(logging.ERROR, logger="worker_shim.shim"):
            async with shim:
                await registered_or_done(shim)
                assert shim.status is ShimStatus.REGISTERED, shim.failure  # was: exit 2, "give --block-size"
                assert shim.limits.block_size == 16 and shim.session_failures == 1
                assert await registered_workers(etcd_url, ns) == {shim.worker_id}
        (said,) = [r for r in caplog.records if r.name == "worker_shim.shim"]
        assert "/metrics answered 503" in said.getMessage() and "a new one starts in" in said.getMessage()
        assert said.exc_info is None  # the engine's fault: no traceback


async def test_a_metrics_body_that_is_not_utf8_at_the_start_is_a_failed_session_said_briefly(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit's bad_engine_proxy.py `nonutf8` at a shim's start: each failed session was said
    with a UnicodeDecodeError's repr, the whole body (~21 KB a line), and a traceback. Now it is
    the engine's fault: an engine_protocol error that names the byte."""
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        proxy.rewrite["/metrics"] = lambda b: b"\xff\xfe" + b
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url)
        with caplog.at_level(logging.ERROR, logger="worker_shim.shim"):
            async with shim:
                await wait_for(lambda: shim.session_failures >= 2, what="two failed sessions")
                del proxy.rewrite["/metrics"]
                await registered_or_done(shim)
                assert shim.status is ShimStatus.REGISTERED, shim.failure
        said = [r for r in caplog.records if r.getMessage().startswith("the session with the engine")]
        assert len(said) >= 2
        for record in said:
            assert f"engine_protocol (502): {proxy.url}/metrics is not UTF-8 text (byte 0)" in record.getMessage()
            assert record.exc_info is None and len(record.getMessage()) < 400, record.getMessage()


async def test_a_session_failure_says_its_error_in_at_most_shown_chars(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of an error no rule expected, the line says a repr clipped to runtime.SHOWN_CHARS (the rule
    /health's engine_error keeps) and the traceback follows: a UnicodeDecodeError's repr holds every
    byte it was given, and the line held 21 KB of /metrics."""
    real = vllm_adapter.VllmAdapter.limits
    error = UnicodeDecodeError("utf-8", b"\xff\xfe" + b"# HELP vllm:x\n" * 2000, 0, 1, "invalid start byte")
    calls = [0]

    async def limits(self: vllm_adapter.VllmAdapter) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise error
        return await real(self)

    monkeypatch.setattr(vllm_adapter.VllmAdapter, "limits", limits)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        with caplog.at_level(logging.ERROR, logger="worker_shim.shim"):
            async with shim:
                await registered_or_done(shim)
                assert shim.status is ShimStatus.REGISTERED and shim.session_failures == 1, shim.failure
    (said,) = [r for r in caplog.records if r.getMessage().startswith("the session with the engine")]
    shown = repr(error)[: SHOWN_CHARS - 3] + "..."
    assert said.getMessage() == f"the session with the engine at {sim.url} failed: {shown}; a new one starts in 0.1s"
    assert said.exc_info is not None  # not the engine's fault: its traceback is kept


async def test_a_metrics_blip_does_not_skip_the_check_of_a_flag_against_the_engine(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        proxy.fail["/metrics"] = 1
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url, block_size=32)  # the engine has 16
        async with shim:
            await registered_or_done(shim)
            # Before, the flag was taken unchecked and a worker registered with the wrong block size.
            assert shim.status is ShimStatus.FAILED and shim.registration_count == 0
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "block_size"
            assert "16" in str(shim.failure) and "32" in str(shim.failure)


async def test_a_kv_event_sources_blip_at_the_start_is_retried_not_a_dead_shim(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        proxy.fail["/kv_event_sources"] = 1
        # No endpoints given: the shim reads them from the engine (was: exit 2, "give --kv-events-config").
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url, kv_events=None, kv_replay=None)
        async with shim:
            await registered_or_done(shim)
            assert shim.status is ShimStatus.REGISTERED, shim.failure
            assert shim.session_failures == 1 and shim.config.kv_events is not None


# --- 2. an unread /v1/models is not a listed --model -----------------------------------------------


async def test_a_models_blip_at_the_start_does_not_skip_the_model_check(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        proxy.fail["/v1/models"] = 1
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url, model="llama-typo")
        async with shim:
            await registered_or_done(shim)
            assert shim.status is ShimStatus.FAILED and shim.registration_count == 0
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "model"
            assert f"serves {sim.config.model}: give --model one of them" in str(shim.failure)
            assert shim.session_failures == 1  # the blip: one session failed, then the check ran


async def test_a_model_the_engine_serves_as_a_lora_adapter_is_refused_naming_its_base(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """--model sql, an adapter vLLM lists with `parent`: registered as a model of its own, its
    prompts were hashed unsalted while the engine's events name the adapter, so base-model blocks
    were credited to its requests and its own cached prefix was never found."""
    async with SimServer(sim_config(lora_modules=(LoraModule("sql", "/adapters/sql"),))) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, model="sql")
        async with shim:
            await registered_or_done(shim)
            assert shim.status is ShimStatus.FAILED and shim.registration_count == 0
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "model"
            assert f"LoRA adapter of {sim.config.model}: give --model {sim.config.model}" in str(shim.failure)


async def test_a_model_the_engine_stops_listing_while_serving_ends_the_shim_as_at_the_start(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shim_module, "ADAPTERS_POLL_S", 0.3)
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url)
        async with shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            # Another engine behind the same URL (restarted faster than the health checks notice).
            model = sim.config.model.encode()
            proxy.rewrite["/v1/models"] = lambda body: body.replace(model, b"other-model")
            await wait_for(shim.done.is_set, what="the shim to end on the model check")
            assert shim.status is ShimStatus.FAILED and not shim.registered.is_set()
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "model"
            assert "serves other-model: give --model one of them" in str(shim.failure)
            assert await registered_workers(etcd_url, ns) == set()


# --- 3. a /metrics without the load series ---------------------------------------------------------


def _without(text: str, prefix: str) -> str:
    return "\n".join(line for line in text.splitlines() if prefix not in line) + "\n"


def test_vllm_metrics_without_the_load_series_are_unusable_and_say_why() -> None:
    real = (FIXTURES / "vllm-0.32/bs32/metrics_after.txt").read_text()
    with pytest.raises(EngineError) as err:
        vllm_adapter.load_from_metrics(_without(real, "vllm:"))  # vLLM --disable-log-stats
    said = str(err.value)
    assert err.value.kind == "engine_protocol" and "--disable-log-stats" in said
    assert all(name in said for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
    with pytest.raises(EngineError, match="of engine 3"):
        vllm_adapter.load_from_metrics((FIXTURES / "vllm-0.32/bs32/metrics_dp2.txt").read_text(), 3)


def test_real_engines_metrics_still_parse_as_usable() -> None:
    for name in ("bs32/metrics_after.txt", "bs32/metrics_no_prefix_caching.txt", "bs16_patched/metrics_after.txt"):
        load = vllm_adapter.load_from_metrics((FIXTURES / "vllm-0.32" / name).read_text())
        assert (load.running, load.waiting, load.kv_usage) == (0, 0, 0.0), name
    dp2 = (FIXTURES / "vllm-0.32/bs32/metrics_dp2.txt").read_text()
    assert [vllm_adapter.load_from_metrics(dp2, rank).running for rank in (0, 1, None)] == [0, 0, 0]
    sglang = (FIXTURES / "sglang/metrics.txt").read_text()
    load = sglang_adapter.load_from_metrics(sglang, 100)
    assert (load.running, load.waiting) == (5, 3)
    with pytest.raises(EngineError, match="sglang:num_queue_reqs, sglang:num_running_reqs, sglang:token_usage"):
        sglang_adapter.load_from_metrics(_without(sglang, "sglang:"), 100)


def _twice(text: str, prefix: str) -> str:
    """`text` with each line of `prefix` written twice, as a proxy relabelling two engines alike would."""
    return "\n".join(f"{line}\n{line}" if line.startswith(prefix) else line for line in text.splitlines()) + "\n"


@pytest.mark.parametrize(
    ("engine", "series"),
    [
        ("vllm", "vllm:num_requests_running"),
        ("vllm", "vllm:iteration_tokens_total_count"),
        ("sglang", "sglang:num_running_reqs"),
    ],
)
def test_a_series_given_twice_is_unusable_and_named(engine: str, series: str) -> None:
    """Until 2026-12-07 it was summed twice, silently: running 3 read as 6 (a counter's rise as
    twice its own). The text format has each series once; the reading is no one engine's."""
    if engine == "vllm":
        real = (
            (FIXTURES / "vllm-0.32/bs32/metrics_after.txt")
            .read_text()
            .replace(
                'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0',
                'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0',
            )
        )
        assert vllm_adapter.load_from_metrics(real).running == 3
        with pytest.raises(EngineError) as err:
            vllm_adapter.load_from_metrics(_twice(real, series + "{"))
    else:
        real = (FIXTURES / "sglang/metrics.txt").read_text()
        assert sglang_adapter.load_from_metrics(real, 100).running == 5
        with pytest.raises(EngineError) as err:
            sglang_adapter.load_from_metrics(_twice(real, series + "{"), 100)
    assert err.value.kind == "engine_protocol" and f"gives {series}{{" in str(err.value) and "twice" in str(err.value)


class _Metrics:
    def __init__(self, text: str) -> None:
        self.text = text

    async def load(self) -> Any:
        return vllm_adapter.load_from_metrics(self.text)


async def test_a_worker_whose_metrics_lose_the_load_series_reports_itself_unhealthy_with_one_warning(
    nats_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    real = (FIXTURES / "vllm-0.32/bs32/metrics_after.txt").read_text()
    nc = await nats.connect(nats_url)
    reports: list[LoadReport] = []

    async def on(msg: Any) -> None:
        reports.append(decode_msg(msg.data, LoadReport))

    await nc.subscribe(subjects.load(ns, "w1"), cb=on)
    await flush(nc)
    engine = _Metrics(real)
    reporter = LoadReporter(nc, ns, "w1", engine, lambda: 0, 100, period_s=0.05, poll_s=0.02)  # type: ignore[arg-type]
    reporter.start()
    try:
        await wait_for(lambda: bool(reports) and reports[-1].healthy, what="a healthy report")
        engine.text = _without(real, "vllm:")
        await wait_for(lambda: not reports[-1].healthy, what="an unhealthy report")  # was: healthy, idle
        seen = len(reports)
        await wait_for(lambda: len(reports) >= seen + 3, what="reports after")
        assert not any(r.healthy for r in reports[seen:])
    finally:
        await reporter.stop()
        await nc.close()
    complaints = [r for r in caplog.records if r.name == "worker_shim.load_reporter" and r.levelno >= logging.WARNING]
    assert len(complaints) == 1 and "--disable-log-stats" in complaints[0].getMessage()


# --- 4. a hung engine that answers /health ---------------------------------------------------------


async def _send_leg(nc: Nats, ns: str, worker: str, rid: str, max_tokens: int) -> None:
    req = GenerateRequest(
        request_id=rid,
        model="sim-llama",
        token_ids=list(range(1, 100)),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )
    await nc.publish(subjects.gen(ns, "agg", worker), encode_msg(req), reply=nc.new_inbox())
    await flush(nc)


async def test_a_hung_engine_is_deregistered_until_it_moves_again_and_a_slow_one_is_not(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    stall_limit = 1.0
    nc = await nats.connect(nats_url)
    try:
        async with SimServer(sim_config(speedup=1.0)) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, stall_limit_s=stall_limit)
            with caplog.at_level(logging.INFO, logger="worker_shim.shim"):
                async with shim:
                    await asyncio.wait_for(shim.registered.wait(), 20)
                    worker = shim.worker_id
                    assert worker is not None
                    # Slow but moving: one leg decoding for several busy limits stays registered.
                    sim.faults.slowdown = 20.0
                    await _send_leg(nc, ns, worker, "slow", max_tokens=400)
                    await wait_for(lambda: "slow" in shim.requests.inflight, what="the slow leg")  # type: ignore[union-attr]
                    await asyncio.sleep(3.5 * stall_limit)
                    assert "slow" in shim.requests.inflight, "the leg must still run"  # type: ignore[union-attr]
                    assert shim.registered.is_set() and "made no progress" not in caplog.text
                    sim.faults.slowdown = 1.0
                    await wait_for(lambda: not shim.requests.inflight, what="the slow leg to end")  # type: ignore[union-attr]

                    sim.faults.hang = True  # accepts requests, never steps; /health and /metrics answer
                    await _send_leg(nc, ns, worker, "hung", max_tokens=16)
                    # registered clears as the session starts to end; worker_id once its key is revoked
                    await wait_for(
                        lambda: not shim.registered.is_set() and shim.worker_id is None,
                        timeout=10,
                        what="deregistered as hung",
                    )
                    assert await registered_workers(etcd_url, ns) == set()
                    assert f"engine at {sim.url} made no progress" in caplog.text
                    await asyncio.sleep(3 * stall_limit)  # no new session while it hangs: no flapping
                    assert not shim.registered.is_set() and shim.registration_count == 1

                    sim.faults.hang = False
                    await wait_for(shim.registered.is_set, what="registered again once it moves")
                    assert "makes progress again" in caplog.text
                    assert await registered_workers(etcd_url, ns) == {shim.worker_id}
                    # Its one-token requests are counted with the probes: the engine served the two legs besides.
                    assert shim.probe.alive >= 1
                    await wait_for(lambda: shim.probe.settled, what="the endpoint probe to settle")
                    assert sim.faults.requests_seen == shim.probe.sent + 2
                    metric = f"kvswitch_shim_alive_requests_total {float(shim.probe.alive)}"
                    assert metric in shim.metrics_text().decode()
    finally:
        await nc.close()


async def test_a_stop_while_a_hung_engine_holds_the_alive_request_returns_at_once(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """Before: the stop waited for the one-token request, up to the stall limit (19 s of 20)."""
    nc = await nats.connect(nats_url)
    try:
        async with SimServer(sim_config(speedup=1.0)) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, stall_limit_s=8.0)
            async with shim:
                await asyncio.wait_for(shim.registered.wait(), 20)
                assert shim.worker_id is not None
                await wait_for(lambda: shim.probe.settled, what="the endpoint probe to settle")
                seen = sim.faults.requests_seen
                sim.faults.hang = True
                await _send_leg(nc, ns, shim.worker_id, "hung", max_tokens=4)
                await wait_for(lambda: not shim.registered.is_set(), timeout=20, what="deregistered as hung")
                await wait_for(lambda: sim.faults.requests_seen == seen + 2, what="the one-token request")
                started = time.monotonic()
                await shim.stop()
                assert time.monotonic() - started < 3.0
                sim.faults.hang = False
    finally:
        await nc.close()


async def test_with_no_endpoint_probe_a_hung_engine_with_nothing_to_run_is_sent_nothing(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """--no-endpoint-probe (an engine whose every request is accounted): the shim sends no one-token
    request of its own; it waits for the engine to move. Before, it sent one per health interval."""
    nc = await nats.connect(nats_url)
    try:
        async with SimServer(sim_config(speedup=1.0)) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, stall_limit_s=1.0, no_endpoint_probe=True)
            with caplog.at_level(logging.INFO, logger="worker_shim.shim"):
                async with shim, aiohttp.ClientSession() as http:
                    await asyncio.wait_for(shim.registered.wait(), 20)
                    assert shim.worker_id is not None
                    seen = sim.faults.requests_seen
                    sim.faults.hang = True
                    await _send_leg(nc, ns, shim.worker_id, "hung", max_tokens=4)
                    await wait_for(lambda: not shim.registered.is_set(), timeout=10, what="deregistered as hung")
                    await asyncio.sleep(1.0)
                    sim.faults.hang = False
                    await asyncio.sleep(2.0)  # idle: nothing moves, nothing tells
                    assert not shim.registered.is_set() and sim.faults.requests_seen == seen + 1
                    assert (shim.probe.sent, shim.probe.alive) == (0, 0)
                    assert "--no-endpoint-probe sends it no one-token request" in caplog.text
                    body = {"model": sim.config.model, "prompt": [5, 6, 7], "max_tokens": 2}
                    async with http.post(sim.url + "/v1/completions", json=body) as resp:  # its own client's
                        assert resp.status == 200
                    await wait_for(shim.registered.is_set, what="registered again once it moves")
                    assert sim.faults.requests_seen == seen + 2
    finally:
        await nc.close()


# --- 5. SIGTERM while NATS is down -----------------------------------------------------------------


async def test_sigterm_while_nats_is_down_stops_the_shim_cleanly(ns: str, etcd_url: str) -> None:
    port = free_port()
    with NatsServer() as nats_server:
        async with SimServer(sim_config()) as sim:
            argv = [sys.executable, "-m", "kvswitch", "shim", "--engine", "vllm", "--engine-url", sim.url]
            assert sim.events_endpoint is not None
            argv += ["--model", sim.config.model, "--kv-events", sim.events_endpoint, "--kv-events-mode", "connect"]
            argv += ["--nats-servers", nats_server.url, "--etcd-endpoints", etcd_url, "--namespace", ns]
            argv += ["--http-port", str(port), "--lease-ttl", "3", "--drain-grace-s", "1"]
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ}
            )
            try:
                async with aiohttp.ClientSession() as http:

                    async def serving() -> bool:
                        try:
                            async with http.get(f"http://127.0.0.1:{port}/health") as r:
                                return r.status == 200 and json.loads(await r.read())["nats"] == "connected"
                        except aiohttp.ClientError:
                            return False

                    for _ in range(300):
                        if await serving():
                            break
                        await asyncio.sleep(0.1)
                    else:
                        raise AssertionError("the shim did not register")
                nats_server.stop()
                await asyncio.sleep(1.0)
                proc.send_signal(signal.SIGTERM)
                out, _ = await asyncio.wait_for(proc.communicate(), 60)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]


# --- optional: a stream that ends early, cleanly ----------------------------------------------------


async def _leg_chunks(nc: Nats, ns: str, worker: str, req: GenerateRequest) -> list[ResponseChunk]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subjects.gen(ns, "agg", worker), encode_msg(req), reply=inbox)
    chunks = [decode_msg((await sub.next_msg(timeout=20)).data, ResponseChunk)]
    while not chunks[-1].final:
        chunks.append(decode_msg((await sub.next_msg(timeout=20)).data, ResponseChunk))
    await sub.unsubscribe()
    return chunks


async def test_a_stream_cut_before_done_and_any_finish_reason_is_an_engine_error(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    nc = await nats.connect(nats_url)
    try:
        async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
            shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url)
            async with shim:
                await asyncio.wait_for(shim.registered.wait(), 20)
                assert shim.worker_id is not None and shim.requests is not None
                proxy.cut_after = 3
                sampling = SamplingParams(max_tokens=50, ignore_eos=True)
                token_ids = list(range(1, 60))
                params = {
                    "model": "sim-llama",
                    "prompt": token_ids,
                    "max_tokens": 50,
                    "ignore_eos": True,
                    "stream": True,
                }
                legs = [
                    GenerateRequest(request_id="ids", model="sim-llama", token_ids=token_ids, sampling=sampling),
                    GenerateRequest(
                        request_id="pass",
                        model="sim-llama",
                        token_ids=token_ids,
                        sampling=sampling,
                        endpoint=ENDPOINT_COMPLETIONS,
                        params=params,
                    ),
                ]
                for req in legs:
                    last = (await _leg_chunks(nc, ns, shim.worker_id, req))[-1]
                    # Before: a final chunk with no error and no finish_reason, counted ok.
                    assert last.error is not None and (last.error.code, last.error.kind) == (502, "engine_protocol")
                    assert "the stream ended without [DONE]" in last.error.message
                assert shim.requests.outcomes[("agg", "engine_protocol")] == 2
                assert shim.requests.outcomes[("agg", "ok")] == 0
                proxy.cut_after = 0
                whole = await _leg_chunks(nc, ns, shim.worker_id, legs[0])
                assert whole[-1].error is None and whole[-1].finish_reason == "length"
    finally:
        await nc.close()


# --- review of the above: the watchdog, a vLLM without load series, a 404 for limits ----------------


def test_the_stall_limit_is_its_own_setting_checked_like_the_others() -> None:
    cfg = ShimConfig(model="m", kv_events="tcp://*:1").validate()
    assert (cfg.busy_limit_s, cfg.stall_limit_s) == (30.0, 120.0)
    for bad, words in ((float("inf"), "finite"), (float("nan"), "finite"), (0.0, "> 0"), (-1.0, "> 0")):
        with pytest.raises(ConfigError) as err:
            ShimConfig(model="m", kv_events="tcp://*:1", stall_limit_s=bad).validate()
        assert err.value.setting == "stall_limit_s" and words in str(err.value)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shim, _, _ = resolve_settings(
        parser.parse_args(["--model", "m", "--kv-events", "tcp://*:1", "--stall-limit-s", "45"])
    )
    assert shim.stall_limit_s == 45.0


async def test_a_long_prefill_while_metrics_fail_is_no_hang(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's counters frozen by a failing /metrics are unknown, not "no progress": a leg
    that sends nothing for a while (a long prefill) must not deregister the worker. Once /metrics
    answers again, a leg that still does not move is a hang."""
    stall_limit = 1.0
    nc = await nats.connect(nats_url)
    try:
        async with SimServer(sim_config(speedup=1.0)) as sim, FaultyProxy(sim.url).running() as proxy:
            shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url, stall_limit_s=stall_limit)
            with caplog.at_level(logging.INFO, logger="worker_shim.shim"):
                async with shim:
                    await asyncio.wait_for(shim.registered.wait(), 20)
                    assert shim.worker_id is not None and shim.requests is not None
                    proxy.fail["/metrics"] = 10**6
                    sim.faults.hang = True  # no step, no token: as a prefill longer than the limit
                    await _send_leg(nc, ns, shim.worker_id, "long", max_tokens=4)
                    await wait_for(lambda: "long" in shim.requests.inflight, what="the leg")  # type: ignore[union-attr]
                    await asyncio.sleep(5 * stall_limit)
                    assert shim.registered.is_set() and "made no progress" not in caplog.text
                    proxy.fail["/metrics"] = 0  # known again: still no move is a hang
                    await wait_for(lambda: not shim.registered.is_set(), timeout=10, what="deregistered as hung")
                    assert f"engine at {proxy.url} made no progress" in caplog.text
                    sim.faults.hang = False
                    await wait_for(shim.registered.is_set, what="registered again once it moves")
    finally:
        await nc.close()


async def test_a_decode_leg_waiting_on_a_slow_kv_pull_is_no_hang_until_it_outlasts_the_limit(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode leg whose KV the engine pulls from another worker shows no step and no token until
    the pull ends; the engine counts it waiting. For one stall limit that is no work the watchdog
    can judge; a pull that lasts longer is a hang like any other (exempt for good, a decode
    worker whose legs all pull would never be found hung)."""
    stall_limit = 1.0
    nc = await nats.connect(nats_url)
    try:
        # ~13 MB of KV (99 tokens of Llama-8B) over 2 MB/s: a pull of several seconds.
        async with SimServer(sim_config(speedup=1.0, kv_transfer_gbps=0.002)) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, role="decode", stall_limit_s=stall_limit)
            with caplog.at_level(logging.INFO, logger="worker_shim.shim"):
                async with shim:
                    await asyncio.wait_for(shim.registered.wait(), 20)
                    assert shim.worker_id is not None and shim.requests is not None
                    params = {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_engine_id": "gone-prefill-engine",
                        "remote_block_ids": list(range(6)),
                        "remote_host": None,
                        "remote_port": None,
                        "remote_request_id": "p-1",
                    }
                    req = GenerateRequest(
                        request_id="pulled",
                        model="sim-llama",
                        token_ids=list(range(1, 100)),
                        sampling=SamplingParams(max_tokens=4, ignore_eos=True),
                        disagg=TransferHandle(engine="vllm", params=params),
                    )
                    await nc.publish(subjects.gen(ns, "decode", shim.worker_id), encode_msg(req), reply=nc.new_inbox())
                    await flush(nc)
                    await wait_for(lambda: set(shim.adapter.pulling) == {"pulled"}, what="the leg pulling")
                    await asyncio.sleep(1.5 * stall_limit)
                    assert "pulled" in shim.requests.inflight and set(shim.adapter.pulling) == {"pulled"}
                    assert shim.registered.is_set() and "made no progress" not in caplog.text
                    # judged well before the pull's several seconds end
                    await wait_for(lambda: "made no progress" in caplog.text, 4 * stall_limit, "the pull judged")
    finally:
        await nc.close()


def test_real_vllm_metrics_right_after_start_have_the_load_series() -> None:
    """What a fresh vLLM 0.32 exports before its first request passes the start's check."""
    shared = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "vllm-0.32"
    texts = [
        (FIXTURES / "vllm-0.32" / name).read_text()
        for name in ("bs32/metrics_after.txt", "bs16_patched/metrics_after.txt")
    ]
    texts += [path.read_text() for path in sorted(shared.glob("*/metrics_before.txt"))]
    for text in texts:
        vllm_adapter.check_load_series(text, None, "http://e")
    dp2 = (FIXTURES / "vllm-0.32/bs32/metrics_dp2.txt").read_text()
    vllm_adapter.check_load_series(dp2, 1, "http://e")
    with pytest.raises(ConfigError, match="of engine 3"):
        vllm_adapter.check_load_series(dp2, 3, "http://e")


async def test_a_vllm_without_load_series_at_the_start_is_a_config_error_not_a_worker_never_routed(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        proxy.rewrite["/metrics"] = lambda body: _without(body.decode(), "vllm:num_requests_").encode()
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url)
        async with shim:
            await registered_or_done(shim)
            # Before: registered, every load report healthy false, so no router ever used it.
            assert shim.status is ShimStatus.FAILED and shim.registration_count == 0
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "engine_url"
            said = str(shim.failure)
            assert "vllm:num_requests_running, vllm:num_requests_waiting" in said
            assert "--disable-log-stats" in said and "start it without that flag" in said
            assert await registered_workers(etcd_url, ns) == set()


async def test_load_series_lost_while_serving_leave_the_worker_registered_and_unhealthy(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url)
        async with shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            proxy.rewrite["/metrics"] = lambda body: _without(body.decode(), "vllm:num_requests_").encode()
            await wait_for(lambda: shim.load_reporter is not None and not shim.load_reporter.report().healthy,
                           what="an unhealthy report")  # fmt: skip
            await asyncio.sleep(0.5)
            assert shim.registered.is_set() and not shim.done.is_set()


async def test_a_404_for_the_limits_route_means_no_limits_reported_not_a_session_retried_forever(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    # An agg SGLang adapter before a server without server info (the sim has no /server_info): the 404 is
    # that engine version's, as /kv_event_sources' is an older vLLM's. Its /metrics is SGLang's:
    # the sim's own vLLM metrics make it a wrong --engine (tests/worker_shim/test_wrong_engine.py).
    sglang_metrics = (FIXTURES / "sglang/metrics.txt").read_bytes()
    async with SimServer(sim_config()) as sim, FaultyProxy(sim.url).running() as proxy:
        proxy.rewrite["/metrics"] = lambda _body: sglang_metrics
        shim = shim_for(sim, ns, nats_url, etcd_url, engine="sglang", block_size=16, engine_url=proxy.url)
        async with shim:
            await registered_or_done(shim)
            assert shim.status is ShimStatus.REGISTERED, shim.failure  # was: failed sessions, forever
            assert shim.limits.block_size == 16 and shim.session_failures == 0
        shim = shim_for(sim, ns, nats_url, etcd_url, engine="sglang", engine_url=proxy.url)
        async with shim:
            await registered_or_done(shim)
            assert shim.status is ShimStatus.FAILED and isinstance(shim.failure, ConfigError)
            assert shim.failure.setting == "block_size" and "give --block-size" in str(shim.failure)


async def test_a_twin_under_a_live_workers_name_publishes_nothing_under_it(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """A second shim started by mistake with a live worker's --worker-name fails before it
    subscribes or starts an epoch: before, it published a Cleared and its snapshot under the live
    worker's name (routers dropped the live worker's index) before create() refused it."""
    nc = await nats.connect(nats_url)
    epochs: list[int] = []

    async def on_kv(msg: Any) -> None:
        epochs.append(decode_msg(msg.data, KvEventBatch).epoch)

    await nc.subscribe(subjects.kv(ns, "gpu-07"), cb=on_kv)
    await flush(nc)
    try:
        async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url, worker_name="gpu-07") as shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            await wait_for(lambda: shim.epoch in epochs, what="the live worker's stream")
            async with shim_for(sim, ns, nats_url, etcd_url, worker_name="gpu-07") as twin:
                await asyncio.wait_for(twin.done.wait(), 20)
                assert isinstance(twin.failure, ConfigError) and twin.failure.setting == "worker_name"
            await flush(nc)
            await asyncio.sleep(0.3)
            assert set(epochs) == {shim.epoch}, "the twin published under the live worker's name"
    finally:
        await nc.close()


async def test_a_name_held_by_a_crashed_shims_lease_is_taken_once_that_lease_expires(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """A shim restarted within its lease TTL (a crashed pod), or one whose revoke did not reach
    etcd, found its --worker-name held and exited 2 for good: the holder's lease was only running
    out."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        lease = await d.grant(2)
        await d.create(subjects.worker_key(ns, "gpu-09"), b"{}", lease)
        await lease.stop_keep_alive()  # the holder crashed: nothing keeps its lease alive
        async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url, worker_name="gpu-09") as shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            assert shim.worker_id == "gpu-09" and shim.failure is None
