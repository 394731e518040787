"""A stall of the shim's own loop (a paused VM or container, a long GC, a debugger) is said as its
own, and its lease's lines name it, not etcd: until 2026-12-07 a shim stopped 10 s woke to "etcd
does not answer" and "check the network to --etcd-endpoints", and no line said it had stalled
(only the router watched its loop: runtime.loop_watch)."""

from __future__ import annotations

import logging
import time

import pytest

from engine_sim.server import SimServer
from tests.worker_shim.cluster import shim_for, sim_config, wait_for


async def test_a_shim_stalled_past_its_lease_ttl_says_it_stalled_and_blames_not_etcd(
    etcd_url: str, ns: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url, lease_ttl=2) as shim:
        await wait_for(shim.registered.is_set, what="registered")
        first = shim.worker_id
        time.sleep(2.6)  # past the 2 s TTL: the renewals due meanwhile went unsent
        stalled = "this shim's event loop was stalled 2."
        await wait_for(lambda: any(r.getMessage().startswith(stalled) for r in caplog.records), what="its line")
        await wait_for(shim.registered.is_set, 10, "serving again")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("etcd does not answer" in line or "check the network" in line for line in warned), warned
    assert any(line.startswith(f"lease {first}: this process was stalled 1.") for line in warned), warned
