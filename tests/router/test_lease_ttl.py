"""A router's lease asks etcd for 10 s, a TTL no flag sets. etcd grants none under 1.5 of its
--election-timeout, rounded up: 12 s at 8000 ms. Until the review of 2026-12-07 every router on such
an etcd exited 2 naming a `--lease-ttl` it does not have; it now keeps the 12 s lease, says so once,
and counts 12 s where it counted its own (docs/router.md, "Lease TTL")."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from discovery import Discovery, Registration, RegistrationState
from kvswitch.servers import EtcdServer
from protocol.config import EtcdSettings
from tests.router.conftest import Cluster
from tests.router.polling import until


class _LongElectionEtcd(EtcdServer):
    """etcd with an 8 s election timeout (a cross-region cluster's): its least TTL is 12 s."""

    def _argv(self) -> list[str]:
        return [*super()._argv(), "--election-timeout", "8000", "--heartbeat-interval", "800"]


def _registered_anew(registration: Registration, old: int) -> bool:
    lease = registration.lease
    return lease is not None and lease.id != old and registration.state is RegistrationState.REGISTERED


@pytest.fixture(scope="module")
def long_election_etcd() -> Iterator[EtcdServer]:
    with _LongElectionEtcd() as server:
        yield server


async def test_a_router_on_an_etcd_whose_least_ttl_is_over_10_s_keeps_the_lease_etcd_grants(
    cluster: Cluster, long_election_etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    etcd = EtcdSettings(endpoints=[long_election_etcd.url])
    with caplog.at_level(logging.INFO, "discovery.registration"):
        router = await cluster.add_router(config={"etcd": etcd}, disagg="never")  # lease_ttl_s 10
    registration = router._registration
    assert registration is not None and registration.lease is not None
    assert registration.lease.ttl == registration.ttl == 12  # what /ready's warning and a failed revoke count
    first = registration.lease
    async with Discovery(etcd, cluster.ns) as d:
        assert await d.holder(registration.key) == first.id
        assert d.client.lease is not None
        assert (await d.client.lease.time_to_live(first.id, timeout=5)).grantedTTL == 12
        with caplog.at_level(logging.INFO, "discovery.registration"):
            await d.client.lease.revoke(first.id, timeout=5)  # lost: the router registers anew
            await until(lambda: _registered_anew(registration, first.id), timeout=20, what="a new lease")
        again = registration.lease
        assert again is not None and again.ttl == registration.ttl == 12
        assert await d.holder(registration.key) == again.id
    said = [r.getMessage() for r in caplog.records if "etcd granted" in r.getMessage()]
    assert said == [  # once: 12 s is asked for from then on
        f"lease {first.hex_id}: etcd granted 12 s where 10 s was asked (it grants no TTL under 1.5 x its "
        "--election-timeout, rounded up); 12 s it is"
    ]
