"""Shared fixtures: real nats-server and etcd on free loopback ports, one pair per xdist worker."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from kvswitch.servers import FREE_PORTS_ENV, EtcdServer, NatsServer
from tests import loop_tasks
from tests.relay import Relay


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


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.is_registered(loop_tasks):  # unless `-p tests.loop_tasks` did
        config.pluginmanager.register(loop_tasks, "loop_tasks")


@pytest.fixture(autouse=True)
def logging_as_found() -> Iterator[None]:
    """The root logger's handlers, filters and level put back after each test. A test that runs a
    service's entry in-process (runtime.run_service: configure_logging, kept for the process) left
    its handler, bound to that test's closed capsys stream, and INFO on the root: every later
    record in that xdist worker printed a 'Logging error' traceback (a 0.6 s test of 5,800
    WARNINGs took 17 s in the suite), and pytest's own --log-file and live-log handlers were gone."""
    root = logging.getLogger()
    handlers, filters, level = root.handlers[:], root.filters[:], root.level
    yield
    root.handlers[:], root.filters[:] = handlers, filters
    root.setLevel(level)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture
async def etcd_relay(etcd_server: EtcdServer) -> AsyncIterator[Relay]:
    """The session's etcd behind a relay of the test's own: delayed, frozen, refusing or cut for
    the process that connects through it while etcd serves everyone else."""
    relay = Relay(etcd_server.port)
    await relay.start()
    yield relay
    relay.frozen.clear()
    relay.cut()
    await relay.close()


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
