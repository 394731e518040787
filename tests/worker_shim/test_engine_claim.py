"""A shim claims its engine (/{ns}/engines/{engine}, under its lease): a second shim started
beside an engine that one serves fails at startup naming --engine-url and the holder, instead of
both registering and the engine's capacity and cache counting twice (ops audit, 2026-12-06)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest
from etcd3aio import prefix_range_end

from discovery import Discovery, KeyTaken, Registration
from engine_sim.config import KVEventsConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_ports
from protocol import ConfigError, EngineClaim, WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings
from tests.worker_shim.cluster import shim_for, sim_config
from worker_shim import engine_claim
from worker_shim.engine_claim import claim, engine_id, this_host
from worker_shim.shim import ShimStatus, WorkerShim


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("http://127.0.0.1:8000", "http://localhost:8000/"),
        ("http://127.0.0.1:8000", "https://0.0.0.0:8000"),
        ("http://[::1]:8000", "http://127.0.0.2:8000"),
        ("http://Engine-1.svc:80", "http://engine-1.svc"),
        ("https://engine-1.svc", "http://engine-1.svc:443"),
        ("http://10.0.0.5:8000/v", "http://10.0.0.5:8000/v/"),
        ("http://127.0.0.1:8000", "http://[::ffff:127.0.0.1]:8000"),  # IPv4-mapped loopback
        ("http://10.0.0.5:8000", "http://[::FFFF:10.0.0.5]:8000"),
        ("http://[2001:db8:0::1]:8000", "http://[2001:DB8::1]:8000"),
        ("http://Host.Docker.Internal:8000", "http://host.docker.internal:8000"),
    ],
)
def test_one_engine_spelled_two_ways_is_one_identity(a: str, b: str) -> None:
    assert engine_id(a, None, "pod-a") == engine_id(b, None, "pod-a")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://[::ffff:127.0.0.1]:8000",
        "http://host.docker.internal:8000",  # each machine's container reaching its own host's engine
        "http://gateway.docker.internal:8000",
        "http://host.containers.internal:8000",  # Podman's
        "http://host.lima.internal:8000",
        "http://172.17.0.1:8000",  # the docker bridge's gateway: each docker host
        "http://172.18.0.5:8000",  # a compose network's container: each machine's own
        "http://192.168.0.10:8000",
        "http://10.0.0.5:8000",  # a private address: another machine's on another network
        "http://100.64.0.7:8000",  # shared address space (carrier-grade NAT)
        "http://169.254.10.1:8000",  # link-local
        "http://[fe80::1]:8000",
        "http://[fd00::5]:8000",  # unique local
        "http://vllm:8000",  # one label: a compose service, an /etc/hosts entry, a search domain
    ],
)
def test_a_host_that_may_be_another_machine_from_each_machine_is_qualified_by_this_one(url: str) -> None:
    """The second machine's shim beside its own engine was refused as the first's twin for these
    (review of 2026-12-06): a false refusal takes an engine out, so any host not proven the same
    from every machine is qualified."""
    assert engine_id(url, None, "gpu-a~aaaaaaaaaaaa") != engine_id(url, None, "gpu-b~bbbbbbbbbbbb")
    assert "@gpu-a~aaaaaaaaaaaa:8000" in engine_id(url, None, "gpu-a~aaaaaaaaaaaa")


@pytest.mark.parametrize(
    "url",
    [
        "http://8.8.8.8:8000",
        "http://[2001:4860::8888]:8000",
        "http://vllm-0.vllm.ns.svc:8000",
        "http://gpu-3.example.com",
    ],
)
def test_a_global_address_or_a_dotted_name_is_one_engine_from_every_machine(url: str) -> None:
    assert engine_id(url, None, "gpu-a~aaaaaaaaaaaa") == engine_id(url, None, "gpu-b~bbbbbbbbbbbb")
    assert "@" not in engine_id(url, None, "gpu-a~aaaaaaaaaaaa")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("http://127.0.0.1:8000", None, "pod-a"), ("http://127.0.0.1:8000", None, "pod-b")),  # two pods' sidecars
        (("http://127.0.0.1:8000", None, "h"), ("http://127.0.0.1:8001", None, "h")),
        (("http://10.0.0.5:8000", 1, "h"), ("http://10.0.0.5:8000", 2, "h")),  # two data-parallel ranks
        (("http://10.0.0.5:8000", None, "h"), ("http://10.0.0.5:8000", 1, "h")),
        (("http://10.0.0.5:8000/a", None, "h"), ("http://10.0.0.5:8000/b", None, "h")),  # behind one proxy
    ],
)
def test_two_engines_are_two_identities(a: tuple[str, int | None, str], b: tuple[str, int | None, str]) -> None:
    assert engine_id(*a) != engine_id(*b)


def test_no_rank_and_rank_0_are_one_engine_and_a_remote_host_is_not_qualified() -> None:
    url = "http://engine-1.ns.svc:8000"
    assert engine_id(url, 0, "h") == engine_id(url, None, "h") == "engine-1.ns.svc:8000"
    assert engine_id("http://localhost:8000", 2, "pod-a") == "localhost@pod-a:8000#dp2"
    assert engine_id("http://[fe80::1]:8000", 1, "pod-a") == "[fe80::1]@pod-a:8000#dp1"


def test_machines_that_share_a_host_name_are_told_apart_by_their_machine_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machines cloned from one image may share a host name (even `localhost`): a shim on the
    second, beside its own engine at 127.0.0.1:8000, must not be refused as the first's twin."""
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu")
    ids = []
    for machine in ("3d1219c7c4c5404aaa1f6d2a48adfda4", "9f00aa11bb22cc33dd44ee55ff667788"):
        (tmp_path / "machine-id").write_text(machine + "\n")
        monkeypatch.setattr(engine_claim, "MACHINE_ID", str(tmp_path / "machine-id"))
        ids.append(next(iter(claim("ns", "http://127.0.0.1:8000", None, "w"))))
    assert ids == ["/ns/engines/localhost@gpu~3d1219c7c4c5:8000", "/ns/engines/localhost@gpu~9f00aa11bb22:8000"]
    monkeypatch.setattr(engine_claim, "MACHINE_ID", str(tmp_path / "none"))  # most containers have none
    assert this_host() == "gpu"


async def _workers(etcd_url: str, ns: str) -> list[str]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        kv = d.client.kv
        assert kv is not None
        prefix = subjects.workers_prefix(ns).encode()
        resp = await kv.get(prefix, prefix_range_end(prefix))
        return sorted(bytes(k.key)[len(prefix) :].decode() for k in resp.kvs)


async def test_a_second_shim_on_one_engine_fails_naming_engine_url_and_the_holder(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """The audit's case: two shims on one sim, --worker-name w1 and w2: both registered and were
    routed to, one engine counted as two workers."""
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url, worker_name="w1") as shim:
        await asyncio.wait_for(shim.registered.wait(), 20)
        url = sim.url.replace("127.0.0.1", "localhost") + "/"  # the same engine, spelled otherwise
        async with shim_for(sim, ns, nats_url, etcd_url, worker_name="w2", engine_url=url) as twin:
            await asyncio.wait_for(twin.done.wait(), 30)
            assert twin.status is ShimStatus.FAILED and isinstance(twin.failure, ConfigError)
            assert twin.failure.setting == "engine_url" and twin.failure.value == url
            said = str(twin.failure)
            assert "already served by worker w1" in said and sim.url in said and socket.gethostname() in said
            assert await _workers(etcd_url, ns) == ["w1"], "the twin never registered"
        assert shim.status is ShimStatus.REGISTERED and shim.failure is None


async def test_an_engine_held_by_a_crashed_shims_lease_is_claimed_once_that_lease_expires(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """A shim restarted within its old lease's TTL (killed without its stop) waits for the old
    claim to go, as a held --worker-name is waited for, rather than being locked out."""
    async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        lease = await d.grant(2)
        [(key, old)] = claim(ns, sim.url, None, "old-run").items()
        await d.create(key, encode_json(old), lease)
        await lease.stop_keep_alive()  # the holder crashed: nothing keeps its lease alive
        async with shim_for(sim, ns, nats_url, etcd_url) as shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            assert shim.failure is None and await d.holder(key) == shim.registration.lease.id  # type: ignore[union-attr]


async def test_health_says_registering_all_the_while_a_held_claim_is_waited_out_with_the_engine_up(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """Each read of the held claim before the session (WorkerShim._keys_free) went back through the
    wait for the engine, which set waiting_engine: /health said so between reads, of an engine up."""
    seen: list[ShimStatus] = []

    class Recorded(WorkerShim):
        def __setattr__(self, name: str, value: object) -> None:
            if name == "status":
                seen.append(value)  # type: ignore[arg-type]
            super().__setattr__(name, value)

    async with SimServer(sim_config()) as sim, Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        lease = await d.grant(2)
        [(key, old)] = claim(ns, sim.url, None, "old-run").items()
        await d.create(key, encode_json(old), lease)
        await lease.stop_keep_alive()  # a crashed holder's: it expires in 2 s
        shim = shim_for(sim, ns, nats_url, etcd_url)
        shim.__class__ = Recorded
        async with shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
    waited = seen[seen.index(ShimStatus.REGISTERING) : seen.index(ShimStatus.REGISTERED)]
    assert waited.count(ShimStatus.REGISTERING) > 3, seen  # read again and again, each health interval
    assert ShimStatus.WAITING_ENGINE not in waited, seen


async def test_each_data_parallel_rank_of_one_server_claims_its_own_engine(etcd_url: str, ns: str) -> None:
    """vLLM data parallelism serves every rank from one URL, a shim per rank: neither is refused,
    and a second shim of one rank is."""

    def registration(d: Discovery, rank: int, worker: str) -> Registration:
        return Registration(
            d,
            key=lambda _: subjects.worker_key(ns, worker),
            value=lambda _: WorkerInfo(worker=worker, model="m", role="agg", engine="vllm", block_size=16),
            name=worker,
            claims=lambda wid: claim(ns, "http://engine-1.ns.svc:8000", rank, wid),
        )

    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        first, second = registration(d, 1, "r1"), registration(d, 2, "r2")
        assert await first.start() == "r1" and await second.start() == "r2"
        with pytest.raises(KeyTaken) as taken:
            await registration(d, 2, "r2-twin").start()
        assert taken.value.key.endswith("engine-1.ns.svc:8000#dp2")
        assert taken.value.value == encode_json(
            EngineClaim(worker="r2", engine_url="http://engine-1.ns.svc:8000", host=socket.gethostname())
        )
        assert await _workers(etcd_url, ns) == ["r1", "r2"]
        await first.stop()
        await second.stop()


async def test_a_second_shim_on_an_engine_that_connects_to_its_shim_fails_on_the_claim_not_the_bind(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """The operator walkthrough's case: the engine connects to the shim's event address (no `*`, as
    `kvswitch up` sets it), so the second shim's bind met the first's socket and it exited 2 naming
    --kv-events-mode ('another process listens there ... Give --kv-events-mode connect'), advice
    that led to 'found no engine' and only then to the claim's error. The claim is read first."""
    port = free_ports(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    kv = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    async with SimServer(sim_config(kv_events=kv)) as sim:
        given: dict[str, Any] = {"kv_events": endpoint, "kv_replay": None, "kv_events_mode": "auto"}
        async with shim_for(sim, ns, nats_url, etcd_url, worker_name="w1", **given) as shim:
            await asyncio.wait_for(shim.registered.wait(), 20)
            async with shim_for(sim, ns, nats_url, etcd_url, worker_name="w2", **given) as twin:
                await asyncio.wait_for(twin.done.wait(), 30)
                assert isinstance(twin.failure, ConfigError) and twin.failure.setting == "engine_url", twin.failure
                assert "already served by worker w1" in str(twin.failure)
                assert twin.sessions == 0 and twin.registration_count == 0
            assert shim.status is ShimStatus.REGISTERED and shim.failure is None
