"""A vLLM shim given no event endpoints reads them from the engine's GET /kv_event_sources (vLLM
0.32 lists each data-parallel rank's --kv-events-config there, its endpoints offset by the rank)."""

from __future__ import annotations

import json

import aiohttp
import pytest

from engine_sim.config import KVEventsConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_ports
from protocol import ConfigError
from tests.protocol.vllm_captures import FIXTURES
from tests.worker_shim.cluster import engine_set, shim_for, sim_config, wait_for
from worker_shim.adapters.base import EventSource
from worker_shim.adapters.vllm import event_sources


def test_vllms_own_list_of_event_sources_is_read_per_rank() -> None:
    raw = json.loads((FIXTURES / "bs32" / "kv_event_sources_dp2.json").read_text())
    assert event_sources(raw) == {
        0: EventSource("tcp://127.0.0.1:30924", "tcp://127.0.0.1:28894", "kv-events"),
        1: EventSource("tcp://127.0.0.1:30925", "tcp://127.0.0.1:28895", "kv-events"),
    }
    off = {"0": {**raw["0"], "enable_kv_cache_events": False}, "x": raw["1"], "1": {**raw["1"], "publisher": "null"}}
    assert event_sources(off) == {}


def sim_as(rank: int, topic: str = "kv-events") -> SimServer:
    events, replay = f"tcp://*:{free_ports(2)}", f"tcp://*:{free_ports(2)}"
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=events, replay_endpoint=replay, topic=topic
    )
    return SimServer(sim_config(data_parallel_rank=rank, kv_events=config))


@pytest.mark.parametrize(
    ("rank", "shim_rank"),
    [(0, None), (1, 1), (1, None)],  # (1, None): one API server per rank (vLLM's external load balancing)
)
async def test_a_shim_given_no_endpoints_takes_its_ranks_from_the_engine(
    rank: int, shim_rank: int | None, ns: str, nats_url: str, etcd_url: str
) -> None:
    async with sim_as(rank) as sim:
        listed = sim.event_sources()[str(rank)]
        shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=None, kv_replay=None, kv_events_mode="auto",
                        data_parallel_rank=shim_rank)  # fmt: skip
        async with shim:
            await shim.registered.wait()
            c = shim.config
            assert (c.kv_events, c.kv_replay, c.kv_events_topic) == (
                listed["endpoint"],
                listed["replay_endpoint"],
                "kv-events",
            )
            async with aiohttp.ClientSession() as http:
                body = {"model": sim.config.model, "prompt": list(range(100, 300)), "max_tokens": 1}
                async with http.post(sim.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
            await wait_for(lambda: shim.canonical_hashes() == engine_set(sim) != set(), 5, "the engine's events")


@pytest.mark.parametrize(
    ("sim_kw", "shim_kw", "setting", "words"),
    [
        ({"kv_events": KVEventsConfig()}, {}, "kv_events", "publishes no KV events: start it with --kv-events-config"),
        ({}, {"kv_events_topic": "other"}, "kv_events_topic", "publishes under topic 'kv-events'"),
    ],
)
async def test_what_the_engine_lists_that_cannot_serve_is_a_startup_error(
    sim_kw: dict[str, object], shim_kw: dict[str, object], setting: str, words: str,
    ns: str, nats_url: str, etcd_url: str,
) -> None:  # fmt: skip
    sim = SimServer(sim_config(**sim_kw)) if sim_kw else sim_as(0)
    async with sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=None, kv_replay=None, **shim_kw)
        async with shim:
            await shim.done.wait()
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == setting
            assert words in str(shim.failure)


async def test_a_restarted_engine_publishing_under_another_topic_is_discovered_again(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """Each session reads /kv_event_sources again: the topic the last one found is no flag the
    operator gave, so a new one is taken, not refused."""
    first = sim_as(0, topic="before")
    await first.start()
    port = int(first.url.rsplit(":", 1)[1])
    shim = shim_for(first, ns, nats_url, etcd_url, kv_events=None, kv_replay=None, kv_events_mode="auto")
    async with shim:
        await shim.registered.wait()
        assert shim.config.kv_events_topic == "before"
        await first.stop()
        await wait_for(lambda: not shim.registered.is_set(), 10, "the shim deregisters")
        events, replay = f"tcp://*:{free_ports(2)}", f"tcp://*:{free_ports(2)}"
        config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events, replay_endpoint=replay, topic="after"
        )
        async with SimServer(sim_config(port=port, kv_events=config)):
            await wait_for(shim.registered.is_set, 20, "the shim registers again")
            assert shim.failure is None and shim.config.kv_events_topic == "after"
