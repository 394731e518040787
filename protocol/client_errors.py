"""An HTTP client's failure to reach a server, said in a few words.

aiohttp's repr of a failed connect carries its whole ConnectionKey ("ClientConnectorError(
ConnectionKey(host='127.0.0.1', port=26508, is_ssl=False, ssl=True, proxy=None, …),
ConnectionRefusedError(111, …))", up to ~480 characters), and shims put it in every leg's error, log
line and client 503 until 2026-12-07. `essence` says an exception as "connection refused
127.0.0.1:26508", "http://…/v1/completions: server disconnected"; `brief` cuts an earlier shim's
repr, still sent during a rolling upgrade (routers go first), to the same words.
"""

from __future__ import annotations

import re

import aiohttp

__all__ = ["brief", "essence"]

_SSL_PLACE = re.compile(r" \(_ssl\.c:\d+\)$")  # where in CPython's ssl module a TLS error was raised
_CONNECT = re.compile(
    r"(?:\S+: )?ClientConnector\w*Error\(ConnectionKey\(host='([^']*)', port=(\d+).*?\), (\w+)\((.*)\)\)$", re.S
)
_ERROR = re.compile(r"(\S+: )?(?:Client\w*|Server\w*)Error\((?:-?\d+, )?(['\"])(.*?)\2\)$", re.S)
_TIMEOUT = re.compile(r"(\S+: )?TimeoutError\(\)$")
_STRERROR = re.compile(r"(['\"])(.*?)\1")


def _unreachable(host: str, port: object, cause: str, why: str | None) -> str:
    if cause == "ConnectionRefusedError":
        return f"connection refused {host}:{port}"
    return f"cannot connect to {host}:{port}: {_SSL_PLACE.sub('', why) if why else cause}"


def _text(text: str) -> str:
    text = text.split(": <", 1)[0]  # ClientPayloadError's nested repr of its cause
    return f"{text[:1].lower()}{text[1:]}"


def _said(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "timed out connecting"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return "timed out reading"
    if isinstance(exc, TimeoutError) and not str(exc):  # a total timeout's, or asyncio's
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return _text(exc.strerror)
    connection = isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError)
    if connection and exc.args and isinstance(exc.args[0], str):
        return _text(exc.args[0])
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def essence(exc: BaseException, url: str) -> str:
    """`exc`, raised by a request to `url`, in a few words: a connection never made named by its
    host and port, anything else by `url` and what went wrong."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause: BaseException = exc.os_error
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            cause = exc.certificate_error  # its os_error is a bare OSError() when the cause is no OSError
        return _unreachable(exc.host, exc.port, type(cause).__name__, getattr(cause, "strerror", None) or str(cause))
    return f"{url}: {_said(exc)}"


def brief(message: str) -> str:
    """`message`, an engine error's, with aiohttp's repr of a connection failure (an earlier shim's
    `f"{url}: {exc!r}"`) cut to `essence`'s words; any other message as it is."""
    m = _CONNECT.match(message)
    if m is not None:
        host, port, cause, args = m.groups()
        said = _STRERROR.search(args)
        return _unreachable(host, port, cause, said[2] if said else None)
    m = _ERROR.match(message)
    if m is not None:
        url, _, text = m.groups()
        return f"{url or ''}{_text(text)}"
    m = _TIMEOUT.match(message)
    if m is not None:
        return f"{m[1] or ''}timed out"
    return message
