"""Who listens on a local TCP port: the pid and command line of its process, from Linux's /proc.

For a process that cannot bind a port it was given (a router's or a sim's HTTP port, a sim's KV
event ports, a shim's event endpoint, `kvswitch up`'s NATS and etcd ports): a check for a free port
cannot see who binds it afterwards, and "Address already in use" alone names no one. Elsewhere than
Linux the tables do not exist and nothing is named.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

__all__ = ["held_by", "listeners", "listening_inodes", "port_holders", "socket_inodes"]


def _address(hex_host: str) -> str:
    raw = bytes.fromhex(hex_host)
    # /proc prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def _listening(net: str) -> Iterator[tuple[str, str]]:
    """(local address field, socket inode) of every listening TCP socket, IPv4 and IPv6, in the
    tables under `net` (`/proc/<pid>/net` for a process's network namespace; Linux), unparsed."""
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(net, table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A":  # LISTEN
                    yield fields[1], fields[9]


def listeners(net: str = "/proc/net") -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every listening TCP socket under `net` (`_listening`)."""
    out = []
    for local, inode in _listening(net):
        host, port = local.split(":")
        out.append((_address(host), int(port, 16), inode))
    return out


def listening_inodes(ports: Collection[int], net: str = "/proc/net") -> dict[str, int]:
    """{socket inode: port} of the listening TCP sockets on `ports` alone: a poll's cost is then one
    read of each table, not an address parsed for each of a busy host's thousands of sockets."""
    return {inode: port for local, inode in _listening(net) if (port := int(local.rpartition(":")[2], 16)) in ports}


def socket_inodes(pid: int | str) -> set[str]:
    """The inodes of the sockets process `pid` holds open (empty where it cannot be read)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # closed meanwhile
                if (target := os.readlink(fd)).startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    return inodes


def port_holders(ports: Sequence[int]) -> list[str]:
    """Who listens on each of `ports` that something listens on ("port 9 is held by pid 12
    (nats-server -c ...)"), in one walk of /proc (Linux).

    For a server that could not bind: a check for a free port cannot see who binds it afterwards.
    """
    wanted = listening_inodes(ports)
    if not wanted:
        return []  # nothing listens (or no /proc to tell): no walk of /proc
    holders: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if len(holders) == len(set(wanted.values())):
            break  # every port held is named
        if proc.name.isdigit() and (mine := socket_inodes(proc.name) & wanted.keys()):
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                for inode in mine:
                    holders.setdefault(wanted[inode], f"pid {proc.name} ({cmdline[:200]})")
    for inode, p in wanted.items():
        holders.setdefault(p, f"a process this user cannot see (socket inode {inode})")
    return [f"port {p} is held by {holders[p]}" for p in ports if p in holders]


def held_by(port: int) -> str:
    """Who listens on `port`, for an error that could not bind it ("port 8080 is held by pid 12
    (python3 -m http.server 8080)"); empty when none does (closed meanwhile, or not Linux)."""
    return "; ".join(port_holders([port]))
