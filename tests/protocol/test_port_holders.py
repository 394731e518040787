"""protocol.port_holders: who listens on a port, for every process's "cannot bind" error (a router's
or a sim's HTTP port, a sim's KV event ports, a shim's event endpoint, `kvswitch up`'s ports)."""

from __future__ import annotations

import errno
import os
import socket

from protocol.errors import listen_error, why_unbound
from protocol.port_holders import held_by


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
