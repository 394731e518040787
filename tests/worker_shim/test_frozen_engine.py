"""An engine frozen (SIGSTOP: a stopped container, a host cut off) with only non-streamed legs on
it: it answers nothing, neither /health nor /metrics, and its legs show no output until they end.
Until 2026-12-07 the stall watchdog took no silence from stale readings without streamed output,
so the legs waited out the router's --request-timeout (600 s), though the shim's WARNING said they
were watched for a stall. Now the engine's silence is the stall: they end with a retryable 503
about --stall-limit-s after its last answer (a real engine_sim process, real nats and etcd)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import cast

import aiohttp
import nats
import pytest
from aiohttp import web
from nats.aio.msg import Msg

from engine_sim.server import SimServer
from kvswitch.servers import free_port
from protocol import GenerateRequest, ResponseChunk, SamplingParams, decode_msg, encode_msg, subjects
from protocol.config import EtcdSettings, NatsSettings
from runtime.nats_flush import flush
from tests.runtime.frozen import frozen, stopped
from tests.worker_shim.cluster import served, shim_for, sim_config, wait_for
from tests.worker_shim.test_silent_failures import FaultyProxy
from worker_shim import ShimConfig, WorkerShim
from worker_shim.adapters import EngineAdapter, EngineError, EngineHealth, EngineLoad, make_adapter
from worker_shim.adapters import silence as silence_module
from worker_shim.adapters.http_engine import HttpEngineAdapter
from worker_shim.request_service import RequestService
from worker_shim.stall_watchdog import StallWatchdog

LEGS = 3


@contextmanager
def sim_process() -> Iterator[tuple[subprocess.Popen[bytes], int, int, int]]:
    """`kvswitch sim` in a process of its own (one that SIGSTOP can freeze): it, its HTTP port, and
    its KV event and replay ports."""
    port, events, replay = free_port(), free_port(), free_port()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
          "replay_endpoint": f"tcp://*:{replay}"}  # fmt: skip
    argv = [sys.executable, "-m", "kvswitch", "sim", "--port", str(port), "--speedup", "1", "--block-size", "16",
            "--num-gpu-blocks", "4096", "--kv-events-config", json.dumps(kv)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc, port, events, replay
    finally:
        proc.kill()
        proc.wait()


async def _up(proc: subprocess.Popen[bytes], url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            assert proc.poll() is None, f"the sim exited {proc.returncode}"
            try:
                async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"the sim at {url} did not come up")


@pytest.mark.parametrize(
    ("busy_limit_s", "stall_limit_s"),
    [
        (30.0, 5.0),  # judged within the session: the busy limit is not reached first
        (1.0, 8.0),  # deregistered as busy first, the legs left to finish: judged between sessions
    ],
)
async def test_non_streamed_legs_on_a_frozen_engine_end_about_the_stall_limit_after_its_last_answer(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, busy_limit_s: float, stall_limit_s: float
) -> None:
    with sim_process() as (proc, port, events, replay):
        url = f"http://127.0.0.1:{port}"
        await _up(proc, url)
        cfg = ShimConfig(
            engine="vllm",
            engine_url=url,
            model="sim-llama",
            kv_events=f"tcp://127.0.0.1:{events}",
            kv_events_mode="connect",
            kv_replay=f"tcp://127.0.0.1:{replay}",
            namespace=ns,
            lease_ttl=3,
            health_interval_s=0.5,
            busy_limit_s=busy_limit_s,
            stall_limit_s=stall_limit_s,
        )
        shim = WorkerShim(cfg, NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url]))
        nc = await nats.connect(nats_url)
        finals: dict[str, ResponseChunk] = {}

        async def on_reply(msg: Msg) -> None:
            chunk = decode_msg(msg.data, ResponseChunk)
            if chunk.final:
                finals[chunk.request_id] = chunk

        try:
            with caplog.at_level(logging.INFO):
                async with shim:
                    await asyncio.wait_for(shim.registered.wait(), 30)
                    assert shim.worker_id is not None and shim.requests is not None
                    await wait_for(lambda: shim.probe.settled, what="the endpoint probe to settle")
                    inbox = nc.new_inbox()
                    await nc.subscribe(inbox + ".*", cb=on_reply)
                    for i in range(LEGS):
                        req = GenerateRequest(
                            request_id=f"batch-{i}",
                            model="sim-llama",
                            token_ids=list(range(1 + i, 200 + i)),
                            # minutes of decoding at the sim's modelled speed: only the freeze ends them
                            sampling=SamplingParams(max_tokens=6000, ignore_eos=True),
                            stream=False,
                        )
                        await nc.publish(subjects.gen(ns, "agg", shim.worker_id), encode_msg(req), reply=f"{inbox}.{i}")
                    await flush(nc)
                    await wait_for(lambda: len(shim.requests.inflight) == LEGS, what="the legs in flight")  # type: ignore[union-attr]
                    await asyncio.sleep(1.0)  # the engine decodes them; its /metrics answer as it does
                    assert not finals
                    with frozen(proc.pid):
                        await wait_for(lambda: stopped(proc.pid), what="the sim stopped")
                        since = time.monotonic()
                        await wait_for(lambda: len(finals) == LEGS, timeout=stall_limit_s + 20, what="the legs ended")
                        took = time.monotonic() - since
                    assert {(c.error.code, c.error.kind) for c in finals.values() if c.error} == {
                        (503, "engine_unavailable")
                    }, finals
                    assert all(c.error is not None and "answered nothing" in c.error.message for c in finals.values())
                    # the last answer came at most a health check (0.5 s apart) or a load read before the stop;
                    # the watchdog looks at each check (between sessions with a /metrics read besides)
                    assert stall_limit_s - 1.5 < took < stall_limit_s + 6.0, took
                    assert "answered neither /health nor /metrics" in caplog.text
                    if busy_limit_s < stall_limit_s:
                        assert "has not answered a health check" in caplog.text
                        assert "left to finish, watched for a stall" in caplog.text
                    assert not shim.registered.is_set()
                    await wait_for(shim.registered.is_set, timeout=30, what="registered again once it moves")
        finally:
            await nc.close()


def _watchdog(
    requests: SimpleNamespace, adapter: EngineAdapter, stall_limit_s: float, own_stall: Callable[[float], float]
) -> StallWatchdog:
    """The shim's watchdog over a stand-in request service with the legs `requests.inflight`."""
    return StallWatchdog(
        lambda: cast(RequestService, requests),
        lambda: adapter,
        stall_limit_s=stall_limit_s,
        health_interval_s=1.0,
        engine_url=adapter.config.engine_url,
        own_stall=own_stall,
    )


async def test_non_streamed_legs_on_an_engine_answering_health_and_metrics_late_run_on(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A loaded engine's API server late on both /health and /metrics, past the shim's 2 s probes
    (vLLM under saturation), but answering: no silence, though its legs stream nothing for several
    stall limits. A late /health answer counts: one probe at a time runs on past its timeout."""
    stall_limit_s = 4.0  # past the gap between late answers (a probe each 2.5 s, answered 2.2 s on)
    async with SimServer(sim_config(speedup=1.0)) as sim, FaultyProxy(sim.url).running() as proxy:
        shim = shim_for(sim, ns, nats_url, etcd_url, engine_url=proxy.url, stall_limit_s=stall_limit_s,
                        health_interval_s=0.5)  # fmt: skip
        nc = await nats.connect(nats_url)
        finals: dict[str, ResponseChunk] = {}

        async def on_reply(msg: Msg) -> None:
            chunk = decode_msg(msg.data, ResponseChunk)
            if chunk.final:
                finals[chunk.request_id] = chunk

        try:
            with caplog.at_level(logging.INFO):
                async with shim:
                    await asyncio.wait_for(shim.registered.wait(), 30)
                    assert shim.worker_id is not None and shim.requests is not None
                    await wait_for(lambda: shim.probe.settled, what="the endpoint probe to settle")
                    inbox = nc.new_inbox()
                    await nc.subscribe(inbox, cb=on_reply)
                    proxy.delay.update({"/health": 2.2, "/metrics": 2.2})
                    await asyncio.sleep(2.2)  # the probes under way answered in time
                    sim.faults.slowdown = 60.0  # seconds of decoding for a few tokens
                    req = GenerateRequest(
                        request_id="batch",
                        model="sim-llama",
                        token_ids=list(range(1, 100)),
                        sampling=SamplingParams(max_tokens=30, ignore_eos=True),
                        stream=False,
                    )
                    await nc.publish(subjects.gen(ns, "agg", shim.worker_id), encode_msg(req), reply=inbox)
                    await flush(nc)
                    sent = time.monotonic()
                    await wait_for(lambda: bool(finals), timeout=60, what="the leg's end")
                    took = time.monotonic() - sent
                    assert finals["batch"].error is None and finals["batch"].finish_reason == "length", finals
                    assert took > 2 * stall_limit_s, "the leg ran several stall limits"
                    assert "does not answer its health check in time" in caplog.text, "its probes were late"
                    assert "answered neither" not in caplog.text and "made no progress" not in caplog.text
        finally:
            await nc.close()


async def test_a_pause_in_which_the_shim_asks_nothing_is_no_silence_of_an_engine_answering_late() -> None:
    """A loaded engine answers /health and /metrics 5 s late (past the 2 s probe and read), with a
    leg in flight; then the shim asks it nothing for longer than the stall limit (resting up to 30 s
    after failed sessions, or waiting for its events to go live), and looks again after a BUSY
    probe and a missed /metrics read. Until 2026-12-07 silence ran from the last answer, the pause
    included: the engine was taken for frozen and its legs ended. Silence is the time spent waiting
    on the engine: the 4 s of those two questions (the probe's late answer comes after them)."""
    stall_limit_s, late_s = 8.0, 5.0  # a late probe runs on for 2 + 4 s: the late /health answer counts

    async def late(_request: web.Request) -> web.Response:
        await asyncio.sleep(late_s)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", late)
    app.router.add_get("/metrics", late)
    async with served(app) as url:
        adapter = make_adapter(ShimConfig(engine="vllm", engine_url=url, model="m", stall_limit_s=stall_limit_s))
        assert isinstance(adapter, HttpEngineAdapter)
        requests = SimpleNamespace(inflight={"leg": SimpleNamespace(writer=None)}, completed=0)  # non-streamed
        watchdog = _watchdog(requests, adapter, stall_limit_s, lambda _s: 0.0)
        await adapter.open()
        try:
            assert await adapter.health() is EngineHealth.BUSY
            await wait_for(lambda: adapter.silence.answered_at is not None, what="the late answer")
            assert watchdog.look(time.monotonic(), None, None, None) is None
            await asyncio.sleep(stall_limit_s + 1)  # the shim asks nothing
            assert await adapter.health() is EngineHealth.BUSY
            with pytest.raises(EngineError):
                await adapter.fetch("/metrics")
            assert watchdog.look(time.monotonic(), None, None, None) is None, "the legs were cut"
            assert watchdog.stalled is None
        finally:
            await adapter.close()


async def test_an_engine_refusing_every_question_at_once_is_judged_within_the_stall_limit() -> None:
    """The engine is cut off so that each question is refused at once (a firewall's REJECT, its
    listening socket closed): /health and /metrics fail in milliseconds each health check. Under
    2bd308e only those milliseconds were silence, never reaching the stall limit, and a
    non-streamed leg waited out --request-timeout. A question the engine could not be reached
    for counts until the next one begins: the engine is judged about the stall limit after it
    went."""
    stall_limit_s = 4.0

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    async with served(app) as url:
        adapter = make_adapter(ShimConfig(engine="vllm", engine_url=url, model="m", stall_limit_s=stall_limit_s))
        assert isinstance(adapter, HttpEngineAdapter)
        requests = SimpleNamespace(inflight={"leg": SimpleNamespace(writer=None)}, completed=0)  # non-streamed
        watchdog = _watchdog(requests, adapter, stall_limit_s, lambda _s: 0.0)
        await adapter.open()
        try:
            assert await adapter.health() is EngineHealth.UP
            adapter.base = f"http://127.0.0.1:{free_port()}"  # nothing listens there: refused
            why = None
            for _ in range(int(stall_limit_s) + 3):  # the shim's health-check cycle
                assert await adapter.health() is EngineHealth.DOWN
                with pytest.raises(EngineError):
                    await adapter.fetch("/metrics")
                if (why := watchdog.look(time.monotonic(), None, None, None)) is not None:
                    break
                await asyncio.sleep(1.0)
            assert why is not None and "answered nothing" in why, "never judged"
        finally:
            await adapter.close()


def test_the_shims_own_stalls_are_taken_off_only_within_the_spans_it_waited_on_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two questions time out, at 0-2 s and 20-22 s (4 s of silence); the shim's loop stood still
    19-20.5 s, half a second of it within the second question. Under 2bd308e the stalls of the
    last 4 s of wall time were taken off (1.5 s: 2.5 s of silence); now those within the questions
    (3.5 s), so a stall limit of 3 s is reached."""
    clock = [0.0]
    monkeypatch.setattr(silence_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    stall = (19.0, 20.5)

    def own_stall(seconds: float) -> float:  # LoopWatch.stalled_within, on the fake clock
        return max(min(stall[1], clock[0]) - max(stall[0], clock[0] - seconds), 0.0)

    adapter = make_adapter(ShimConfig(engine="vllm", engine_url="http://127.0.0.1:1", model="m", stall_limit_s=3.0))
    adapter.silence.own_stall = own_stall
    adapter.silence.answered()  # at 0
    requests = SimpleNamespace(inflight={"leg": SimpleNamespace(writer=None)}, completed=0)
    watchdog = _watchdog(requests, adapter, 3.0, own_stall)
    for start in (0.0, 20.0):
        clock[0] = start
        with pytest.raises(TimeoutError), adapter.silence.asking():
            clock[0] = start + 2.0
            raise TimeoutError
    assert adapter.silence.silent_s(clock[0]) == pytest.approx(3.5)
    assert watchdog.look(clock[0], None, None, None) is not None, "the stalls outside the questions were taken off"


def test_a_stall_of_the_shims_own_after_a_legs_output_is_taken_off_that_output_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A question in flight from 0 s, a leg's output at 2 s, the shim's loop still 5-8 s: at 10 s the
    engine was silent 8 s since that output, 5 s of it the engine's. 8b7a455 took the stall off the
    question's 10 s (7 s) and, that being shorter than the 8 s since output, said 7 s: past a 6 s limit;
    the no-progress count took nothing off (8 s since the output moved)."""
    clock = [0.0]
    monkeypatch.setattr(silence_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    def own_stall(seconds: float) -> float:  # LoopWatch.stalled_within, on the fake clock
        return max(min(8.0, clock[0]) - max(5.0, clock[0] - seconds), 0.0)

    adapter = make_adapter(ShimConfig(engine="vllm", engine_url="http://127.0.0.1:1", model="m", stall_limit_s=6.0))
    adapter.silence.own_stall = own_stall
    adapter.silence.answered()  # at 0
    writer = SimpleNamespace(sent_tokens=1)
    requests = SimpleNamespace(inflight={"leg": SimpleNamespace(writer=writer)}, completed=0)
    watchdog = _watchdog(requests, adapter, 6.0, own_stall)
    with adapter.silence.asking():
        assert watchdog.look(0.0, None, None, None) is None
        clock[0] = 2.0
        writer.sent_tokens = 2
        assert watchdog.look(2.0, None, None, None) is None
        clock[0] = 10.0
        said = watchdog.look(10.0, None, None, None)
        assert said is None, f"the shim's own stall was counted as the engine's: {said}"


def test_a_stall_of_the_shims_own_after_a_fresh_reading_is_not_taken_off_the_engines_still_time() -> None:
    """The engine's counters stood still from 0 s to a fresh reading at 9.5 s (limit 9.3 s), the
    shim's loop still 9.6-10 s: judged hung at 10 s. 6d6a448 took the shim's stalls since the last
    move off, 0.4 s after the reading included, and counted 9.1 s."""
    clock = [0.0]

    def own_stall(seconds: float) -> float:  # LoopWatch.stalled_within, on the fake clock
        return max(min(10.0, clock[0]) - max(9.6, clock[0] - seconds), 0.0)

    silence = SimpleNamespace(answered_at=None, silent_s=lambda _now: 0.0)
    adapter = SimpleNamespace(pulling={}, waiting_peer=set(), silence=silence)
    requests = SimpleNamespace(inflight={"leg": SimpleNamespace(writer=None)}, completed=0)
    watchdog = StallWatchdog(
        lambda: cast(RequestService, requests),
        lambda: cast(EngineAdapter, adapter),
        stall_limit_s=9.3,
        health_interval_s=1.0,
        engine_url="http://127.0.0.1:1",
        own_stall=own_stall,
    )
    load = cast(
        EngineLoad,
        SimpleNamespace(running=1, waiting=0, peer_waiting=0, timing=SimpleNamespace(iterations=5), kv_usage=0.5),
    )
    for now in (0.0, 1.0):
        clock[0] = now
        assert watchdog.look(now, load, now, None) is None
    clock[0] = 10.0
    assert watchdog.look(10.0, load, 9.5, None) is not None, "a stall after the reading was taken off the engine's"
