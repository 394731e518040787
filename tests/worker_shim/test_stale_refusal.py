"""A subscription refused once on the shim's connection (a NATS authorization reload, since fixed)
does not make the shim take a later, accepted subscription to that subject for refused."""

from __future__ import annotations

import asyncio

from engine_sim.server import SimServer
from protocol import subjects
from runtime.nats_connect import refused_subscriptions
from tests.worker_shim.cluster import shim_for, sim_config


async def test_a_refusal_from_before_does_not_fail_a_new_session(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, worker_name="w1")
        async with shim:
            # As the server's -ERR at a reload that denied the subject leaves it; the server (no
            # authorization here) takes the new session's SUB.
            refused_subscriptions(shim.nc).add(subjects.gen(ns, "agg", "w1").lower())
            waits = [asyncio.create_task(shim.registered.wait()), asyncio.create_task(shim.done.wait())]
            await asyncio.wait(waits, timeout=20, return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()
            assert shim.failure is None, f"the shim failed: {shim.failure}"
            assert shim.registered.is_set() and shim.worker_id == "w1"
