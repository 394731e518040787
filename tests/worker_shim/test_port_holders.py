"""Whose socket fails a bind with EADDRINUSE, read from /proc/net/tcp{,6} (worker_shim.adapters.
port_holders), and what zmq_bind makes of it. Until 2026-12-07 the shim connected to the address
(127.0.0.1 for a wildcard) and took any port nothing answered on for a connection's, which frees
itself: a listed port an open connection held was looked at again every second for ever, with
nothing on /health, and a wildcard endpoint a listener held on another local address too (review,
2026-12-07)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from protocol import ConfigError
from worker_shim.adapters import zmq_bind
from worker_shim.adapters.port_holders import holders
from worker_shim.adapters.zmq_bind import NAME_GRACE_S, TIME_WAIT_GRACE_S, BindFailures, BindPending, in_use
from worker_shim.kv_events_config import listed_mode

URL = "http://127.0.0.1:8000"


@contextmanager
def _held() -> Iterator[int]:
    """A port that an open connection's local end holds (ESTABLISHED), nothing listening on it."""
    with socket.socket() as listener, socket.socket() as held:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held.bind(("127.0.0.1", 0))
        held.connect(listener.getsockname())
        yield held.getsockname()[1]


def _time_wait() -> int:
    """A port a connection this side closed first holds in TIME_WAIT (for 60 s)."""
    with socket.socket() as listener, socket.socket() as client:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client.bind(("127.0.0.1", 0))
        client.connect(listener.getsockname())
        port: int = client.getsockname()[1]
        accepted, _ = listener.accept()
        client.close()  # the active close: its end goes to TIME_WAIT
        time.sleep(0.2)
        accepted.close()
    return port


def test_the_reader_lists_each_socket_on_a_port_with_its_address_and_state() -> None:
    with socket.socket() as listener, socket.socket() as held:
        listener.bind(("127.0.0.2", 0))
        listener.listen()
        held.bind(("127.0.0.1", 0))
        held.connect(listener.getsockname())
        # the listener, and the end it accepted (not yet taken by accept())
        listed = sorted(str(h) for h in holders(listener.getsockname()[1]))
        assert listed == ["127.0.0.2 (ESTABLISHED)", "127.0.0.2 (LISTEN)"], listed
        assert [str(h) for h in holders(held.getsockname()[1])] == ["127.0.0.1 (ESTABLISHED)"]
    assert [str(h) for h in holders(_time_wait())] == ["127.0.0.1 (TIME_WAIT)"]
    with pytest.raises(FileNotFoundError):
        holders(1, ("/nonexistent/tcp",))


async def test_a_listed_port_an_open_connection_holds_is_final_after_the_grace_naming_its_state() -> None:
    now = [0.0]
    binds = BindFailures(clock=lambda: now[0])
    with _held() as port:
        listed = f"tcp://127.0.0.1:{port}"
        with pytest.raises(BindPending) as pending:
            await listed_mode(listed, None, "auto", URL, binds)
        assert f"a connection's local end holds port {port} (127.0.0.1 (ESTABLISHED))" in str(pending.value)
        now[0] = NAME_GRACE_S
        with pytest.raises(ConfigError) as caught:
            await listed_mode(listed, None, "auto", URL, binds)
    assert caught.value.setting == "kv_events_mode"
    assert "(127.0.0.1 (ESTABLISHED)), which frees it only as that connection closes" in str(caught.value)
    assert f"(binds failed for {NAME_GRACE_S:.0f} s)" in str(caught.value)


async def test_a_listed_port_in_time_wait_is_looked_at_again_past_its_minute_then_is_final() -> None:
    port = _time_wait()
    now = [0.0]
    binds = BindFailures(clock=lambda: now[0])
    listed = f"tcp://127.0.0.1:{port}"
    for at in (0.0, NAME_GRACE_S, 61.0):  # past the grace an open connection gets, and TIME_WAIT's 60 s
        now[0] = at
        with pytest.raises(BindPending) as pending:
            await listed_mode(listed, None, "auto", URL, binds)
        assert f"connections closed within a minute hold port {port} in TIME_WAIT" in str(pending.value)
    now[0] = TIME_WAIT_GRACE_S
    with pytest.raises(ConfigError) as caught:
        await listed_mode(listed, None, "auto", URL, binds)
    assert "(127.0.0.1 (TIME_WAIT))" in str(caught.value)


@pytest.mark.parametrize(
    ("endpoint", "listener"),
    [("tcp://*:{port}", "127.0.0.2"), ("tcp://127.0.0.1:{port}", "0.0.0.0")],
    ids=["wildcard-another-address", "address-wildcard-listener"],
)
async def test_a_listener_the_bind_meets_on_any_address_is_final(endpoint: str, listener: str) -> None:
    # A wildcard endpoint meets a listener on 127.0.0.2 (or the pod IP), which a connect to
    # 127.0.0.1 does not reach: that was taken for a connection's port, tried again for ever.
    with socket.socket() as lis:
        lis.bind((listener, 0))
        lis.listen()
        port = lis.getsockname()[1]
        found = await in_use(endpoint.format(port=port))
    assert found.outcome == "final", found
    holder = f"port {port} is held by pid {os.getpid()} ("
    assert f"another process listens there ({listener} (LISTEN)): stop it ({holder}" in found.why, found.why
    assert "the shim's --kv-events" in found.why


async def test_a_host_without_the_tables_gets_the_grace_and_says_it_cannot_tell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(port: int) -> list[object]:
        raise FileNotFoundError(2, "No such file or directory", "/proc/net/tcp")

    monkeypatch.setattr(zmq_bind, "holders", missing)
    found = await in_use("tcp://127.0.0.1:5557")
    assert found.outcome == "grace" and found.grace_s is None, found
    assert "another socket holds port 5557, and this host does not say whose" in found.why


async def test_a_holder_gone_as_it_was_looked_at_is_no_cause_to_say(caplog: pytest.LogCaptureFixture) -> None:
    # The port freed between ZMQ's failed bind and the look: a second "trying again each session"
    # WARNING followed the real cause's, for a session that binds next (clean-clone CI, 2026-12-07).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found = await in_use(f"tcp://127.0.0.1:{port}")
    assert found.outcome == "again" and not found.news, found
    with caplog.at_level(logging.INFO, logger="worker_shim"):
        pending = BindFailures().pending("kv_events", f"tcp://127.0.0.1:{port}", "cannot bind", found)
    assert isinstance(pending, BindPending)
    assert not [r for r in caplog.records if "trying again each session" in r.getMessage()], caplog.text
