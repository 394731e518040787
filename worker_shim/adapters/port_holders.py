"""Which local TCP sockets hold a port: Linux's /proc/net/tcp and /proc/net/tcp6.

zmq_bind asks it after a bind failed with EADDRINUSE, where ZMQ says the same for a listener's port
(no later bind gets it), a connection's in TIME_WAIT (free within a minute) and an open
connection's local end (free only when that connection closes). Each row of those files is a socket
of this network namespace: its local address and port, hex, and its state (include/net/tcp_states.h).
Elsewhere than Linux the files do not exist: `holders` raises the OSError, and the caller says it
cannot tell.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

__all__ = ["LISTEN", "PROC_NET_TCP", "TIME_WAIT", "Holder", "holders"]

PROC_NET_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
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


def _address(field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    # The kernel prints each 32-bit word of the network-order address as a native integer (%08X).
    words = [int(field[i : i + 8], 16) for i in range(0, len(field), 8)]
    packed = struct.pack(f"={len(words)}I", *words)
    if len(packed) == 4:
        return ipaddress.IPv4Address(packed)
    ip = ipaddress.IPv6Address(packed)
    return ip.ipv4_mapped or ip


def holders(port: int, paths: tuple[str, ...] = PROC_NET_TCP) -> list[Holder]:
    """The sockets whose local port is `port`. OSError when no file of `paths` can be read (not
    Linux); a missing tcp6 alone (IPv6 off) is no error."""
    found: list[Holder] = []
    read = 0
    error: OSError | None = None
    for path in paths:
        try:
            with open(path, encoding="ascii") as table:
                rows = table.readlines()[1:]  # the header
        except OSError as exc:
            error = error or exc
            continue
        read += 1
        for row in rows:
            fields = row.split()
            if len(fields) < 4:
                continue
            local, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) == port:
                state = int(fields[3], 16)
                found.append(Holder(_address(local), _STATES.get(state, f"state 0x{state:02X}")))
    if not read:
        assert error is not None
        raise error
    return found
