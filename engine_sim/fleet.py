"""SimFleet: N independent simulated engines in one process (`kvswitch sim --count N`).

Port assignment, engine i of N (i from 0):
- HTTP: `port + i` (consecutive); port 0 gives each engine its own free port.
- KV events: when the events endpoint ends in a port P other than 0, engine i uses `P + i`; the
  replay endpoint likewise `Q + i`. Port 0 or ZMQ's `*` gives each its own free port. An endpoint
  without a port (ipc://path, inproc://name) gets `-{i}` appended.
Every engine is a full SimServer (own engine id, cache, sockets, faults); idle ones cost nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
from typing import Any

import msgspec

from engine_sim.config import SimConfig
from engine_sim.server import SimServer
from protocol.vllm_events import publisher_binds
from protocol.zmq_endpoint import split_endpoint

__all__ = ["SimFleet", "fleet_config", "shared_ports"]


def _offset_endpoint(endpoint: str | None, i: int) -> str | None:
    if endpoint is None or i == 0:
        return endpoint
    m = re.search(r":(\d+|\*)$", endpoint)
    if m is None:
        return f"{endpoint}-{i}"
    port = m.group(1)  # `*` or 0: each engine binds its own free port
    return endpoint if port == "*" or not int(port) else f"{endpoint[: m.start()]}:{int(port) + i}"


def fleet_config(config: SimConfig, i: int) -> SimConfig:
    """The config of engine i of a fleet built from `config` (see the module docstring)."""
    ev = config.kv_events
    ev = msgspec.structs.replace(
        ev,
        endpoint=_offset_endpoint(ev.endpoint, i) or ev.endpoint,
        replay_endpoint=_offset_endpoint(ev.replay_endpoint, i),
    )
    return config.replace(port=config.port + i if config.port else 0, kv_events=ev)


def _local_port(endpoint: str | None, binds: bool) -> int:
    """The TCP port `endpoint` takes on this machine: its own where it binds, its subscriber's where it
    connects to loopback or 0.0.0.0 (that subscriber binds it here); 0 for none (port 0 or `*`, ipc,
    elsewhere)."""
    split = split_endpoint(endpoint) if endpoint else None
    if split is None or split.scheme != "tcp" or not split.port:
        return 0
    if binds or split.host == "localhost":
        return split.port
    with contextlib.suppress(ValueError):
        address = ipaddress.ip_address(split.host.partition("%")[0])
        return split.port if address.is_loopback or address.is_unspecified else 0
    return 0


def shared_ports(config: SimConfig, count: int) -> str | None:
    """What two of a fleet's sockets would both bind, said with the settings they come from; None
    when every port is its own. Each setting's ports run + 0 to + count - 1, so two settings fewer
    than `count` apart overlap (events :5557 and replay :5558 at --count 2: engine 1's events port
    is engine 0's replay port)."""
    ev = config.kv_events
    bases = {
        "--port": config.port,
        "--kv-events-config's endpoint": _local_port(ev.endpoint, publisher_binds(ev.endpoint)) if ev.active else 0,
        "--kv-events-config's replay_endpoint": _local_port(ev.replay_endpoint, True) if ev.active else 0,
    }
    taken: dict[int, tuple[str, int]] = {}
    for what, base in bases.items():
        for i in range(count if base else 0):
            other, j = taken.setdefault(base + i, (what, i))
            if other != what:
                return (
                    f"engine {j}'s {other} and engine {i}'s {what} are both port {base + i} "
                    f"({other} {bases[other]}, {what} {base}, each + 0 to + {count - 1}): "
                    f"give ports at least --count ({count}) apart"
                )
    return None


class SimFleet:
    def __init__(self, config: SimConfig | None = None, count: int = 1, **overrides: Any) -> None:
        if count < 1:
            raise ValueError(f"a fleet needs at least one engine, got count={count}")
        base = (config or SimConfig()).replace(**overrides) if overrides else (config or SimConfig())
        self.servers = [SimServer(fleet_config(base, i)) for i in range(count)]

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, i: int) -> SimServer:
        return self.servers[i]

    async def start(self) -> None:
        try:
            for s in self.servers:  # one at a time: consecutive ports, clear errors
                await s.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "index": i,
                "url": s.url,
                "events_endpoint": s.events_endpoint,
                "replay_endpoint": s.replay_endpoint,
                "engine_id": s.engine.engine_id,
            }
            for i, s in enumerate(self.servers)
        ]
