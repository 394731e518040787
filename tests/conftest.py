"""Shared fixtures: real nats-server and etcd on free loopback ports, one pair per xdist worker."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from kvswitch.servers import FREE_PORTS_ENV, EtcdServer, NatsServer


def _own_ports() -> None:
    """Each xdist worker draws its servers' ports from a range of its own (children inherit it):
    from one range, two workers took the same port between one's check and its server's bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None or FREE_PORTS_ENV in os.environ:
        return
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    low, high = 10000, 32768  # below the kernel's default ephemeral range
    span = (high - low) // max(count, 1)
    n = int(worker.removeprefix("gw"))
    os.environ[FREE_PORTS_ENV] = f"{low + n * span}-{low + (n + 1) * span}"


_own_ports()


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture
def own_nats() -> Iterator[NatsServer]:
    """A nats-server of the test's own, to kill and start again (the session's is shared)."""
    with NatsServer() as server:
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
