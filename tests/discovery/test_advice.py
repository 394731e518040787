"""What a failed etcd call says and asks of an operator (discovery.advice), against a real etcd:
one that does not answer (a relay frozen: a hung member) and one that answers and refuses (its
NOSPACE alarm raised: the quota full).

Review of 2026-12-07: a grant out of time was "lease grant failed: " (a timeout's str() is empty),
one a full etcd refused a five-line gRPC repr, and the shim named --etcd-endpoints for both."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from etcd3aio import EtcdConnectionError, EtcdPermissionDeniedError

from discovery import Discovery, DiscoveryError, Registration, RegistrationState, advice
from discovery import registration as registration_module
from discovery.advice import NO_SPACE, REFUSED, UNANSWERED
from kvswitch.servers import EtcdServer
from protocol import WorkerInfo, subjects
from protocol.config import EtcdSettings
from tests.etcd_alarm import nospace_alarm
from tests.relay import Relay
from tests.router.polling import until


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
    ],
)
def test_the_endpoints_are_named_only_where_etcd_did_not_answer(cause: BaseException, expected: str) -> None:
    assert advice(_raised_from(cause)) == expected
    assert advice(cause) == expected


def test_a_discovery_error_of_its_own_asks_nothing() -> None:
    assert advice(DiscoveryError("the registration's supervisor of /k crashed")) == ""


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


@pytest.fixture
async def relay(etcd_server: EtcdServer) -> AsyncIterator[Relay]:
    relay = Relay(etcd_server.port)
    await relay.start()
    yield relay
    relay.frozen.clear()
    relay.cut()
    await relay.close()


async def test_a_hung_etcd_is_said_as_a_timeout_naming_the_endpoints(relay: Relay, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[f"http://127.0.0.1:{relay.port}"]), ns) as d:
        relay.frozen.set()  # connected, then nothing answers: a member that hangs
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
