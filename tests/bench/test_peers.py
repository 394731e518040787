"""Peer command lines built from the fleet (the peers themselves are optional and not run here)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bench.peers import PEERS, connect_endpoint


@dataclass
class _Engine:
    role: str
    url: str
    events: str


@pytest.mark.parametrize(
    ("bind", "connect"),
    [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557"),
        ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5557"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
    ],
)
def test_connect_endpoint_turns_a_wildcard_bind_into_loopback(bind: str, connect: str) -> None:
    assert connect_endpoint(bind) == connect


def test_vllm_kv_aware_subscribes_to_each_engine_on_a_connectable_address() -> None:
    engines = [_Engine("agg", f"http://127.0.0.1:{8000 + i}", f"tcp://*:{5557 + i}") for i in range(2)]
    argv = PEERS["vllm_kv_aware"].engine_args(engines, 16, "m")
    sources = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:8000=tcp://127.0.0.1:5557", "http://127.0.0.1:8001=tcp://127.0.0.1:5558"]
