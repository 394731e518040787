"""GET /kv_event_sources lists each endpoint as vLLM 0.32 does (vllm/distributed/kv_events.py
ZmqEventPublisher._bind): `tcp://*:0` as `tcp://<node IP>:<port bound>`, with no `*` left;
`tcp://*:PORT` and a concrete address as given. A restart still binds the same port."""

from __future__ import annotations

import aiohttp

from engine_sim.config import KVEventsConfig, SimConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_ports


def _events(endpoint: str, replay: str | None) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay)


async def _listed(sim: SimServer) -> dict[str, object]:
    async with aiohttp.ClientSession() as http, http.get(sim.url + "/kv_event_sources") as r:
        assert r.status == 200
        listed: dict[str, object] = (await r.json())["0"]
        return listed


async def test_a_wildcard_port_0_is_listed_as_the_node_address_and_port_bound() -> None:
    sim = SimServer(SimConfig(kv_events=_events("tcp://*:0", "tcp://*:0")))
    async with sim:
        events, replay = sim.events_endpoint, sim.replay_endpoint
        assert events is not None and replay is not None
        port, rport = events.rsplit(":", 1)[1], replay.rsplit(":", 1)[1]
        listed = await _listed(sim)
        assert (listed["endpoint"], listed["replay_endpoint"]) == (
            f"tcp://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{rport}",
        )
        await sim.restart()
        assert (sim.events_endpoint, sim.replay_endpoint) == (events, replay)  # the same ports
        assert await _listed(sim) == listed


async def test_a_wildcard_with_a_port_and_a_concrete_address_are_listed_as_given() -> None:
    port = free_ports(2)
    rport = port + 1
    sim = SimServer(SimConfig(kv_events=_events(f"tcp://*:{port}", f"tcp://127.0.0.1:{rport}")))
    async with sim:
        listed = await _listed(sim)
        assert (listed["endpoint"], listed["replay_endpoint"]) == (f"tcp://*:{port}", f"tcp://127.0.0.1:{rport}")
