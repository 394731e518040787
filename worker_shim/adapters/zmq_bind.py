"""Why the shim's SUB cannot bind its KV event address, and whether a later session could.

libzmq says only "Cannot assign requested address" (EADDRNOTAVAIL) or "No such device" (ENODEV),
for a bind that can never work and for one that works seconds later alike: a name it cannot
resolve yet (a DNS record that appears late, a temporary DNS failure) is ENODEV, and an IPv6
address still in duplicate-address detection ("tentative", 1-2 s after it is added) is
EADDRNOTAVAIL. So on either the shim asks the host itself:
- an IP address (an IPv4-mapped one as its IPv4, as ZMQ opens it): bound with a plain socket. It
  binds now: the next session tries again. No interface has it: a ConfigError at once. An IPv6 one
  that /proc/net/if_inet6 lists as tentative: try again; as having failed DAD: a ConfigError.
- a name: getaddrinfo. A temporary failure (EAI_AGAIN): try again for as long as it lasts. Anything
  else (no such name, IPv6 addresses only, addresses no interface has): try again, and a
  ConfigError once binds have failed for NAME_GRACE_S (a record may appear seconds after the pod).
EINVAL is final at once: after the shim's validation of the endpoint it has no cause that passes.
EADDRINUSE is another socket's port (`in_use`, from the sockets /proc/net/tcp{,6} lists on it): a
listener's is final (no new session frees it); connections in TIME_WAIT free it within a minute
(tried again for TIME_WAIT_GRACE_S); an open connection's local end frees it only when that
connection closes, so it gets NAME_GRACE_S, then is final naming the connection's state.
Each case is said once at WARNING, naming the setting; the session failure (BindPending, no
traceback) each session. `BindFailures.probe` asks the same before the shim takes a side of the
endpoint vLLM lists (kv_events_config.listed_mode): a SUB opened as the shim's is bound and closed.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import zmq
import zmq.asyncio

from protocol.errors import ConfigError
from protocol.port_holders import held_by
from protocol.zmq_endpoint import ZmqEndpoint, split_endpoint
from worker_shim.adapters.port_holders import LISTEN, TIME_WAIT, Holder, holders

__all__ = [
    "IF_INET6",
    "NAME_GRACE_S",
    "TIME_WAIT_GRACE_S",
    "UNBINDABLE",
    "BindFailures",
    "BindPending",
    "Diagnosis",
    "diagnose",
    "in_use",
    "socket_for",
]

log = logging.getLogger(__name__)
# The bind errors `diagnose` reads; any other is final, the caller's.
UNBINDABLE = (errno.EADDRNOTAVAIL, errno.ENODEV, errno.EINVAL, errno.EADDRINUSE)
# How long a name's binds may fail before the shim exits 2: a DNS record of a new pod or service
# appears within seconds; a typo never does. An open connection on the port gets as long to close.
NAME_GRACE_S = 15.0
# Linux keeps a closed connection's port in TIME_WAIT for 60 s (TCP_TIMEWAIT_LEN); counted from the
# run's first failure, which an open connection's NAME_GRACE_S may have begun.
TIME_WAIT_GRACE_S = NAME_GRACE_S + 60.0 + 15.0
IF_INET6 = "/proc/net/if_inet6"  # Linux: address, ifindex, prefix, scope, flags, name
_TENTATIVE, _DADFAILED = 0x40, 0x08  # IFA_F_TENTATIVE, IFA_F_DADFAILED (linux/if_addr.h)
_FIX = "Run the shim where the engine's PUB connects, or give --kv-events-mode connect if the engine binds it"

Outcome = Literal["final", "grace", "again"]


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """final: a ConfigError now; grace: try again until `grace_s` (None: NAME_GRACE_S) of
    failures; again: try again."""

    outcome: Outcome
    why: str
    grace_s: float | None = None
    news: bool = True  # False: the holder went as it was looked at, nothing for an operator to do


class BindPending(ConnectionError):
    """A bind a later session may make: BindFailures said its cause once at WARNING, naming the
    setting, so each session's failure is said at WARNING with no traceback."""


def socket_for(ctx: zmq.asyncio.Context, kind: int, address: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    split = split_endpoint(address)
    # Only then: a name would resolve to IPv6 first; an IPv4-mapped address opens as its IPv4, as the engine's does.
    if split is not None and split.ipv6 and not split.ipv4_mapped:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def _bind_error(address: str) -> zmq.ZMQError | None:
    """Why a SUB opened as the shim's cannot bind `address` now, as ZMQ says it; None if it can (the
    socket is closed again). Blocking: ZMQ resolves a name in the caller's thread."""
    ctx = zmq.asyncio.Context()
    sock = socket_for(ctx, zmq.SUB, address)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        return exc
    finally:
        sock.close(linger=0)
        ctx.term()
    return None


async def diagnose(address: str, exc: zmq.ZMQError) -> Diagnosis:
    """Why ZMQ could not bind `address` (a tcp:// one, validated), and whether it may later."""
    if exc.errno == errno.EADDRINUSE:
        return await in_use(address)
    split = split_endpoint(address)
    if exc.errno == errno.EINVAL:
        return Diagnosis("final", f"ZMQ calls the endpoint invalid. {_FIX}")
    if split is None or split.scheme != "tcp" or split.wildcard:
        return Diagnosis("final", f"no new session changes that. {_FIX}")
    try:
        ip = ipaddress.ip_address(split.host.partition("%")[0])
    except ValueError:
        return await _name(split.host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _address(str(ip.ipv4_mapped), ip.ipv4_mapped)
    return _address(split.host, ip)


async def in_use(address: str) -> Diagnosis:
    """Why a bind of `address` failed with EADDRINUSE, and whether a later one may work, from the
    sockets on its port that the bind meets: on its address or a wildcard one, and on any address
    for a wildcard endpoint or a name (whose address ZMQ chose)."""
    split = split_endpoint(address)
    if split is None or split.scheme != "tcp" or not split.port:
        return Diagnosis("final", "another socket holds it")
    port = split.port
    try:  # a host with many connections lists megabytes
        found = [h for h in await asyncio.to_thread(holders, port) if _meets(split, h)]
    except OSError as exc:  # not Linux
        return Diagnosis("grace", f"another socket holds port {port}, and this host does not say whose ({exc})")
    listening = [h for h in found if h.state == LISTEN]
    if listening:
        who = await asyncio.to_thread(held_by, port)  # its pid and command line, where this user may see them
        return Diagnosis(
            "final",
            f"another process listens there ({_named(listening)}): stop it{f' ({who})' if who else ''}, or give the "
            "engine and the shim another endpoint (the engine's --kv-events-config endpoint, the shim's "
            "--kv-events)",
        )
    if not found:  # closed between ZMQ's try and the look
        return Diagnosis("again", f"no socket holds port {port} now", news=False)
    open_ = [h for h in found if h.state != TIME_WAIT]
    if not open_:
        return Diagnosis(
            "grace",
            f"connections closed within a minute hold port {port} in TIME_WAIT ({_named(found)}), which frees it",
            TIME_WAIT_GRACE_S,
        )
    return Diagnosis(
        "grace",
        f"a connection's local end holds port {port} ({_named(open_)}), which frees it only as that connection "
        "closes: close it, or give the engine and the shim another endpoint",
    )


def _meets(split: ZmqEndpoint, holder: Holder) -> bool:
    if split.wildcard or holder.address.is_unspecified:
        return True
    try:
        ip = ipaddress.ip_address(split.host.partition("%")[0])
    except ValueError:  # a name
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return holder.address == ip.ipv4_mapped
    return holder.address == ip


def _named(found: list[Holder]) -> str:
    return ", ".join(sorted({str(h) for h in found}))


def _binds(host: str, family: int) -> OSError | None:
    """Why a plain socket cannot bind `host` now; None if it can."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError as err:
        return err
    return None


def _address(host: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Diagnosis:
    err = _binds(host, socket.AF_INET6 if ip.version == 6 else socket.AF_INET)
    if err is None:  # ready between ZMQ's try and this one (DAD just ended)
        return Diagnosis("again", f"{host} binds now")
    if err.errno != errno.EADDRNOTAVAIL:
        return Diagnosis("final", f"binding {host} here fails: {err}. {_FIX}")
    if ip.version == 4:
        return Diagnosis("final", f"no interface of this host has {host}. {_FIX}")
    try:
        with open(IF_INET6, encoding="ascii") as listing:
            rows = [line.split() for line in listing]
    except OSError as list_err:
        return Diagnosis("grace", f"{host} may be an address still in duplicate-address detection ({list_err})")
    packed = ip.packed.hex()
    for row in rows:
        if len(row) == 6 and row[0] == packed:
            flags, name = int(row[4], 16), row[5]
            if flags & _DADFAILED:
                return Diagnosis("final", f"{host} on {name} failed duplicate-address detection: another host has it")
            if flags & _TENTATIVE:
                return Diagnosis("again", f"{host} on {name} is tentative (duplicate-address detection, 1-2 s)")
            return Diagnosis("grace", f"{host} is on {name} (flags 0x{flags:02x}) yet refuses a bind")
    return Diagnosis("final", f"no interface of this host has {host}. {_FIX}")


async def _name(host: str) -> Diagnosis:
    try:  # in a thread: a DNS outage can take seconds per lookup
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno == socket.EAI_AGAIN:
            return Diagnosis("again", f"the name {host} does not resolve for now ({err})")
        return Diagnosis("grace", f"the name {host} does not resolve ({err}). {_FIX}")
    except UnicodeError as err:
        return Diagnosis("final", f"{host} is no host name ({err})")
    ipv4 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET})
    if not ipv4:
        ipv6 = ", ".join(sorted({str(info[4][0]) for info in infos}))
        return Diagnosis(
            "grace",
            f"the name {host} resolves only to IPv6 ({ipv6}); names are opened as IPv4 because vLLM's and "
            "SGLang's PUB set no zmq.IPV6: give an IPv4 address or name",
        )
    if any(_binds(address, socket.AF_INET) is None for address in ipv4):
        return Diagnosis("again", f"the name {host} resolves to {', '.join(ipv4)}, which binds now")
    return Diagnosis("grace", f"the name {host} resolves to {', '.join(ipv4)}, no address of this host. {_FIX}")


class BindFailures:
    """Failed binds of one address in a row, across sessions (the adapter keeps one): when the run
    began, for NAME_GRACE_S, and which causes were said. A bind that works ends the run."""

    def __init__(self, grace_s: float = NAME_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self._since: float | None = None
        self._said: set[str] = set()

    def bound(self) -> None:
        self._since = None

    async def _judged(self, address: str, exc: zmq.ZMQError) -> Diagnosis:
        """`diagnose`'s answer, a "grace" one final once binds have failed for grace_s."""
        now = self._clock()
        since = self._since = now if self._since is None else self._since
        found = await diagnose(address, exc)
        if found.outcome == "grace" and now - since >= self._limit(found):
            return Diagnosis("final", f"{found.why} (binds failed for {now - since:.0f} s)")
        return found

    def _limit(self, found: Diagnosis) -> float:
        return self.grace_s if found.grace_s is None else found.grace_s

    async def probe(self, address: str) -> tuple[zmq.ZMQError, Diagnosis] | None:
        """Whether the shim's SUB could bind `address` now: None if it can (which ends a run of
        failures), else ZMQ's error and why, judged as ZmqEventSource judges a failed bind of the
        SUB's. Any other errno is final."""
        exc = await asyncio.to_thread(_bind_error, address)  # a name's lookup may take seconds
        if exc is None:
            self.bound()
            return None
        if exc.errno not in UNBINDABLE:
            return exc, Diagnosis("final", "no later session changes that")
        return exc, await self._judged(address, exc)

    async def error(self, setting: str, endpoint: str, address: str, exc: zmq.ZMQError) -> Exception:
        """What the session raises: a ConfigError (the shim exits 2), or a ConnectionError (the
        next session tries again)."""
        found = await self._judged(address, exc)
        said = f"the shim binds {address} (where the engine connects) and this host cannot ({exc}): {found.why}"
        if found.outcome == "final":
            return ConfigError(setting, endpoint, said)
        return self.pending(setting, endpoint, said, found)

    def pending(self, setting: str, value: object, said: str, found: Diagnosis) -> BindPending:
        """What a session raises for a bind a later one may make (`found` not final), its cause
        said once at WARNING naming `setting` (not a holder gone as it was looked at: the next
        session binds; the session's own line says it)."""
        if found.news and found.why not in self._said:
            self._said.add(found.why)
            until = f", for up to {self._limit(found):g} s" if found.outcome == "grace" else ""
            log.warning("%s %s: %s; trying again each session%s", setting, value, said, until)
        return BindPending(f"{said}: trying again in the next session")
