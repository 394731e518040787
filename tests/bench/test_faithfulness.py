"""The virtual clock against the live stack, CI-sized: the same small slice on a real local cluster
(nats, etcd, simulated engines at 1x, shims, a router) and on the virtual clock, with bounds loose
enough for a shared CI box (docs/benchmarks.md has the full-size comparison and its gaps).

The live run pays real overheads the virtual one models only as small constant hops (HTTP, NATS,
Python on a busy CPU), so live latencies are at least the virtual ones and at most a few times
them; the engine work is the same, so outputs and the prefill paths agree exactly."""

from __future__ import annotations

import asyncio
import importlib.util
import statistics

import pytest

from bench.compare import CONFIGURATIONS, CompareSpec, _cluster_spec, fleet_spec
from bench.replay import RequestResult, replay
from bench.summary import tpot
from bench.trace import TokenSynth, load_trace, shipped_trace
from bench.virtual.fleet import VirtualFleet
from bench.workloads import from_trace
from kvswitch.cluster import LocalCluster

_MISSING = [m for m in ("router.cli", "worker_shim.cli", "engine_sim.cli") if importlib.util.find_spec(m) is None]


def _live(spec: CompareSpec, name: str) -> list[RequestResult]:
    cluster = LocalCluster(_cluster_spec(spec, CONFIGURATIONS[name]))
    try:
        cluster.start()
        cluster.wait_ready(timeout=90.0)
        run = asyncio.run(
            replay(spec.items, cluster.router_urls, model=cluster.spec.model, synth=TokenSynth(0), progress=False)
        )
    finally:
        cluster.stop()
    return run.results


def _median(values: list[float]) -> float:
    assert values
    return statistics.median(values)


@pytest.mark.timing
@pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)}")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["kv", "kv_disagg"])
def test_virtual_latencies_bracket_the_live_ones(name: str) -> None:
    items = from_trace(load_trace(shipped_trace(), start_s=990, limit=16), scale_tokens=1 / 16)
    spec = CompareSpec(items=items, configurations=[], prefill=1, decode=1, speedup=1.0, progress=False)
    live = _live(spec, name)
    virtual = VirtualFleet(fleet_spec(spec, CONFIGURATIONS[name], 0)).run(items, TokenSynth(0)).results()
    assert all(r.ok for r in live) and all(r.ok for r in virtual)
    assert [r.output_tokens for r in live] == [r.output_tokens for r in virtual] == [i.output_len for i in items]
    assert [r.prefill for r in live] == [r.prefill for r in virtual]
    ttft_live = _median([r.ttft_s for r in live if r.ttft_s is not None])
    ttft_virtual = _median([r.ttft_s for r in virtual if r.ttft_s is not None])
    assert ttft_live / 4 <= ttft_virtual <= ttft_live * 1.5
    tpot_live = _median([t for r in live if (t := tpot(r)) is not None])
    tpot_virtual = _median([t for r in virtual if (t := tpot(r)) is not None])
    assert tpot_live / 3 <= tpot_virtual <= tpot_live * 1.3
