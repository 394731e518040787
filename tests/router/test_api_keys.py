"""API keys: the file, its reload, and the front door's 401s."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from protocol import ConfigError
from router import cli
from router.api_keys import ApiKeys, ApiKeysError
from tests.router.conftest import MODEL, Cluster


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_only_listed_bearer_keys_pass(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team A\nsk-aaaa\n\n  sk-bbbb  \n")
    keys = ApiKeys(f)
    assert keys.allows("Bearer sk-aaaa") and keys.allows("bearer sk-bbbb")
    for bad in (None, "", "Bearer", "Bearer sk-aaa", "Bearer sk-aaaax", "Basic sk-aaaa", "sk-aaaa", "Bearer # team A"):
        assert not keys.allows(bad), bad


def test_the_key_is_what_follows_bearer_and_one_space_exactly(tmp_path: Path) -> None:
    """vLLM 0.32 (AuthenticationMiddleware.verify_token) compares what follows the first space
    with the key: a second space, or a tab, is part of what the client presented."""
    f = tmp_path / "keys"
    f.write_text("sk-aaaa\n")
    keys = ApiKeys(f)
    assert keys.allows("Bearer sk-aaaa") and keys.allows("BEARER sk-aaaa")
    for bad in ("Bearer  sk-aaaa", "Bearer \tsk-aaaa", "Bearer sk-aaaa ", "Bearer\tsk-aaaa"):
        assert not keys.allows(bad), repr(bad)


def test_the_file_is_reloaded_when_it_changes_and_a_broken_one_keeps_the_old_keys(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("old-key\n")
    clock = Clock()
    keys = ApiKeys(f, clock=clock)
    f.write_text("new-key-longer\n")
    assert keys.allows("Bearer old-key")  # checked at most once a second
    clock.now += 1.0
    assert keys.allows("Bearer new-key-longer") and not keys.allows("Bearer old-key")
    f.write_text("# nothing\n")
    clock.now += 1.0
    assert keys.allows("Bearer new-key-longer") and keys.reloads == 1
    os.remove(f)
    clock.now += 1.0
    assert keys.allows("Bearer new-key-longer")


def test_a_rotation_that_keeps_size_and_mtime_is_still_seen(tmp_path: Path) -> None:
    """Generated keys have one length, and `cp -p` or rsync keep the mtime: the new file is a new
    inode (and a new change time), which is enough."""
    f = tmp_path / "keys"
    f.write_text("sk-old-aaaa\n")
    clock = Clock()
    keys = ApiKeys(f, clock=clock)
    new = tmp_path / "keys.new"
    new.write_text("sk-new-bbbb\n")
    os.utime(new, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
    os.replace(new, f)
    clock.now += 1.0
    assert keys.allows("Bearer sk-new-bbbb") and not keys.allows("Bearer sk-old-aaaa")


def _unreadable_unless_owner_may_read(monkeypatch: pytest.MonkeyPatch, f: Path) -> list[int]:
    """`f` reads as a router that is not root would read it: EACCES while its mode denies the owner
    reading, which root's own reads ignore. Returns the count of tries, in a list."""
    real_read_text = Path.read_text
    tries = [0]

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self == f:
            tries[0] += 1
            if not self.stat().st_mode & stat.S_IRUSR:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    return tries


def test_a_rotation_left_unreadable_is_read_once_its_mode_is_fixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A chmod or chown changes neither mtime nor size: the revoked key stayed valid, and the new one
    401'd, until something else touched the file."""
    f = tmp_path / "keys"
    f.write_text("sk-old-revoked\n")
    tries = _unreadable_unless_owner_may_read(monkeypatch, f)
    clock = Clock()
    keys = ApiKeys(f, clock=clock)
    new = tmp_path / "keys.new"
    new.write_text("sk-new-current\n")
    new.chmod(0o000)  # the rotation's mistake: the router's user cannot read it
    os.replace(new, f)
    with caplog.at_level(logging.ERROR, logger="router.api_keys"):
        for _ in range(3):
            clock.now += 1.0
            assert keys.allows("Bearer sk-old-revoked") and not keys.allows("Bearer sk-new-current")
    assert tries[0] == 1 + 3 and len(caplog.records) == 1, caplog.records  # tried at each check, said once
    assert "Permission denied; keeping the 1 keys read before" in caplog.records[0].getMessage()
    f.chmod(0o600)  # the operator's fix
    clock.now += 1.0
    assert keys.allows("Bearer sk-new-current") and not keys.allows("Bearer sk-old-revoked")
    assert keys.reloads == 1


def test_a_read_that_failed_once_is_tried_again_without_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A passing failure (EMFILE on a busy router) must not leave the new keys unread until the file
    changes once more."""
    f = tmp_path / "keys"
    f.write_text("sk-old\n")
    clock = Clock()
    keys = ApiKeys(f, clock=clock)
    f.write_text("sk-new-key\n")
    real_read_text = Path.read_text
    failures = [1]

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    clock.now += 1.0
    assert keys.allows("Bearer sk-old")
    clock.now += 1.0
    assert keys.allows("Bearer sk-new-key") and not keys.allows("Bearer sk-old")


def test_an_empty_or_missing_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n# x\n")
    with pytest.raises(ApiKeysError, match="no API key"):
        ApiKeys(tmp_path / "empty")
    with pytest.raises(ApiKeysError, match="cannot read"):
        ApiKeys(tmp_path / "absent")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_router_beyond_loopback_needs_keys_or_an_explicit_no(tmp_path: Path) -> None:
    assert cli.build_config(_args()).http_host == "127.0.0.1"
    with pytest.raises(ConfigError, match="--api-keys-file"):
        cli.build_config(_args("--http-host", "0.0.0.0"))
    assert cli.build_config(_args("--http-host", "0.0.0.0", "--no-api-keys")).api_keys_file is None
    (tmp_path / "keys").write_text("k\n")
    config = cli.build_config(_args("--http-host", "0.0.0.0", "--api-keys-file", str(tmp_path / "keys")))
    assert config.api_keys_file == str(tmp_path / "keys")
    with pytest.raises(ConfigError, match="api_keys_file"):
        cli.build_config(_args("--api-keys-file", str(tmp_path / "none")))


async def test_missing_or_wrong_key_is_401_openai_json_and_the_right_key_serves(
    cluster: Cluster, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (tmp_path / "keys").write_text("sk-right\n")
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(api_keys_file=str(tmp_path / "keys"), disagg="never")
    body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 401
            err = (await r.json())["error"]
            assert err["code"] == 401 and err["type"] == "AuthenticationError" and "API key" in err["message"]
    async with http.get(router.url + "/v1/models") as r:
        assert r.status == 401
    async with http.post(router.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-right"}) as r:
        assert r.status == 200
    for open_path in ("/health", "/ping", "/ready", "/metrics"):
        async with http.get(router.url + open_path) as r:
            assert r.status == 200, open_path
    async with http.post(router.url + "/ping") as r:  # vLLM's liveness route takes POST too
        assert r.status == 200


@pytest.mark.parametrize("api_keys", [True, False], ids=["with-api-keys", "loopback-without"])
async def test_debug_paths_take_only_operator_keys(
    cluster: Cluster, http: aiohttp.ClientSession, tmp_path: Path, api_keys: bool
) -> None:
    (tmp_path / "keys").write_text("sk-client\n")
    (tmp_path / "debug-keys").write_text("sk-operator\n")
    await cluster.add_worker("agg")
    router = await cluster.add_router(
        api_keys_file=str(tmp_path / "keys") if api_keys else None,
        config={"debug_api_keys_file": str(tmp_path / "debug-keys")},
        disagg="never",
    )
    await cluster.ready(router)
    client, operator = {"Authorization": "Bearer sk-client"}, {"Authorization": "Bearer sk-operator"}
    route = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 2}
    for headers in ({}, client):  # a client's API key reads no other client's cached prefixes
        async with http.get(router.url + "/debug/index", headers=headers) as r:
            assert r.status == 401
            err = (await r.json())["error"]
            assert err["type"] == "AuthenticationError" and "--debug-api-keys-file" in err["message"]
        async with http.post(router.url + "/debug/route", json=route, headers=headers) as r:
            assert r.status == 401
        async with http.get(router.url + "/debug/workers", headers=headers) as r:  # /ready says less, keyless
            assert r.status == 401
    async with http.get(router.url + "/debug/index", headers=operator) as r:
        assert r.status == 200
    async with http.get(router.url + "/debug/workers", headers=operator) as r:
        assert r.status == 200 and [w["routable"] for w in (await r.json())["worker_status"]] == [True]
    async with http.post(router.url + "/debug/route", json=route, headers=operator) as r:
        assert r.status == 200
    async with http.get(router.url + "/v1/models", headers=operator) as r:  # an operator key is no API key
        assert r.status == (401 if api_keys else 200)
    async with http.get(router.url + "/v1/models", headers=client) as r:
        assert r.status == 200


async def test_debug_paths_are_closed_with_api_keys_and_no_operator_keys(
    cluster: Cluster, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (tmp_path / "keys").write_text("sk-client\n")
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(api_keys_file=str(tmp_path / "keys"), disagg="never")
    async with http.get(router.url + "/debug/index", headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 403
        err = (await r.json())["error"]
        assert err["type"] == "PermissionDeniedError" and "--debug-api-keys-file" in err["message"]
    async with http.get(router.url + "/debug/workers", headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 403
    async with http.get(router.url + "/v1/models", headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200


def test_an_operator_keys_file_that_cannot_be_read_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="debug_api_keys_file"):
        cli.build_config(_args("--debug-api-keys-file", str(tmp_path / "none")))


def test_a_rotation_to_a_file_that_is_not_utf8_keeps_the_keys_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The UnicodeDecodeError escaped `allows`: every check (once a second) was a 500 with a traceback."""
    f = tmp_path / "keys"
    f.write_text("sk-good\n")
    clock = Clock()
    keys = ApiKeys(f, clock=clock)
    f.write_bytes("sk-good\nsk-cl\xe9\n".encode("latin-1"))
    with caplog.at_level(logging.ERROR, logger="router.api_keys"):
        for _ in range(3):
            clock.now += 1.1
            assert keys.allows("Bearer sk-good")
    assert len(caplog.records) == 1, caplog.records
    assert "not UTF-8 text (line 2); keeping the 1 keys read before" in caplog.records[0].getMessage()
    assert "sk-cl" not in caplog.records[0].getMessage()  # no byte of a key is quoted
    f.write_text("sk-good\nsk-clé\n")  # the fix, in UTF-8
    clock.now += 1.1
    assert keys.allows("Bearer sk-clé") and keys.reloads == 1


def test_a_keys_file_that_is_not_utf8_is_refused_at_start_naming_the_flag(tmp_path: Path) -> None:
    """It was a traceback and exit 1 (a UnicodeDecodeError), not exit 2 naming --api-keys-file."""
    f = tmp_path / "keys"
    f.write_bytes("sk-cl\xe9\n".encode("latin-1"))
    with pytest.raises(ApiKeysError, match="not UTF-8 text"):
        ApiKeys(f)
    with pytest.raises(ConfigError, match=r"api_keys_file.*not UTF-8 text"):
        cli.build_config(_args("--api-keys-file", str(f)))


def test_a_byte_order_mark_is_no_part_of_the_first_key(tmp_path: Path) -> None:
    """A Windows editor's BOM was read into the first key, which then never matched."""
    f = tmp_path / "keys"
    f.write_bytes("\ufeffsk-first\nsk-second\n".encode())
    keys = ApiKeys(f)
    assert keys.allows("Bearer sk-first") and keys.allows("Bearer sk-second")
    assert not keys.allows("Bearer \ufeffsk-first")


def test_a_presented_key_that_is_not_utf8_is_refused_not_raised(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("sk-\xff\n")  # "ÿ", in UTF-8: not the raw byte 0xff
    keys = ApiKeys(tmp_path / "keys")
    for bad in ("Bearer sk-\udcff", "Bearer \ud800", "Bearer sk-\udcc3\udcbf"):  # aiohttp's escapes, a lone surrogate
        assert not keys.allows(bad), ascii(bad)
    assert keys.allows("Bearer sk-\xff")


async def test_an_authorization_header_with_a_byte_not_utf8_is_a_401_not_a_500(
    cluster: Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It was a 500 "the router failed", with an ERROR traceback per request: any client could fill the
    log. Sent raw, since aiohttp's client would encode the header itself."""
    (tmp_path / "keys").write_text("sk-right\n")
    router = await cluster.add_router(api_keys_file=str(tmp_path / "keys"))
    url = URL(router.url)
    assert url.host is not None and url.port is not None
    caplog.set_level(logging.ERROR)
    for header in (b"Bearer sk-\xff", b"Bearer cl\xe9", b"bearer \xc3"):
        reader, writer = await asyncio.open_connection(url.host, url.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: %s\r\n\r\n" % header)
        response = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await writer.wait_closed()
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401 "), (header, response)
        err = json.loads(body)["error"]
        assert err["code"] == 401 and err["type"] == "AuthenticationError", err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
