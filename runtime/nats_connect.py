"""Connecting to NATS with no TLS downgrade: a connection that was asked to be encrypted is never
made in the clear.

nats-py 2.16 starts TLS only when the server's INFO says `tls_required`, whatever the `tls://`
scheme or the SSL context it was given. A server that leaves it out (a misconfigured one, or an
impostor on the path) got the CONNECT in plaintext, with a user and password in it. Here the
connection stops before the CONNECT is written, and the error names both ways out. The router and
the shim connect through `connect` (benchmarks and tests against local plain servers need not).

It also leaves a server that stops answering (frozen, or cut off with its TCP connection up) at
once: nats-py noticed it (PINGs unanswered, protocol.config.PINGS_UNANSWERED) and then awaited the
old socket's graceful close, which with bytes still queued for that server waited until the kernel
gave up on it, ~15 minutes (nats-io/nats.py#671). Both the leaving and the server joined are said.

In its own module, not in `runtime`'s namespace: processes without NATS (engine_sim) import runtime.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from nats.aio.client import Client, Srv, _default_error_callback
from nats.aio.errors import ErrStaleConnection
from nats.aio.transport import TcpTransport, Transport, WebSocketTransport
from nats.errors import AuthorizationError, Error

from runtime import RepeatedErrors

__all__ = ["TlsNotOffered", "connect", "error_reporter", "refused_subscriptions"]

_log = logging.getLogger("kvswitch.nats")

# nats-py's text (lower-cased) of a server's -ERR for a subject this identity may not use.
_VIOLATION = re.compile(r'permissions violation for (subscription|publish) to "([^"]+)"')
# A reply goes to the requester's inbox, which a worker may publish to only as allow_responses grants
# (kvswitch.nats_auth): for `kvswitch secrets --response-ttl` seconds per request.
_REPLY_SUBJECT = "_inbox."
_NO_CREDENTIALS = (
    "the server wants credentials: give --nats-creds-file, --nats-nkey-file, --nats-token, or --nats-user and "
    "--nats-password"
)


def error_reporter(
    log: logging.Logger, servers: Sequence[str], credentials: Sequence[str], names: str = "--namespace"
) -> Callable[[Exception], Awaitable[None]]:
    """NATS's error_cb for the router and the shim: each kind of error said once, then counted
    (RepeatedErrors). A server that refuses the credentials (missing, wrong or unknown alike: nats-py
    says 'Authorization Violation' while connecting, AuthorizationError after) names the credential
    flags (`credentials`, those given), not --nats-servers, the one setting that was right, and so
    does a connection reset that follows a refusal. Both keep trying (docs/deployment.md): a server
    reloading its authorization takes them a moment later. `servers` are named as given: pass them
    without the `user:password@` a URL may carry (NatsSettings.shown_servers).

    A permissions violation (a subject this identity may not use) names the credentials and
    `names`, the flags the subjects are made of (the shim's --worker-name and --namespace): one of
    them differs from what `kvswitch secrets` was given. But a refused publish to a reply inbox is
    a reply that outlived its permission (allow_responses' expiry, `kvswitch secrets
    --response-ttl`), whatever the credentials: that names --response-ttl and the routers'
    --request-timeout it must stay above (until 2026-12-07 it blamed the credentials, once per
    expiry, as a stream past the TTL went on). A certificate that does not verify names
    --nats-tls-ca."""
    what = f"NATS {', '.join(servers)}"
    hint = f"the server refused the credentials: check {', '.join(credentials)}" if credentials else _NO_CREDENTIALS
    refused = RepeatedErrors(log, what, hint)
    forbidden = RepeatedErrors(
        log,
        what,
        f"this identity may not use that subject: check that the credentials ({', '.join(credentials) or 'none'}) "
        f"are this process's own, and {names} what kvswitch secrets was given",
    )
    expired = RepeatedErrors(
        log,
        what,
        "reply permission expired (a worker may reply to one request for kvswitch secrets' --response-ttl, 900 s "
        "by default): rerun kvswitch secrets with --response-ttl above the routers' --request-timeout and reload "
        "nats-server",
    )
    unverified = RepeatedErrors(
        log,
        what,
        "the server's certificate does not verify: check --nats-tls-ca (the CA that signed it; the system's CAs "
        "without it) and that the certificate names the host in --nats-servers",
    )
    # The server closes the socket right behind its -ERR, so some tries read the reset before the
    # refusal: that reset is the refusal again, not a wrong address.
    reset_after_refusal = RepeatedErrors(log, what, f"closed by the server, which refused the credentials; {hint}")
    other = RepeatedErrors(log, what, "check --nats-servers and the server")
    last_refused = False

    async def on_error(exc: Exception) -> None:
        nonlocal last_refused
        if isinstance(exc, AuthorizationError) or "Authorization Violation" in str(exc):
            last_refused = True
            await refused.on_error(exc)
        elif last_refused and isinstance(exc, ConnectionResetError | BrokenPipeError):
            await reset_after_refusal.on_error(exc)
        else:
            last_refused = False
            if (m := _VIOLATION.search(str(exc))) is not None:  # the connection stays up: the credentials were taken
                late_reply = m[1] == "publish" and m[2].startswith(_REPLY_SUBJECT)
                await (expired if late_reply else forbidden).on_error(exc)
            elif isinstance(exc, ssl.SSLCertVerificationError):
                await unverified.on_error(exc)
            else:
                await other.on_error(exc)

    return on_error


class TlsNotOffered(Error):
    """The server did not start TLS on a connection that was to be encrypted."""

    def __init__(self, server: str) -> None:
        super().__init__(
            f"{server} did not ask for TLS, but this connection must be encrypted (a tls:// URL or "
            "--nats-tls-ca): nothing was sent to it. Enable TLS on the server (its `tls {...}` "
            "block), or connect to it with a nats:// URL and no --nats-tls-* flag"
        )


class _EncryptedOrNothing(Client):
    def __init__(self, log: logging.Logger) -> None:
        super().__init__()
        self.refused_subscriptions: set[str] = set()
        self._log = log
        self.left_stale: str | None = None  # the server last left for answering no PING, until one is joined
        self._left_address: _Address | None = None  # its socket's peer, until one is joined
        self._to_move_back: _Address | None = None  # the same, until the pool was reordered once

    def server(self) -> str:
        """The server of this connection (or of its last try), without a `user:password@`."""
        assert self._current_server is not None, "called only once connect() began"
        return _shown(self._current_server)

    async def _ping_interval(self) -> None:
        # nats-py's PING loop, but a message read since the last PING counts as the server heard from,
        # as a PONG does: nats-py counted PONGs only, and a PONG is read behind every message the
        # server sent before it, so a reader a few seconds behind on a backlog took its healthy server
        # for a frozen one, left it and lost the backlog (at the 2 s minimum interval, 5 of 40 runs of
        # test_nats_stale's busy reader with a CPU hog beside `-n 2`, 16 of 30 with two, 2026-12-07;
        # none since). A frozen server sends nothing: only what it sent before it froze, already on
        # this host, is still read. Here, not per message: nats-py counts every one in its stats.
        heard = self.stats["in_msgs"]
        while True:
            await asyncio.sleep(self.options["ping_interval"])
            if not self.is_connected:
                continue
            if self.stats["in_msgs"] != heard:
                heard, self._pings_outstanding = self.stats["in_msgs"], 0
            try:
                self._pings_outstanding += 1
                if self._pings_outstanding > self.options["max_outstanding_pings"]:
                    await self._process_op_err(ErrStaleConnection())
                    return
                await self._send_ping()
            except (asyncio.CancelledError, RuntimeError, AttributeError):
                break  # the connection closing under it, as nats-py's loop ends

    async def _process_op_err(self, e: Exception) -> None:
        # ErrStaleConnection: nothing read from the server over our last PINGs (the server's -ERR
        # 'Stale Connection' and an EOF are other classes); nats-py says it to no callback.
        if isinstance(e, ErrStaleConnection) and self.is_connected:
            self.left_stale = self.server()
            self._left_address = self._to_move_back = _peer(self._transport)
            self._log.warning(
                "NATS connection %s: %s answered none of its last %d PINGs (one every %g s, --nats-ping-interval-s): "
                "the server is frozen or overloaded, or the path to it cut; leaving it for another of --nats-servers",
                self.options["name"],
                self.left_stale,
                self.options["max_outstanding_pings"],
                self.options["ping_interval"],
            )
        await super()._process_op_err(e)

    async def _attempt_reconnect(self) -> None:
        # nats-py then closes the old socket gracefully and awaits it: with bytes queued for a server
        # that reads none, until the kernel gives up (~15 min). Aborted, its queue is dropped now
        # (that server would never have read it).
        if isinstance(self._transport, TcpTransport) and self._transport._io_writer is not None:
            self._transport._io_writer.transport.abort()
        await super()._attempt_reconnect()

    async def _select_next_server(self) -> None:
        # nats-py shuffled the pool and tries it in turn: a server just left for answering no PING
        # goes behind the others, else the first try could be its connect timeout (2 s) again. It is
        # known by its address, not its name: a cluster adds the addresses it advertises to the pool
        # ('127.0.0.1:4222' beside a given 'localhost:4222'). Once per leaving, after nats-py's
        # shuffle: sorted before every try, one other server that takes the TCP connection but never
        # completes the CONNECT (frozen too, or refusing the credentials) would be tried for good.
        if (left := self._to_move_back) is not None:
            self._to_move_back = None
            timeout = self.options["connect_timeout"]
            pool = list(self._server_pool)
            found = await asyncio.gather(*(_resolves_to(s, left, timeout) for s in pool))
            at_left = {id(s) for s, hit in zip(pool, found, strict=True) if hit}
            self._server_pool.sort(key=lambda s: id(s) in at_left)  # stable: the rest as shuffled
        await super()._select_next_server()

    def _connect_command(self) -> bytes:
        # Called after nats-py has decided on TLS and before the CONNECT goes out.
        server = self._current_server
        assert server is not None, "called only while connecting"
        scheme = server.uri.scheme
        wanted = "tls" in self.options or scheme in ("tls", "wss")
        encrypted = (
            scheme == "wss"
            or (scheme != "ws" and self.options["tls_handshake_first"])
            or (scheme != "ws" and bool(self._server_info.get("tls_required")))
        )
        if wanted and not encrypted:
            raise TlsNotOffered(_shown(server))
        return super()._connect_command()


def _shown(server: Srv) -> str:
    # As protocol.errors.without_userinfo shows --nats-servers: brackets and case kept.
    return f"{server.uri.scheme}://{server.uri.netloc.rpartition('@')[2]}"


_Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def _address(sockaddr: tuple[Any, ...]) -> _Address:
    return ipaddress.ip_address(sockaddr[0].partition("%")[0]), int(sockaddr[1])  # no IPv6 scope


def _peer(transport: Transport | None) -> _Address | None:
    """The address `transport` is connected to (None before it is)."""
    if isinstance(transport, TcpTransport) and transport._io_writer is not None:
        peer = transport._io_writer.get_extra_info("peername")
    elif isinstance(transport, WebSocketTransport) and transport._ws is not None:
        peer = transport._ws.get_extra_info("peername")
    else:
        return None
    return None if peer is None else _address(peer)


async def _resolves_to(server: Srv, address: _Address, timeout: float) -> bool:
    """Whether `server` names `address`. A name that does not resolve in `timeout` is taken for
    another server: nats-py's own try of it then fails and says why (error_cb)."""
    host, port = server.uri.hostname, server.uri.port
    if host is None or port != address[1]:
        return False
    try:
        return ipaddress.ip_address(host) == address[0]
    except ValueError:  # a name, not an address
        pass
    try:
        async with asyncio.timeout(timeout):
            found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        return False
    return any(_address(sockaddr) == address for *_, sockaddr in found)


async def connect(log: logging.Logger = _log, **options: Any) -> Client:
    """`nats.connect(**options)`, refusing (TlsNotOffered, through `error_cb` while it retries) to
    connect in the clear when the options ask for TLS, and keeping the subjects whose
    subscriptions the server refused (refused_subscriptions). A server left for answering no PING
    is said on `log` (WARNING), and so is the server joined after it; any other reconnection is
    said at INFO (what ended it was said by `error_cb`)."""
    nc = _EncryptedOrNothing(log)
    given = options.pop("error_cb", None) or _default_error_callback
    given_reconnected = options.pop("reconnected_cb", None)

    async def on_reconnected() -> None:
        name, joined, left = options.get("name"), nc.server(), nc.left_stale
        back = nc._left_address is not None and _peer(nc._transport) == nc._left_address
        nc.left_stale = nc._left_address = None
        if back:  # by another of its names, maybe
            log.warning("NATS connection %s: back on %s, which had answered no PING", name, joined)
        elif left is not None:
            log.warning("NATS connection %s: moved from %s, which answered no PING, to %s", name, left, joined)
        else:
            log.info("NATS connection %s: re-established, to %s", name, joined)
        if given_reconnected is not None:
            await given_reconnected()

    async def on_error(exc: Exception) -> None:
        # Recorded before `given` awaits anything: nats-py reads the server's -ERR, and awaits
        # this, before the PONG of a flush sent after the SUB, so a flush that returned has it.
        if (m := _VIOLATION.search(str(exc))) is not None and m[1] == "subscription":
            nc.refused_subscriptions.add(m[2])
        await given(exc)

    await nc.connect(**options, error_cb=on_error, reconnected_cb=on_reconnected)
    return nc


def refused_subscriptions(nc: Client) -> set[str]:
    """The subjects, lower-cased (as nats-py passes the server's -ERR on), whose subscriptions the
    server refused on `nc` (made by `connect`): it says so only in an -ERR, and the subscription
    stays, silent, on the client's side. Flush first."""
    return nc.refused_subscriptions if isinstance(nc, _EncryptedOrNothing) else set()
