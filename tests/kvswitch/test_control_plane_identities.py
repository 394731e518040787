"""One identity per purpose (kvswitch.certs): against real nats-server and etcd, a NATS cluster
member takes as a route only its route identity, and an etcd member as a peer only its peer identity.

Until 2026-12-07 one certificate served NATS, etcd, routes and peers, and nats-server takes any
certificate its CA signed as a route (routes are under no client authorization): a rogue
nats-server holding the etcd Secret's key joined the cluster and read every subject."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from kvswitch.certs import ETCD_PEER_NAME, NATS_ROUTE_NAME, KeptCertificateError, write_tls
from kvswitch.servers import (
    ControlPlaneTls,
    EtcdCluster,
    EtcdServer,
    NatsCluster,
    NatsServer,
    ServerError,
    TlsFiles,
    free_ports,
)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> ControlPlaneTls:
    return write_tls(tmp_path_factory.mktemp("tls"), ["127.0.0.1", "localhost"])


@pytest.fixture(scope="module")
def one_ca(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    """Leaves of one CA (a PKI of your own with one issuer) named for a route, a peer and a stranger."""
    ca, out = trustme.CA(), tmp_path_factory.mktemp("one-ca")
    ca.cert_pem.write_to_path(str(out / "ca.pem"))
    leaves = {}
    for name in (NATS_ROUTE_NAME, ETCD_PEER_NAME, "kvswitch-client"):
        leaf = ca.issue_cert("127.0.0.1", "localhost", common_name=name)
        files = leaves[name] = TlsFiles(out / "ca.pem", out / f"{name}.crt", out / f"{name}.key")
        leaf.cert_chain_pems[0].write_to_path(str(files.cert))
        leaf.private_key_pem.write_to_path(str(files.key))
    return leaves


POOLED = [4, 4]  # two members' routes to each other: nats-server's pool of 3 and the system account's


def _stolen(route_ca: Path, cert: TlsFiles) -> TlsFiles:
    """A rogue's route identity: another purpose's key, trusting the members' route CA (public), so
    only the members' own check can refuse it."""
    return TlsFiles(route_ca, cert.cert, cert.key)


def _rogue_routes(member: NatsServer, identity: TlsFiles, client_tls: TlsFiles) -> tuple[int, str]:
    """A rogue nats-server routing to `member` with `identity`, alone in its config (no
    authorization): its routes once `member` answered it, and what both logged meanwhile."""
    rogue = NatsServer(
        tls=client_tls,
        cluster_port=free_ports(1),
        routes=[member.cluster_port or 0],
        route_tls=identity,
        server_name="rogue",
    )
    seen = len(member.log_path.read_bytes())

    def logs() -> str:
        return member.log_path.read_bytes()[seen:].decode(errors="replace") + rogue.log_path.read_text(errors="replace")

    with rogue:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not rogue.route_count():
            if "TLS route handshake error" in logs() or "Authorization Violation" in logs():
                break
            time.sleep(0.05)
        time.sleep(0.3)  # a route accepted shows in routez a moment after its handshake
        return rogue.route_count(), logs()


@pytest.fixture(scope="module")
def nats_cluster(tls: ControlPlaneTls) -> Iterator[NatsCluster]:
    with NatsCluster(2, tls=tls.nats, route_tls=tls.nats_route).start() as cluster:
        # healthy comes before the members' pooled routes are all up: a test reading the counts
        # first read [3, 3] once in a full run
        deadline = time.monotonic() + 10
        while [n.route_count() for n in cluster.nodes] != POOLED and time.monotonic() < deadline:
            time.sleep(0.05)
        yield cluster


@pytest.fixture(scope="module")
def pinned_cluster(tls: ControlPlaneTls, one_ca: dict[str, TlsFiles]) -> Iterator[NatsCluster]:
    with NatsCluster(2, tls=tls.nats, route_tls=one_ca[NATS_ROUTE_NAME]).start() as cluster:
        yield cluster


def test_the_route_identity_still_joins(nats_cluster: NatsCluster, tls: ControlPlaneTls) -> None:
    # the control for the refusals below: the same rogue config with the route identity routes
    routes, log = _rogue_routes(nats_cluster.nodes[0], tls.nats_route, tls.nats)
    assert routes > 0, log


@pytest.mark.parametrize("purpose", ["etcd", "etcd_peer", "nats"])
def test_a_nats_member_refuses_a_route_with_another_purposes_key(
    nats_cluster: NatsCluster, tls: ControlPlaneTls, purpose: str
) -> None:
    # the etcd Secret's keys, and the key NATS shows its clients: none is signed by the route CA
    routes, log = _rogue_routes(nats_cluster.nodes[0], _stolen(tls.nats_route.ca, getattr(tls, purpose)), tls.nats)
    assert routes == 0 and "TLS route handshake error" in log, log
    assert [n.route_count() for n in nats_cluster.nodes] == POOLED  # each other's pooled routes only


@pytest.mark.parametrize("name", [ETCD_PEER_NAME, "kvswitch-client"])
def test_a_nats_member_refuses_a_route_its_ca_signed_for_another_name(
    pinned_cluster: NatsCluster, tls: ControlPlaneTls, one_ca: dict[str, TlsFiles], name: str
) -> None:
    # one CA for everything: the route authorization (verify_and_map on the route's subject) refuses
    routes, log = _rogue_routes(pinned_cluster.nodes[0], one_ca[name], tls.nats)
    assert routes == 0 and "Authorization Violation" in log, log


def test_a_tls_cluster_member_without_a_route_identity_is_refused(tls: ControlPlaneTls) -> None:
    with pytest.raises(ServerError, match="needs route_tls"):
        NatsServer(tls=tls.nats, cluster_port=free_ports(1))
    with pytest.raises(ServerError, match="needs peer_tls"):
        EtcdServer(tls=tls.etcd)


def _peer_get(member: EtcdServer, identity: TlsFiles, trust: Path) -> int | str:
    """GET the member's peer /members as `identity`: the status, or why the handshake failed."""
    context = ssl.create_default_context(cafile=str(trust))
    context.load_cert_chain(str(identity.cert), str(identity.key))
    try:
        with urllib.request.urlopen(f"{member.peer_url}/members", context=context, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.URLError as exc:
        return f"refused: {exc.reason}"
    except (ssl.SSLError, ConnectionError) as exc:  # the alert can come after the handshake (TLS 1.3)
        return f"refused: {exc}"


@pytest.fixture(scope="module")
def etcd_member(tls: ControlPlaneTls) -> Iterator[EtcdServer]:
    # two members: the peer identity, pinned, still forms a cluster
    with EtcdCluster(2, tls=tls.etcd, peer_tls=tls.etcd_peer) as cluster:
        yield cluster.members[0]


@pytest.mark.parametrize("purpose", ["etcd_peer", "nats_route", "nats", "etcd"])
def test_an_etcd_member_takes_only_its_peer_identity_as_a_peer(
    etcd_member: EtcdServer, tls: ControlPlaneTls, purpose: str
) -> None:
    got = _peer_get(etcd_member, getattr(tls, purpose), tls.etcd_peer.ca)
    if purpose == "etcd_peer":
        assert got == 200
    else:
        assert isinstance(got, str) and got.startswith("refused"), got


def test_an_etcd_member_refuses_a_peer_its_ca_signed_for_another_name(one_ca: dict[str, TlsFiles]) -> None:
    peer = one_ca[ETCD_PEER_NAME]
    with EtcdServer(tls=peer, peer_tls=peer) as member:
        assert _peer_get(member, peer, peer.ca) == 200
        got = _peer_get(member, one_ca[NATS_ROUTE_NAME], peer.ca)
        assert isinstance(got, str) and got.startswith("refused"), got


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_each_purpose_has_its_own_key_and_routes_and_peers_their_own_ca(tls: ControlPlaneTls) -> None:
    leaves = [tls.nats, tls.nats_route, tls.etcd, tls.etcd_peer]
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    keys = {_cert(f.cert).public_key().public_bytes(der, spki) for f in leaves}
    assert len(keys) == 4
    assert len({tls.ca.read_bytes(), tls.nats_route.ca.read_bytes(), tls.etcd_peer.ca.read_bytes()}) == 3
    assert tls.nats.ca == tls.etcd.ca == tls.ca
    for files, cn, client_auth in [
        (tls.nats, "kvswitch-nats", False),
        (tls.etcd, "kvswitch-etcd", False),
        (tls.nats_route, NATS_ROUTE_NAME, True),
        (tls.etcd_peer, ETCD_PEER_NAME, True),
    ]:
        cert = _cert(files.cert)
        assert cert.issuer == _cert(files.ca).subject and files.common_name() == cn
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert (ExtendedKeyUsageOID.CLIENT_AUTH in usages) is client_auth
        assert oct(files.key.stat().st_mode & 0o777) == "0o600"


def test_the_one_shared_certificate_of_an_older_release_is_refused_not_reused(tmp_path: Path) -> None:
    old = tmp_path / "tls"
    old.mkdir()
    for name in ("ca.pem", "tls.crt", "tls.key"):
        (old / name).write_text(f"old {name}\n")
    with pytest.raises(KeptCertificateError, match=r"tls\.crt and tls\.key, the one certificate for NATS and etcd"):
        write_tls(old, ["nats"])
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "secrets", "--out", str(tmp_path), "--tls-hosts", "nats"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.startswith("kvswitch secrets: --tls-hosts: "), out.stderr
    assert f"delete {old} to issue new CAs" in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in old.iterdir()) == ["ca.pem", "tls.crt", "tls.key"]
    assert (old / "ca.pem").read_text() == "old ca.pem\n"
