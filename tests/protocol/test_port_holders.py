"""protocol.port_holders: who listens on a port, for every process's "cannot bind" error (a router's
or a sim's HTTP port, a sim's KV event ports, a shim's event endpoint, `kvswitch up`'s ports)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

import pytest

from protocol.errors import listen_error, why_unbound
from protocol.port_holders import held_by, local_address, local_port, tcp_sockets


def test_a_listened_port_names_this_process_and_a_free_one_no_one() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert held_by(port).startswith(f"port {port} is held by pid {os.getpid()} (")
    assert held_by(port) == ""


def test_a_port_in_use_is_said_with_its_holder_and_the_flag_to_change() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        in_use = OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        said = str(listen_error("127.0.0.1", port, in_use))
        denied = why_unbound(port, OSError(errno.EACCES, os.strerror(errno.EACCES)))
    holder = f"port {port} is held by pid {os.getpid()} ("
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use; {holder}" in said, said
    assert said.endswith("): choose another --http-port, or 0 for a free one"), said
    assert denied == "Permission denied"  # not a holder's fault: no holder named


def test_a_tables_local_address_field_is_read_as_the_kernel_prints_it() -> None:
    # One parser for every process (the shim's reader had its own): each 32-bit word native-endian
    assert (local_address("0100007F:1F90"), local_port("0100007F:1F90")) == (ipaddress.ip_address("127.0.0.1"), 8080)
    assert local_address("00000000000000000000000001000000:0050") == ipaddress.ip_address("::1")
    assert local_address("0000000000000000FFFF00000100007F:0050") == ipaddress.ip_address("127.0.0.1")


def test_the_tables_list_every_socket_state_and_a_missing_table_alone_is_no_error() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rows = [row for row in tcp_sockets(("/proc/net/tcp", "/nonexistent/tcp6")) if local_port(row[0]) == port]
    assert [state for _, state, _ in rows] == ["0A"], rows
    with pytest.raises(FileNotFoundError):
        tcp_sockets(("/nonexistent/tcp",))
