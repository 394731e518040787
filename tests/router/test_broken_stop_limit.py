"""A router that broke (RouterService.broken) stops as on SIGTERM, and its stop is cut at the same
limit: `kvswitch router` exits 130 after `drain_s + 10` s, its lease revoked first (runtime.run_service).
Until the review of 2026-12-06 only the signal handler started that limit, so a broken router whose
stop hung (NATS frozen) was bounded by its libraries' timeouts alone: 31 s in a repro against 20 s
after SIGTERM, past Kubernetes' 30 s grace. Real nats-server and etcd; the router runs as a process,
with its drain limit shortened to 2 s and its stop made to hang."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from etcd3aio import prefix_range_end

from discovery import Discovery
from kvswitch.servers import free_port
from protocol import subjects
from protocol.config import EtcdSettings

LIMIT_S = 2.0

_ROUTER = """
import asyncio, sys
import router.cli
import runtime
from router.service import RouterService
from runtime.loop_watch import LoopWatch

mode = sys.argv[1]
real_run_service = runtime.run_service

def run_service(main, **kwargs):  # the router's own stop path, with a shorter limit
    return real_run_service(main, **{**kwargs, "drain_limit_s": LIMIT_S})

router.cli.run_service = run_service

async def stop(self):  # NATS or etcd frozen: the stop never ends
    await asyncio.sleep(3600)

RouterService.stop = stop

if mode == "broken":
    async def crash(self):  # a loop the router needs ends: it is no longer correct
        await asyncio.sleep(1.0)
        raise RuntimeError("injected: a bug in the loop watch")

    LoopWatch._run = crash

from kvswitch.cli import main
sys.exit(main(sys.argv[2:]))
""".replace("LIMIT_S", repr(LIMIT_S))


async def _router_keys(etcd_url: str, ns: str) -> int:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        assert d.client.kv is not None
        prefix = subjects.routers_prefix(ns)
        resp = await d.client.kv.get(prefix, prefix_range_end(prefix.encode()), keys_only=True)
        return len(resp.kvs)


@pytest.mark.parametrize("how", ["broken", "SIGTERM"])
async def test_a_broken_routers_hung_stop_is_cut_at_the_sigterm_limit(
    how: str, nats_url: str, etcd_url: str, ns: str
) -> None:
    args = ["router", "--namespace", ns, "--nats-servers", nats_url, "--etcd-endpoints", etcd_url,
            "--http-port", str(free_port()), "--no-api-keys"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_ROUTER), how, *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: list[tuple[float, str]] = []
    listening, draining = threading.Event(), threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.monotonic(), line))
            if "listening on" in line:
                listening.set()
            if "draining" in line:
                draining.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(60), "".join(line for _, line in lines)
        assert await _router_keys(etcd_url, ns) == 1
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        assert draining.wait(10), "".join(line for _, line in lines)
        began = time.monotonic()
        code = proc.wait(30)  # before the fix, a broken router's hung stop never ended
        took = time.monotonic() - began
        reader.join(5)
        said = "".join(line for _, line in lines)
        assert code == 130, said
        assert f"still draining after {LIMIT_S:.0f}s: exiting now" in said, said
        assert LIMIT_S - 0.5 <= took <= LIMIT_S + 3.0, (took, said)
        if how == "broken":
            assert "no longer correct" in said, said
        assert await _router_keys(etcd_url, ns) == 0  # run_service's on_abort revoked its lease
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
