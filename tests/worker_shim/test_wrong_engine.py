"""A shim given the wrong --engine fails at the start of its session, naming the flag and the
engine it found (worker_shim.engine_kind); a real engine of its own kind is never taken for
another: every fixture payload of each engine is recognised as its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from engine_sim.server import SimServer
from protocol import ConfigError
from tests.router.conftest import Cluster
from tests.worker_shim.cluster import served, shim_for, sim_config
from tests.worker_shim.test_shim_lifecycle import registered_workers
from worker_shim import ShimConfig, ShimStatus
from worker_shim.adapters import EngineCold, EngineError, make_adapter
from worker_shim.config import EngineKind
from worker_shim.engine_kind import SIGNATURES, check_engine_kind, recognise

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "vllm-0.32"
URL = "http://e"
KINDS = ("vllm", "sglang", "trtllm")


def _without(body: bytes, prefix: bytes) -> bytes:
    return b"\n".join(line for line in body.splitlines() if prefix not in line) + b"\n"


def _payloads() -> list[tuple[str, str, bytes]]:
    """(engine kind, name, its /metrics body) for every fixture, and what a real engine of that
    kind serves before its first request or without its own series."""
    vllm = sorted((FIXTURES / "vllm-0.32").rglob("metrics*.txt")) + sorted(SHARED.rglob("metrics*.txt"))
    assert len(vllm) >= 4
    out = [("vllm", str(p.relative_to(SHARED.parents[2])), p.read_bytes()) for p in vllm]
    # vLLM --disable-log-stats: no vllm: series, Prometheus text all the same
    out.append(("vllm", "vllm without vllm: series", _without(vllm[0].read_bytes(), b"vllm:")))
    sglang = (FIXTURES / "sglang" / "metrics.txt").read_bytes()
    out.append(("sglang", "sglang/metrics.txt", sglang))
    out.append(("sglang", "sglang without sglang: series", _without(sglang, b"sglang:")))
    out.append(("trtllm", "trtllm/metrics.json", (FIXTURES / "trtllm" / "metrics.json").read_bytes()))
    out.append(("trtllm", "trtllm before its first iteration", b"[]"))
    return out


PAYLOADS = _payloads()
IDS = [name for _, name, _ in PAYLOADS]


@pytest.mark.parametrize(("kind", "name", "body"), PAYLOADS, ids=IDS)
def test_every_engines_own_metrics_pass_for_its_kind(kind: str, name: str, body: bytes) -> None:
    sig = recognise(body)
    assert sig is None or kind in sig.kinds, name
    check_engine_kind(kind, URL, body)


@pytest.mark.parametrize(("kind", "name", "body"), PAYLOADS, ids=IDS)
def test_another_kinds_shim_is_told_which_engine_to_give(kind: str, name: str, body: bytes) -> None:
    sig = recognise(body)
    if sig is None:  # SGLang's /metrics without its series is empty: it tells nothing
        assert name == "sglang without sglang: series"
        return
    for wrong in (k for k in KINDS if k not in sig.kinds):
        with pytest.raises(ConfigError) as err:
            check_engine_kind(wrong, URL, body)
        assert err.value.setting == "engine" and err.value.value == wrong, name
        assert f"the engine at {URL} serves " in str(err.value) and f"--engine {kind}" in str(err.value), name


def test_the_messages_say_what_the_engine_looks_like() -> None:
    vllm = (FIXTURES / "vllm-0.32/bs32/metrics_after.txt").read_bytes()
    with pytest.raises(ConfigError) as err:
        check_engine_kind("trtllm", URL, vllm)
    assert str(err.value) == (
        "invalid engine (--engine, KVSWITCH_ENGINE) = 'trtllm': "
        "the engine at http://e serves vLLM's metrics (vllm:*): give --engine vllm"
    )
    with pytest.raises(ConfigError, match=r"serves SGLang's metrics \(sglang:\*\): give --engine sglang$"):
        check_engine_kind("vllm", URL, (FIXTURES / "sglang" / "metrics.txt").read_bytes())
    with pytest.raises(
        ConfigError, match=r"TensorRT-LLM's iteration stats \(JSON\) on /metrics: give --engine trtllm$"
    ):
        check_engine_kind("sglang", URL, b"[]")
    with pytest.raises(ConfigError, match=r"Prometheus text .*: give --engine vllm or --engine sglang$"):
        check_engine_kind("trtllm", URL, _without(vllm, b"vllm:"))


def test_a_body_that_tells_nothing_is_no_error() -> None:
    both = (FIXTURES / "vllm-0.32/bs32/metrics_after.txt").read_bytes() + (FIXTURES / "sglang/metrics.txt").read_bytes()
    for body in (b"", b"OK", b"{}", b'{"detail": "Not Found"}'):
        assert recognise(body) is None, body
        for kind in KINDS:
            check_engine_kind(kind, URL, body)
    sig = recognise(both)  # two engines' series: neither engine's signature, Prometheus text still
    assert sig is SIGNATURES[-1] and sig.kinds == ("vllm", "sglang")


# --- the adapters at the start of a session, before a fake engine ------------------------------------


@asynccontextmanager
async def fake_engine(routes: dict[str, bytes | int]) -> AsyncIterator[str]:
    """An HTTP server answering each path with a body (200) or a bare status; other paths 404."""

    async def handle(request: web.Request) -> web.Response:
        answer = routes.get(request.rel_url.path, 404)
        return web.Response(status=answer) if isinstance(answer, int) else web.Response(body=answer)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    async with served(app) as url:
        yield url


async def _limits(engine: EngineKind, routes: dict[str, bytes | int]) -> Any:
    async with fake_engine(routes) as url:
        kv = "tcp://127.0.0.1:9" if engine == "sglang" else None
        adapter = make_adapter(ShimConfig(engine=engine, model="m", engine_url=url, kv_events=kv).validate())
        await adapter.open()
        try:
            return await adapter.limits()
        finally:
            await adapter.close()


VLLM = (FIXTURES / "vllm-0.32/bs32/metrics_after.txt").read_bytes()
SGLANG = (FIXTURES / "sglang/metrics.txt").read_bytes()
TRTLLM = (FIXTURES / "trtllm/metrics.json").read_bytes()
SERVER_INFO = (FIXTURES / "sglang/get_server_info.json").read_bytes()


async def test_each_adapter_takes_its_own_engines_payloads() -> None:
    assert (await _limits("vllm", {"/metrics": VLLM})).block_size == 32
    assert (await _limits("trtllm", {"/metrics": TRTLLM})).block_size == 32
    with pytest.raises(EngineCold):  # no iteration yet: the shim warms the engine up (test_trtllm_cold_start.py)
        await _limits("trtllm", {"/metrics": b"[]"})
    assert (await _limits("sglang", {"/get_server_info": SERVER_INFO, "/metrics": SGLANG})).block_size is not None
    # An SGLang serving neither /server_info nor /get_server_info: the agg shim's 404 stands (the flags
    # stand in), whatever /metrics is.
    for metrics in (SGLANG, _without(SGLANG, b"sglang:"), 404, 503):
        with pytest.raises(EngineError) as err:
            await _limits("sglang", {"/metrics": metrics})
        assert err.value.code == 404


@pytest.mark.parametrize(
    ("engine", "routes", "give"),
    [
        ("trtllm", {"/metrics": VLLM}, "--engine vllm"),  # was: retried forever, "JSON is malformed"
        ("trtllm", {"/metrics": SGLANG}, "--engine sglang"),
        ("sglang", {"/metrics": VLLM}, "--engine vllm"),  # was: "give --block-size", or a worker excluded
        ("sglang", {"/metrics": TRTLLM}, "--engine trtllm"),
        ("vllm", {"/metrics": SGLANG}, "--engine sglang"),  # was: "start it without --disable-log-stats"
        ("vllm", {"/metrics": TRTLLM}, "--engine trtllm"),
    ],
)
async def test_each_adapter_refuses_another_engines_payloads(
    engine: EngineKind, routes: dict[str, bytes], give: str
) -> None:
    with pytest.raises(ConfigError) as err:
        await _limits(engine, dict(routes))
    assert err.value.setting == "engine" and str(err.value).endswith(f"give {give}")


async def test_a_trtllm_metrics_that_is_no_json_is_a_protocol_error_not_an_engine_away() -> None:
    with pytest.raises(EngineError) as err:
        await _limits("trtllm", {"/metrics": b"<html>gateway</html>"})
    assert (err.value.code, err.value.kind) == (502, "engine_protocol")  # was 503 engine_unavailable
    assert "/metrics answered no JSON" in err.value.message


# --- the audit's cases: shims before a vLLM-speaking sim ---------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"engine": "trtllm", "kv_events": None, "kv_replay": None, "kv_events_mode": "auto"},  # trtllm reads none
        {"engine": "sglang"},
        {"engine": "sglang", "block_size": 16, "kv_total_blocks": 1000},
    ],
    ids=["trtllm", "sglang", "sglang-with-limits"],
)
async def test_a_shim_told_the_wrong_engine_exits_naming_engine(
    settings: dict[str, Any], ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, **settings)
        async with shim:
            await asyncio.wait_for(shim.done.wait(), 10)
            assert shim.status is ShimStatus.FAILED and isinstance(shim.failure, ConfigError)
            assert str(shim.failure) == (
                f"invalid engine (--engine, KVSWITCH_ENGINE) = {settings['engine']!r}: "
                f"the engine at {sim.url} serves vLLM's metrics (vllm:*): give --engine vllm"
            )
            assert shim.registration_count == 0 and shim.session_failures == 0
            assert await registered_workers(etcd_url, ns) == set()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_shim_pointed_at_kvswitch_instead_of_its_engine_exits_naming_engine_url(
    engine: EngineKind, ns: str, nats_url: str, etcd_url: str
) -> None:
    """--engine-url given a router's address (both serve /v1/models) was told that a vLLM started
    with --disable-log-stats exports no load series (ops audit, 2026-12-06); another shim's
    address the same."""
    cluster = Cluster(ns, nats_url, etcd_url)
    try:
        router = await cluster.add_router()
        async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url) as first:
            await asyncio.wait_for(first.registered.wait(), 20)
            for url, what in ((router.url, "router"), (first.http.url, "shim")):
                kv = "tcp://127.0.0.1:9" if engine == "sglang" else sim.events_endpoint
                async with shim_for(sim, ns, nats_url, etcd_url, engine=engine, engine_url=url, kv_events=kv) as shim:
                    await asyncio.wait_for(shim.done.wait(), 20)
                    assert shim.status is ShimStatus.FAILED and isinstance(shim.failure, ConfigError), shim.failure
                    assert shim.failure.setting == "engine_url" and shim.failure.value == url
                    assert f"--engine-url points at a kvswitch {what} (its /metrics has kvswitch_{what}_*" in str(
                        shim.failure
                    )
                    assert "disable-log-stats" not in str(shim.failure)
    finally:
        await cluster.close()
