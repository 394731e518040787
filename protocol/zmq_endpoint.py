"""ZMQ endpoint syntax, split once for every process: `tcp://HOST:PORT` (an IPv6 HOST in
brackets), `ipc://PATH`, `inproc://NAME`. Each side keeps its own policy on what it splits (the
sim takes port 0 or `*`, as ZMQ binds; the shim takes port 0 only as vLLM's `tcp://*:0`).

Refused here, as ZMQ refuses them only when a socket opens them (each session, for ever, naming
no flag) or opens something else: no port, a port that is not ASCII digits or `*`, past 65535
(ZMQ wraps it), no host, `[]`, unbalanced brackets, a bracketed host that is no IPv6 address, an
IPv6 address without brackets (ZMQ reads it only with zmq.IPV6 set), whitespace or `/` in a host.
"""

from __future__ import annotations

import ipaddress

import msgspec

__all__ = ["WILDCARD_HOSTS", "ZmqEndpoint", "split_endpoint"]

# A host that binds every address: a peer reaches it at the binding host (vLLM's _WILDCARD_HOSTS).
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::"})
_SCHEMES = ("tcp", "ipc", "inproc")
MAX_PORT = 65535


class ZmqEndpoint(msgspec.Struct, frozen=True):
    """One endpoint, split. tcp: `host` without brackets, `port` None for `*`; ipc/inproc: `path`."""

    scheme: str
    host: str = ""
    port: int | None = None
    path: str = ""

    @property
    def ipv6(self) -> bool:
        """Whether the host is an IPv6 address: a ZMQ socket opens it only with zmq.IPV6 set."""
        return ":" in self.host

    @property
    def ipv4_mapped(self) -> bool:
        """An IPv6 host such as ::ffff:127.0.0.1, which ZMQ without zmq.IPV6 opens as its IPv4."""
        return self.ipv6 and ipaddress.IPv6Address(self.host.partition("%")[0]).ipv4_mapped is not None

    @property
    def wildcard(self) -> bool:
        return self.scheme == "tcp" and self.host in WILDCARD_HOSTS

    def on_host(self, host: str) -> str:
        """This endpoint with another host (bracketed if IPv6), as a string."""
        shown = f"[{host}]" if ":" in host else host
        return f"tcp://{shown}:{'*' if self.port is None else self.port}"


def split_endpoint(endpoint: str) -> ZmqEndpoint | None:
    """`endpoint` split, or None if ZMQ cannot open it as one endpoint (the module's list)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in _SCHEMES or not rest:
        return None
    if scheme != "tcp":
        return ZmqEndpoint(scheme, path=rest)
    host, colon, port = rest.rpartition(":")
    if not colon or not host or any(c.isspace() or c == "/" for c in host):
        return None
    if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= MAX_PORT):
        return None
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
        if not _ipv6(host):
            return None
    elif "[" in host or "]" in host or ":" in host:
        return None
    return ZmqEndpoint(scheme, host=host, port=None if port == "*" else int(port))


def _ipv6(host: str) -> bool:
    address, _, zone = host.partition("%")  # fe80::1%eth0: ZMQ takes a zone
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return "%" not in host or bool(zone)
