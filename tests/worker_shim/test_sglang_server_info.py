"""The SGLang adapter's startup checks of the engine's server info (adapters/sglang.py): which
route it reads, and the engines it refuses to serve (data parallelism, a P/D mode that is not the
shim's role, a prefill engine that does not say where its bootstrap server listens)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from protocol import ConfigError, SamplingParams
from tests.worker_shim.cluster import served
from worker_shim.adapters.base import EngineError, EngineLimits, LegRequest
from worker_shim.adapters.sglang import SglangAdapter
from worker_shim.config import ShimConfig, ShimRole

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"
INFO: dict[str, Any] = json.loads((FIX / "get_server_info.json").read_text())  # an aggregated server, dp_size 1
MODES = {"agg": "null", "prefill": "prefill", "decode": "decode"}
BOTH_ROUTES = ("/server_info", "/get_server_info")  # a current SGLang serves its info on both


@asynccontextmanager
async def _adapter(
    routes: Mapping[str, object], role: ShimRole = "agg"
) -> AsyncIterator[tuple[SglangAdapter, list[str]]]:
    """An SGLang adapter before an engine serving `routes` (a path: its JSON answer), and the
    paths the engine was asked for."""
    asked: list[str] = []

    async def generate(request: web.Request) -> web.Response:
        await request.json()
        return web.json_response({"output_ids": [1], "meta_info": {"completion_tokens": 1}})

    @web.middleware
    async def record(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        asked.append(request.path)
        return await handler(request)

    def answering(answer: object) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(answer)

        return handler

    app = web.Application(middlewares=[record])
    for path, answer in routes.items():
        app.router.add_get(path, answering(answer))
    app.router.add_post("/generate", generate)
    async with served(app) as url:
        config = ShimConfig(
            engine="sglang",
            model="m",
            engine_url=url,
            kv_events="tcp://127.0.0.1:9",
            role=role,
            bootstrap_host="10.0.0.5",
        )
        adapter = SglangAdapter(config.validate())
        await adapter.open()
        try:
            yield adapter, asked
        finally:
            await adapter.close()


async def _ignore(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
    return None


async def _limits(info: object, role: ShimRole = "agg") -> EngineLimits:
    """The adapter's limits before an engine whose server info is `info` (None: it serves none),
    on both routes as a current SGLang serves it."""
    routes = {} if info is None else dict.fromkeys(BOTH_ROUTES, info)
    async with _adapter(routes, role) as (adapter, _):
        return await adapter.limits()


async def test_a_data_parallel_engine_is_refused_naming_its_dp_size_and_the_way_out() -> None:
    """Until 2026-12-07 accepted: the shim heard rank 0's publisher alone (each rank publishes on the
    endpoint's port + rank) while SGLang spread requests over both ranks, so routers credited rank
    0's prefixes to requests the other rank served."""
    info = {**INFO, "dp_size": 2, "kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'}
    with pytest.raises(ConfigError) as caught:
        await _limits(info)
    assert caught.value.setting == "engine_url"
    assert "reports dp_size 2 on /server_info" in str(caught.value)
    assert "Run SGLang with --dp-size 1" in str(caught.value)
    assert (await _limits({**INFO, "dp_size": 1})).block_size == 16


@pytest.mark.parametrize("dp_size", ["2", 0, True, 1.0])
async def test_a_dp_size_that_is_no_positive_integer_is_the_engines_protocol_error(dp_size: object) -> None:
    with pytest.raises(EngineError) as caught:
        await _limits({**INFO, "dp_size": dp_size})
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert f"/server_info dp_size is {dp_size!r}" in caught.value.message


def test_a_rank_for_sglang_is_refused_naming_the_way_out() -> None:
    with pytest.raises(ConfigError, match=r"only vLLM .*not sglang: run SGLang with --dp-size 1"):
        ShimConfig(engine="sglang", model="m", kv_events="tcp://*:5557", data_parallel_rank=1).validate()


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
async def test_a_role_the_engines_disaggregation_mode_disagrees_with_is_refused_naming_both(
    role: ShimRole, mode: str
) -> None:
    """Until 2026-12-07 never checked: a shim without --role before a P/D engine sent it every
    request without a bootstrap room, its own alive probe too (SGLang asserts one, or its decode
    waits for a peer that never comes), and a P/D role before a plain engine sent bootstrap
    fields it ignores."""
    info = {**INFO, "disaggregation_mode": mode}
    if MODES[role] == mode:
        assert (await _limits(info, role)).block_size == 16
        return
    with pytest.raises(ConfigError) as caught:
        await _limits(info, role)
    assert caught.value.setting == "role" and caught.value.value == role
    assert f"runs disaggregation_mode {mode!r} (its /server_info)" in str(caught.value)
    wants = {"null": "agg", "prefill": "prefill", "decode": "decode"}[mode]
    assert f"give --role {wants}" in str(caught.value)


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
async def test_an_engine_that_reports_no_mode_serves_agg_only(role: ShimRole) -> None:
    """An SGLang from before P/D has no disaggregation_mode among its args."""
    info = {k: v for k, v in INFO.items() if k != "disaggregation_mode"}
    if role == "agg":
        assert (await _limits(info, role)).block_size == 16
        return
    with pytest.raises(ConfigError, match=r"reports no disaggregation_mode on /server_info.*--role agg only"):
        await _limits(info, role)


async def test_a_mode_sglang_has_no_name_for_is_the_engines_protocol_error() -> None:
    with pytest.raises(EngineError) as caught:
        await _limits({**INFO, "disaggregation_mode": "both"})
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert "disaggregation_mode is 'both'" in caught.value.message


async def test_the_canonical_server_info_is_read_and_its_deprecated_alias_only_where_it_is_missing() -> None:
    """/get_server_info is /server_info's deprecated alias (sglang PR #14533), which logs a
    deprecation warning per call and will be removed; until 2026-12-07 the shim read it alone."""
    async with _adapter({"/server_info": INFO, "/get_server_info": {**INFO, "page_size": 32}}) as (adapter, asked):
        assert (await adapter.limits()).block_size == 16
    assert asked == ["/server_info"]
    async with _adapter({"/get_server_info": {**INFO, "page_size": 32}}) as (adapter, asked):  # an older SGLang
        assert (await adapter.limits()).block_size == 32
    assert asked == ["/server_info", "/get_server_info"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_pd_role_before_an_engine_with_no_server_info_is_refused(role: ShimRole) -> None:
    """Neither route: the engine's P/D mode (and a prefill engine's bootstrap port) cannot be read;
    the agg role's flags stand in for the limits, as before (test_wrong_engine)."""
    with pytest.raises(ConfigError) as caught:
        await _limits(None, role)
    assert caught.value.setting == "role"
    assert "serves neither /server_info nor /get_server_info" in str(caught.value)
    with pytest.raises(EngineError) as not_found:
        await _limits(None, "agg")
    assert not_found.value.code == 404


async def test_a_prefill_engine_tells_decode_engines_the_bootstrap_port_its_server_info_reports() -> None:
    """Until 2026-12-07 a 404 on /get_server_info (an SGLang serving /server_info alone) left the
    port at SGLang's default, 8998, and decode engines looked for the bootstrap server there."""
    info = {**INFO, "disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 9001}
    async with _adapter({"/server_info": info}, "prefill") as (adapter, _):
        await adapter.limits()
        leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=4), prefill_only=True)
        out = await adapter.generate(leg, _ignore)
    assert out.transfer_params is not None and out.transfer_params["bootstrap_port"] == 9001


async def test_a_prefill_engine_that_reports_no_bootstrap_port_is_refused() -> None:
    info = {k: v for k, v in INFO.items() if k != "disaggregation_bootstrap_port"}
    with pytest.raises(ConfigError) as caught:
        await _limits({**info, "disaggregation_mode": "prefill"}, "prefill")
    assert caught.value.setting == "role"
    assert "reports no disaggregation_bootstrap_port on /server_info" in str(caught.value)
    assert (await _limits({**info, "disaggregation_mode": "decode"}, "decode")).block_size == 16


@pytest.mark.parametrize("answer", [[1, 2], "oops", None])
async def test_server_info_that_is_no_json_object_is_the_engines_protocol_error(answer: object) -> None:
    """Until 2026-12-07 read as "no limits reported": the flags stood in for an engine that answered."""
    async with _adapter(dict.fromkeys(BOTH_ROUTES, answer)) as (adapter, _):
        with pytest.raises(EngineError) as caught:
            await adapter.limits()
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert "/server_info is not a JSON object" in caught.value.message
