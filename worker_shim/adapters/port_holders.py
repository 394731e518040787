"""Which local TCP sockets hold a port, and in what state: Linux's /proc/net/tcp and /proc/net/tcp6,
read by protocol.port_holders (one parser of those tables for every process).

zmq_bind asks it after a bind failed with EADDRINUSE, where ZMQ says the same for a listener's port
(no later bind gets it), a connection's in TIME_WAIT (free within a minute) and an open
connection's local end (free only when that connection closes): every socket on the port, not
only listeners as protocol.port_holders names them. Each row of those files is a socket of this
network namespace: its local address and port, hex, and its state (include/net/tcp_states.h).
Elsewhere than Linux the files do not exist: `holders` raises the OSError, and the caller says it
cannot tell.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from protocol.port_holders import TCP_TABLES, local_address, local_port, tcp_sockets

__all__ = ["LISTEN", "PROC_NET_TCP", "TIME_WAIT", "Holder", "holders"]

PROC_NET_TCP = TCP_TABLES
LISTEN, TIME_WAIT = "LISTEN", "TIME_WAIT"
_STATES = {
    0x01: "ESTABLISHED",
    0x02: "SYN_SENT",
    0x03: "SYN_RECV",
    0x04: "FIN_WAIT1",
    0x05: "FIN_WAIT2",
    0x06: TIME_WAIT,
    0x07: "CLOSE",
    0x08: "CLOSE_WAIT",
    0x09: "LAST_ACK",
    0x0A: LISTEN,
    0x0B: "CLOSING",
    0x0C: "NEW_SYN_RECV",
}


@dataclass(frozen=True, slots=True)
class Holder:
    """A socket on the port: its local address (an IPv4-mapped IPv6 one as its IPv4, as ZMQ opens
    it) and its TCP state's name."""

    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    state: str

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host} ({self.state})"


def holders(port: int, paths: tuple[str, ...] = PROC_NET_TCP) -> list[Holder]:
    """The sockets whose local port is `port`. OSError when no file of `paths` can be read (not
    Linux); a missing tcp6 alone (IPv6 off) is no error."""
    found: list[Holder] = []
    for local, state_field, _ in tcp_sockets(paths):
        if local_port(local) == port:
            state = int(state_field, 16)
            found.append(Holder(local_address(local), _STATES.get(state, f"state 0x{state:02X}")))
    return found
