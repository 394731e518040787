"""TLS on NATS and etcd, with certificates made in the test (trustme), against real servers."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import trustme

from discovery import Discovery, DiscoveryError
from kvswitch.certs import write_tls
from kvswitch.cluster import ClusterSpec, LocalCluster
from kvswitch.etcd_auth import enable_auth, namespace_users
from kvswitch.servers import EtcdServer, NatsServer, TlsFiles
from protocol import ConfigError, WorkerInfo
from protocol.config import EtcdSettings, NatsSettings
from router.service import RouterConfig, RouterService
from runtime.nats_connect import TlsNotOffered
from runtime.nats_connect import connect as nats_connect
from tests.runtime.recording_proxy import recording_proxy
from worker_shim.nats_connect import connect_nats


def _tls_files(ca: trustme.CA, out: Path) -> TlsFiles:
    leaf = ca.issue_cert("127.0.0.1", "localhost", common_name="kvswitch-test")  # etcd pins peers to it
    files = TlsFiles(out / "ca.pem", out / "tls.crt", out / "tls.key")
    ca.cert_pem.write_to_path(str(files.ca))
    leaf.cert_chain_pems[0].write_to_path(str(files.cert))
    leaf.private_key_pem.write_to_path(str(files.key))
    return files


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return _tls_files(trustme.CA(), tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("other") / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return path


@pytest.fixture(scope="module")
def nats_tls(tls: TlsFiles) -> Iterator[NatsServer]:
    with NatsServer(tls=tls) as server:
        yield server


@pytest.fixture(scope="module")
def etcd_tls(tls: TlsFiles) -> Iterator[EtcdServer]:
    with EtcdServer(tls=tls, peer_tls=tls) as server:
        enable_auth(
            server.url, "root-pw", namespace_users("tlsns", "router-pw", "worker-pw"), context=tls.client_context()
        )
        yield server


async def test_nats_client_with_the_ca_connects_through_connect_options(nats_tls: NatsServer, tls: TlsFiles) -> None:
    assert nats_tls.url.startswith("tls://")
    settings = NatsSettings(servers=[nats_tls.url], tls_ca=str(tls.ca)).validate()
    nc = await nats.connect(**settings.connect_options("test"), allow_reconnect=False)
    try:
        sub = await nc.subscribe("x")
        await nc.publish("x", b"over tls")
        assert (await sub.next_msg(timeout=5)).data == b"over tls"
    finally:
        await nc.close()


@pytest.mark.parametrize("which_ca", ["none", "other"])
async def test_nats_client_without_the_ca_fails_naming_the_certificate(
    nats_tls: NatsServer, other_ca: Path, which_ca: str
) -> None:
    settings = NatsSettings(servers=[nats_tls.url], tls_ca=str(other_ca) if which_ca == "other" else None)
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        await nats.connect(**settings.connect_options("test"), allow_reconnect=False)


@pytest.fixture(scope="module")
def nats_plain_with_password() -> Iterator[NatsServer]:
    with NatsServer(authorization='authorization { user: app, password: "s3cret-pw" }') as server:
        yield server


@pytest.mark.parametrize("asked_by", ["tls_ca", "tls_scheme"])
async def test_a_server_that_does_not_ask_for_tls_is_sent_nothing(
    nats_plain_with_password: NatsServer, tls: TlsFiles, asked_by: str
) -> None:
    # nats-py upgrades only when the server's INFO asks; alone it sent this CONNECT, password and
    # all, in the clear to a server (or an impostor) that did not.
    sent = bytearray()
    proxy = await recording_proxy(nats_plain_with_password.port, sent)
    port = proxy.sockets[0].getsockname()[1]
    scheme, ca = ("nats", str(tls.ca)) if asked_by == "tls_ca" else ("tls", None)
    settings = NatsSettings(servers=[f"{scheme}://127.0.0.1:{port}"], user="app", password="s3cret-pw", tls_ca=ca)
    try:
        with pytest.raises(TlsNotOffered, match=r"did not ask for TLS.*nothing was sent"):
            await nats_connect(**settings.connect_options("test"), allow_reconnect=False)
    finally:
        proxy.close()
        await proxy.wait_closed()
    assert b"CONNECT" not in sent and b"s3cret-pw" not in sent, bytes(sent)


async def test_the_router_and_the_shim_refuse_a_server_that_does_not_ask_for_tls(
    nats_plain_with_password: NatsServer, tls: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    settings = NatsSettings(
        servers=[nats_plain_with_password.url], user="app", password="s3cret-pw", tls_ca=str(tls.ca)
    )
    router = RouterService(RouterConfig(nats=settings))
    for name, start in (("router", router.start()), ("shim", connect_nats(settings, "test"))):
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(TimeoutError):
            await asyncio.wait_for(start, 3)  # they keep retrying, saying why
        assert any("did not ask for TLS" in r.getMessage() for r in caplog.records), name


def _info(worker: str) -> WorkerInfo:
    return WorkerInfo(
        worker=worker, model="m", role="decode", engine="vllm", block_size=16, kv_total_blocks=100,
        max_num_batched_tokens=8192, kv_bytes_per_token=1, epoch=1, version="test",
    )  # fmt: skip


async def test_discovery_with_the_ca_and_a_user_registers(etcd_tls: EtcdServer, tls: TlsFiles) -> None:
    settings = EtcdSettings(endpoints=[etcd_tls.url], tls_ca=str(tls.ca), user="worker", password="worker-pw")
    async with Discovery(settings.validate(), "tlsns") as d:
        lease = await d.register_worker(_info)
    router = EtcdSettings(endpoints=[etcd_tls.url], tls_ca=str(tls.ca), user="router", password="router-pw")
    async with Discovery(router, "tlsns") as d:
        async for event in d.watch_workers():
            assert event is not None  # the snapshot arrives: the router may read the workers
            break
    assert lease.hex_id


async def test_discovery_without_tls_fails_clearly(etcd_tls: EtcdServer) -> None:
    endpoint = etcd_tls.url.replace("https://", "http://")
    settings = EtcdSettings(endpoints=[endpoint], user="worker", password="worker-pw")
    with pytest.raises(DiscoveryError, match=f"etcd at {endpoint} is not reachable"):
        await Discovery(settings, "tlsns").connect(timeout=3)


async def test_discovery_with_another_ca_names_the_ca_flag(etcd_tls: EtcdServer, other_ca: Path) -> None:
    """It was a DiscoveryError blaming --etcd-endpoints, the one setting that was right (exit 1)."""
    settings = EtcdSettings(endpoints=[etcd_tls.url], tls_ca=str(other_ca), user="worker", password="worker-pw")
    with pytest.raises(ConfigError) as caught:
        await Discovery(settings, "tlsns").connect(timeout=3)
    assert caught.value.setting == "etcd_tls_ca", caught.value
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value) and "give the CA that signed its" in str(caught.value)


async def test_nats_with_another_ca_names_the_ca_flag(
    nats_tls: NatsServer, other_ca: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The router and the shim retry, saying "check --nats-tls-ca"; it was "check --nats-servers"."""
    settings = NatsSettings(servers=[nats_tls.url], tls_ca=str(other_ca))
    router = RouterService(RouterConfig(nats=settings))
    for name, start in (("router", router.start()), ("shim", connect_nats(settings, "test"))):
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(TimeoutError):
            await asyncio.wait_for(start, 2)
        said = [r.getMessage() for r in caplog.records if "SSLCertVerificationError" in r.getMessage()]
        assert said and all("does not verify: check --nats-tls-ca" in s for s in said), (name, said)


def test_etcd_health_needs_the_ca(etcd_tls: EtcdServer, tls: TlsFiles) -> None:
    with urllib.request.urlopen(f"{etcd_tls.url}/health", timeout=2, context=tls.client_context()) as resp:
        assert json.loads(resp.read())["health"] == "true"
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"{etcd_tls.url}/health", timeout=2, context=ssl.create_default_context())


def test_a_request_succeeds_end_to_end_over_tls_with_etcd_auth(tmp_path: Path) -> None:
    tls = write_tls(tmp_path, ["127.0.0.1", "localhost"])
    cluster = LocalCluster(ClusterSpec(agg=1, routers=1, speedup=20.0, tls=tls, etcd_auth=True))
    try:
        cluster.start()
        cluster.wait_ready(timeout=60)
        assert all(u.startswith("tls://") for u in cluster.nats.urls)  # type: ignore[union-attr]
        assert all(u.startswith("https://") for u in cluster.etcd.urls)  # type: ignore[union-attr]
        body = json.dumps({"model": "sim-llama", "prompt": list(range(300, 340)), "max_tokens": 4}).encode()
        request = urllib.request.Request(
            cluster.router_urls[0] + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop()
