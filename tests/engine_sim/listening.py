"""Which TCP addresses a process listens on, read from /proc (Linux): what the kernel says, not what
the code meant to bind."""

from __future__ import annotations

import ipaddress
import os

__all__ = ["listening"]

_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_host: str) -> str:
    raw = bytes.fromhex(hex_host)
    # /proc prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, IPv4 and IPv6."""
    inodes = _socket_inodes(pid)
    out: set[tuple[str, int]] = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    host, port = fields[1].split(":")
                    out.add((_address(host), int(port, 16)))
    return out
