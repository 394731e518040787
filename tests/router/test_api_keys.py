"""API keys: the file, its reload, and the front door's 401s."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import aiohttp
import pytest

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
    for open_path in ("/health", "/ready", "/metrics"):
        async with http.get(router.url + open_path) as r:
            assert r.status == 200, open_path
