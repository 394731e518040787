"""Shared fixtures: real nats-server and etcd on free loopback ports, one pair per xdist worker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvswitch.servers import EtcdServer, NatsServer


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
def etcd_url(etcd_server: EtcdServer) -> str:
    return etcd_server.url


@pytest.fixture
def ns() -> str:
    """A namespace of its own per test, so tests sharing one server never see each other."""
    return "t" + uuid.uuid4().hex[:10]
