"""Typed errors shared by every process. Each carries the values involved."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

__all__ = ["ConfigError", "ProtocolError", "listen_error"]


# Settings with a flag and no environment variable: the config file's own path is a flag only.
_FLAG_ONLY = frozenset({"config"})


class ConfigError(ValueError):
    """A setting has a value it may not have. Names the setting and what is allowed."""

    def __init__(self, setting: str, value: object, allowed: str) -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        names = "--" + setting.replace("_", "-")
        if setting not in _FLAG_ONLY:
            names += f", KVSWITCH_{setting.upper()}"
        super().__init__(f"invalid {setting} ({names}) = {value!r}: {allowed}")

    @classmethod
    def one_of(cls, setting: str, value: object, choices: Iterable[str]) -> ConfigError:
        return cls(setting, value, "allowed values: " + ", ".join(choices))


def listen_error(host: str, port: int, exc: OSError) -> ConfigError:
    """The setting an HTTP server's failed listen is the fault of: a host that does not resolve, or
    an address not on this machine, is --http-host's (it was blamed on --http-port); a port taken
    or forbidden, --http-port's."""
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError("http_host", host, f"cannot listen there: {exc}: give a name or address of this host")
    return ConfigError("http_port", port, f"cannot listen on {host}: {exc}")


class ProtocolError(ValueError):
    """Bytes that do not decode to the message the subject promises."""

    def __init__(self, what: str, detail: str) -> None:
        self.what = what
        self.detail = detail
        super().__init__(f"malformed {what}: {detail}")
