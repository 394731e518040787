"""Which TCP addresses a process listens on, read from /proc (Linux): what the kernel says, not what
the code meant to bind."""

from __future__ import annotations

from protocol.port_holders import listeners, socket_inodes

__all__ = ["listening"]


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, IPv4 and IPv6."""
    inodes = socket_inodes(pid)
    return {(address, port) for address, port, inode in listeners(f"/proc/{pid}/net") if inode in inodes}
