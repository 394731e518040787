"""`kvswitch secrets` and what it writes, used by real servers: certificates that nats-server and
etcd serve and clients verify, and etcd users scoped to their prefixes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from etcd3aio import Etcd3Client

from discovery import Discovery
from kvswitch.certs import certificate_hosts, write_tls
from kvswitch.servers import EtcdServer, NatsServer, find_nats_server, free_port
from protocol.config import EtcdSettings, NatsSettings


def _secrets(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvswitch", "secrets", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_a_rerun_keeps_seeds_and_certificates_and_adds_new_workers(tmp_path: Path) -> None:
    first = _secrets("--out", str(tmp_path), "--routers", "r0", "--workers", "w0", "--tls-hosts", "nats,127.0.0.1")
    assert first.returncode == 0, first.stderr
    seed, ca = (tmp_path / "worker-w0.nk").read_text(), (tmp_path / "tls" / "ca.pem").read_bytes()
    again = _secrets("--out", str(tmp_path), "--routers", "r0", "--workers", "w0,w1", "--tls-hosts", "nats")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "worker-w0.nk").read_text() == seed
    assert (tmp_path / "tls" / "ca.pem").read_bytes() == ca
    assert (tmp_path / "worker-w1.nk").is_file()


def test_a_bad_worker_name_is_refused_naming_it(tmp_path: Path) -> None:
    out = _secrets("--out", str(tmp_path), "--workers", "decode.0")
    assert out.returncode == 2 and "'decode.0' must match" in out.stderr
    assert not (tmp_path / "nats-auth.conf").exists()


def test_files_need_an_out_directory() -> None:
    out = _secrets("--workers", "w0")
    assert out.returncode == 2 and "need --out DIR" in out.stderr


@pytest.mark.parametrize("ca", ["missing.pem", "not-a-ca.pem", "."])
def test_an_etcd_ca_it_cannot_read_is_one_line_naming_the_flag(ca: str, tmp_path: Path) -> None:
    # It was a traceback (FileNotFoundError, ssl.SSLError), and only after the other files were written.
    (tmp_path / "not-a-ca.pem").write_text("not a certificate\n")
    path = str(tmp_path / ca)
    env = {**os.environ, "KVSWITCH_ETCD_ROOT_PASSWORD": "r", "KVSWITCH_ETCD_ROUTER_PASSWORD": "rt"}
    env["KVSWITCH_ETCD_WORKER_PASSWORD"] = "w"
    args = ("--out", str(tmp_path / "out"), "--api-keys", "1", "--etcd-endpoint", "http://127.0.0.1:9")
    out = _secrets(*args, "--etcd-ca", path, env=env)
    assert out.returncode == 2 and out.stderr.startswith(f"kvswitch secrets: --etcd-ca {path}: "), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()


async def test_generated_certificates_serve_nats_and_etcd(tmp_path: Path) -> None:
    tls = write_tls(tmp_path, ["127.0.0.1", "localhost"])
    with NatsServer(tls=tls.nats) as server, EtcdServer(tls=tls.etcd, peer_tls=tls.etcd_peer) as etcd:
        nc = await nats.connect(**NatsSettings(servers=[server.url], tls_ca=str(tls.ca)).connect_options("t"))
        await nc.close()
        async with Discovery(EtcdSettings(endpoints=[etcd.url], tls_ca=str(tls.ca)), "certs") as d:
            await d.put_raw("/certs/config/router", b"{}")


def test_etcd_auth_through_the_cli_scopes_each_user_to_its_prefixes(etcd_server_auth: EtcdServer) -> None:
    async def check() -> None:
        worker = Discovery(EtcdSettings(endpoints=[etcd_server_auth.url], user="worker", password="w"), "sc")
        await worker.connect()
        try:
            await worker.put_raw("/sc/workers/x", b"{}")
            await worker.put_raw("/sc/engines/x", b"{}")  # its claim on its engine (worker_shim.engine_claim)
            with pytest.raises(Exception, match="permission denied"):
                await worker.put_raw("/sc/routers/x", b"{}")
            with pytest.raises(Exception, match="permission denied"):
                await worker.put_raw("/other/workers/x", b"{}")
        finally:
            await worker.close()
        anonymous = Etcd3Client([etcd_server_auth.url.split("://", 1)[1]])
        await anonymous.connect()
        try:
            assert anonymous.kv is not None
            with pytest.raises(Exception, match="user name is empty"):
                await anonymous.kv.get("/sc/workers/x")
        finally:
            await anonymous.close()

    asyncio.run(check())


@pytest.fixture
def etcd_server_auth(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    env = {
        "PATH": "/usr/bin:/bin",
        "KVSWITCH_ETCD_ROOT_PASSWORD": "r",
        "KVSWITCH_ETCD_ROUTER_PASSWORD": "o",
        "KVSWITCH_ETCD_WORKER_PASSWORD": "w",
    }
    args = ("--namespace", "sc", "--etcd-endpoint", server.url)
    try:
        out = _secrets(*args, env=env)
        assert out.returncode == 0 and "etcd authentication on" in out.stdout, out.stderr
        out = _secrets(*args, env=env)
        assert out.returncode == 0 and "already on" in out.stdout, out.stderr
        yield server
    finally:
        server.close()


def test_api_keys_are_written_private_kept_on_rerun_and_accepted_by_the_router(tmp_path: Path) -> None:
    from router.api_keys import ApiKeys

    first = _secrets("--out", str(tmp_path), "--api-keys", "2")
    assert first.returncode == 0, first.stderr
    path = tmp_path / "api-keys"
    keys = path.read_text().split()
    assert len(keys) == 2 and len(set(keys)) == 2 and (path.stat().st_mode & 0o777) == 0o600
    assert _secrets("--out", str(tmp_path), "--api-keys", "3").returncode == 0
    again = path.read_text().split()
    assert again[:2] == keys and len(again) == 3
    assert all(ApiKeys(path).allows(f"Bearer {k}") for k in again)
    assert _secrets("--out", str(tmp_path), "--api-keys", "-1").returncode == 2


def test_api_keys_are_never_in_a_file_others_may_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode as each write of the keys ends (before anything after it could fix it), on a first
    run under the usual umask and on a rerun over a file loosened since."""
    from kvswitch.deploy_secrets import write_api_keys

    modes: list[int] = []
    real_write_text = Path.write_text

    def write_text(self: Path, *args: Any, **kwargs: Any) -> int:
        written = real_write_text(self, *args, **kwargs)
        modes.append(self.stat().st_mode & 0o777)
        return written

    monkeypatch.setattr(Path, "write_text", write_text)
    umask = os.umask(0o022)
    try:
        path = write_api_keys(tmp_path / "out", 1)
        path.chmod(0o644)
        write_api_keys(tmp_path / "out", 2)
    finally:
        os.umask(umask)
    assert modes == [0o600, 0o600]


def test_a_rerun_asking_for_a_host_the_kept_certificate_lacks_is_refused_naming_it(tmp_path: Path) -> None:
    """It printed the new host list and kept the old certificate: clients of the new name then failed
    hostname verification. A new certificate needs a new CA (its key is not kept), so it is refused,
    before anything is written, naming what the certificate holds and the directory to delete."""
    first = _secrets("--out", str(tmp_path), "--tls-hosts", "nats,etcd,127.0.0.1")
    assert first.returncode == 0, first.stderr
    assert first.stdout.rstrip().endswith("for nats, etcd, 127.0.0.1"), first.stdout
    kept = {p.name: p.read_bytes() for p in (tmp_path / "tls").iterdir()}
    assert len(kept) == 11  # ca.pem, the route and peer CAs, four certificates and their keys
    again = _secrets("--out", str(tmp_path), "--workers", "w0", "--tls-hosts", "nats,etcd,127.0.0.1,nats.example.com")
    assert again.returncode == 2, (again.stdout, again.stderr)
    assert again.stdout == "" and again.stderr.count("\n") == 1, again.stderr
    assert "names nats, etcd, 127.0.0.1, not nats.example.com" in again.stderr
    assert f"delete {tmp_path / 'tls'} to issue new CAs" in again.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "tls").iterdir()} == kept
    assert not (tmp_path / "worker-w0.nk").exists()
    # Fewer names, in another case: all in the kept certificate.
    same = _secrets("--out", str(tmp_path), "--tls-hosts", "NATS,127.0.0.1")
    assert same.returncode == 0 and same.stdout.rstrip().endswith("for nats, etcd, 127.0.0.1"), same.stderr


def test_a_kept_certificate_that_is_not_one_is_refused_naming_it(tmp_path: Path) -> None:
    assert _secrets("--out", str(tmp_path), "--tls-hosts", "nats").returncode == 0
    (tmp_path / "tls" / "etcd-peer.crt").write_text("not a certificate\n")
    again = _secrets("--out", str(tmp_path), "--tls-hosts", "nats")
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert "etcd-peer.crt is not a PEM certificate" in again.stderr and "delete " in again.stderr


def test_api_keys_counts_keys_not_comment_lines(tmp_path: Path) -> None:
    """`--api-keys 2` over a file holding a comment and one key wrote no key: the router took 1."""
    from router.api_keys import ApiKeys

    path = tmp_path / "api-keys"
    path.write_text("# team A, rotated 2026-12\nsk-a\n")
    assert _secrets("--out", str(tmp_path), "--api-keys", "2").returncode == 0
    lines = path.read_text().splitlines()
    assert lines[:2] == ["# team A, rotated 2026-12", "sk-a"] and len(lines) == 3
    keys = ApiKeys(path)
    assert keys.allows("Bearer sk-a") and keys.allows(f"Bearer {lines[2]}") and lines[2].startswith("sk-kvswitch-")


def test_write_tls_compares_hosts_as_the_certificate_names_them(tmp_path: Path) -> None:
    from kvswitch.certs import KeptCertificateError, certificate_hosts

    tls = write_tls(tmp_path, ["Nats.Example", "::1"])
    for leaf in (tls.nats, tls.nats_route, tls.etcd, tls.etcd_peer):
        assert certificate_hosts(leaf.cert) == ["Nats.Example", "::1"]
    assert write_tls(tmp_path, ["0:0::1", "nats.example"]) == tls  # the same address, a DNS name in any case
    with pytest.raises(KeptCertificateError, match=r"names Nats\.Example, ::1, not 127\.0\.0\.1: delete "):
        write_tls(tmp_path, ["nats.example", "127.0.0.1"])


def test_a_first_host_longer_than_a_common_name_may_be_is_still_certified(tmp_path: Path) -> None:
    # the CN is capped at 64 characters: a Kubernetes FQDN of 68 was a traceback and an empty tls/
    long = "etcd-0.etcd-headless.kvswitch-production-inference.svc.cluster.local"
    tls = write_tls(tmp_path, [long, "nats"])
    assert certificate_hosts(tls.nats.cert) == certificate_hosts(tls.etcd_peer.cert) == [long, "nats"]


def _etcd_env() -> dict[str, str]:
    return {
        **os.environ,
        "KVSWITCH_ETCD_ROOT_PASSWORD": "rootNEW",
        "KVSWITCH_ETCD_ROUTER_PASSWORD": "routerNEW",
        "KVSWITCH_ETCD_WORKER_PASSWORD": "workerNEW",
    }


def test_an_etcd_ca_with_a_plaintext_endpoint_is_refused(tmp_path: Path) -> None:
    # urllib ignores a TLS context for http://: the run said "authentication on" and had sent all
    # three passwords in the clear
    tls = write_tls(tmp_path / "tls", ["127.0.0.1"])
    out = _secrets("--etcd-endpoint", "http://127.0.0.1:9", "--etcd-ca", str(tls.ca), env=_etcd_env())
    assert out.returncode == 2 and "with --etcd-ca it must be https://" in out.stderr, out.stderr


def test_credentials_in_the_etcd_endpoint_are_refused_unshown() -> None:
    # they were printed with any error, into the job's log
    out = _secrets("--etcd-endpoint", "http://root:rootSECRET@127.0.0.1:9", env=_etcd_env())
    assert out.returncode == 2 and "credentials in the URL are refused" in out.stderr
    assert "rootSECRET" not in out.stderr + out.stdout


def test_a_rerun_after_one_that_stopped_part_way_sets_the_passwords_and_grants_given() -> None:
    from kvswitch.etcd_auth import EtcdAuthError, EtcdGateway, b64

    with EtcdServer() as etcd:
        left = EtcdGateway(etcd.url, None)  # what an earlier run (or an operator) left, auth still off
        left.call("auth/user/add", {"name": "router", "password": "OLDpw"})
        left.call("auth/role/add", {"name": "router"})
        left.call("auth/role/grant", {"name": "router", "perm": {"permType": "READWRITE", "key": b64("/sc/old")}})
        # another namespace's grant on the shared role: kept (kvswitch.etcd_auth)
        left.call("auth/role/grant", {"name": "router", "perm": {"permType": "READWRITE", "key": b64("/other/")}})
        out = _secrets("--namespace", "sc", "--etcd-endpoint", etcd.url, env=_etcd_env())
        assert out.returncode == 0 and "etcd authentication on" in out.stdout, out.stderr
        assert "revoked a grant this release does not make: router READWRITE /sc/old\n" in out.stdout + "\n"
        EtcdGateway(etcd.url, None).call("auth/authenticate", {"name": "router", "password": "routerNEW"})
        with pytest.raises(EtcdAuthError, match="authentication failed"):
            EtcdGateway(etcd.url, None).call("auth/authenticate", {"name": "router", "password": "OLDpw"})
        root = EtcdGateway(etcd.url, None)
        root.token = root.call("auth/authenticate", {"name": "root", "password": "rootNEW"})["token"]
        keys = {p["key"] for p in root.call("auth/role/get", {"role": "router"})["perm"]}
        assert b64("/sc/old") not in keys and b64("/other/") in keys and b64("/sc/") in keys


def test_a_rerun_once_auth_is_on_grants_what_this_release_needs_and_keeps_working_tokens() -> None:
    """The upgrade step of docs/deployment.md: a cluster whose worker role an older release made
    (no /{ns}/engines/) is rerun; the rerun said "already on" and granted nothing, so upgraded
    shims exited 2 on their engine claim (review of 2026-12-06)."""
    from kvswitch.etcd_auth import EtcdGateway, b64

    env = _etcd_env()
    with EtcdServer() as etcd:
        args = ("--namespace", "sc", "--etcd-endpoint", etcd.url)
        assert _secrets(*args, env=env).returncode == 0
        root = EtcdGateway(etcd.url, None)
        root.token = root.call("auth/authenticate", {"name": "root", "password": "rootNEW"})["token"]
        old: dict[str, object] = {"role": "worker", "key": b64("/sc/engines/"), "range_end": b64("/sc/engines0")}
        root.call("auth/role/revoke", old)  # the worker role as a release before 2026-12-06 made it
        worker = EtcdGateway(etcd.url, None)
        worker.token = worker.call("auth/authenticate", {"name": "worker", "password": "workerNEW"})["token"]

        async def claim() -> None:
            settings = EtcdSettings(endpoints=[etcd.url], user="worker", password="workerNEW")
            async with Discovery(settings, "sc") as d:
                await d.create("/sc/engines/localhost@h:8000", b"{}", await d.grant(5))

        with pytest.raises(Exception, match="does not let this user write /sc/engines/"):
            asyncio.run(claim())
        out = _secrets(*args, env=env)
        assert out.returncode == 0 and "already on" in out.stdout and "grants" in out.stdout, out.stderr
        asyncio.run(claim())
        # The worker's password was right: left alone, so the token a running shim holds still works.
        worker.call("kv/range", {"key": b64("/sc/workers/x")})


def test_a_run_for_a_second_namespace_on_one_etcd_keeps_the_first_ones_grants() -> None:
    """The roles are etcd-wide, the grants per namespace: a run with --namespace staging revoked
    every grant it does not make, /kvswitch/'s among them, and the running namespace's worker was
    refused /kvswitch/workers/ (review of 2026-12-06). Only grants inside the run's namespace are
    revoked, and each is said."""
    from kvswitch.etcd_auth import EtcdAuthError, EtcdGateway, b64

    env = _etcd_env()
    with EtcdServer() as etcd:
        assert _secrets("--namespace", "kvswitch", "--etcd-endpoint", etcd.url, env=env).returncode == 0
        worker = EtcdGateway(etcd.url, None)
        worker.token = worker.call("auth/authenticate", {"name": "worker", "password": "workerNEW"})["token"]
        root = EtcdGateway(etcd.url, None)
        root.token = root.call("auth/authenticate", {"name": "root", "password": "rootNEW"})["token"]
        extra = {"permType": "READ", "key": b64("/staging/old/"), "range_end": b64("/staging/old0")}
        root.call("auth/role/grant", {"name": "worker", "perm": extra})  # one staging's older release made

        out = _secrets("--namespace", "staging", "--etcd-endpoint", etcd.url, env=env)
        assert out.returncode == 0 and "already on" in out.stdout, out.stderr
        for ns in ("kvswitch", "staging"):  # the running namespace's token still writes its workers
            worker.call("kv/put", {"key": b64(f"/{ns}/workers/w1"), "value": b64("{}")})
            worker.call("kv/put", {"key": b64(f"/{ns}/engines/e1"), "value": b64("{}")})
        assert out.stdout.count("revoked a grant") == 1, out.stdout
        assert "revoked a grant this release does not make: worker READ /staging/old/ (prefix)" in out.stdout
        with pytest.raises(EtcdAuthError, match="permission denied"):
            worker.call("kv/range", {"key": b64("/staging/old/x")})
        again = _secrets("--namespace", "kvswitch", "--etcd-endpoint", etcd.url, env=env)
        assert again.returncode == 0 and "revoked" not in again.stdout, again.stdout
        worker.call("kv/put", {"key": b64("/staging/workers/w2"), "value": b64("{}")})


def test_a_rerun_once_auth_is_on_with_another_root_password_fails_naming_root() -> None:
    with EtcdServer() as etcd:
        args = ("--namespace", "sc", "--etcd-endpoint", etcd.url)
        assert _secrets(*args, env=_etcd_env()).returncode == 0
        out = _secrets(*args, env={**_etcd_env(), "KVSWITCH_ETCD_ROOT_PASSWORD": "wrong"})
        assert out.returncode == 1 and "authentication is on" in out.stderr and "root's password" in out.stderr


def test_a_run_with_other_passwords_once_auth_is_on_is_refused_unless_rotating() -> None:
    """The users and passwords are etcd-wide: a run for another namespace with other passwords
    changed the router's, and the running namespace's router lost its token (401) and could not
    sign in again (review of 2026-12-06). Refused, naming the variable, and nothing changed;
    --rotate-etcd-passwords changes it, saying so for each user."""
    from kvswitch.etcd_auth import EtcdAuthError, EtcdGateway, b64

    with EtcdServer() as etcd:
        assert _secrets("--namespace", "kvswitch", "--etcd-endpoint", etcd.url, env=_etcd_env()).returncode == 0
        router = EtcdGateway(etcd.url, None)
        router.token = router.call("auth/authenticate", {"name": "router", "password": "routerNEW"})["token"]
        other = {**_etcd_env(), "KVSWITCH_ETCD_ROUTER_PASSWORD": "routerOTHER"}
        staging = ("--namespace", "staging", "--etcd-endpoint", etcd.url)
        out = _secrets(*staging, env=other)
        assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
        assert "refuses the password given for router (from KVSWITCH_ETCD_ROUTER_PASSWORD)" in out.stderr
        assert "WORKER" not in out.stderr and "routerOTHER" not in out.stderr
        assert "shared by every namespace on this etcd" in out.stderr and "--rotate-etcd-passwords" in out.stderr
        router.call("kv/range", {"key": b64("/kvswitch/routers/r1")})  # the running router's token works
        EtcdGateway(etcd.url, None).call("auth/authenticate", {"name": "router", "password": "routerNEW"})
        root = EtcdGateway(etcd.url, None)
        root.token = root.call("auth/authenticate", {"name": "root", "password": "rootNEW"})["token"]
        assert b64("/staging/") not in {p["key"] for p in root.call("auth/role/get", {"role": "router"})["perm"]}

        rotated = _secrets(*staging, "--rotate-etcd-passwords", env=other)
        assert rotated.returncode == 0, rotated.stderr
        assert rotated.stdout.count("changed etcd user") == 1, rotated.stdout
        assert "changed etcd user router's password to KVSWITCH_ETCD_ROUTER_PASSWORD's" in rotated.stdout
        EtcdGateway(etcd.url, None).call("auth/authenticate", {"name": "router", "password": "routerOTHER"})
        with pytest.raises(EtcdAuthError, match="authentication failed"):
            EtcdGateway(etcd.url, None).call("auth/authenticate", {"name": "router", "password": "routerNEW"})
        again = _secrets(*staging, "--rotate-etcd-passwords", env=other)
        assert again.returncode == 0 and "changed" not in again.stdout, again.stdout


def test_a_user_missing_once_auth_is_on_is_created_not_refused() -> None:
    from kvswitch.etcd_auth import EtcdGateway

    with EtcdServer() as etcd:
        args = ("--namespace", "sc", "--etcd-endpoint", etcd.url)
        assert _secrets(*args, env=_etcd_env()).returncode == 0
        root = EtcdGateway(etcd.url, None)
        root.token = root.call("auth/authenticate", {"name": "root", "password": "rootNEW"})["token"]
        root.call("auth/user/delete", {"name": "worker"})
        out = _secrets(*args, env=_etcd_env())
        assert out.returncode == 0 and "changed" not in out.stdout, out.stdout + out.stderr
        EtcdGateway(etcd.url, None).call("auth/authenticate", {"name": "worker", "password": "workerNEW"})


def test_a_from_key_grant_reaches_past_the_namespace_and_is_kept() -> None:
    """A grant of every key from /sc/z on (etcdctl --from-key: range end "\\0") was taken for one
    inside /sc/ and revoked, shown with a raw NUL (review of 2026-12-06)."""
    from kvswitch.etcd_auth import EtcdGateway, _shown, b64

    with EtcdServer() as etcd:
        args = ("--namespace", "sc", "--etcd-endpoint", etcd.url)
        assert _secrets(*args, env=_etcd_env()).returncode == 0
        root = EtcdGateway(etcd.url, None)
        root.token = root.call("auth/authenticate", {"name": "root", "password": "rootNEW"})["token"]
        from_key = {"permType": "READ", "key": b64("/sc/z"), "range_end": b64("\0")}
        root.call("auth/role/grant", {"name": "worker", "perm": from_key})
        out = _secrets(*args, env=_etcd_env())
        assert out.returncode == 0 and "revoked" not in out.stdout, out.stdout
        held = {(p["key"], p.get("range_end")) for p in root.call("auth/role/get", {"role": "worker"})["perm"]}
        assert (b64("/sc/z"), b64("\0")) in held
    assert _shown("/sc/z", "\0") == "/sc/z (from key)"


@pytest.mark.parametrize(
    ("host", "said"),
    [
        ("nats.kvswitch.svc:4222", "has a port in it"),
        ("[::1]:4222", "has a port in it"),
        ("https://etcd.x", "a URL: give its host alone"),
        ("etcd.x/v3", "has a path in it"),
        ("nats kvswitch", "has whitespace in it"),
        ("10.0.0.256", "is no IP address"),
        ("1.2.3", "is no IP address"),
        ("fe80::1%eth0", "has an IPv6 zone"),
        ("nats_0.svc", "is neither an IP address nor a DNS name"),
        ("-nats.svc", "is neither an IP address nor a DNS name"),
        ("nats.svc.", "is neither an IP address nor a DNS name"),
        ("a." * 127 + "b", "is neither an IP address nor a DNS name"),  # 255 characters
        ("*.*.svc", "is neither an IP address nor a DNS name"),
    ],
)
def test_a_tls_host_no_certificate_can_name_is_refused_naming_the_flag(host: str, said: str, tmp_path: Path) -> None:
    """Config review of 2026-12-07, finding 4: anything not an IP address was written as a DNS
    name (DNS:nats.kvswitch.svc:4222, DNS:https://etcd.x, DNS:10.0.0.256), exit 0, and every client
    then refused the certificate."""
    out = _secrets("--out", str(tmp_path), "--workers", "w0", "--tls-hosts", f"nats,{host}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"kvswitch secrets: --tls-hosts: {host!r} {said}"), out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, the NATS files neither


def test_tls_hosts_of_every_kind_a_certificate_names_are_certified(tmp_path: Path) -> None:
    hosts = ["nats", "*.etcd-headless.kvswitch.svc", "etcd-0.etcd-headless.kvswitch.svc", "127.0.0.1", "fd00::7"]
    tls = write_tls(tmp_path, hosts)
    assert certificate_hosts(tls.nats.cert) == hosts


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--workers", "w0", "--response-ttl", "99999999999999"],
            "--response-ttl must be in 1..86400 seconds (a day; nats-server keeps a worker's leave to reply to each "
            "request that long; give one above every router's --request-timeout, which is below a day)",
        ),
        (["--workers", "w0", "--response-ttl", "0"], "--response-ttl must be in 1..86400 seconds"),
        (["--routers", "r0", "--response-ttl", "600"], "--response-ttl is read with --workers only"),
        (["--workers", "w0", "--etcd-ca", "/etc/hosts"], "--etcd-ca is read with --etcd-endpoint only"),
        (["--workers", "w0", "--rotate-etcd-passwords"], "--rotate-etcd-passwords is read with --etcd-endpoint only"),
    ],
)
def test_a_flag_nothing_reads_or_a_response_ttl_nats_would_refuse_is_refused(
    args: list[str], said: str, tmp_path: Path
) -> None:
    """Config review of 2026-12-07, findings 4 and 7: --response-ttl 99999999999999 wrote
    "expires": "99999999999999s", which nats-server refuses ("invalid duration") only when it
    starts; --etcd-ca without --etcd-endpoint was ignored, exit 0."""
    out = _secrets("--out", str(tmp_path), *args)
    assert out.returncode == 2 and out.stderr.startswith(f"kvswitch secrets: {said}"), out.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_longest_response_ttl_is_written_as_nats_server_takes_it(tmp_path: Path) -> None:
    out = _secrets("--out", str(tmp_path), "--workers", "w0", "--response-ttl", "86400")
    assert out.returncode == 0, out.stderr
    (tmp_path / "nats.conf").write_text(f"port: {free_port()}\ninclude ./nats-auth.conf\n")
    checked = subprocess.run(
        [find_nats_server(), "-t", "-c", "nats.conf"], cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0 and '"expires": "86400s"' in (tmp_path / "nats-auth.conf").read_text(), checked
