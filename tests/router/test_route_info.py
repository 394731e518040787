"""Who sees a routed answer's route (router.route_info, `--route-info`): with API keys, only an
operator's requests by default, as only an operator reads /debug/route's overlap (docs/security.md,
"Not protected, or not yet")."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from protocol import ConfigError
from router import cli
from router.route_info import route_info_mode
from tests.router.conftest import MODEL, Cluster

ROUTE_HEADERS = ("x-kvswitch-decode-worker", "x-kvswitch-prefill", "x-kvswitch-outcome")
CLIENT = {"Authorization": "Bearer sk-client"}
OPERATOR = {"Authorization": "Bearer sk-operator"}  # in both files: an operator key serves /v1 only as an API key


async def _answer(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], *, stream: bool
) -> tuple[dict[str, str], dict[str, object] | None]:
    """An answer's route headers and its body's `kvswitch` member (None: a stream's, or none)."""
    body = {"model": MODEL, "prompt": list(range(64)), "max_tokens": 2, "stream": stream}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        assert r.headers["x-request-id"] and "worker;dur=" in r.headers["Server-Timing"]  # kept for everyone
        raw = await r.read()
    shown = {h: r.headers[h] for h in ROUTE_HEADERS if h in r.headers}
    if stream:
        assert b'"kvswitch"' not in raw  # a stream's events are the engine's own
        return shown, None
    return shown, json.loads(raw).get("kvswitch")


@pytest.mark.parametrize(
    ("route_info", "client_sees", "operator_sees"),
    [(None, False, True), ("operator", False, True), ("off", False, False), ("all", True, True)],
    ids=["default", "operator", "off", "all"],
)
async def test_with_api_keys_the_route_goes_only_where_route_info_says(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    route_info: str | None,
    client_sees: bool,
    operator_sees: bool,
) -> None:
    """A client's key gets no x-kvswitch-* headers nor `kvswitch` member by default: under
    conditional disaggregation they say whether, and where, the fleet caches a guessed prompt."""
    (tmp_path / "keys").write_text("sk-client\nsk-operator\n")
    (tmp_path / "debug-keys").write_text("sk-operator\n")
    await cluster.add_worker("agg")
    config: dict[str, object] = {"debug_api_keys_file": str(tmp_path / "debug-keys")}
    if route_info is not None:
        config["route_info"] = route_info
    router = await cluster.add_router(api_keys_file=str(tmp_path / "keys"), config=config, disagg="never")
    await cluster.ready(router)
    worker = cluster.workers[0].id
    for headers, sees in ((CLIENT, client_sees), (OPERATOR, operator_sees)):
        for stream in (False, True):
            shown, member = await _answer(http, router.url, headers, stream=stream)
            if sees:
                assert shown == {
                    "x-kvswitch-decode-worker": worker,
                    "x-kvswitch-prefill": "agg",
                    "x-kvswitch-outcome": shown["x-kvswitch-outcome"],
                }, (headers, stream)
                assert stream or (member is not None and member["decode_worker"] == worker)
            else:
                assert shown == {} and member is None, (headers, stream, shown, member)


async def test_without_api_keys_every_answer_carries_its_route(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    """The default of a router without keys, which the benchmarks, the demo and the tests read."""
    router = await cluster.agg_router(1, disagg="never")
    for stream in (False, True):
        shown, member = await _answer(http, router.url, {}, stream=stream)
        assert set(shown) == set(ROUTE_HEADERS) and (stream or member is not None)


async def test_with_api_keys_and_no_operator_keys_no_answer_carries_its_route(
    cluster: Cluster, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (tmp_path / "keys").write_text("sk-client\n")
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(api_keys_file=str(tmp_path / "keys"), disagg="never")
    shown, member = await _answer(http, router.url, CLIENT, stream=False)
    assert shown == {} and member is None


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


REFUSED = r"invalid route_info \(--route-info, KVSWITCH_ROUTE_INFO\) = 'everyone': allowed values: all, operator, off$"


def test_route_info_is_taken_from_the_flag_and_a_bad_one_is_refused_naming_it_and_the_values(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The one check, wherever the value comes from (ProcessSettings.validate): until 2026-12-07
    argparse's `choices` refused the flag's in words of its own, and the check saw the rest."""
    assert cli.build_config(_args()).route_info is None  # its default follows the keys (route_info_mode)
    assert cli.build_config(_args("--route-info", "off")).route_info == "off"
    with pytest.raises(ConfigError, match=REFUSED):
        cli.build_config(_args("--route-info", "everyone"))
    (tmp_path / "router.yaml").write_text("route_info: everyone\n")
    with pytest.raises(ConfigError, match=REFUSED):
        cli.build_config(_args("--config", str(tmp_path / "router.yaml")))
    monkeypatch.setenv("KVSWITCH_ROUTE_INFO", "everyone")
    with pytest.raises(ConfigError, match=REFUSED):
        cli.build_config(_args())


def test_a_bad_route_info_flag_stops_the_router_with_one_line_naming_it_and_the_values() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "router", "--route-info", "everyone",
         "--nats-servers", "nats://127.0.0.1:1", "--etcd-endpoints", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch("kvswitch router: " + REFUSED, lines[0]), out.stderr


def test_a_bad_route_info_in_an_in_process_config_is_refused_naming_the_flag_and_the_values() -> None:
    """A RouterConfig built in-process passes no flag parse: route_info_mode checks it, as it
    would otherwise pass as `operator`."""
    with pytest.raises(ConfigError, match=REFUSED):
        route_info_mode("everyone", api_keys=True)
