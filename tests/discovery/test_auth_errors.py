"""etcd refusing the credentials at connect is a configuration error naming --etcd-user and
--etcd-password, one line and exit status 2 from the router and the shim. Wrong, missing and
unneeded credentials each ended in a 60-line gRPC traceback (AioRpcError escaped Discovery.connect)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from discovery import Discovery, DiscoveryError
from kvswitch.etcd_auth import PING_KEY, EtcdUser, enable_auth, namespace_users
from kvswitch.servers import EtcdServer
from protocol import ConfigError, RouterInfo, WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings

PASSWORD = "s3cret-pw"


@pytest.fixture(scope="module")
def etcd_auth() -> Iterator[EtcdServer]:
    """An etcd with authentication on: `worker` may connect, `nobody` may read nothing."""
    with EtcdServer() as server:
        enable_auth(server.url, "rootpw", [EtcdUser("worker", PASSWORD, keys=[PING_KEY]), EtcdUser("nobody", "n")])
        yield server


async def _refused(url: str, user: str | None = None, password: str | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        await Discovery(EtcdSettings(endpoints=[url], user=user, password=password)).connect()
    exc = caught.value
    assert exc.setting == "etcd_user" and url in str(exc)
    return exc


async def test_a_wrong_password_names_the_credential_flags_and_not_the_password(etcd_auth: EtcdServer) -> None:
    exc = await _refused(etcd_auth.url, "worker", "not-it")
    assert exc.value == "worker"
    assert "invalid user ID or password" in str(exc) and "check --etcd-user and --etcd-password" in str(exc)
    assert "not-it" not in str(exc)


async def test_an_unknown_user_is_refused_the_same_way(etcd_auth: EtcdServer) -> None:
    exc = await _refused(etcd_auth.url, "nosuch", PASSWORD)
    assert "check --etcd-user and --etcd-password" in str(exc)


async def test_no_credentials_against_etcd_with_auth_on_says_to_give_them(etcd_auth: EtcdServer) -> None:
    exc = await _refused(etcd_auth.url)
    assert exc.value is None
    assert "has authentication on" in str(exc) and "give --etcd-user and --etcd-password" in str(exc)


async def test_credentials_against_etcd_with_auth_off_say_to_drop_them(etcd_url: str) -> None:
    exc = await _refused(etcd_url, "worker", PASSWORD)
    assert "has authentication off" in str(exc) and "drop --etcd-user and --etcd-password" in str(exc)
    # on Kubernetes the likely cause is the etcd-auth Job not having run yet, not a credential too many
    assert "the etcd-auth Job, which may not have run yet" in str(exc)


async def test_a_user_that_may_not_read_the_health_key_is_told_which_key(etcd_auth: EtcdServer) -> None:
    exc = await _refused(etcd_auth.url, "nobody", "n")
    assert "permission denied" in str(exc) and repr(PING_KEY) in str(exc)


async def test_the_right_credentials_still_connect(etcd_auth: EtcdServer) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_auth.url], user="worker", password=PASSWORD)) as d:
        assert d.token is not None


async def test_a_worker_user_without_the_engines_grant_is_told_how_to_grant_it(etcd_auth: EtcdServer) -> None:
    """A worker user made before 2026-12-06 may not write /{ns}/engines/ (the shim's engine
    claim): "give the worker user" alone would not fix it, its own user being given."""
    async with Discovery(EtcdSettings(endpoints=[etcd_auth.url], user="worker", password=PASSWORD)) as d:
        lease = await d.grant()
        with pytest.raises(ConfigError) as caught:
            await d.create(subjects.engine_key("kvswitch", "h:8000"), b"{}", lease)
    said = str(caught.value)
    assert caught.value.setting == "etcd_user" and "write /kvswitch/engines/h:8000" in said, said
    assert "give the worker user" in said and "run kvswitch secrets --etcd-endpoint again" in said, said
    assert "etcdctl role grant-permission worker --prefix=true readwrite /kvswitch/engines/" in said, said


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvswitch", *argv], capture_output=True, text=True, timeout=60)


ROUTER = ["router", "--http-port", "0"]
SHIM = ["shim", "--engine-url", "http://127.0.0.1:9", "--model", "m"]  # etcd comes before the engine
WRONG = ["--etcd-user", "worker", "--etcd-password", "nope"]


@pytest.mark.parametrize(
    ("command", "credentials", "said"),
    [(ROUTER, WRONG, "check --etcd-user"), (ROUTER, [], "give --etcd-user"), (SHIM, WRONG, "check --etcd-user"),
     (SHIM, [], "give --etcd-user")],
)  # fmt: skip
def test_the_router_and_the_shim_exit_2_with_one_line(
    etcd_auth: EtcdServer, nats_url: str, command: list[str], credentials: list[str], said: str
) -> None:
    out = _run(*command, "--nats-servers", nats_url, "--etcd-endpoints", etcd_auth.url, *credentials)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2, lines
    assert len(lines) == 1 and "invalid etcd_user (--etcd-user" in lines[0] and said in lines[0], lines


@pytest.fixture(scope="module")
def etcd_roles() -> Iterator[EtcdServer]:
    """An etcd with the users kvswitch secrets makes: `router` writes routers, `worker` workers."""
    with EtcdServer() as server:
        enable_auth(server.url, "rootpw", namespace_users("kvswitch", "router-pw", "worker-pw"))
        yield server


def _router(rid: str) -> RouterInfo:
    return RouterInfo(router=rid, http_url="http://127.0.0.1:1", started_at=0.0, version="test")


def _worker(wid: str) -> WorkerInfo:
    return WorkerInfo(
        worker=wid, model="m", role="decode", engine="vllm", block_size=16, kv_total_blocks=100,
        max_num_batched_tokens=8192, kv_bytes_per_token=1, epoch=1, version="test",
    )  # fmt: skip


async def test_credentials_of_the_other_role_name_the_etcd_user(etcd_roles: EtcdServer) -> None:
    """A router given the worker user (a swapped Secret or variable) exited 1 with "create ...
    failed: permission denied (check --etcd-endpoints and the server)"."""
    worker = EtcdSettings(endpoints=[etcd_roles.url], user="worker", password="worker-pw")
    async with Discovery(worker) as d:
        with pytest.raises(ConfigError) as caught:
            await d.register_router(_router)
    assert caught.value.setting == "etcd_user" and caught.value.value == "worker"
    said = str(caught.value)
    assert "does not let this user write /kvswitch/routers/" in said and "give the router user" in said, said
    router = EtcdSettings(endpoints=[etcd_roles.url], user="router", password="router-pw")
    async with Discovery(router) as d:
        lease = await d.grant()
        with pytest.raises(ConfigError, match=r"write /kvswitch/workers/w1 .*: give the worker user"):
            await d.create(subjects.worker_key("kvswitch", "w1"), encode_json(_worker("w1")), lease)
        with pytest.raises(ConfigError, match="give the worker user"):
            await d.register_worker(_worker)


async def test_a_denial_after_a_write_etcd_took_is_a_discovery_error(etcd_roles: EtcdServer) -> None:
    """The role changed under a running process: its retries go on (Registration catches
    DiscoveryError), and the message still names the user."""
    worker = EtcdSettings(endpoints=[etcd_roles.url], user="worker", password="worker-pw")
    async with Discovery(worker) as d:
        await d.register_worker(_worker)
        with pytest.raises(DiscoveryError, match=r"give the router user .*--etcd-user"):
            await d.put(subjects.router_key("kvswitch", "r1"), b"{}")


def test_a_router_with_the_worker_user_exits_2_naming_the_etcd_user(etcd_roles: EtcdServer, nats_url: str) -> None:
    out = _run(*ROUTER, "--nats-servers", nats_url, "--etcd-endpoints", etcd_roles.url,
               "--etcd-user", "worker", "--etcd-password", "worker-pw")  # fmt: skip
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2, lines
    assert "invalid etcd_user (--etcd-user" in lines[-1] and "give the router user" in lines[-1], lines
    assert "--etcd-endpoints and the server" not in out.stdout + out.stderr, lines
    assert not any("stopped" in line for line in lines), lines  # it never registered: no "router  stopped"
