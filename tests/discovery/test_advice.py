"""What a failed etcd call says and asks of an operator (discovery.advice), against a real etcd:
one that does not answer (a relay frozen: a hung member), one that answers and refuses (its
NOSPACE alarm raised: the quota full) and one whose certificate another CA signed since connect.

Review of 2026-12-07: a grant out of time was "lease grant failed: " (a timeout's str() is empty),
one a full etcd refused a five-line gRPC repr, and the shim named --etcd-endpoints for both; a TLS
handshake failing during a run named --etcd-endpoints too (gRPC says UNAVAILABLE), and a token etcd
forgot (renewed by itself) was "etcd answered and refused it"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from etcd3aio import EtcdConnectionError, EtcdPermissionDeniedError, EtcdUnauthenticatedError

from discovery import Discovery, DiscoveryError, Registration, RegistrationState, advice
from discovery import registration as registration_module
from discovery.advice import NO_SPACE, REFUSED, TLS, TOKEN_FORGOTTEN, UNANSWERED
from kvswitch.certs import write_tls
from kvswitch.servers import EtcdServer
from protocol import WorkerInfo, subjects
from protocol.config import EtcdSettings
from tests.etcd_alarm import nospace_alarm
from tests.relay import Relay
from tests.router.polling import until

# What etcd3aio raised once etcd's certificate came from another CA than --etcd-tls-ca (audit of 2026-12-07)
_HANDSHAKE = (
    "UNAVAILABLE (connections to all backends failing; last error: UNKNOWN: ipv4:127.0.0.1:26397: Tls handshake "
    "failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1a000064:ECDSA routines:OPENSSL_internal:BAD_SIGNATURE: "
    "certificate signature failure: OK)"
)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _raised_from(cause: BaseException) -> DiscoveryError:
    try:
        raise DiscoveryError("lease grant failed") from cause
    except DiscoveryError as exc:
        return exc


@pytest.mark.parametrize(
    ("cause", "expected"),
    [
        (TimeoutError(), UNANSWERED),
        (EtcdConnectionError("Lease.Grant failed after 3 attempts: UNAVAILABLE"), UNANSWERED),
        (_rpc_error(grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader"), UNANSWERED),
        (_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded"), NO_SPACE),
        (_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests"), REFUSED),
        (EtcdPermissionDeniedError("Lease.Grant failed: etcdserver: permission denied"), REFUSED),
        (EtcdUnauthenticatedError("Lease.Grant failed: etcdserver: invalid auth token"), TOKEN_FORGOTTEN),
        (_rpc_error(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token"), TOKEN_FORGOTTEN),
        (EtcdConnectionError(f"Lease.Grant failed after 3 attempts: {_HANDSHAKE}"), TLS),
    ],
)
def test_the_endpoints_are_named_only_where_etcd_did_not_answer(cause: BaseException, expected: str) -> None:
    assert advice(_raised_from(cause)) == expected
    assert advice(cause) == expected


def test_a_discovery_error_of_its_own_asks_nothing() -> None:
    assert advice(DiscoveryError("the registration's supervisor of /k crashed")) == ""


async def test_a_tls_handshake_failing_during_a_run_names_the_certificates_not_the_endpoints(
    tmp_path: Path, ns: str
) -> None:
    """etcd restarted on its ports with a certificate another CA signed (rotated): the connected
    client's calls fail as UNAVAILABLE, which named --etcd-endpoints."""
    first, rotated = write_tls(tmp_path / "a", ["127.0.0.1"]), write_tls(tmp_path / "b", ["127.0.0.1"])
    etcd = EtcdServer(tls=first.etcd, peer_tls=first.etcd_peer).start()
    try:
        async with Discovery(EtcdSettings(endpoints=[etcd.url], tls_ca=str(first.ca)), ns) as d:
            await d.grant(5)
            etcd.close()
            etcd = EtcdServer(etcd.port, etcd.peer_port, tls=rotated.etcd, peer_tls=rotated.etcd_peer).start()
            with pytest.raises(DiscoveryError) as grant:
                await d.grant(5)
    finally:
        etcd.close()
    assert "Tls handshake failed" in str(grant.value), grant.value
    assert advice(grant.value) == TLS and "--etcd-tls-ca" in TLS and "--etcd-endpoints and" not in TLS


@pytest.fixture
def full_etcd() -> Iterator[EtcdServer]:
    """An etcd of the test's own (the alarm refuses every client's writes), its quota full."""
    with EtcdServer() as etcd:
        nospace_alarm(etcd, "ACTIVATE")
        yield etcd


async def test_a_full_etcd_refusing_a_grant_and_a_create_says_so_in_one_line(full_etcd: EtcdServer, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[full_etcd.url]), ns) as d:
        with pytest.raises(DiscoveryError) as grant:
            await d.grant(5)
        nospace_alarm(full_etcd, "DEACTIVATE")
        lease = await d.grant(5)
        nospace_alarm(full_etcd, "ACTIVATE")
        with pytest.raises(DiscoveryError) as create:
            await d.create("/k", b"v", lease)
        nospace_alarm(full_etcd, "DEACTIVATE")
    space = "RESOURCE_EXHAUSTED: etcdserver: mvcc: database space exceeded"
    assert str(grant.value) == f"lease grant failed: {space}"
    assert str(create.value) == f"create /k failed: {space}"
    assert advice(grant.value) == advice(create.value) == NO_SPACE and "--etcd-endpoints" not in NO_SPACE


async def test_a_hung_etcd_is_said_as_a_timeout_naming_the_endpoints(etcd_relay: Relay, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[f"http://127.0.0.1:{etcd_relay.port}"]), ns) as d:
        etcd_relay.frozen.set()  # connected, then nothing answers: a member that hangs
        grant, get = await asyncio.gather(d.grant(5), d.holder("/k"), return_exceptions=True)
    assert isinstance(grant, DiscoveryError) and str(grant) == "lease grant failed: TimeoutError"
    assert isinstance(get, DiscoveryError) and str(get) == "get /k failed: TimeoutError"
    assert advice(grant) == advice(get) == UNANSWERED


async def test_registering_anew_into_a_full_etcd_is_said_once_with_what_to_do(
    full_etcd: EtcdServer, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an owner's on_failing (a router's): each try was a WARNING, 0.2 s doubling to 5 s,
    each a five-line gRPC repr (22 in 90 s)."""
    monkeypatch.setattr(registration_module, "RETRY_MAX_S", 0.1)  # many tries in a short test
    caplog.set_level(logging.INFO, logger="discovery.registration")
    nospace_alarm(full_etcd, "DEACTIVATE")
    async with Discovery(EtcdSettings(endpoints=[full_etcd.url]), ns) as d:
        reg = Registration(
            d,
            key=lambda wid: subjects.worker_key(ns, wid),
            value=lambda wid: WorkerInfo(worker=wid, model="m", role="agg", engine="vllm", block_size=16),
            ttl=3,
        )
        first = await reg.start()
        tries = 0
        granting = d.grant

        async def counted(ttl: int, *, setting: str | None = "lease_ttl") -> object:
            nonlocal tries
            tries += 1
            return await granting(ttl, setting=setting)

        d.grant = counted  # type: ignore[assignment,method-assign]
        nospace_alarm(full_etcd, "ACTIVATE")
        assert reg.lease is not None and d.client.lease is not None
        await d.client.lease.revoke(reg.lease.id)  # etcd takes a revoke while full: the lease is lost
        await until(lambda: tries >= 8, 10, "8 tries")
        assert reg.state is RegistrationState.REREGISTERING
        nospace_alarm(full_etcd, "DEACTIVATE")
        await until(lambda: reg.state is RegistrationState.REGISTERED, 10, "registered anew")
        assert reg.id != first
        await reg.stop()
    failed = [r for r in caplog.records if "again failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING, [r.getMessage() for r in failed]
    line = failed[0].getMessage()
    assert "lease grant failed: RESOURCE_EXHAUSTED: etcdserver: mvcc: database space exceeded" in line, line
    assert NO_SPACE in line and "--etcd-endpoints" not in line and "\n" not in line, line


@pytest.mark.parametrize("said_every_s", [30.0, 0.0])
async def test_re_putting_into_a_full_etcd_is_an_episode_said_once_with_what_to_do_and_its_end(
    full_etcd: EtcdServer,
    ns: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    said_every_s: float,
) -> None:
    """An update() etcd refuses is put again each keep-alive tick (TTL/3 s): each failed try was a
    WARNING, for as long as etcd refused it. Now the first is, naming what to do, then a count at
    most every SAID_EVERY_S (0 here: at each try), and an INFO once a put works again."""
    monkeypatch.setattr(registration_module, "SAID_EVERY_S", said_every_s)
    caplog.set_level(logging.INFO, logger="discovery.registration")
    nospace_alarm(full_etcd, "DEACTIVATE")
    async with Discovery(EtcdSettings(endpoints=[full_etcd.url]), ns) as d:
        healthy = [True]
        reg = Registration(
            d,
            key=lambda wid: subjects.worker_key(ns, wid),
            value=lambda wid: WorkerInfo(
                worker=wid, model="m", role="agg", engine="vllm", block_size=16, events_ok=healthy[0]
            ),
            ttl=3,
        )
        await reg.start()
        failed_tries = 0
        rewriting = d.rewrite

        async def counted(key: str, value: bytes, lease: object) -> bool:
            nonlocal failed_tries
            try:
                return await rewriting(key, value, lease)  # type: ignore[arg-type]
            except DiscoveryError:
                failed_tries += 1
                raise

        d.rewrite = counted  # type: ignore[method-assign]
        nospace_alarm(full_etcd, "ACTIVATE")
        healthy[0] = False
        reg.update()
        await until(lambda: failed_tries >= 3, 10, "3 failed tries")
        assert reg.state is RegistrationState.REGISTERED  # the keep-alive works: only the puts are refused
        nospace_alarm(full_etcd, "DEACTIVATE")
        key = reg.key

        async def stored() -> bytes:
            assert d.client.kv is not None
            return bytes((await d.client.kv.get(key, timeout=5)).kvs[0].value)

        deadline = asyncio.get_running_loop().time() + 10
        while b'"events_ok":false' not in await stored():
            assert asyncio.get_running_loop().time() < deadline, "the update never landed"
            await asyncio.sleep(0.05)
        await reg.stop()
    said = [r for r in caplog.records if "re-put" in r.getMessage()]
    warnings = [r.getMessage() for r in said if r.levelno == logging.WARNING]
    first = warnings[0]
    assert f"re-putting {key} failed (put {key} failed: RESOURCE_EXHAUSTED" in first, first
    assert NO_SPACE in first and "--etcd-endpoints" not in first and "\n" not in first, first
    if said_every_s:
        assert len(warnings) == 1, warnings
    else:
        assert len(warnings) == failed_tries, warnings
        for n, line in enumerate(warnings[1:], 2):
            assert f"re-putting {key} still fails after" in line and f"({n} tries; the last: put {key}" in line, line
    ends = [r for r in said if r.levelno == logging.INFO]
    assert len(ends) == 1 and f"re-put {key} after" in ends[0].getMessage(), [r.getMessage() for r in said]
    assert f"({failed_tries} tries)" in ends[0].getMessage(), ends[0].getMessage()
