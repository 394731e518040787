"""The shim and its open-file limit: raised to the hard limit at start, legs in flight capped below
it, and a health probe that fails for want of a descriptor blamed on the shim, not the engine (for
up to busy_limit_s: then the shim cannot serve and says the engine is down)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from aiohttp import web

from protocol import ConfigError, subjects
from protocol.config import EtcdSettings, NatsSettings
from runtime.fd_limit import raise_fd_limit
from tests.worker_shim.cluster import connect, wait_for
from tests.worker_shim.test_request_service import Collector, gen
from worker_shim import ShimConfig, WorkerShim
from worker_shim.adapters.base import EngineHealth
from worker_shim.adapters.vllm import VllmAdapter
from worker_shim.cli import add_arguments, resolve_settings
from worker_shim.metrics import render_metrics
from worker_shim.request_service import FD_RESERVE, leg_cap


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def lowest_free_fd() -> int:
    """The descriptor the next open takes: a soft limit this low refuses it (EMFILE)."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


@contextmanager
def soft_limit(soft: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE lowered to `soft` for the block."""
    was, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (was, hard))


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")


def test_the_soft_limit_is_raised_to_the_hard_one(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 200:
        pytest.skip(f"hard limit {hard}")
    with soft_limit(hard - 100):
        raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    assert f"open-file limit raised from {hard - 100} to {hard}" in caplog.text


def test_the_leg_cap_leaves_the_reserve_free_and_refuses_more() -> None:
    with soft_limit(open_fds() + FD_RESERVE + 50):
        default = leg_cap(None)
        assert default is not None and 40 <= default <= 50
        assert leg_cap(10) == 10
        with pytest.raises(ConfigError) as err:
            leg_cap(500)
    assert "max_inflight_legs" in str(err.value) and "open-file limit" in str(err.value)


def test_the_flag_reaches_the_config_and_must_be_positive() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shim, _, _ = resolve_settings(parser.parse_args(["--model", "m", "--max-inflight-legs", "5"]))
    assert shim.max_inflight_legs == 5
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", max_inflight_legs=0).validate()
    assert err.value.setting == "max_inflight_legs"


async def test_a_cap_above_what_the_limit_allows_is_refused_at_start(ns: str, nats_url: str, etcd_url: str) -> None:
    cfg = ShimConfig(model="m", namespace=ns, max_inflight_legs=1000)
    shim = WorkerShim(cfg, NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url]))
    with soft_limit(open_fds() + FD_RESERVE + 100), pytest.raises(ConfigError) as err:
        await shim.start()
    assert err.value.setting == "max_inflight_legs" and "--max-inflight-legs" in str(err.value)
    await shim.stop()


async def _healthy_engine() -> tuple[web.AppRunner, int]:
    """A stand-in engine whose /health closes each connection, so each probe opens a socket."""

    async def answer(_req: web.Request) -> web.Response:
        return web.Response(headers={"Connection": "close"})

    app = web.Application()
    app.router.add_get("/health", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def test_a_probe_the_shim_cannot_make_for_want_of_fds_does_not_fail_the_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner, port = await _healthy_engine()
    adapter = VllmAdapter(ShimConfig(engine_url=f"http://127.0.0.1:{port}", model="m"))
    await adapter.open()
    try:
        assert await adapter.health() is EngineHealth.UP
        await asyncio.sleep(0.05)  # the probe's socket closed
        with soft_limit(lowest_free_fd()):
            health = await adapter.health()
        assert health is EngineHealth.UP, "a probe the shim could not make counted against the engine"
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "out of file descriptors" in errors[0] and "open-file limit" in errors[0]
        assert await adapter.health() is EngineHealth.UP
    finally:
        await adapter.close()
        await runner.cleanup()


async def test_out_of_fds_past_the_busy_limit_the_probe_says_down(caplog: pytest.LogCaptureFixture) -> None:
    runner, port = await _healthy_engine()
    adapter = VllmAdapter(ShimConfig(engine_url=f"http://127.0.0.1:{port}", model="m", busy_limit_s=0.2))
    await adapter.open()
    try:
        assert await adapter.health() is EngineHealth.UP
        await runner.cleanup()  # the engine dies while the shim cannot see it
        await asyncio.sleep(0.05)
        with soft_limit(lowest_free_fd()):
            assert await adapter.health() is EngineHealth.UP  # within the bound: as last seen
            await asyncio.sleep(0.25)
            past = [await adapter.health() for _ in range(3)]
        assert past == [EngineHealth.DOWN] * 3, "out of descriptors, the probe repeats UP with no bound"
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2 and "the shim, not the engine" in errors[1] and "file descriptors" in errors[1]
        assert await adapter.health() is EngineHealth.DOWN  # descriptors back: the probe finds it dead
    finally:
        await adapter.close()


SIM = """
import asyncio, sys
from tests.worker_shim.cluster import sim_config
from engine_sim.server import SimServer

async def main():
    async with SimServer(sim_config(speedup=1.0, num_gpu_blocks=100000, max_num_seqs=4096)) as sim:
        print(sim.url, sim.events_endpoint, sim.replay_endpoint, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""


async def test_more_legs_than_the_fd_limit_allows_are_refused_and_the_worker_stays(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    # The sim in a process of its own: its sockets are not the shim's.
    sim = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SIM,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert sim.stdout is not None and sim.stdin is not None
    try:
        url, events, replay = (await asyncio.wait_for(sim.stdout.readline(), 30)).decode().split()
        cfg = ShimConfig(
            engine_url=url,
            model="sim-llama",
            kv_events=events,
            kv_events_mode="connect",
            kv_replay=replay,
            namespace=ns,
            lease_ttl=10,  # the lease is not what is tested: 3 s expired on a loaded CI (etcd unanswered 2 s)
            health_interval_s=0.1,
            drain_grace_s=0.5,
        )
        with soft_limit(open_fds() + FD_RESERVE + 60):
            shim = WorkerShim(cfg, NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url]))
            async with shim:
                await shim.registered.wait()
                assert shim.requests is not None and shim.requests.max_legs is not None
                cap, wid = shim.requests.max_legs, shim.worker_id
                assert wid is not None
                nc = await connect(nats_url)
                try:
                    col = Collector(nc)
                    await col.start()
                    legs = cap + 100
                    for i in range(legs):
                        req = gen(f"r{i}", [1 + i % 50] * 32, max_tokens=3000, heartbeat_s=0.4)
                        await col.send(subjects.gen(ns, "agg", wid), req)
                    stays = shim.registered.is_set
                    await wait_for(lambda: len(col.finals) >= legs - cap or not stays(), 10, "the refusals")
                    for _ in range(15):  # 1.5 s: 15 health checks, 2 failed ones deregister
                        await asyncio.sleep(0.1)
                        assert shim.registered.is_set() and shim.registration_count == 1
                    errors = {(f.error.code, f.error.kind) for f in col.finals.values() if f.error is not None}
                    assert errors == {(503, "overloaded")}
                    assert len(col.finals) == legs - cap and len(shim.requests.inflight) == cap
                    text = render_metrics(shim).decode()
                    assert f"kvswitch_shim_max_inflight_legs {float(cap)}" in text
                    assert "kvswitch_shim_chunks_unsent_total 0.0" in text
                finally:
                    await nc.close()
    finally:
        sim.stdin.close()
        await asyncio.wait_for(sim.wait(), 30)
