"""A shim whose registration's supervisor ends starts a new session and registers anew: before
2026-12-06 the supervisor's end set nothing the shim watches, so its key, once deleted or its lease
lost, was never put back while /health said registered (real nats, etcd, sim)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from discovery import Registration
from engine_sim.server import SimServer
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_shim_lifecycle import registered_workers


async def test_a_supervisor_that_ends_makes_the_shim_register_anew(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Registration._supervise
    ended: list[str] = []

    async def supervise_once_bad(self: Registration) -> None:
        if not ended:
            ended.append(self.id)
            raise RuntimeError("injected: the registration's supervisor ended")
        await real(self)

    monkeypatch.setattr(Registration, "_supervise", supervise_once_bad)
    caplog.set_level(logging.INFO)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        async with shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            await wait_for(lambda: bool(ended), what="the first supervisor ended")
            first = ended[0]
            await wait_for(
                lambda: shim.worker_id not in (None, first) and shim.registered.is_set(),
                what="a new session registered under a new id",
            )
            assert shim.sessions >= 2
            assert any("re-registration failed" in r.getMessage() for r in caplog.records)
            assert await registered_workers(etcd_url, ns) == {shim.worker_id}  # the old key went with its session
