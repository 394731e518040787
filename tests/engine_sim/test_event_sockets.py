"""Which side of the KV event sockets binds, as vLLM decides it (vllm/distributed/kv_events.py): the
PUB binds an endpoint with `*` or `::` (or ipc/inproc) and connects to any other, where the
subscriber must bind (the bs32 capture: `tcp://127.0.0.1:5557`); the replay ROUTER always binds.
And nothing the sim opens listens beyond 127.0.0.1 unless told to. Real processes, real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from engine_sim import KVEventsConfig, SimConfig, SimServer
from engine_sim.config import LOOPBACK_PUB_ENDPOINT
from kvswitch.servers import free_ports
from protocol.vllm_events import publisher_binds
from tests.engine_sim.conftest import replay
from tests.engine_sim.listening import listening

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def _sim_cli(events: dict[str, object]) -> Iterator[tuple[subprocess.Popen[str], dict[str, object]]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "sim", "--port", "0", "--speedup", "100", "--num-gpu-blocks", "257",
         "--max-model-len", "4096",
         "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", **events})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line, f"the sim exited before saying where it listens: {proc.stderr.read()[-2000:]}"
        yield proc, json.loads(line)
    finally:
        proc.terminate()
        proc.wait(15)


class _Receiver:
    """A SUB socket that keeps receiving (so it sends its subscription at once) into `batches`."""

    def __init__(self, endpoint: str, *, bind: bool) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.batches: list[list[bytes]] = []
        self._arrived = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self.batches.append(await self.sock.recv_multipart())
            self._arrived.set()

    async def wait(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self._arrived.wait(), timeout)

    def close(self) -> None:
        self._task.cancel()
        self.sock.close(linger=0)


async def _complete_until_received(url: str, rx: _Receiver) -> None:
    """Requests go out until a batch arrives: the PUB learns of a subscriber asynchronously."""
    async with aiohttp.ClientSession() as s:
        for i in range(20):
            body = {"prompt": list(range(2000 + 100 * i, 2064 + 100 * i)), "max_tokens": 2}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
            try:
                await rx.wait(0.5)
                return
            except TimeoutError:
                continue
    raise AssertionError("no KV event batch arrived live")


async def test_pub_connects_to_a_bound_subscriber_and_binds_replay() -> None:
    events_port = free_ports(2)  # the events port and the replay port beside it
    replay_port = events_port + 1
    rx = _Receiver(f"tcp://127.0.0.1:{events_port}", bind=True)  # as the bs32 capture's subscriber did
    try:
        events = {"endpoint": f"tcp://127.0.0.1:{events_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
        with _sim_cli({**events, "topic": "kv"}) as (proc, line):
            assert line["events_endpoint"] == f"tcp://127.0.0.1:{events_port}"
            await _complete_until_received(str(line["url"]), rx)
            topic, seq, payload = rx.batches[0]
            assert topic == b"kv" and len(seq) == 8
            assert msgspec.msgpack.decode(payload)[1]  # a real batch of events
            # The sim connected to our port and bound its replay port: only HTTP and replay listen.
            http_port = int(str(line["url"]).rsplit(":", 1)[1])
            assert listening(proc.pid) == {("127.0.0.1", http_port), ("127.0.0.1", replay_port)}
            frames = await replay(f"tcp://127.0.0.1:{replay_port}", 0)
            assert frames[0][1] == b"kv" and frames[0][2] == (0).to_bytes(8, "big") and frames[-1][2] == b"\xff" * 8
    finally:
        rx.close()


async def test_pub_binds_a_double_colon_endpoint_on_loopback_only() -> None:
    events_port = free_ports(2)  # the events port and the replay port beside it
    replay_port = events_port + 1
    events = {
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    with _sim_cli({**events, "topic": "kv"}) as (proc, line):
        http_port = int(str(line["url"]).rsplit(":", 1)[1])
        assert listening(proc.pid) == {("127.0.0.1", p) for p in (http_port, events_port, replay_port)}
        assert line["events_endpoint"] == f"tcp://127.0.0.1:{events_port}"
        rx = _Receiver(str(line["events_endpoint"]), bind=False)
        try:
            await _complete_until_received(str(line["url"]), rx)
        finally:
            rx.close()


async def test_python_api_defaults_listen_on_loopback_only() -> None:
    before = listening(os.getpid())
    async with SimServer(SimConfig(speedup=100, num_gpu_blocks=64)) as sim:
        opened = listening(os.getpid()) - before
        assert sim.events_endpoint is not None and sim.replay_endpoint is not None
        ports = {sim.port, int(sim.events_endpoint.rsplit(":", 1)[1]), int(sim.replay_endpoint.rsplit(":", 1)[1])}
        assert opened == {("127.0.0.1", p) for p in ports}


def test_default_events_endpoint_binds_by_vllms_rule_on_loopback() -> None:
    assert KVEventsConfig().endpoint == LOOPBACK_PUB_ENDPOINT
    assert publisher_binds(LOOPBACK_PUB_ENDPOINT) and "127.0.0.1" in LOOPBACK_PUB_ENDPOINT
    ephemeral = KVEventsConfig.ephemeral()
    assert publisher_binds(ephemeral.endpoint) and "*" not in ephemeral.endpoint
    assert ephemeral.replay_endpoint == "tcp://127.0.0.1:0"
