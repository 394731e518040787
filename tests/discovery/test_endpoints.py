"""How --etcd-endpoints become a gRPC channel, against real etcd servers. etcd3aio builds an `ipv4:`
target, where a DNS name never connects (every shipped deployment names etcd by DNS), and with
several TLS endpoints it checked the certificates against the whole comma-joined list."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trustme

from discovery import Discovery, Snapshot
from discovery.session import channel_target
from kvswitch.servers import EtcdCluster, EtcdServer, TlsFiles
from protocol import ConfigError
from protocol.config import EtcdSettings
from tests.kvswitch.test_tls import _tls_files


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return _tls_files(trustme.CA(), tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def etcd_tls(tls: TlsFiles) -> Iterator[EtcdServer]:
    with EtcdServer(tls=tls, peer_tls=tls) as server:
        yield server


async def _round_trip(settings: EtcdSettings) -> bytes | None:
    """A write, then a watch's snapshot of it."""
    async with Discovery(settings.validate(), "endpoints") as d:
        await d.put_raw("/endpoints/probe/k", b"1")
        async for event in d.watch_raw("/endpoints/probe/"):
            assert isinstance(event, Snapshot)
            return event.items.get("k")
    return None


async def test_a_dns_name_connects(etcd_url: str) -> None:
    # LOCALHOST: a name etcd3aio's own rewrite of "localhost" to 127.0.0.1 does not touch
    port = etcd_url.rsplit(":", 1)[1]
    assert await _round_trip(EtcdSettings(endpoints=[f"http://LOCALHOST:{port}"])) == b"1"


async def test_a_dns_name_over_tls_is_checked_against_that_name(etcd_tls: EtcdServer, tls: TlsFiles) -> None:
    port = etcd_tls.url.rsplit(":", 1)[1]
    settings = EtcdSettings(endpoints=[f"https://LOCALHOST:{port}"], tls_ca=str(tls.ca))
    assert await _round_trip(settings) == b"1"


async def test_several_tls_endpoints_connect(tls: TlsFiles) -> None:
    # kvswitch up --secure --etcd-members 3 could not start: no certificate names a list
    with EtcdCluster(3, tls=tls, peer_tls=tls) as cluster:
        assert await _round_trip(EtcdSettings(endpoints=cluster.urls, tls_ca=str(tls.ca))) == b"1"


def test_the_channel_target_of_each_kind_of_endpoint_list() -> None:
    def target(*urls: str) -> tuple[str, str | None]:
        return channel_target(EtcdSettings(endpoints=list(urls)).validate())

    assert target("http://etcd.kvswitch.svc:2379") == ("dns:///etcd.kvswitch.svc:2379", None)
    assert target("http://10.0.0.1:2379") == ("ipv4:10.0.0.1:2379", None)
    assert target("http://10.0.0.1:2379", "http://10.0.0.2:2380") == ("ipv4:10.0.0.1:2379,10.0.0.2:2380", "10.0.0.1")
    assert target("http://[::1]:2379", "http://[fd00::2]") == ("ipv6:[::1]:2379,[fd00::2]:2379", "::1")


@pytest.mark.parametrize(
    ("urls", "why"),
    [
        (["http://etcd-0.etcd-headless:2379", "http://etcd-1.etcd-headless:2379"], "several endpoints must be IP"),
        (["http://10.0.0.1:2379", "http://etcd:2379"], "several endpoints must be IP"),
        (["http://10.0.0.1:2379", "http://[::1]:2379"], "IPv4 or IPv6 addresses, not both"),
    ],
)
def test_endpoint_lists_no_channel_can_balance_over_are_refused_naming_the_flag(urls: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why) as caught:
        EtcdSettings(endpoints=urls).validate()
    assert caught.value.setting == "etcd_endpoints"


def test_the_check_is_the_settings_own() -> None:
    # every process validates its settings at startup: a bad list never reaches a connect
    assert EtcdSettings(endpoints=["http://etcd:2379"]).validate().members() == (None, [("etcd", 2379)])
