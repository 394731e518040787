"""Where the router's front door cannot listen, the setting at fault is named: a host that does not
resolve, or an address not on this machine, is --http-host's. Both were blamed on --http-port
("invalid http_port (--http-port, ...) = 18099: cannot listen on bogus.invalid: [Errno -2] ...")."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from protocol import ConfigError
from protocol.config import EtcdSettings, NatsSettings
from router.service import RouterConfig, RouterService
from tests.listen_backlog import connected_while_blocked


async def _start(nats_url: str, etcd_url: str, host: str, port: int = 0) -> ConfigError:
    router = RouterService(
        RouterConfig(
            nats=NatsSettings(servers=[nats_url]),
            etcd=EtcdSettings(endpoints=[etcd_url]),
            http_host=host,
            http_port=port,
        )
    )
    with pytest.raises(ConfigError) as err:
        await router.start()
    return err.value


async def test_a_host_it_cannot_listen_on_is_named_as_http_host(nats_url: str, etcd_url: str) -> None:
    err = await _start(nats_url, etcd_url, "bogus.invalid")
    assert (err.setting, err.value) == ("http_host", "bogus.invalid")
    assert str(err).startswith("invalid http_host (--http-host, KVSWITCH_HTTP_HOST) = 'bogus.invalid': cannot listen")
    err = await _start(nats_url, etcd_url, "192.0.2.1")  # TEST-NET-1: resolves, but is no address of this machine
    assert (err.setting, err.value) == ("http_host", "192.0.2.1")
    assert "cannot assign requested address" in str(err).lower()


async def test_a_port_taken_is_still_named_as_http_port(nats_url: str, etcd_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = await _start(nats_url, etcd_url, "127.0.0.1", port)
    assert (err.setting, err.value) == ("http_port", port) and "cannot listen on 127.0.0.1" in str(err)
    # and who holds it, with what to change: it was "[Errno 98] Address already in use" alone
    held = f"cannot listen on 127.0.0.1:{port} (Address already in use; port {port} is held by pid {os.getpid()} ("
    assert held in str(err) and str(err).endswith("choose another --http-port, or 0 for a free one"), err


async def test_a_bad_host_or_port_is_named_before_nats_and_etcd_are_waited_on() -> None:
    # before, the router retried an unreachable NATS for ever and never said its --http-host was bad
    unreachable = "nats://127.0.0.1:1", "http://127.0.0.1:1"
    err = await asyncio.wait_for(_start(*unreachable, "bogus.invalid"), 10)
    assert (err.setting, err.value) == ("http_host", "bogus.invalid")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = await asyncio.wait_for(_start(*unreachable, "127.0.0.1", port), 10)
    assert (err.setting, err.value) == ("http_port", port)


async def test_an_ipv6_wildcard_host_beside_an_ipv4_listener_on_its_port_starts(nats_url: str, etcd_url: str) -> None:
    # the listener binds `::` IPv6-only, as asyncio does; a dual-stack probe was refused by the IPv4
    # socket and blamed --http-port
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    with socket.socket() as ipv4:
        ipv4.bind(("0.0.0.0", 0))
        ipv4.listen()
        port = ipv4.getsockname()[1]
        router = RouterService(
            RouterConfig(
                nats=NatsSettings(servers=[nats_url]),
                etcd=EtcdSettings(endpoints=[etcd_url]),
                http_host="::",
                http_port=port,
            )
        )
        try:
            await router.start()
        finally:
            await router.stop()


async def test_a_burst_of_new_clients_waits_in_the_listen_backlog_while_the_router_is_busy(
    nats_url: str, etcd_url: str
) -> None:
    """vLLM's front door listens with uvicorn's backlog of 2048; with aiohttp's default of 128 the
    router reset the connections of a burst of new clients while its loop was busy."""
    router = RouterService(
        RouterConfig(nats=NatsSettings(servers=[nats_url]), etcd=EtcdSettings(endpoints=[etcd_url]), http_port=0)
    )
    await router.start()
    try:
        host, port = router.url.removeprefix("http://").split(":")
        assert connected_while_blocked(host, int(port), 300) == 300
    finally:
        await router.stop()
