"""A worker whose shim finds its engine reusing far less than its KV events promise
(worker_shim.credit_check) is named on every router."""

from __future__ import annotations

import time

import nats

from protocol import LoadReport, encode_msg, subjects
from tests.router.conftest import Cluster
from tests.router.polling import until


async def test_a_worker_whose_shim_finds_its_credit_short_is_named_in_the_metrics(cluster: Cluster) -> None:
    """LoadReport.prefix_credit_short (the shim's credit check) shows per worker on every router."""
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    nc = await nats.connect(cluster.nats_url)
    line = f'kvswitch_router_worker_prefix_credit_short{{worker="{worker.id}"}} 1.0'
    try:
        short = LoadReport(worker=worker.id, ts=time.time(), prefix_credit_short=True)
        await nc.publish(subjects.load(cluster.ns, worker.id), encode_msg(short))
        await until(lambda: line in router.metrics.render().decode(), what="the worker named in /metrics")
    finally:
        await nc.close()
    # The shim's own reports (its engine reuses what it promised) take it out again.
    await until(lambda: line not in router.metrics.render().decode(), timeout=10, what="the worker gone")
