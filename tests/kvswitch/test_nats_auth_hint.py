"""A NATS server that refuses the credentials: the router and the shim name the credential flags
(those given, or all of them when none is), where they said "check --nats-servers and the server"
for a server that answered at that very address. They keep trying, as for an unreachable server:
a server whose authorization is reloaded (a worker added by `kvswitch secrets`) lets them in."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from nats.errors import Error as NatsError

from kvswitch.servers import NatsServer, free_port
from protocol.config import NatsSettings
from router.service import RouterConfig, RouterService
from runtime.nats_connect import error_reporter
from worker_shim.nats_connect import connect_nats


def _token(token: str) -> str:
    return f'authorization {{ token: "{token}" }}'


@pytest.fixture
def nats_token() -> Iterator[NatsServer]:
    with NatsServer(authorization=_token("s3cret")) as server:
        yield server


def _starts(settings: NatsSettings) -> dict[str, Coroutine[Any, Any, object]]:
    return {"router": RouterService(RouterConfig(nats=settings)).start(), "shim": connect_nats(settings, "test")}


async def _warnings(start: Coroutine[Any, Any, object], caplog: pytest.LogCaptureFixture, about: str) -> list[str]:
    """The WARNINGs that say `about`, while `start` keeps retrying for 2 s."""
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(TimeoutError):
        await asyncio.wait_for(start, 2)
    return [r.getMessage() for r in caplog.records if about in r.getMessage()]


@pytest.mark.parametrize(
    ("credentials", "hint"),
    [
        ({"token": "wrong"}, "(the server refused the credentials: check --nats-token)"),
        ({"user": "app", "password": "pw"}, "(the server refused the credentials: check --nats-user and --nats-pass"),
        ({}, "(the server wants credentials: give --nats-creds-file, --nats-nkey-file, --nats-token, or --nats-user"),
    ],
)  # fmt: skip
async def test_a_refused_credential_names_the_credential_flags(
    nats_token: NatsServer, caplog: pytest.LogCaptureFixture, credentials: dict[str, Any], hint: str
) -> None:
    for name, start in _starts(NatsSettings(servers=[nats_token.url], **credentials)).items():
        said = await _warnings(start, caplog, "'Authorization Violation'")
        assert said and all(hint in s and "--nats-servers" not in s for s in said), (name, said)


async def test_an_unreachable_server_still_names_the_servers(caplog: pytest.LogCaptureFixture) -> None:
    for name, start in _starts(NatsSettings(servers=[f"nats://127.0.0.1:{free_port()}"])).items():
        assert await _warnings(start, caplog, "(check --nats-servers and the server)"), name


async def test_credentials_in_the_url_are_named_and_never_logged(
    nats_token: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-py takes `nats://user:password@host`: the password was in every WARNING, every 30 s
    of an outage, and the hint asked for credentials that had been given."""
    for port, about, hint in (
        (
            nats_token.port,
            "'Authorization Violation'",
            "(the server refused the credentials: check the user and password",
        ),
        (free_port(), "(check --nats-servers and the server)", "(check --nats-servers and the server)"),
    ):
        for name, start in _starts(NatsSettings(servers=[f"nats://alice:S3cretPW@127.0.0.1:{port}"])).items():
            said = await _warnings(start, caplog, about)
            assert said and all(s.startswith(f"NATS nats://127.0.0.1:{port}: ") and hint in s for s in said), said
            assert not any("S3cretPW" in r.getMessage() or "alice" in r.getMessage() for r in caplog.records), name


async def test_the_shim_gets_in_once_the_server_accepts_its_token(
    nats_token: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    connecting = asyncio.create_task(connect_nats(NatsSettings(servers=[nats_token.url], token="new"), "test"))
    with caplog.at_level(logging.WARNING):
        async with asyncio.timeout(5):
            while not any("check --nats-token" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    nats_token.authorization = _token("new")  # the operator's new authorization, then a reload
    (nats_token.workdir / "nats.conf").write_text(nats_token.config_text())
    assert nats_token.proc is not None
    nats_token.proc.send_signal(signal.SIGHUP)
    nc = await asyncio.wait_for(connecting, 10)
    assert nc.is_connected
    await nc.close()


def test_no_userinfo_in_the_servers_named() -> None:
    servers = ["nats://alice:pw1@a:4222", "tls://tok3n@b:4222", "nats://bob:p@ss/w0rd@c:4222", "nats://d:4222"]
    shown = NatsSettings(servers=servers).shown_servers()
    assert shown == ["nats://a:4222", "tls://b:4222", "nats://c:4222", "nats://d:4222"]


async def test_a_reset_right_after_a_refusal_is_the_refusal_again(caplog: pytest.LogCaptureFixture) -> None:
    """The server closes the socket behind its -ERR, so a try can read the reset first (a router's
    second line against a password server was such a reset): it must not point at --nats-servers."""
    log = logging.getLogger("test.nats")
    on_error = error_reporter(log, ["nats://127.0.0.1:4222"], ["--nats-token"])
    reset = ConnectionResetError(104, "Connection reset by peer")
    with caplog.at_level(logging.WARNING, logger="test.nats"):
        await on_error(NatsError("nats: 'Authorization Violation'"))
        await on_error(reset)
        await on_error(OSError(111, "Connect call failed"))  # the server went away: the address again
        await on_error(reset)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said
    assert "check --nats-token" in said[1] and "--nats-servers" not in said[1], said
    assert "check --nats-servers" in said[2] and "check --nats-servers" in said[3], said


async def test_the_shim_says_once_that_nats_is_back(caplog: pytest.LogCaptureFixture) -> None:
    """Its log ended on 'ConnectionRefusedError ... (check --nats-servers ...)' for good after an
    outage, though it was connected again."""
    with NatsServer() as server:
        nc = await connect_nats(NatsSettings(servers=[server.url]), "test")
        try:
            with caplog.at_level(logging.INFO, logger="kvswitch.shim.nats"):
                server.restart()
                async with asyncio.timeout(10):
                    while not any("re-established" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # and said once
            back = [r.getMessage() for r in caplog.records if "re-established" in r.getMessage()]
            assert back == [f"NATS connection test: re-established, to {server.url}"], back
        finally:
            await nc.close()
