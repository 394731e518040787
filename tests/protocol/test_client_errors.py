"""An HTTP client's failure said in a few words (protocol.client_errors): shims put aiohttp's whole
repr, its ConnectionKey in it, in every leg's error, log line and client 503 (log-quality audit of
2026-12-07); the router cuts an earlier shim's repr to the same words."""

from __future__ import annotations

import socket
import ssl

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from protocol.client_errors import brief, essence

URL = "http://127.0.0.1:26508/v1/completions"
REFUSED = (
    "http://127.0.0.1:26508/v1/completions: ClientConnectorError(ConnectionKey(host='127.0.0.1', port=26508, "
    "is_ssl=False, ssl=True, proxy=None, proxy_auth=None, proxy_headers_hash=None, server_hostname=None), "
    "ConnectionRefusedError(111, \"Connect call failed ('127.0.0.1', 26508)\"))"
)


def _key(host: str, port: int, *, tls: bool = False) -> ConnectionKey:
    return ConnectionKey(host, port, tls, True, None, None, None)


# each as aiohttp 3.14 raises it, and its words: a connection never made by host and port alone
SAID: list[tuple[BaseException, str]] = [
    (
        aiohttp.ClientConnectorError(
            _key("127.0.0.1", 26508), ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 26508)")
        ),
        "connection refused 127.0.0.1:26508",
    ),
    (
        aiohttp.ClientConnectorDNSError(_key("h", 1), socket.gaierror(-2, "Name or service not known")),
        "cannot connect to h:1: Name or service not known",
    ),
    (
        aiohttp.ClientConnectorError(_key("10.0.0.9", 8000), OSError(113, "No route to host")),
        "cannot connect to 10.0.0.9:8000: No route to host",
    ),
    (
        aiohttp.ClientConnectorSSLError(
            _key("h", 443, tls=True),
            ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"),
        ),
        "cannot connect to h:443: [SSL: WRONG_VERSION_NUMBER] wrong version number",
    ),
    (
        aiohttp.ClientConnectorCertificateError(
            _key("h", 443, tls=True),
            ssl.SSLCertVerificationError(
                1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate (_ssl.c:1006)"
            ),
        ),
        "cannot connect to h:443: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate",
    ),
    (aiohttp.ServerDisconnectedError(), f"{URL}: server disconnected"),
    (aiohttp.ClientOSError(104, "Connection reset by peer"), f"{URL}: connection reset by peer"),
    (
        aiohttp.ClientPayloadError(
            "Response payload is not completed: <TransferEncodingError: 400, message='Not enough data to satisfy "
            "transfer length header.'>"
        ),
        f"{URL}: response payload is not completed",
    ),
    (TimeoutError(), f"{URL}: timed out"),
]
# what only a shim of this build words so (an earlier shim's repr of them is left as it is)
SAID_HERE: list[tuple[BaseException, str]] = [
    (ConnectionResetError(104, "Connection reset by peer"), f"{URL}: connection reset by peer"),
    (aiohttp.ConnectionTimeoutError(f"Connection timeout to host {URL}"), f"{URL}: timed out connecting"),
    (aiohttp.SocketTimeoutError("Timeout on reading data from socket"), f"{URL}: timed out reading"),
    (
        aiohttp.ClientConnectionResetError("Cannot write to closing transport"),
        f"{URL}: cannot write to closing transport",
    ),
    (aiohttp.InvalidURL("nope"), f"{URL}: InvalidURL: nope"),
    (aiohttp.ClientPayloadError(), f"{URL}: ClientPayloadError"),
]


@pytest.mark.parametrize(("exc", "said"), SAID + SAID_HERE)
def test_an_aiohttp_error_is_said_in_a_few_words(exc: BaseException, said: str) -> None:
    assert essence(exc, URL) == said


@pytest.mark.parametrize(("exc", "said"), SAID)
def test_an_earlier_shims_repr_is_cut_to_the_same_words(exc: BaseException, said: str) -> None:
    assert brief(f"{URL}: {exc!r}") == said


async def test_a_refused_connect_is_said_so() -> None:
    with socket.socket() as sock:  # a port bound and never listened on: connecting to it is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError) as err:
                await session.post(url)
    assert essence(err.value, url) == brief(f"{url}: {err.value!r}") == f"connection refused 127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("message", "said"),
    [
        (REFUSED, "connection refused 127.0.0.1:26508"),
        (
            "http://h:1/v1/completions: ClientConnectorError(ConnectionKey(host='h', port=1, is_ssl=False, ssl=True, "
            "proxy=None), gaierror(-2, 'Name or service not known'))",
            "cannot connect to h:1: Name or service not known",
        ),
        (
            "http://127.0.0.1:26508/v1/completions: ClientOSError(104, 'Connection reset by peer')",
            "http://127.0.0.1:26508/v1/completions: connection reset by peer",
        ),
        (
            "http://127.0.0.1:26508/v1/completions: ServerDisconnectedError('Server disconnected')",
            "http://127.0.0.1:26508/v1/completions: server disconnected",
        ),
        (
            'http://127.0.0.1:26508/v1/completions: ClientPayloadError("Response payload is not completed: '
            "<TransferEncodingError: 400, message='Not enough data to satisfy transfer length header.'>\")",
            "http://127.0.0.1:26508/v1/completions: response payload is not completed",
        ),
        ("Internal server error (the tokenizer crashed)", "Internal server error (the tokenizer crashed)"),
        (
            "http://127.0.0.1:26508/v1/completions: connection refused",
            "http://127.0.0.1:26508/v1/completions: connection refused",
        ),
    ],
)
def test_an_aiohttp_error_is_cut_to_its_essence(message: str, said: str) -> None:
    assert brief(message) == said
