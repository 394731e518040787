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
import struct
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

__all__ = [
    "TCP_TABLES",
    "held_by",
    "listeners",
    "listening_inodes",
    "local_address",
    "local_port",
    "port_holders",
    "socket_inodes",
    "tcp_sockets",
]

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")  # this network namespace's TCP sockets, IPv4 and IPv6
_LISTEN = "0A"  # include/net/tcp_states.h


def tcp_sockets(paths: Sequence[str] = TCP_TABLES) -> list[tuple[str, str, str]]:
    """(local address field, state field, socket inode) of every TCP socket the tables `paths` list
    (Linux's /proc/net/tcp{,6}; /proc/<pid>/net/... for a process's network namespace), unparsed: a
    busy host lists thousands, and a caller parses (`local_port`, `local_address`) those it keeps.
    OSError when no file of `paths` can be read (not Linux); a missing tcp6 alone (IPv6 off) is no
    error."""
    rows: list[tuple[str, str, str]] = []
    error: OSError | None = None
    read = False
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="ascii").splitlines()[1:]  # the header
        except OSError as exc:
            error = error or exc
            continue
        read = True
        rows += [(fields[1], fields[3], fields[9]) for fields in map(str.split, lines) if len(fields) > 9]
    if not read and error is not None:
        raise error
    return rows


def local_port(field: str) -> int:
    """The port of a local address field (`0100007F:1F90`)."""
    return int(field.rpartition(":")[2], 16)


def local_address(field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address of a local address field, an IPv4-mapped IPv6 one as its IPv4 (as ZMQ opens it)."""
    hex_host = field.partition(":")[0]
    # The kernel prints each 32-bit word of the network-order address as a native integer (%08X).
    words = [int(hex_host[i : i + 8], 16) for i in range(0, len(hex_host), 8)]
    packed = struct.pack(f"={len(words)}I", *words)
    if len(packed) == 4:
        return ipaddress.IPv4Address(packed)
    ip = ipaddress.IPv6Address(packed)
    return ip.ipv4_mapped or ip


def _listening(net: str) -> Iterator[tuple[str, str]]:
    """(local address field, socket inode) of every listening TCP socket, IPv4 and IPv6, in the
    tables under `net` (`/proc/<pid>/net` for a process's network namespace; Linux), unparsed."""
    with contextlib.suppress(OSError):  # not Linux: none
        for local, state, inode in tcp_sockets((f"{net}/tcp", f"{net}/tcp6")):
            if state == _LISTEN:
                yield local, inode


def listeners(net: str = "/proc/net") -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every listening TCP socket under `net` (`_listening`)."""
    return [(str(local_address(local)), local_port(local), inode) for local, inode in _listening(net)]


def listening_inodes(ports: Collection[int], net: str = "/proc/net") -> dict[str, int]:
    """{socket inode: port} of the listening TCP sockets on `ports` alone: a poll's cost is then one
    read of each table, not an address parsed for each of a busy host's thousands of sockets."""
    return {inode: port for local, inode in _listening(net) if (port := local_port(local)) in ports}


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
