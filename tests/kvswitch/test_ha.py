"""High availability on real servers: a 3-node NATS cluster and a 3-member etcd cluster on loopback,
simulated engines with their shims, and 2 router replicas, all given every node's URL.

Under steady load through both routers, one NATS node (the busiest) and then the etcd leader are
killed with SIGKILL: no request may fail and no worker may be deregistered (its lease id, which is
its identity, stays the same). The killed node then restarts and must rejoin with nothing lost.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import nats
import pytest

from kvswitch.client import CompletionClient
from kvswitch.cluster import ClusterSpec, LocalCluster
from kvswitch.servers import EtcdServer, NatsServer
from protocol import subjects

NS = "ha"
WORKERS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    spec = ClusterSpec(namespace=NS, agg=WORKERS, routers=2, speedup=10.0, nats_nodes=3, etcd_members=3)
    c = LocalCluster(spec)
    try:
        c.start()
        c.wait_ready(timeout=90)
        yield c
    finally:
        c.stop()


@dataclass
class Load:
    """Requests sent round-robin over the routers from a thread of its own, until stopped."""

    routers: list[str]
    concurrency: int = 4
    output_tokens: int = 128
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(60)

    def wait_for(self, requests: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        target = self.ok + requests
        while self.ok < target and time.monotonic() < deadline and not self.failures:
            time.sleep(0.05)

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            client = CompletionClient(session, "sim-llama", timeout_s=10.0)

            async def user(u: int) -> None:
                i = 0
                while not self._stop.is_set():
                    url = self.routers[(u + i) % len(self.routers)]
                    prompt = [300 + (u * 997 + i * 31 + k) % 30000 for k in range(64)]
                    # Streams long enough that some are always in flight when a node dies.
                    result = await client.complete(url, prompt, self.output_tokens, request_id=f"ha-{u}-{i}")
                    if result.ok:
                        self.ok += 1
                    else:
                        self.failures.append(f"{url}: {result.error}")
                    i += 1

            await asyncio.gather(*(user(u) for u in range(self.concurrency)))


def _post(url: str, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(f"{url}/v3/{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=2) as resp:
        return dict(json.loads(resp.read()))


def _worker_keys(member: EtcdServer) -> set[str]:
    """Registered workers as this member alone sees them (a serializable read: no quorum asked)."""
    prefix = subjects.workers_prefix(NS)
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = {"key": base64.b64encode(prefix.encode()).decode(), "range_end": base64.b64encode(end.encode()).decode()}
    reply = _post(member.url, "kv/range", {**body, "serializable": True})
    kvs = reply.get("kvs") or []
    assert isinstance(kvs, list)
    return {base64.b64decode(kv["key"]).decode() for kv in kvs}


def _router_workers(cluster: LocalCluster) -> list[int]:
    counts = []
    for url in cluster.router_urls:
        with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
            counts.append(int(json.loads(resp.read())["workers"]))
    return counts


def _clients(node: NatsServer) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/connz", timeout=2) as resp:
        return [str(c.get("name", "")) for c in json.loads(resp.read())["connections"]]


def _busiest(nodes: list[NatsServer]) -> int:
    """The node serving a router (the most clients among those), so killing it cuts request streams."""
    clients = [_clients(n) for n in nodes]
    with_router = [i for i, names in enumerate(clients) if any("router" in n for n in names)]
    assert with_router, clients
    return max(with_router, key=lambda i: len(clients[i]))


async def _load_reports_through(url: str, timeout: float = 5.0) -> set[str]:
    """Workers whose load reports reach a client connected to this node alone."""
    nc = await nats.connect(url, allow_reconnect=False)
    seen: set[str] = set()
    try:
        sub = await nc.subscribe(subjects.load_all(NS))
        deadline = time.monotonic() + timeout
        while len(seen) < WORKERS and time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=max(0.01, deadline - time.monotonic()))
            except nats.errors.TimeoutError:
                break
            seen.add(msg.subject.rsplit(".", 1)[-1])
    finally:
        await nc.close()
    return seen


def _run_through(cluster: LocalCluster, fault: object) -> Load:
    load = Load(cluster.router_urls).start()
    try:
        load.wait_for(20)
        assert callable(fault)
        fault()
        load.wait_for(40)
    finally:
        load.stop()
    return load


def test_losing_the_busiest_nats_node_fails_no_request(cluster: LocalCluster) -> None:
    assert cluster.nats is not None and cluster.etcd is not None
    before = _worker_keys(cluster.etcd.members[0])
    assert len(before) == WORKERS
    victim = _busiest(cluster.nats.nodes)
    try:
        load = _run_through(cluster, cluster.nats.nodes[victim].kill)
    finally:
        cluster.nats.nodes[victim].start()
        cluster.nats.wait_routes()
    assert _worker_keys(cluster.etcd.members[0]) == before, "a worker re-registered"
    assert _router_workers(cluster) == [WORKERS, WORKERS]
    assert not load.failures, load.failures[:5]
    assert load.ok >= 60


def test_a_killed_nats_node_restarts_and_rejoins_with_nothing_lost(cluster: LocalCluster) -> None:
    assert cluster.nats is not None and cluster.etcd is not None
    before = _worker_keys(cluster.etcd.members[0])
    victim = _busiest(cluster.nats.nodes)
    cluster.nats.nodes[victim].kill()
    time.sleep(2.0)  # clients notice and reconnect to the other nodes
    assert _router_workers(cluster) == [WORKERS, WORKERS]
    node = cluster.nats.nodes[victim].start()
    cluster.nats.wait_routes()
    # Every worker's load reports reach a client of the restarted node alone: it is routed in again.
    assert asyncio.run(_load_reports_through(node.url)) == {k.rsplit("/", 1)[-1] for k in before}
    assert _worker_keys(cluster.etcd.members[0]) == before, "a worker re-registered"
    load = _run_through(cluster, lambda: None)
    assert not load.failures and load.ok >= 60


def test_losing_the_etcd_leader_fails_no_request_and_deregisters_no_worker(cluster: LocalCluster) -> None:
    assert cluster.etcd is not None
    leader = cluster.etcd.leader()
    survivor = cluster.etcd.members[(leader + 1) % 3]
    before = _worker_keys(survivor)
    assert len(before) == WORKERS
    load = _run_through(cluster, cluster.etcd.members[leader].kill)
    time.sleep(3.0)  # past a lease keep-alive period with the old leader gone

    assert not load.failures, load.failures[:5]
    assert load.ok >= 60
    assert cluster.etcd.leader() != leader
    assert _worker_keys(survivor) == before, "a worker was deregistered or re-registered"
    assert _router_workers(cluster) == [WORKERS, WORKERS]

    restarted = cluster.etcd.members[leader].start()
    deadline = time.monotonic() + 10
    while _worker_keys(restarted) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _worker_keys(restarted) == before, "the restarted member did not catch up"
    assert cluster.etcd.healthy()
