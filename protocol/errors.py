"""Typed errors shared by every process. Each carries the values involved."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

from protocol.port_holders import held_by

__all__ = [
    "FLAG_ONLY",
    "ConfigError",
    "ProtocolError",
    "VariableError",
    "bind_sockets",
    "host_fault",
    "listen_error",
    "setting_names",
    "try_listen",
    "why_unbound",
    "without_userinfo",
]


# The settings a flag alone sets, with no variable or file key (docs/router.md, "Flags"), of every
# process: --config names the file; the router's others each turn a safeguard off, so must be asked
# for on the command line. A ConfigError names no variable for them, and each process refuses a
# KVSWITCH_ variable of those it has (protocol.config.check_flag_only_env) rather than ignore it.
FLAG_ONLY = frozenset({"config", "no_api_keys", "trust_request_chat_template"})
# Settings whose values are secrets: a ConfigError shows only their type.
_SECRETS = frozenset({"nats_password", "nats_token", "etcd_password"})
# Settings whose values are names, never URLs: a ConfigError shows them whole. `without_userinfo`
# takes all up to the last `@` of text with a `:` (`h200:nope@10x` was shown as '10x'). The others keep
# it: a URL setting left out of a list of URLs would show its password; one left out of this, its
# value cut short.
_NAMES = frozenset({"timing_profile", "model"})


def without_userinfo(url: str) -> str:
    """`url` without the `user:password@` (or `token@`) it may carry, for logs and errors. All up
    to the last `@` goes: a password with an unescaped `/` or `@` in it must not survive either. A
    URL whose scheme was left out keeps it out, but not a `user:password@`: text with an `@` and a
    `:` is taken for one (`user@host` alone stays)."""
    scheme, sep, rest = url.partition("://")
    if sep:
        return f"{scheme}{sep}{rest.rpartition('@')[2]}"
    return url.rpartition("@")[2] if "@" in url and ":" in url else url


def setting_names(setting: str) -> str:
    """How a process is given `setting`: its flag, and its variable unless it is FLAG_ONLY (its file
    key is `setting` itself)."""
    flag = "--" + setting.replace("_", "-")
    return flag if setting in FLAG_ONLY else f"{flag}, KVSWITCH_{setting.upper()}"


def _shown(value: object) -> object:
    """`value` with URL userinfo stripped from every string in it."""
    if isinstance(value, str):
        return without_userinfo(value)
    if isinstance(value, list | tuple):
        return type(value)(_shown(v) for v in value)
    if isinstance(value, dict):
        return {k: _shown(v) for k, v in value.items()}
    return value


class ConfigError(ValueError):
    """A setting has a value it may not have. Names the setting and what is allowed. The message
    never carries a secret: a password's or token's value is `<redacted>` (its type stays, the
    useful part of "Expected `str`, got `int`"), and URLs lose their userinfo (`value` keeps it all):
    any text with an `@` and a `:` is taken for one, but in a setting whose value is a name."""

    def __init__(self, setting: str, value: object, allowed: str) -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        if setting in _SECRETS and value is not None:
            kind = type(value).__name__
            shown = f"<redacted> ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"
        else:
            shown = repr(value if setting in _NAMES else _shown(value))
        super().__init__(f"invalid {setting} ({setting_names(setting)}) = {shown}: {allowed}")

    @classmethod
    def one_of(cls, setting: str, value: object, choices: Iterable[str]) -> ConfigError:
        return cls(setting, value, "allowed values: " + ", ".join(choices))


class VariableError(ConfigError):
    """A `KVSWITCH_` variable wrong in itself rather than as a setting's value: one no kvswitch
    process reads, or a process-wide one whose value cannot be used (KVSWITCH_PROFILE_DIR naming no
    directory). It has no flag, so the message names the variable alone, and shows no value the
    problem does not: a misspelt password's must not be."""

    def __init__(self, variable: str, problem: str) -> None:
        ValueError.__init__(self, f"{variable} {problem}")  # not ConfigError's: that names a flag
        self.setting = variable
        self.value = None
        self.allowed = problem


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound, not listening, as asyncio's listener binds them: one for each address `host`
    resolves to, IPv6 ones IPv6-only, SO_REUSEADDR (a port left in TIME_WAIT is free; a listening
    socket still holds its port). OSError, with every socket bound so far closed, when one cannot
    be had."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def try_listen(host: str, port: int) -> None:
    """OSError unless an HTTP server could listen on `host`:`port` now: `bind_sockets`, closed at once."""
    for sock in bind_sockets(host, port):
        sock.close()


def listen_error(host: str, port: int, exc: OSError) -> ConfigError:
    """The setting an HTTP server's failed listen is the fault of: a host that does not resolve, or
    an address not on this machine, is --http-host's (it was blamed on --http-port); a port taken
    or forbidden, --http-port's."""
    if host_fault(exc):
        return ConfigError("http_host", host, f"cannot listen there: {exc}: give a name or address of this host")
    if not port:
        return ConfigError("http_port", port, f"cannot listen on {host}: {exc}")
    return ConfigError(
        "http_port", port, f"cannot listen on {host}:{port} ({why_unbound(port, exc)}): choose another --http-port, "
        "or 0 for a free one"
    )  # fmt: skip


def host_fault(exc: OSError) -> bool:
    """Whether a failed listen is its host's fault (a name that does not resolve, an address not on
    this machine), not its port's: `listen_error`'s rule, for a process that words its own error."""
    return isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL


def why_unbound(port: int, exc: OSError) -> str:
    """Why `port` could not be bound, for an error: the OS's words, and for a port in use the pid and
    command line of whoever listens on it ("Address already in use; port 8080 is held by pid 12
    (...)"): "Address already in use" alone sent the operator looking."""
    said = exc.strerror or str(exc)
    held = held_by(port) if exc.errno == errno.EADDRINUSE else ""
    return f"{said}; {held}" if held else said


class ProtocolError(ValueError):
    """Bytes that do not decode to the message the subject promises. `kind` names the fault without
    the peer's values (what "logged once per kind" keys on; the detail itself when it has none):
    keyed on the detail, a peer sending ever new values logged each one and grew the key set."""

    def __init__(self, what: str, detail: str, kind: str | None = None) -> None:
        self.what = what
        self.detail = detail
        self.kind = kind or detail
        super().__init__(f"malformed {what}: {detail}")
