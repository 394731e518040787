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
    routes: Mapping[str, object], role: ShimRole = "agg", metrics: str | None = None
) -> AsyncIterator[tuple[SglangAdapter, list[str]]]:
    """An SGLang adapter before an engine serving `routes` (a path: its JSON answer) and, where
    given, `metrics` on /metrics, and the paths the engine was asked for."""
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
    if metrics is not None:
        text = metrics

        async def prometheus(request: web.Request) -> web.Response:
            return web.Response(text=text)

        app.router.add_get("/metrics", prometheus)
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
    with pytest.raises(
        ConfigError, match=r"only vLLM .*not sglang: drop the flag.*radix cache must run SGLang with --dp-size 1"
    ):
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
    """/get_server_info is /server_info's deprecated alias, which logs a
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


def _dp(dp_size: int, **args: object) -> dict[str, Any]:
    """Server info of a data-parallel server (DP attention, as upstream's P/D recipes run it)."""
    return {**INFO, "dp_size": dp_size, "enable_dp_attention": True, **args}


@pytest.mark.parametrize(
    ("role", "args"),
    [
        # A P/D decode server: upstream resolves disable_radix_cache True without the decode flag.
        ("decode", {"disaggregation_mode": "decode", "disable_radix_cache": True}),
        # The flag without the cache resolved on is no cache; nor is the cache on without the flag.
        (
            "decode",
            {
                "disaggregation_mode": "decode",
                "disable_radix_cache": True,
                "disaggregation_decode_enable_radix_cache": True,
            },
        ),
        ("decode", {"disaggregation_mode": "decode", "disable_radix_cache": False}),
        ("agg", {"disable_radix_cache": True}),
        ("prefill", {"disaggregation_mode": "prefill", "disable_radix_cache": True}),
    ],
)
async def test_a_data_parallel_engine_without_a_radix_cache_is_served_whole_routed_by_load(
    role: ShimRole, args: dict[str, object]
) -> None:
    """Such an engine publishes no KV event, and each rank reports its load on /metrics (summed).
    Refused from 5ab0213 until 2026-12-07, where before it was served: the usual P/D decode fleet
    (--dp-size 8 --enable-dp-attention) and an agg one with --disable-radix-cache exited 2."""
    limits = await _limits(_dp(8, **args), role)
    assert limits.prefix_caching is False
    # max_total_num_tokens is rank 0's pool; each of the 8 ranks has one, and the load is theirs together.
    assert limits.kv_total_blocks == 401408 // 16 * 8


@pytest.mark.parametrize(
    ("role", "args"),
    [
        ("agg", {"disable_radix_cache": False}),
        ("agg", {}),  # args that do not say whether it caches: refused, as before
        (
            "decode",
            {
                "disaggregation_mode": "decode",
                "disable_radix_cache": False,
                "disaggregation_decode_enable_radix_cache": True,
            },
        ),
        ("prefill", {"disaggregation_mode": "prefill", "disable_radix_cache": False}),
    ],
)
async def test_a_data_parallel_engine_with_a_radix_cache_is_refused(role: ShimRole, args: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as caught:
        await _limits(_dp(4, **args), role)
    assert caught.value.setting == "engine_url"
    said = "and no disable_radix_cache (whether it caches)" if not args else "with a radix cache"
    assert f"reports dp_size 4 on /server_info {said}:" in str(caught.value)
    assert "--disable-radix-cache" in str(caught.value)


def _attn_dp(ranks: int, **args: object) -> dict[str, Any]:
    """SGLang 0.5.23's server info with DP attention (--attn-dp-size N, or the deprecated --dp-size N
    --enable-dp-attention, which parallel_hook resolves so): dp_size 1, attn_dp_size N, and
    enable_dp_attention reported true (ServerArgs.resolved_dict)."""
    return {**INFO, "dp_size": 1, "attn_dp_size": ranks, "enable_dp_attention": True, **args}


async def test_sglang_0_5_23s_attention_dp_with_a_radix_cache_is_refused() -> None:
    """Each attention-DP rank keeps a cache of its own and publishes on the endpoint's port + rank
    (kv_events.select_kv_publisher_dp_rank). Until 2026-12-07 only dp_size was read: served, one
    shim heard rank 0 alone."""
    with pytest.raises(ConfigError) as caught:
        await _limits(_attn_dp(4, disable_radix_cache=False))
    assert "reports dp_size 1 and attn_dp_size 4 (4 data-parallel ranks) on /server_info with a radix cache" in str(
        caught.value
    )


async def test_sglang_0_5_23s_attention_dp_without_a_cache_registers_every_ranks_pool() -> None:
    """Until 2026-12-07 rank 0's pool alone, while the load summed every rank's requests."""
    limits = await _limits(_attn_dp(8, disaggregation_mode="decode", disable_radix_cache=True), "decode")
    assert limits.kv_total_blocks == 401408 // 16 * 8


async def test_a_data_parallel_engines_load_is_its_ranks_together() -> None:
    """Each rank whose attention TP rank is 0 reports on /metrics (one series per rank): the requests
    are summed, the KV use is their mean, and the capacity is every rank's pool."""
    ranks = 8
    lines = []
    for r in range(ranks):
        labels = f'engine_type="decode",model_name="m",tp_rank="{r}",dp_rank="{r}"'
        lines += [
            f"sglang:num_running_reqs{{{labels}}} {10 + r}.0",
            f"sglang:num_queue_reqs{{{labels}}} 1.0",
            f"sglang:token_usage{{{labels}}} 0.5",
            f"sglang:num_used_tokens{{{labels}}} 200704.0",
        ]
    info = _dp(ranks, disaggregation_mode="decode", disable_radix_cache=True)
    async with _adapter(dict.fromkeys(BOTH_ROUTES, info), "decode", metrics="\n".join(lines) + "\n") as (adapter, _):
        limits = await adapter.limits()
        load = await adapter.load()
    assert (load.running, load.waiting, load.kv_usage) == (sum(10 + r for r in range(ranks)), ranks, 0.5)
    assert load.kv_total_blocks == limits.kv_total_blocks == 401408 // 16 * ranks


RUST_INFO: dict[str, Any] = json.loads((FIX / "server_info_rust.json").read_text())
MODEL_INFO = {"model_path": "/m", "served_model_name": "m", "is_generation": True, "weight_version": None}


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
async def test_a_rust_frontends_mode_is_read_from_its_model_info(role: ShimRole, mode: str) -> None:
    """SGLang's Rust HTTP frontend (SGLANG_RUST_SERVER=1) serves /server_info without the server
    args, its mode on /model_info. Until 2026-12-07 read as an SGLang before P/D: --role decode and
    prefill were refused as if the engine had no P/D, and --role agg before its decode engine accepted."""
    routes = {"/server_info": RUST_INFO, "/model_info": {**MODEL_INFO, "disaggregation_mode": mode}}
    async with _adapter(routes, role) as (adapter, asked):
        if MODES[role] != mode:
            with pytest.raises(ConfigError) as caught:
                await adapter.limits()
            assert caught.value.setting == "role"
            assert f"runs disaggregation_mode {mode!r} (its /model_info)" in str(caught.value)
        elif role == "prefill":  # its bootstrap port is no server arg it reports
            with pytest.raises(ConfigError, match=r"no disaggregation_bootstrap_port .*SGLANG_RUST_SERVER=1"):
                await adapter.limits()
        else:
            limits = await adapter.limits()
            assert (limits.block_size, limits.prefix_caching) == (None, None)  # --block-size stands in
    assert asked == ["/server_info", "/model_info"]


async def test_a_rust_frontends_mode_is_read_from_the_older_model_info_route() -> None:
    routes = {"/server_info": RUST_INFO, "/get_model_info": {**MODEL_INFO, "disaggregation_mode": "decode"}}
    async with _adapter(routes, "decode") as (adapter, asked):
        await adapter.limits()
    assert asked == ["/server_info", "/model_info", "/get_model_info"]


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
@pytest.mark.parametrize("model_info", [MODEL_INFO, None])
async def test_a_rust_frontend_that_reports_no_mode_is_refused_naming_it(
    role: ShimRole, model_info: dict[str, Any] | None
) -> None:
    """Its P/D mode unread, no role is safe: agg before a P/D engine sends requests without a room."""
    info = {k: v for k, v in RUST_INFO.items() if k != "frontend"}  # told by its want of server args too
    routes = {"/server_info": info} if model_info is None else {"/server_info": info, "/model_info": model_info}
    with pytest.raises(ConfigError) as caught:
        async with _adapter(routes, role) as (adapter, _):
            await adapter.limits()
    assert caught.value.setting == "engine_url"
    unread = "serves neither /model_info nor /get_model_info" if model_info is None else "no disaggregation_mode on"
    assert "without its server args (SGLang's Rust HTTP frontend, SGLANG_RUST_SERVER=1)" in str(caught.value)
    assert unread in str(caught.value)
