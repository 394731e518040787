"""A shim serving one data-parallel rank of a vLLM (`--data-parallel-rank`) against a sim running
as that rank's own API server (external load balancing): the rank's offset event endpoints, its
share of /metrics, and on every leg the header vLLM reads there, the rank's index among the
server's engines (0), not the rank."""

from __future__ import annotations

from typing import Any

import aiohttp

from engine_sim.config import KVEventsConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_ports
from protocol import ConfigError, subjects
from tests.worker_shim.cluster import connect, engine_set, shim_for, sim_config, wait_for
from tests.worker_shim.test_request_service import Collector, gen
from worker_shim.adapters.vllm import VllmAdapter
from worker_shim.event_health import EventProblem


def rank_one_sim() -> tuple[SimServer, dict[str, Any]]:
    """A sim as rank 1 of a vLLM given these endpoints: it publishes on events + 1 (its PUB
    connects, as vLLM's does to an address without `*`) and serves replay on replay + 1; and the
    shim settings that name the endpoints as the engine was given them."""
    events, replay = f"tcp://127.0.0.1:{free_ports(2)}", f"tcp://127.0.0.1:{free_ports(2)}"
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=events, replay_endpoint=replay, topic="kv-events"
    )
    shim = {"kv_events": events, "kv_replay": replay, "kv_events_mode": "auto", "kv_events_topic": "kv-events"}
    return SimServer(sim_config(data_parallel_rank=1, kv_events=config)), shim


async def test_a_shim_serves_its_rank_from_the_endpoints_the_engine_was_given(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    sim, given = rank_one_sim()
    async with sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, data_parallel_rank=1, **given)
        async with shim:
            await shim.registered.wait()
            assert shim.worker_id is not None and shim.limits.kv_total_blocks == 256, "rank 1's /metrics"
            nc = await connect(nats_url)
            try:
                col = Collector(nc)
                await col.start()
                await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("r1", list(range(100, 300))))
                final = await col.final("r1")
            finally:
                await nc.close()
            # Every generate request the engine saw named index 0: the leg, and any probe the shim
            # sent it under load (one had, so a count of exactly one was a race).
            assert final.error is None and sim.ranked_requests == sim.faults.requests_seen >= 1, (
                "the leg named the rank's engine, index 0"
            )
            await wait_for(lambda: shim.canonical_hashes() == engine_set(sim) != set(), 5, "rank 1's events indexed")


async def test_a_rank_the_engine_does_not_run_is_a_startup_error_naming_its_ranks(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    sim, given = rank_one_sim()
    async with sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, data_parallel_rank=3, **given)
        async with shim:
            await shim.done.wait()
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "data_parallel_rank"
            assert "runs data-parallel ranks 1" in str(shim.failure)


async def test_a_shim_without_the_flag_beside_one_rank_refuses_another_ranks_events(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """External load balancing: ranks 0 and 1, an API server each, started with one
    --kv-events-config (rank 1 publishes on its ports plus 1). Rank 1's shim, given that config and
    no --data-parallel-rank, reads rank 0's publisher: its server lists only engine="1", so rank 0's
    batches are dropped and reported, not indexed as rank 1's cache."""
    rank1, given = rank_one_sim()
    rank0 = SimServer(sim_config(data_parallel_rank=0, kv_events=rank1.config.kv_events))
    async with rank0, rank1:
        shim = shim_for(rank1, ns, nats_url, etcd_url, **given)
        async with shim:
            await shim.registered.wait()
            async with aiohttp.ClientSession() as s:  # traffic rank 0's server runs
                for i in range(1, 4):
                    body = {
                        "model": rank0.config.model,
                        "prompt": list(range(1000 * i, 1000 * i + 64)),
                        "max_tokens": 1,
                    }
                    async with s.post(rank0.url + "/v1/completions", json=body) as r:
                        assert r.status == 200
            await wait_for(lambda: EventProblem.WRONG_RANK in shim.events.problems, 5, "rank 0's events refused")
            assert engine_set(rank0) and not shim.canonical_hashes() and not shim.events.ok
            assert isinstance(shim.adapter, VllmAdapter) and shim.adapter.stats.other_rank >= 1
            assert "come from data-parallel rank 0, but this shim serves rank 1" in shim.events.why
            assert "give --data-parallel-rank 1 with the engine's --kv-events-config" in shim.events.why
