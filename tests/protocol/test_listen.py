"""protocol.errors.bind_sockets, shared by try_listen (a port checked before a process starts) and
the router's start door (the port it serves on): bound, not listening, and nothing left bound when
one address cannot be had."""

from __future__ import annotations

import errno
import socket

import pytest

from protocol.errors import bind_sockets, try_listen


def test_the_sockets_are_bound_not_listening_and_their_port_is_free_once_closed() -> None:
    sockets = bind_sockets("127.0.0.1", 0)
    assert len(sockets) == 1
    port = sockets[0].getsockname()[1]
    with socket.socket() as client, pytest.raises(ConnectionRefusedError):
        client.connect(("127.0.0.1", port))
    sockets[0].close()
    try_listen("127.0.0.1", port)


def test_a_port_listened_on_is_refused_and_the_addresses_bound_before_it_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as held, socket.socket() as spare:
        held.bind(("127.0.0.1", 0))
        held.listen()
        spare.bind(("127.0.0.1", 0))
        free = spare.getsockname()[1]
        spare.close()
        addresses = [("127.0.0.1", free), held.getsockname()]
        infos = [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", a) for a in addresses]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *_, **__: infos)
        with pytest.raises(OSError) as err:
            bind_sockets("somewhere", 0)
        assert err.value.errno == errno.EADDRINUSE
        with socket.socket() as again:  # no SO_REUSEADDR: fails while the first socket is still bound
            again.bind(("127.0.0.1", free))
