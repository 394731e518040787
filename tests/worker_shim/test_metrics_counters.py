"""The shim's /metrics counters only go up while its process runs: a re-registration (lost lease,
new worker id) keeps kvswitch_shim_load_reports_total, which until 2026-12-04 read the current
worker id's reporter and fell back to its count (observability audit). Real NATS and etcd."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engine_sim.server import SimServer
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_reregistration import _revoke_behind_its_back


async def _value(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return next(x.value for f in text_string_to_metric_families(text) for x in f.samples if x.name == name)


async def test_load_reports_total_keeps_counting_across_a_re_registration(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url, lease_ttl=2) as shim:
        await shim.registered.wait()
        before = 0.0
        for _ in range(200):  # the shim's own counter, as a scrape reads it
            if (before := await _value(shim.http.url, "kvswitch_shim_load_reports_total")) >= 10:
                break
            await asyncio.sleep(0.1)
        old = shim.worker_id
        await _revoke_behind_its_back(shim, etcd_url, ns)
        await wait_for(lambda: shim.registered.is_set() and shim.worker_id != old, 20, "registered anew")
        after = await _value(shim.http.url, "kvswitch_shim_load_reports_total")
        assert await _value(shim.http.url, "kvswitch_shim_registrations_total") == 2.0
        assert after >= before >= 10, (before, after)
