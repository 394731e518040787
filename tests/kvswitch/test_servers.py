"""kvswitch.servers: free ports handed out once across a process and its children, and a server that
cannot bind naming the port and who holds it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvswitch.servers import FREE_PORTS_ENV, NatsServer, ServerError, _port_range, free_port, free_ports

DRAWS = 30
_CHILD = f"from kvswitch.servers import free_port; print(*[free_port() for _ in range({DRAWS})])"


def test_a_parent_and_its_child_drawing_from_one_range_get_disjoint_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing binds these ports, as nothing had yet bound a test's --http-port when its `kvswitch up`
    # drew its NATS ports: each process drew at random, alone, and the two took one port (CI, 2026-12-06).
    low = _port_range()[0]
    monkeypatch.setenv(FREE_PORTS_ENV, f"{low}-{low + 100}")  # within this worker's own range
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    mine = [free_port() for _ in range(DRAWS)]
    out, _ = child.communicate(timeout=60)
    theirs = [int(p) for p in out.split()]
    assert child.returncode == 0 and len(theirs) == DRAWS
    assert len(set(mine)) == DRAWS and len(set(theirs)) == DRAWS, (mine, theirs)
    assert not set(mine) & set(theirs), sorted(set(mine) & set(theirs))


def test_consecutive_draws_do_not_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    # A NatsCluster's client, monitor and cluster ports are three draws, none bound before the last.
    low = _port_range()[0]
    monkeypatch.setenv(FREE_PORTS_ENV, f"{low}-{low + 60}")
    taken = [p for base in (free_ports(3) for _ in range(15)) for p in range(base, base + 3)]
    assert len(set(taken)) == len(taken), sorted(taken)


def test_a_draw_larger_than_the_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    with pytest.raises(ServerError, match=r"11 consecutive ports from 20000-20010"):
        free_ports(11)


def test_a_server_that_cannot_bind_names_the_port_and_its_holder() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ServerError, match=rf"port {port} is held by pid {os.getpid()} \(.*python"):
            NatsServer(port=port).start()


def test_a_server_given_one_port_twice_is_refused_before_it_starts() -> None:
    port = free_port()
    server = NatsServer(port=port, monitor_port=port)
    try:
        with pytest.raises(ServerError, match=rf"nats given one port for two of its listeners: \[{port}, {port}\]"):
            server.start()
        assert server.proc is None
    finally:
        server.close()
