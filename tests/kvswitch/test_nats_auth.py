"""The generated NATS permissions, enforced by a real nats-server started with them."""

from __future__ import annotations

import asyncio
import json
import logging
import stat
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from discovery import Discovery
from kvswitch.cluster import ClusterSpec, LocalCluster
from kvswitch.nats_auth import RESPONSE_MAX, NatsAuthPlan, NatsIdentity
from kvswitch.servers import NatsServer
from protocol import ConfigError, KvEventBatch, Stored, encode_msg, subjects
from protocol.config import EtcdSettings, NatsSettings
from router.service import RouterConfig, RouterService
from runtime.nats_connect import connect as nats_connect
from runtime.nats_connect import error_reporter, refused_subscriptions
from runtime.nats_flush import flush

NS = "authns"
Connect = Callable[[str, str], Awaitable["Conn"]]


@pytest.fixture(scope="module")
def plan() -> NatsAuthPlan:
    return NatsAuthPlan.generate(NS, routers=["r0", "r1"], workers=["w1", "w2"])


@pytest.fixture(scope="module")
def server(plan: NatsAuthPlan) -> Iterator[NatsServer]:
    with NatsServer(authorization=plan.authorization_block()) as srv:
        yield srv


class Conn:
    """A client under one identity, with the server's errors (permission violations) queued."""

    def __init__(self, monitor_url: str = "") -> None:
        self.errors: asyncio.Queue[str] = asyncio.Queue()
        self.nc = Client()
        self.monitor_url = monitor_url  # the server's monitoring endpoint, for failure messages

    async def connect(self, url: str, seed_file: Path) -> Conn:
        async def on_error(exc: Exception) -> None:
            await self.errors.put(str(exc))

        await self.nc.connect(
            url, nkeys_seed=str(seed_file), error_cb=on_error, allow_reconnect=False, connect_timeout=10
        )
        return self

    async def violation(self) -> str:
        return await asyncio.wait_for(self.errors.get(), timeout=10)


@pytest.fixture
async def connect(plan: NatsAuthPlan, server: NatsServer, tmp_path: Path) -> AsyncIterator[Connect]:
    plan.write(tmp_path)
    conns: list[Conn] = []

    async def make(role: str, name: str) -> Conn:
        identity = plan.identity(role, name)  # type: ignore[arg-type]
        monitor = f"http://127.0.0.1:{server.monitor_port}"
        conn = await Conn(monitor).connect(server.url, tmp_path / identity.seed_file_name)
        conns.append(conn)
        return conn

    yield make
    for c in conns:
        await c.nc.close()


def _batch(worker: str, seq: int) -> bytes:
    return encode_msg(KvEventBatch(worker=worker, epoch=1, seq=seq, ts=0.0, events=[Stored(hashes=[7], parent=None)]))


async def _next(queue: asyncio.Queue[Msg], *conns: Conn) -> Msg:
    """The next message; on a timeout the error says what the server told each of `conns`."""
    try:
        return await asyncio.wait_for(queue.get(), timeout=5)
    except TimeoutError:
        said = [(c.nc.is_connected, [c.errors.get_nowait() for _ in range(c.errors.qsize())]) for c in conns]
        raise AssertionError(
            f"no message within 5 s; (connected, server errors) per connection: {said}; "
            f"the server's view: {_connz(conns[0].monitor_url) if conns else '-'}"
        ) from None


async def _until_delivered(publisher: Conn, subject: str, queue: asyncio.Queue[Msg]) -> None:
    """Publish probes until one reaches `queue`, then drain it. nats-server 2.15 can still drop a
    publish that follows a subscription on another connection whose flush (PING/PONG) has already
    returned: measured here, 1 in 10-50 runs, the server counting the publish in and delivering
    nothing, with no error to either side; 50 ms later it delivers. (A router's request carries a
    reply subject and so gets "no responders" in that window, which it treats as a failed leg.)"""

    # Stopped between probes, never cancelled: nats.py leaves a flush cancelled mid-way in its PONG
    # queue, and the PONG then ends the connection's read loop (InvalidStateError), so a later
    # server error (the permission violation under test) would never be read.
    delivered = asyncio.Event()

    async def probe() -> None:
        while not delivered.is_set():
            await publisher.nc.publish(subject, b"probe")
            await flush(publisher.nc)
            await asyncio.sleep(0.02)

    task = asyncio.create_task(probe())
    try:
        assert (await _next(queue, publisher)).data == b"probe"
    finally:
        delivered.set()
        await task


def _connz(monitor_url: str) -> list[dict[str, object]]:
    """Per client connection: its subscriptions and message counts, as the server counts them."""
    with urllib.request.urlopen(monitor_url + "/connz?subs=1", timeout=5) as resp:
        conns = json.load(resp).get("connections", [])
    keys = ("cid", "subscriptions_list", "in_msgs", "out_msgs", "pending_bytes")
    return [{k: c.get(k) for k in keys} for c in conns]


async def test_a_worker_publishing_another_workers_kv_subject_is_refused_and_never_reaches_routers(
    connect: Connect,
) -> None:
    make = connect
    router, w1, w2 = await make("router", "r0"), await make("worker", "w1"), await make("worker", "w2")
    seen: asyncio.Queue[Msg] = asyncio.Queue()
    await router.nc.subscribe(subjects.kv_all(NS), cb=seen.put)
    await flush(router.nc)
    await _until_delivered(w1, subjects.kv(NS, "w1"), seen)

    await w1.nc.publish(subjects.kv(NS, "w2"), _batch("w2", 1))  # forged: w1 speaking for w2
    assert "permissions violation for publish" in (await w1.violation()).lower()
    await w1.nc.publish(subjects.kv(NS, "w1"), _batch("w1", 1))  # after the forgery, on the same connection
    await w2.nc.publish(subjects.kv(NS, "w2"), _batch("w2", 1))

    got: list[str] = []
    while len(got) < 2:
        msg = await _next(seen)
        if msg.data != b"probe":  # a probe may still be on its way
            got.append(msg.subject)
    assert sorted(got) == [subjects.kv(NS, "w1"), subjects.kv(NS, "w2")]
    await asyncio.sleep(0.2)
    assert all(seen.get_nowait().data == b"probe" for _ in range(seen.qsize()))


async def test_a_worker_reads_only_its_own_requests(connect: Connect) -> None:
    make = connect
    router, w1, w2 = await make("router", "r0"), await make("worker", "w1"), await make("worker", "w2")
    stolen: asyncio.Queue[Msg] = asyncio.Queue()
    own: asyncio.Queue[Msg] = asyncio.Queue()
    await w1.nc.subscribe(subjects.gen(NS, "decode", "w2"), cb=stolen.put)
    assert "permissions violation for subscription" in (await w1.violation()).lower()
    await w1.nc.subscribe(f"{NS}.gen.>", cb=stolen.put)
    assert "permissions violation for subscription" in (await w1.violation()).lower()
    await w2.nc.subscribe(subjects.gen(NS, "decode", "w2"), cb=own.put)
    await flush(w2.nc)
    await _until_delivered(router, subjects.gen(NS, "decode", "w2"), own)

    await router.nc.publish(subjects.gen(NS, "decode", "w2"), b"prompt")
    got = (await _next(own, router, w2)).data
    while got == b"probe":  # one still on its way when the probes stopped
        got = (await _next(own, router, w2)).data
    assert got == b"prompt"
    await asyncio.sleep(0.2)
    assert stolen.empty()


async def test_a_worker_cannot_publish_to_an_inbox_it_was_not_sent(connect: Connect) -> None:
    make = connect
    router, w1 = await make("router", "r0"), await make("worker", "w1")
    inbox: asyncio.Queue[Msg] = asyncio.Queue()
    await router.nc.subscribe("_INBOX.r0.>", cb=inbox.put)
    await flush(router.nc)
    await w1.nc.publish("_INBOX.r0.forged", b"forged chunk")
    assert "permissions violation for publish" in (await w1.violation()).lower()
    await asyncio.sleep(0.2)
    assert inbox.empty()


async def test_the_router_user_does_what_a_router_does(connect: Connect) -> None:
    make = connect
    r0, r1, w1 = await make("router", "r0"), await make("router", "r1"), await make("worker", "w1")
    chunks = 50

    async def serve(msg: Msg) -> None:
        for i in range(chunks):  # a streamed response: many messages to one reply subject
            await w1.nc.publish(msg.reply, str(i).encode())

    for subject in (subjects.gen(NS, "decode", "w1"), subjects.kvstate(NS, "w1")):
        await w1.nc.subscribe(subject, cb=serve)
    cancels: asyncio.Queue[Msg] = asyncio.Queue()
    await w1.nc.subscribe(subjects.cancel(NS, "w1"), cb=cancels.put)
    synced: asyncio.Queue[Msg] = asyncio.Queue()
    await r1.nc.subscribe(subjects.sync(NS), cb=synced.put)
    loads: asyncio.Queue[Msg] = asyncio.Queue()
    await r0.nc.subscribe(subjects.load_all(NS), cb=loads.put)
    await flush(w1.nc)
    await flush(r1.nc)

    for subject in (subjects.gen(NS, "decode", "w1"), subjects.kvstate(NS, "w1")):
        replies: asyncio.Queue[Msg] = asyncio.Queue()
        inbox = r0.nc.new_inbox()
        await r0.nc.subscribe(inbox, cb=replies.put)
        await r0.nc.publish(subject, b"request", reply=inbox)
        assert [int((await _next(replies)).data) for _ in range(chunks)] == list(range(chunks))
    await r0.nc.publish(subjects.cancel(NS, "w1"), b"req-1")
    assert (await _next(cancels)).data == b"req-1"
    await r0.nc.publish(subjects.sync(NS), b"booking")
    assert (await _next(synced)).data == b"booking"
    await w1.nc.publish(subjects.load(NS, "w1"), b"load")
    assert (await _next(loads)).subject == subjects.load(NS, "w1")

    await r0.nc.publish(subjects.kv(NS, "w1"), _batch("w1", 9))  # a router cannot speak for a worker
    assert "permissions violation for publish" in (await r0.violation()).lower()
    assert r0.errors.empty() and r1.errors.empty() and w1.errors.empty()


async def test_a_client_without_credentials_cannot_connect_so_cannot_read_gen(server: NatsServer) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)


async def test_a_client_with_an_unknown_key_is_refused(server: NatsServer, tmp_path: Path) -> None:
    stranger = NatsIdentity.create("w1", "worker")  # the right name, a key the server never saw
    seed = tmp_path / "stranger.nk"
    seed.write_text(stranger.seed)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(server.url, nkeys_seed=str(seed), allow_reconnect=False, max_reconnect_attempts=0)


def test_the_config_holds_public_keys_only_and_seeds_are_private(plan: NatsAuthPlan, tmp_path: Path) -> None:
    written = plan.write(tmp_path)
    conf = (tmp_path / "nats-auth.conf").read_text()
    for identity in plan.identities:
        assert identity.public_key.startswith("U") and identity.public_key in conf
        assert identity.seed not in conf
        seed_file = tmp_path / identity.seed_file_name
        assert seed_file in written
        assert stat.S_IMODE(seed_file.stat().st_mode) == 0o600
    assert f'"max": {RESPONSE_MAX}' in conf and '"expires": "900s"' in conf


def test_regenerating_keeps_existing_seeds_and_adds_new_workers(plan: NatsAuthPlan, tmp_path: Path) -> None:
    plan.write(tmp_path)
    again = NatsAuthPlan.generate(NS, routers=["r0", "r1"], workers=["w1", "w2", "w3"], seeds_dir=tmp_path)
    for identity in plan.identities:
        assert again.identity(identity.role, identity.name).seed == identity.seed
    assert again.identity("worker", "w3").seed not in {i.seed for i in plan.identities}


@pytest.mark.parametrize(
    ("routers", "workers", "message"),
    [
        (["r0"], ["bad.name"], "must match"),
        (["r0"], ["w1", "w1"], "given twice"),
        (["r*"], [], "must match"),
    ],
)
def test_bad_names_are_refused(routers: list[str], workers: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NatsAuthPlan.generate(NS, routers=routers, workers=workers)


def _index_entries(router_url: str) -> float:
    with urllib.request.urlopen(router_url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return float(next(x for x in lines if x.startswith("kvswitch_router_index_entries")).rsplit(" ", 1)[1])


def _probed_blocks(router_url: str, sim_urls: list[str], timeout: float = 20.0) -> float:
    """The router's index entries once each shim's endpoint probe (worker_shim.endpoint_probe: one
    request on its engine as the event socket connects, one block) is served and indexed: every
    engine served a request and holds one block per request served, and the index holds them all."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for sim in sim_urls:
            with urllib.request.urlopen(sim + "/sim/state?canonical=1", timeout=5) as resp:
                states.append(json.loads(resp.read()))
        blocks = [len(st["cached_canonical_hashes"]) for st in states]
        served = [st["faults"]["requests_seen"] for st in states]
        entries = _index_entries(router_url)
        if all(n >= 1 for n in served) and blocks == served and entries == sum(blocks):
            return entries
        assert time.monotonic() < deadline, f"probes not settled: served {served}, blocks {blocks}, index {entries}"
        time.sleep(0.05)


def _complete(router_url: str) -> int:
    body = json.dumps({"model": "sim-llama", "prompt": list(range(300, 364)), "max_tokens": 2}).encode()
    request = urllib.request.Request(
        router_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return int(resp.status)


async def _forge(url: str, seed: Path) -> str:
    forger = await Conn().connect(url, seed)
    try:
        await forger.nc.publish(subjects.kv(NS, "agg-1"), _batch("agg-1", 10**6))
        return await forger.violation()
    finally:
        await forger.nc.close()


def test_a_whole_cluster_serves_under_permissions_and_a_forged_batch_leaves_the_index_alone() -> None:
    spec = ClusterSpec(namespace=NS, agg=2, routers=1, speedup=20.0, nats_auth=True, etcd_auth=True)
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(timeout=60)
        url = cluster.router_urls[0]
        probed = _probed_blocks(url, cluster.sim_urls)
        assert _complete(url) == 200
        deadline = time.monotonic() + 20
        while _index_entries(url) < probed + 4 and time.monotonic() < deadline:  # the prompt's 4 blocks, by KV events
            time.sleep(0.05)
        before = _index_entries(url)
        assert before == probed + 4
        assert cluster.secrets_dir is not None and cluster.nats is not None
        seed = cluster.secrets_dir / "worker-agg-0.nk"
        assert "permissions violation for publish" in asyncio.run(_forge(cluster.nats.urls[0], seed)).lower()
        time.sleep(1.0)
        assert _index_entries(url) == before
    finally:
        cluster.stop()


async def test_a_refused_subscription_is_recorded_and_its_warning_names_the_identity_flags(
    plan: NatsAuthPlan, server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-py passes a refused SUB to error_cb only; it said "check --nats-servers and the server"."""
    plan.write(tmp_path)
    settings = NatsSettings(
        servers=[server.url], nkey_file=str(tmp_path / plan.identity("worker", "w1").seed_file_name)
    )
    log = logging.getLogger("test.nats")
    errors = error_reporter(log, settings.shown_servers(), settings.credential_flags(), "--worker-name and --namespace")
    nc = await nats_connect(**settings.connect_options("test"), error_cb=errors)
    try:
        with caplog.at_level(logging.WARNING, "test.nats"):
            await nc.subscribe(subjects.gen(NS, "decode", "w1"))
            await nc.subscribe(subjects.gen(NS, "decode", "w2"))  # another worker's
            await flush(nc)
        assert refused_subscriptions(nc) == {subjects.gen(NS, "decode", "w2")}
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "permissions violation for subscription" in said[0], said
        assert "--nats-nkey-file" in said[0] and "--worker-name and --namespace" in said[0], said
        assert "--nats-servers" not in said[0], said
    finally:
        await nc.close()


async def test_a_reply_past_its_response_ttl_names_response_ttl_not_the_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream that outlives allow_responses' expiry: nats-server refuses its next chunk's publish to
    the router's inbox. Said once, naming --response-ttl and --request-timeout; it said "check that
    the credentials (--nats-nkey-file) are this process's own", at every expiry (security audit,
    2026-12-07). Another worker's subject still gets the credentials hint."""
    plan = NatsAuthPlan.generate(NS, routers=["r0"], workers=["w1"], response_ttl_s=1)
    plan.write(tmp_path)
    with NatsServer(authorization=plan.authorization_block()) as srv:
        router = await Conn().connect(srv.url, tmp_path / plan.identity("router", "r0").seed_file_name)
        settings = NatsSettings(
            servers=[srv.url], nkey_file=str(tmp_path / plan.identity("worker", "w1").seed_file_name)
        )
        log = logging.getLogger("test.nats.ttl")
        errors = error_reporter(
            log, settings.shown_servers(), settings.credential_flags(), "--worker-name and --namespace"
        )
        worker = await nats_connect(**settings.connect_options("test"), error_cb=errors)
        requests: asyncio.Queue[Msg] = asyncio.Queue()

        async def take(msg: Msg) -> None:
            await requests.put(msg)

        try:
            await worker.subscribe(subjects.gen(NS, "agg", "w1"), cb=take)
            await flush(worker)
            inbox = router.nc.new_inbox()
            replies = await router.nc.subscribe(inbox)
            await router.nc.publish(subjects.gen(NS, "agg", "w1"), b"go", reply=inbox)
            msg = await asyncio.wait_for(requests.get(), 10)
            with caplog.at_level(logging.WARNING, "test.nats.ttl"):
                await worker.publish(msg.reply, b"chunk 1")  # within the TTL: delivered
                assert (await replies.next_msg(timeout=10)).data == b"chunk 1"
                await asyncio.sleep(1.5)
                for i in range(3):  # past it: refused, each
                    await worker.publish(msg.reply, f"chunk {i + 2}".encode())
                await flush(worker)
                await worker.publish(subjects.kv(NS, "w2"), b"forged")  # not its own: its credentials
                await flush(worker)
            said = [r.getMessage() for r in caplog.records]
            late = [m for m in said if "_inbox." in m]
            assert len(late) == 1, said
            assert "reply permission expired" in late[0] and "--response-ttl" in late[0], late
            assert "--request-timeout" in late[0] and "--nats-nkey-file" not in late[0], late
            forged = [m for m in said if subjects.kv(NS, "w2") in m]
            assert len(forged) == 1 and "--nats-nkey-file" in forged[0] and "--response-ttl" not in forged[0], said
        finally:
            await worker.close()
            await router.nc.close()


async def test_a_router_with_a_workers_identity_refuses_to_start(
    plan: NatsAuthPlan, server: NatsServer, etcd_url: str, tmp_path: Path
) -> None:
    plan.write(tmp_path)
    seed = tmp_path / plan.identity("worker", "w1").seed_file_name
    config = RouterConfig(
        ns=NS, nats=NatsSettings(servers=[server.url], nkey_file=str(seed)), etcd=EtcdSettings(endpoints=[etcd_url])
    )
    router = RouterService(config)
    with pytest.raises(ConfigError, match="NATS refuses this identity the subscription to ") as err:
        await asyncio.wait_for(router.start(), 30)
    assert err.value.setting == "namespace" and "--nats-nkey-file" in str(err.value)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), NS) as d:  # its registration is revoked
        assert await d.holder(subjects.router_key(NS, router.router_id)) is None


def test_a_shim_whose_worker_name_is_not_its_identitys_exits_2_before_registering(tmp_path: Path) -> None:
    """Its nkey is agg-0's, its --worker-name agg-7 (the last flag wins): it registered, said
    /health 200 "serving", and no request could ever reach it, with one WARNING blaming
    --nats-servers."""
    spec = ClusterSpec(
        namespace=NS, agg=1, speedup=20.0, nats_auth=True, shim_args=["--worker-name", "agg-7"], log_dir=tmp_path
    )
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        shim = next(c for c in cluster.children if c.kind == "shim")
        try:
            status = shim.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            status = None
        said = shim.log.read_text()
        assert status == 2, said[-3000:]
        assert "invalid worker_name (--worker-name, KVSWITCH_WORKER_NAME) = 'agg-7'" in said, said[-3000:]
        assert "NATS refuses this identity the subscription to authns." in said and "--nats-nkey-file" in said
        assert "registered worker" not in said and "registered /" not in said, said[-3000:]
        assert cluster.etcd is not None
        etcd = EtcdSettings(endpoints=cluster.etcd.urls)

        async def holder() -> int | None:
            async with Discovery(etcd, NS) as d:
                return await d.holder(subjects.worker_key(NS, "agg-7"))

        assert asyncio.run(holder()) is None
    finally:
        cluster.stop()
