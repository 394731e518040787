"""A fleet of processes each valid on its own that together would route wrongly, silently: names
served as two models, prefill and decode workers of different engines, a --model no worker serves,
shims and router in different namespaces, a model with only prefill workers, replicas that route
with different settings (docs/router.md, "Fleet consistency"). End to end against real NATS and
etcd."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import re
import shutil
import time
from collections.abc import AsyncGenerator
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from discovery import Discovery, WatchEvent
from engine_sim.lora import LoraModule
from protocol import RouterInfo, WorkerInfo, encode_json, subjects
from protocol.config import ConditionalDisaggConfig, EtcdSettings, RouterSettings
from protocol.version import BUILD, __version__
from router import cli, tokenization
from router.peer_settings import SETTLE_S, PeerSettings, rendering_digest, settings_digest, settings_fields
from router.service import RouterConfig, RouterService
from router.tokenization import ChatOptions, load_tokenizer, tokenizer_fingerprint
from tests.router.conftest import MODEL, Cluster, complete
from tests.router.fingerprint_variants import build_variant
from tests.router.polling import until
from tests.router.template_clock import TemplateClock
from worker_shim.shim import WorkerShim


async def _get(http: aiohttp.ClientSession, router: RouterService, path: str) -> tuple[int, Any]:
    async with http.get(router.url + path) as resp:
        return resp.status, await resp.json()


async def _ask(http: aiohttp.ClientSession, router: RouterService, model: str, i: int = 0) -> tuple[int, Any]:
    body = {"model": model, "prompt": list(range(100 + i, 140 + i)), "max_tokens": 2}
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


async def _ids(http: aiohttp.ClientSession, router: RouterService) -> list[str]:
    _, body = await _get(http, router, "/v1/models")
    return [card["id"] for card in body["data"]]


def _gauge(router: RouterService, name: str) -> dict[str, float]:
    """A labelled gauge's samples by their one label's value."""
    return {
        next(iter(s.labels.values())): s.value
        for family in text_string_to_metric_families(router.metrics.render().decode())
        for s in family.samples
        if s.name == name
    }


# --- F1: one name, two models -----------------------------------------------------------------------


async def test_a_name_served_as_two_models_is_refused_logged_once_and_served_again_when_it_clears(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # Two aliases of different models, neither a model's own name: no one answer.
    caplog.set_level(logging.INFO, logger="router.worker_registry")
    a = await cluster.add_worker("agg", model="llama", aliases=("chat",), shim={"model": "llama"})
    b = await cluster.add_worker("agg", model="qwen", aliases=("chat",), shim={"model": "qwen"})
    router = await cluster.add_ready_router()
    for i in range(4):  # before: about half went to qwen's worker and answered as qwen
        status, body = await _ask(http, router, "chat", i)
        assert status == 503, body
        message = body["error"]["message"]
        assert "`chat`" in message and "model llama on " + a.id in message and "model qwen on " + b.id in message
    status, body = await _ask(http, router, "qwen")
    assert status == 200 and body["model"] == "qwen"
    assert await _ids(http, router) == ["llama", "qwen"]  # the clashing name is not offered
    status, ready = await _get(http, router, "/ready")
    assert status == 200 and ready["problems"] == []  # both serve on: one bad name does not stop the router
    assert [w for w in ready["warnings"] if "`chat`" in w and a.id in w and b.id in w]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "`chat`" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # once per clash, not per request

    await b.shim.stop()  # the clash clears
    await until(lambda: len(router.registry.workers()) == 1, what="qwen's worker to leave")
    status, body = await _ask(http, router, "chat")
    assert status == 200 and body["kvswitch"]["decode_worker"] == a.id
    assert await _ids(http, router) == ["llama", "chat"]
    assert (await _get(http, router, "/ready"))[1]["warnings"] == []
    assert any("served as one model again" in r.getMessage() for r in caplog.records)


async def test_a_models_own_name_wins_over_another_models_alias_logged_once_and_warned_until_it_goes(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # One qwen worker aliasing `llama` (--served-model-name qwen llama, or a faulty shim) made every
    # request for llama a 503 on every router, and a router with --model llama served nothing while
    # /ready said 200. Now llama's workers serve it; the qwen worker serves qwen and is reported.
    caplog.set_level(logging.INFO, logger="router.worker_registry")
    llamas = [await cluster.add_worker("agg", model="llama", shim={"model": "llama"}) for _ in range(2)]
    b = await cluster.add_worker("agg", model="qwen", aliases=("llama",), shim={"model": "qwen"})
    router = await cluster.add_ready_router(config={"model": "llama"})
    anyone = await cluster.add_ready_router()
    for r in (router, anyone):
        assert r.registry.name_clashes == {} and r.registry.get(b.id).aliases == ["llama"]  # type: ignore[union-attr]
        for i in range(4):
            status, body = await _ask(http, r, "llama", i)
            assert status == 200 and body["model"] == "llama", body
            assert body["kvswitch"]["decode_worker"] in {w.id for w in llamas}
        status, ready = await _get(http, r, "/ready")
        assert status == 200 and ready["problems"] == []
        assert [w for w in ready["warnings"] if "`llama`" in w and b.id in w], ready["warnings"]
    status, body = await _ask(http, anyone, "qwen")
    assert status == 200 and body["kvswitch"]["decode_worker"] == b.id
    assert await _ids(http, anyone) == ["llama", "qwen"] and await _ids(http, router) == ["llama"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "`llama`" in r.getMessage()]
    assert len(errors) == 2, [r.getMessage() for r in errors]  # once per router, not per request

    await b.shim.stop()
    await until(lambda: len(router.registry.workers()) == 2, what="qwen's worker to leave")
    assert (await _get(http, router, "/ready"))[1]["warnings"] == []
    assert any("as an alias any more" in r.getMessage() for r in caplog.records)


async def test_a_lora_adapter_of_one_name_on_two_base_models_is_refused(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    for model in ("m1", "m2"):
        await cluster.add_worker(
            "agg", model=model, lora_modules=(LoraModule("sql", f"/a/sql-{model}"),), shim={"model": model}
        )
    router = await cluster.add_ready_router()
    assert all(router.registry.get(w.id).adapters == ["sql"] for w in cluster.workers)  # type: ignore[union-attr]
    status, body = await _ask(http, router, "sql")
    assert status == 503 and "model m1 on" in body["error"]["message"] and "model m2 on" in body["error"]["message"]
    assert [(await _ask(http, router, m))[0] for m in ("m1", "m2")] == [200, 200]
    assert await _ids(http, router) == ["m1", "m2"]


@pytest.mark.parametrize("alias_model", ["qwen", "llama"])
async def test_an_alias_on_one_worker_and_a_lora_adapter_on_another_clash(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, alias_model: str
) -> None:
    # Across models, or within one: the adapter's weights are not the model's. Before, the alias won
    # silently (every request ran on B's base weights) and /v1/models listed `chat` twice.
    caplog.set_level(logging.INFO, logger="router.worker_registry")
    a = await cluster.add_worker(
        "agg", model="llama", lora_modules=(LoraModule("chat", "/a/chat"),), shim={"model": "llama"}
    )
    b = await cluster.add_worker("agg", model=alias_model, aliases=("chat",), shim={"model": alias_model})
    router = await cluster.add_ready_router()
    assert router.registry.get(a.id).adapters == ["chat"] and router.registry.get(b.id).aliases == ["chat"]  # type: ignore[union-attr]
    assert "chat" in router.registry.name_clashes
    for i in range(3):
        status, body = await _ask(http, router, "chat", i)
        assert status == 503, body
        message = body["error"]["message"]
        assert "`chat`" in message and a.id in message and b.id in message
    if alias_model == "llama":
        assert f"model llama with its LoRA adapter chat on {a.id}" in message and f"model llama on {b.id}" in message
    ids = await _ids(http, router)
    assert "chat" not in ids and len(ids) == len(set(ids)) and set(ids) == {"llama", alias_model}
    status, ready = await _get(http, router, "/ready")
    assert status == 200 and [w for w in ready["warnings"] if "`chat`" in w and a.id in w and b.id in w]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "`chat`" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    for model in {"llama", alias_model}:  # their own names serve on
        assert (await _ask(http, router, model))[0] == 200


async def test_a_model_name_still_wins_over_another_models_adapter(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    q = await cluster.add_worker("agg", model="qwen", shim={"model": "qwen"})
    await cluster.add_worker("agg", model="llama", lora_modules=(LoraModule("qwen", "/a/q"),), shim={"model": "llama"})
    router = await cluster.add_ready_router()
    assert router.registry.name_clashes == {}
    status, body = await _ask(http, router, "qwen")
    assert status == 200 and body["kvswitch"]["decode_worker"] == q.id
    assert await _ids(http, router) == ["llama", "qwen"]


async def test_workers_serving_each_others_model_names_as_aliases_serve_their_own(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # Each worker serves the other's model name as an alias. Before, no name reached one model and
    # the router was not ready; a model's own name wins over another model's alias now.
    a = await cluster.add_worker("agg", model="a", aliases=("b",), shim={"model": "a"})
    b = await cluster.add_worker("agg", model="b", aliases=("a",), shim={"model": "b"})
    router = await cluster.add_router()
    await until(lambda: router.readiness()[1]["routable"] == 2, what="both workers routable")
    assert sorted(router.registry.get(w.id).aliases[0] for w in cluster.workers) == ["a", "b"]  # type: ignore[union-attr]
    status, ready = await _get(http, router, "/ready")
    assert status == 200 and ready["problems"] == [] and len(ready["warnings"]) == 2
    for model, worker in (("a", a), ("b", b)):
        status, body = await _ask(http, router, model)
        assert status == 200 and body["kvswitch"]["decode_worker"] == worker.id


async def _llama_and_qwen(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, qwens: str) -> RouterService:
    """A router before llama and qwen workers, qwen's shim reporting the tokenizer `qwens`
    (engine_sim has the built-in tokenizer alone)."""
    probe = WorkerShim._tokenizer

    async def tokenizer(shim: WorkerShim) -> str:
        return qwens if shim.config.model == "qwen" else await probe(shim)

    monkeypatch.setattr(WorkerShim, "_tokenizer", tokenizer)
    await cluster.add_worker("agg", model="llama", shim={"model": "llama"})
    await cluster.add_worker("agg", model="qwen", shim={"model": "qwen"})
    return await cluster.add_ready_router()


async def test_a_model_of_another_tokenizer_is_refused_text_for_good_naming_a_router_per_tokenizer(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = await _llama_and_qwen(cluster, monkeypatch, "sha256:qwen")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(router.url + "/v1/chat/completions", json={**chat, "model": "llama"}) as r:
        assert r.status == 200, await r.text()
    async with http.post(router.url + "/v1/chat/completions", json={**chat, "model": "qwen"}) as r:
        # Before: Retry-After: 5, for ever, and a fix (give the router qwen's tokenizer) that refuses llama.
        assert r.status == 503 and "Retry-After" not in r.headers
        message = (await r.json())["error"]["message"]
    assert "sha256:qwen" in message and "--model qwen --tokenizer" in message and "token ids" in message
    assert (await _ask(http, router, "qwen"))[0] == 200  # token ids route
    status, ready = await _get(http, router, "/ready")
    assert status == 200 and ready["warnings"] == [message]


async def test_a_model_whose_tokenizer_no_shim_could_read_is_told_to_send_token_ids(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang and TensorRT-LLM workers register no tokenizer: no router of its own can match one,
    so the refusal must not advise one (review of the tokenizer refusal)."""
    router = await _llama_and_qwen(cluster, monkeypatch, "")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "qwen"}
    async with http.post(router.url + "/v1/chat/completions", json=chat) as r:
        assert r.status == 503 and "Retry-After" not in r.headers
        message = (await r.json())["error"]["message"]
    assert "send token ids" in message and "--tokenizer" not in message, message


# --- F2: prefill and decode workers of different engines -----------------------------------------------


def _routable(router: RouterService, worker: str) -> bool:
    return any(st["worker"] == worker and st["routable"] for st in router.worker_listing()["worker_status"])


def _count(router: RouterService, outcome: str) -> float:
    return _gauge(router, "kvswitch_router_decisions_total").get(outcome, 0.0)


async def test_a_prefill_worker_of_another_engine_is_never_paired_and_ready_warns(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    # As an SGLang prefill shim would register and stamp its transfer handles.
    p.shim.config = msgspec.structs.replace(p.shim.config, engine="sglang")
    p.shim.adapter.kind = "sglang"  # type: ignore[misc]  # an instance of its own, as an SGLang shim has
    assert p.shim.registration is not None
    p.shim.registration.update()
    router = await cluster.add_ready_router(disagg="always")
    await until(lambda: router.registry.get(p.id) is not None and router.registry.get(p.id).engine == "sglang")  # type: ignore[union-attr]
    status, ready = await _get(http, router, "/ready")
    assert status == 200
    assert [w for w in ready["warnings"] if f"{p.id} (sglang)" in w and "decode workers run vllm" in w]
    for i in range(3):  # before: every request a 400 from the decode shim, counted as remote_prefill
        status, body, headers = await complete(http, router, list(range(7 + i, 307 + i)), max_tokens=2)
        assert status == 200, body
        assert headers["x-kvswitch-decode-worker"] == d.id and headers["x-kvswitch-prefill"] == "agg"
        assert headers["x-kvswitch-outcome"] == "no_prefill_pool"
    assert _count(router, "remote_prefill") == 0 and _count(router, "no_prefill_pool") == 3

    same = await cluster.add_worker("prefill")  # one of the decode worker's own engine: paired
    await until(lambda: _routable(router, same.id), what="the vLLM prefill worker routable")
    status, body, headers = await complete(http, router, list(range(500, 800)), max_tokens=2)
    assert status == 200 and headers["x-kvswitch-prefill"] == "remote"
    assert body["kvswitch"]["prefill_worker"] == same.id


# --- F3: --model that no worker serves ------------------------------------------------------------------


async def test_with_model_only_its_workers_count_for_ready_and_models(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add_worker("agg", model="served", aliases=("served-too",), shim={"model": "served"})
    await cluster.add_worker("agg", model="x", shim={"model": "x"})
    other = await cluster.add_router(config={"model": "other"})
    await until(lambda: len(other.registry.workers()) == 2 and other.ingest.synced, what="the workers read")
    status, ready = await _get(http, other, "/ready")
    assert status == 503  # before: 200, while every request it takes is refused
    assert ready["problems"] == [
        "no worker serves other, the only model this router serves (--model); registered: served, x, served-too"
    ]
    assert ready["models"] == {} and await _ids(http, other) == []  # before: served and x, which it refuses

    mine = await cluster.add_router(config={"model": "served"})
    await cluster.ready(mine)
    status, ready = await _get(http, mine, "/ready")
    assert status == 200 and list(ready["models"]) == ["served"] and ready["workers"] == 1
    assert await _ids(http, mine) == ["served", "served-too"]


# --- F4: shims and router in different namespaces ---------------------------------------------------------


async def test_a_router_that_sees_no_worker_names_its_namespace_and_the_key_it_watches(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker_shim.shim")
    shim_ns = cluster.ns
    await cluster.add_worker("agg")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("registered worker")]
    assert said and f"/{shim_ns}/workers/" in said[0] and f"namespace {shim_ns}" in said[0]
    cluster.ns = "other" + shim_ns
    router = await cluster.add_router()
    await until(lambda: any("/workers/" in p for p in router.readiness()[1]["problems"]), what="the registry read")
    status, ready = await _get(http, router, "/ready")
    assert status == 503
    (problem,) = [p for p in ready["problems"] if "/workers/" in p]
    assert f"/{cluster.ns}/workers/" in problem and f"--namespace is {cluster.ns}" in problem
    status, body = await _ask(http, router, MODEL)
    assert status == 404
    assert f"/{cluster.ns}/workers/" in body["error"]["message"] and "--namespace" in body["error"]["message"]


async def test_a_router_that_has_not_read_its_workers_yet_says_it_is_starting_not_that_none_is_registered(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before its first read of the workers a router answered "no worker serves the model ...
    # Registered: none (no worker is registered under /kvswitch/workers/: this router's --namespace
    # is kvswitch)" while /ready said it was starting and the workers were there (replica audit of
    # 2026-12-07): a namespace mistake that was none.
    read = asyncio.Event()
    watch_workers = Discovery.watch_workers

    async def held(self: Discovery, health: Any = None) -> AsyncGenerator[WatchEvent[WorkerInfo]]:
        await read.wait()  # etcd's first answer, late
        async for event in watch_workers(self, health):
            yield event

    monkeypatch.setattr(Discovery, "watch_workers", held)
    await cluster.add_worker("agg")
    starting = "the router is starting: reading workers from etcd: send the request again"
    for router in (await cluster.add_router(), await cluster.add_router(config={"model": MODEL})):
        status, ready = await _get(http, router, "/ready")
        assert status == 503 and any("has not been read from etcd yet" in p for p in ready["problems"])
        for model in (MODEL, "another-model"):
            async with http.post(
                router.url + "/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2}
            ) as resp:
                assert (resp.status, (await resp.json())["error"]["message"]) == (503, starting)
                assert resp.headers["Retry-After"] == "1"
        async with http.post(router.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}) as resp:
            assert (resp.status, (await resp.json())["error"]["message"]) == (503, starting)
    read.set()
    for router in cluster.routers:
        await cluster.ready(router)
        status, body = await _ask(http, router, MODEL)
        assert status == 200, body


# --- F5: a model with prefill workers only ------------------------------------------------------------------


async def test_a_model_with_only_prefill_workers_is_a_ready_warning(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    p = await cluster.add_worker("prefill", model="ponly", shim={"model": "ponly"})
    await cluster.add_worker("decode", model="donly", shim={"model": "donly"})
    router = await cluster.add_ready_router(conditional_disagg=True)
    status, ready = await _get(http, router, "/ready")
    assert status == 200  # donly serves
    assert [w for w in ready["warnings"] if w.startswith("model ponly has prefill workers") and p.id in w]
    assert (await _ask(http, router, "ponly"))[0] == 503


# --- F5b: prefill workers at odds with their decode pool -------------------------------------------------------


@pytest.mark.parametrize(
    ("prefill", "reason", "why"),
    [
        ({"block_size": 32}, "block_size", f"block size 32, but model {MODEL} is served with 16"),
        ({"max_model_len": 2048}, "context_conflict", f"max_model_len 2048, but model {MODEL} is served with 4096"),
    ],
)
async def test_prefill_workers_at_odds_with_their_decode_worker_are_left_out_and_it_serves(
    cluster: Cluster, http: aiohttp.ClientSession, prefill: dict[str, Any], reason: str, why: str
) -> None:
    # The audit of 2026-12-07: prefill workers outnumbering the decode worker outvoted it on the
    # model's block size (or max_model_len), so it was left out and every request was a 503 ("no
    # decode or agg worker is registered", for the length) for a fault of the prefill pool alone.
    d = await cluster.add_worker("decode", max_model_len=4096)
    odd = [await cluster.add_worker("prefill", **{"max_model_len": 4096, **prefill}) for _ in range(3)]
    router = await cluster.add_router(conditional_disagg=True)
    await until(lambda: len(router.registry) == 4 and router.ingest.synced, what="every worker synced")
    await until(lambda: router.ready, what="the router ready")
    status, ready = await _get(http, router, "/ready")
    assert status == 200 and ready["ready"] and ready["problems"] == [], ready
    status_of = {w["worker"]: w for w in ready["worker_status"]}
    assert d.id not in status_of  # routable: /ready names only those left out
    assert all(status_of[p.id]["excluded"] == reason and status_of[p.id]["why"].startswith(why) for p in odd), ready
    for i in range(3):
        status, body = await _ask(http, router, MODEL, i)
        assert status == 200, body


@pytest.mark.parametrize("newcomer", ["silent", "never_bootstraps"])
async def test_a_decode_worker_joining_at_another_block_size_never_takes_the_model_from_the_one_serving(
    cluster: Cluster, http: aiohttp.ClientSession, newcomer: str
) -> None:
    # The second review of 2026-12-07: a decode worker at block size 32 joining one at 16 tied 1-1
    # and took the model over (ties went to the greater value), and it kept its vote while silent:
    # killed, the model was a 503 until its lease expired though the old worker was healthy. A
    # record whose shim never bootstrapped voted on max_model_len too: "d_new: bootstrapping".
    d = await cluster.add_worker("decode", max_model_len=4096)
    router = await cluster.add_ready_router()
    async with Discovery(EtcdSettings(endpoints=[cluster.etcd_url]), cluster.ns) as disc:
        if newcomer == "silent":
            new = await cluster.add_worker("decode", block_size=32, max_model_len=4096)
            await until(lambda: len(router.registry) == 2 and router.ingest.synced, what="the newcomer synced")
            assert new.shim.load_reporter is not None
            await new.shim.load_reporter.stop()
            new_id, reason = new.id, "block_size"
            await until(  # no report for 3 of its periods (or none heard at all)
                lambda: (live := router.view.liveness(new_id)) is None or live.age_s > 3 * live.period_s,
                what="the newcomer silent",
            )
        else:
            lease = await disc.grant(30)
            new_id, reason = "00d0e32a", "context_conflict"
            record = WorkerInfo(
                worker=new_id, model=MODEL, role="decode", engine="vllm", block_size=32, max_model_len=8192,
                tokenizer="builtin",
            )  # fmt: skip
            await disc.put(subjects.worker_key(cluster.ns, new_id), encode_json(record), lease)
            await until(lambda: len(router.registry) == 2, what="the record read")
        await asyncio.sleep(1.5)  # a revote (every second) finds the same
        status, ready = await _get(http, router, "/ready")
        assert status == 200 and ready["ready"], ready
        status_of = {w["worker"]: w for w in ready["worker_status"]}
        assert d.id not in status_of and status_of[new_id]["excluded"] == reason, ready
        for i in range(3):
            status, body = await _ask(http, router, MODEL, i)
            assert status == 200, body


# --- F6: replicas that route with different settings ----------------------------------------------------------


async def test_replicas_with_different_settings_or_versions_warn_until_they_agree(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.peer_settings")
    await cluster.add_worker("agg")
    kv = await cluster.add_router(routing="kv")
    rr = await cluster.add_router(routing="round_robin")
    for r in (kv, rr):
        await cluster.ready(r)

    def differs(r: RouterService, peer: RouterService) -> bool:
        return any(peer.router_id in w and "routing settings digest" in w for w in r.readiness()[1]["warnings"])

    await until(lambda: differs(kv, rr) and differs(rr, kv), what="each replica to warn about the other")
    assert kv.peer_settings.digest != rr.peer_settings.digest
    # Which flag, with both values: the digests alone left the operator to guess (audit, 2026-12-07)
    (about_rr,) = [w for w in kv.readiness()[1]["warnings"] if rr.router_id in w]
    assert 'set otherwise: --routing "round_robin" (this router\'s "kv")' in about_rr, about_rr
    assert _gauge(kv, "kvswitch_router_peer_settings_mismatch") == {rr.router_id: 1.0}

    def warned() -> list[str]:
        said = [
            r.getMessage() for r in caplog.records if r.name == "router.peer_settings" and r.levelno == logging.WARNING
        ]
        return [m for m in said if rr.router_id in m and rr.peer_settings.digest in m]

    # /ready reads the difference once it has lasted SETTLE_S; the WARNING comes from a timer of
    # the same length, which may run a moment after.
    await until(lambda: len(warned()) >= 1, what="the WARNING about rr")
    assert len(warned()) == 1

    # Live config is one for all: once both apply it they agree, and the warning goes.
    async with Discovery(EtcdSettings(endpoints=[cluster.etcd_url]), cluster.ns) as disc:
        await disc.put_raw(subjects.config_key(cluster.ns), b'{"routing": "least_loaded"}')
        await until(lambda: kv.peer_settings.digest == rr.peer_settings.digest, what="both to apply it")
        await until(lambda: not kv.readiness()[1]["warnings"] and not rr.readiness()[1]["warnings"])
        assert _gauge(kv, "kvswitch_router_peer_settings_mismatch") == {}
        assert any("same settings and version" in r.getMessage() for r in caplog.records)

        # A change every replica applies never reads as a difference, however long one waits.
        caplog.clear()
        await disc.put_raw(subjects.config_key(cluster.ns), b'{"routing": "kv", "temperature": 0.2}')
        await until(lambda: kv.settings.temperature == rr.settings.temperature == 0.2, what="the change applied")
        await asyncio.sleep(SETTLE_S + 0.5)
        assert not kv.readiness()[1]["warnings"] and not rr.readiness()[1]["warnings"]
        assert not [r for r in caplog.records if r.name == "router.peer_settings" and r.levelno >= logging.WARNING]

        # A peer of another build (its digest may mean other settings, or the same ones) is named
        # too: one of this release that speaks another wire, as real builds between releases do.
        other = f"{__version__}+wire.000000000000"
        assert kv.peer_settings.version == BUILD != other
        lease = await disc.register_router(
            lambda rid: RouterInfo(router=rid, http_url="http://127.0.0.1:1", started_at=time.time(), version=other),
            ttl=5,
        )
        await until(lambda: any(f"version {other}" in w for w in kv.readiness()[1]["warnings"]), what="the old peer")
        assert _gauge(kv, "kvswitch_router_peer_version_mismatch") == {lease.hex_id: 1.0}
        await disc.release(lease)
        await until(lambda: not kv.readiness()[1]["warnings"], what="the old peer gone")


async def test_a_replica_that_renders_chats_otherwise_is_warned_naming_the_rendering_digest(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # Three replicas, one with --exclude-tools-when-tool-choice-none: it routes tool_choice "none"
    # chats on other ids than its peers. Before, all three published one digest, /ready said
    # nothing and no line was logged (audit, 2026-12-07).
    caplog.set_level(logging.INFO, logger="router.peer_settings")
    await cluster.add_worker("agg")
    a = await cluster.add_router()
    b = await cluster.add_router()
    odd = await cluster.add_router(config={"exclude_tools_when_tool_choice_none": True})
    for r in (a, b, odd):
        await cluster.ready(r)
    assert a.peer_settings.digest == b.peer_settings.digest == odd.peer_settings.digest  # the routing settings agree

    def named(r: RouterService) -> list[str]:
        return [
            next(p.router_id for p in (a, b, odd) if p.router_id in w)
            for w in r.readiness()[1]["warnings"]
            if "chat rendering digest" in w and "--exclude-tools-when-tool-choice-none" in w
        ]

    await until(
        lambda: named(a) == [odd.router_id] and named(b) == [odd.router_id] and len(named(odd)) == 2,
        what="each replica to warn about the one that renders otherwise, and it about both",
    )
    assert sorted(named(odd)) == sorted([a.router_id, b.router_id])
    status, ready = await _get(http, a, "/ready")
    assert status == 200 and ready["problems"] == []  # a warning, not a problem: each routes on
    assert [w for w in ready["warnings"] if odd.router_id in w and "chat rendering digest" in w]
    assert _gauge(a, "kvswitch_router_peer_settings_mismatch") == {odd.router_id: 1.0}
    assert _gauge(a, "kvswitch_router_peer_version_mismatch") == {}

    def about_odd() -> list[str]:
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        return [m for m in warned if f"peer router {odd.router_id}" in m]

    # The WARNINGs come from a timer as long as /ready's wait, which may run a moment after it.
    await until(lambda: len(about_odd()) >= 2, what="a WARNING from each peer")
    assert len(about_odd()) == 2  # once by each peer
    assert all(odd.peer_settings.rendering in m and a.peer_settings.rendering in m for m in about_odd())
    assert all("routing settings digest" not in m and "the same tokenizer files" in m for m in about_odd())
    assert all(
        "set otherwise: --exclude-tools-when-tool-choice-none true (this router's false)" in m for m in about_odd()
    )


async def test_a_worker_of_another_build_is_warned_once_and_counted_while_registered(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    # A rolling upgrade: a real shim of this build, and a worker whose shim speaks another wire.
    caplog.set_level(logging.INFO, logger="router.worker_versions")
    same = await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    assert router.registry.get(same.id) is not None and router.registry.get(same.id).version == BUILD  # type: ignore[union-attr]
    assert _scalar(router, "kvswitch_router_workers_other_version") == 0.0
    other = f"{__version__}+wire.000000000000"
    info = partial(WorkerInfo, model=MODEL, role="agg", engine="vllm", block_size=16, version=other)
    async with Discovery(EtcdSettings(endpoints=[cluster.etcd_url]), cluster.ns) as disc:
        lease = await disc.register_worker(lambda wid: info(worker=wid), ttl=5)
        await until(lambda: router.registry.get(lease.hex_id) is not None, what="the old worker")
        await until(lambda: _scalar(router, "kvswitch_router_workers_other_version") == 1.0)
        key = subjects.worker_key(cluster.ns, lease.hex_id)
        await disc.put(key, encode_json(info(worker=lease.hex_id, epoch=1)), lease)  # its record changes: no new line
        await until(lambda: getattr(router.registry.get(lease.hex_id), "epoch", 0) == 1, what="the record changed")
        (warned,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert f"worker {lease.hex_id} runs kvswitch {other}, this router {BUILD}" in warned
        assert "rolling upgrade" in warned and "docs/deployment.md, Upgrades" in warned
        await disc.delete(key)
        await disc.release(lease)
        await until(lambda: _scalar(router, "kvswitch_router_workers_other_version") == 0.0, what="the old worker gone")


def _scalar(router: RouterService, name: str) -> float:
    (value,) = [
        s.value
        for family in text_string_to_metric_families(router.metrics.render().decode())
        for s in family.samples
        if s.name == name
    ]
    return value


def test_a_replica_without_calibration_has_another_digest_and_a_calibrating_one_keeps_its_own() -> None:
    # --no-calibration (or a forgotten KVSWITCH_NO_CALIBRATION) prices workers by their profiles
    # alone: admission and the path choice differ from a calibrating peer's, which no digest showed.
    default = settings_digest(RouterSettings())
    assert settings_digest(RouterSettings(), calibrated=True) == default
    assert settings_digest(RouterSettings(), calibrated=False) != default


def _rendering(**config: Any) -> str:
    """The rendering digest a router of `config` (RouterConfig fields) puts in its RouterInfo."""
    return RouterService(RouterConfig(**config)).peer_settings.rendering


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tokenizers")
    folders = {name: build_variant(name, root / name) for name in ("llama31", "llama31_added_token")}
    shutil.copytree(folders["llama31"], root / "elsewhere")
    return {**{name: str(folder) for name, folder in folders.items()}, "elsewhere": str(root / "elsewhere")}


@pytest.mark.parametrize(
    "flag",
    [
        {"exclude_tools_when_tool_choice_none": True},
        {"chat_template_content_format": "string"},
        {"chat_template_content_format": "openai"},
        {"default_chat_template_kwargs": {"enable_thinking": False}},
        {"trust_request_chat_template": True},
    ],
    ids=lambda flag: next(iter(flag)),
)
def test_a_replica_that_renders_chats_with_another_flag_has_another_rendering_digest(
    tokenizers: dict[str, str], flag: dict[str, Any]
) -> None:
    # --exclude-tools-when-tool-choice-none beside a replica without it routed tool_choice "none"
    # chats on other ids, and both published one digest: no engine probe shows that flag, so only a
    # peer could (audit, 2026-12-07).
    base = _rendering(tokenizer=tokenizers["llama31"])
    assert _rendering(tokenizer=tokenizers["llama31"], **flag) != base
    assert _rendering(tokenizer=tokenizers["llama31"], default_chat_template_kwargs={}) == base  # renders alike


def test_a_replica_of_another_tokenizer_has_another_rendering_digest_and_the_same_files_elsewhere_the_same(
    tokenizers: dict[str, str],
) -> None:
    # By the tokenizer's fingerprint, not its path: one added special token differs, a copy does not.
    base = _rendering(tokenizer=tokenizers["llama31"])
    assert _rendering(tokenizer=tokenizers["llama31_added_token"]) != base
    assert _rendering() != base  # the built-in tokenizer
    assert _rendering(tokenizer=tokenizers["elsewhere"]) == base
    assert base == rendering_digest(tokenizer_fingerprint(load_tokenizer(tokenizers["elsewhere"])))


def test_a_template_that_writes_todays_date_has_one_rendering_digest_across_midnight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Llama 3.2's and 3.3's templates write `Today Date: {{ strftime_now("%d %b %Y") }}`: the digest
    # was of the fingerprint at the router's start, so replicas started on different days (or in
    # other time zones) warned about each other for good (review, 2026-12-07).
    folder = build_variant("llama31", tmp_path / "dated")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n' }}" + config["chat_template"]
    config_file.write_text(json.dumps(config))
    clock = TemplateClock(datetime.datetime(2026, 12, 7, 23, 59))
    monkeypatch.setattr(tokenization, "datetime", clock)
    tok = load_tokenizer(str(folder))
    chat = ({"role": "user", "content": "hi"},)
    before, digest_before = tok.encode_chat(chat, ChatOptions()), _rendering(tokenizer=str(folder))
    worker_match_before = tokenizer_fingerprint(tok)
    clock.at = datetime.datetime(2026, 12, 8, 0, 1)
    # The template does write the date: a request renders today's, as the engine renders it, and the
    # fingerprint workers are matched on follows it (vLLM's /tokenize renders the probes so too).
    assert tok.encode_chat(chat, ChatOptions()) != before
    assert tokenizer_fingerprint(tok) != worker_match_before
    assert _rendering(tokenizer=str(folder)) == digest_before


def test_a_peer_counts_as_different_only_after_it_stays_so_and_is_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.peer_settings")
    now = [0.0]
    mine = settings_digest(RouterSettings())
    other = settings_digest(RouterSettings(routing="round_robin"))
    assert mine == settings_digest(RouterSettings()) and mine != other
    peers = PeerSettings("ns", mine, "0.1.0", settle_s=2.0, clock=lambda: now[0])

    def info(digest: str, version: str = "0.1.0") -> RouterInfo:
        return RouterInfo(router="p", http_url="", started_at=0.0, version=version, settings_digest=digest)

    peers.seen("p", info(other))  # a peer that has not applied a live change yet
    now[0] = 1.0
    peers.check()
    assert peers.warnings() == [] and peers.settings_mismatch() == []
    peers.seen("p", info(mine))  # ... and now has
    now[0] = 10.0
    peers.check()
    assert peers.warnings() == [] and not caplog.records

    peers.seen("p", info(other))
    now[0] = 12.0
    peers.check()
    peers.check()
    assert peers.settings_mismatch() == ["p"] and peers.version_mismatch() == []
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "peer router p" in warned and other in warned and mine in warned
    peers.mine(other, {})  # we applied what the peer runs
    assert peers.warnings() == []
    assert any("same settings and version" in r.getMessage() for r in caplog.records)

    peers.seen("p", info("", version="0.0.9"))  # a release before the digest: its version alone
    now[0] = 20.0
    assert peers.version_mismatch() == ["p"] and peers.settings_mismatch() == []
    peers.gone("p")
    assert peers.warnings() == []


def test_a_peer_of_another_rendering_digest_is_named_for_it_and_one_without_one_is_not() -> None:
    now = [0.0]
    settings = settings_digest(RouterSettings())
    mine, other = rendering_digest("builtin"), rendering_digest("builtin", exclude_tools_when_tool_choice_none=True)
    peers = PeerSettings("ns", settings, "0.1.0", rendering=mine, settle_s=2.0, clock=lambda: now[0])

    def info(rendering: str) -> RouterInfo:
        return RouterInfo(
            router="p",
            http_url="",
            started_at=0.0,
            version="0.1.0",
            settings_digest=settings,
            rendering_digest=rendering,
        )

    peers.seen("p", info(other))
    now[0] = 2.0
    assert peers.settings_mismatch() == ["p"] and peers.version_mismatch() == []
    (warning,) = peers.warnings()
    assert f"chat rendering digest {other} (this router's {mine}" in warning and "routing settings" not in warning
    peers.seen("p", info(""))  # a router before the rendering digest: its settings and version alone
    assert peers.warnings() == []


def test_a_peer_is_told_by_the_flags_it_sets_otherwise_and_one_that_publishes_none_by_its_digest() -> None:
    now = [0.0]
    mine = RouterSettings()
    other = RouterSettings(routing="round_robin", temperature=0.3)
    peers = PeerSettings(
        "ns", settings_digest(mine), "0.1.0", settings=settings_fields(mine), settle_s=2.0, clock=lambda: now[0]
    )

    def info(fields: dict[str, str]) -> RouterInfo:
        digest = settings_digest(other, calibrated=False)
        return RouterInfo(
            router="p", http_url="", started_at=0.0, version="0.1.0", settings_digest=digest, settings=fields
        )

    peers.seen("p", info(settings_fields(other, calibrated=False)))
    now[0] = 2.0
    (warning,) = peers.warnings()
    assert (
        'set otherwise: --no-calibration (calibration) false (this router\'s unset), --routing "round_robin" '
        "(this router's \"kv\"), --temperature 0.3 (this router's " + settings_fields(mine)["temperature"] + ")"
    ) in warning, warning
    peers.seen("p", info({}))  # a router before RouterInfo.settings: its digest alone
    (warning,) = peers.warnings()
    assert "set otherwise" not in warning and settings_digest(other, calibrated=False) in warning


def test_a_peer_of_other_conditional_disagg_settings_is_told_by_their_own_flags() -> None:
    """The conditional disaggregation settings, nested in RouterSettings, were named as one
    `--conditional`, which is no flag, with the whole struct as its value (review of 2026-12-07):
    each is named by its own flag, one the router's parser takes."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    now = [0.0]
    mine = RouterSettings()
    other = RouterSettings(conditional=ConditionalDisaggConfig(eff_isl_threshold=123))
    assert settings_digest(mine) == "692031a217bb"  # as before the settings were named flat
    peers = PeerSettings("ns", settings_digest(mine), "0.1.0", settings=settings_fields(mine), clock=lambda: now[0])

    def warning(fields: dict[str, str]) -> str:
        info = RouterInfo(
            router="p", http_url="", started_at=0.0, version="0.1.0", settings_digest="0" * 12, settings=fields
        )
        peers.seen("p", info)
        now[0] += SETTLE_S
        (said,) = peers.warnings()
        return said

    said = warning(settings_fields(other))
    assert "set otherwise: --eff-isl-threshold 123 (this router's 2048):" in said, said
    assert parser.parse_args(["--eff-isl-threshold", "123"]).eff_isl_threshold == 123
    # Every setting a peer can publish, each set otherwise alone: named by one of the router's flags
    fields = settings_fields(mine, calibrated=False)
    peers.mine("1" * 12, fields)
    named = set()
    for name in fields:
        said = warning({**fields, name: "7"})
        (flag,) = re.findall(r"set otherwise: (--[a-z-]+)[^,:]* 7 \(this router's [^)]*\):", said)
        assert flag in parser._option_string_actions, said
        named.add(flag)
    assert len(named) == len(fields) > 20


async def test_a_difference_is_warned_even_when_its_timer_fires_before_it_has_settled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Under uvloop the settle timer could fire up to 1 ms early: check() found nothing settled and
    # never looked again, so about half the replicas that differed were never a WARNING (audit,
    # 2026-12-07); /ready and the gauge said so all along. The router's clock is driven by hand,
    # short of settle_s when the timer fires: a loop firing timers 1 ms early caught it in about
    # 60% of runs, as asyncio's selector rounds its timeout up to the next millisecond.
    caplog.set_level(logging.WARNING, logger="router.peer_settings")
    mine, other = settings_digest(RouterSettings()), settings_digest(RouterSettings(routing="round_robin"))
    now = [0.0]
    peers = PeerSettings("ns", mine, "0.1.0", settle_s=0.05, clock=lambda: now[0])
    peers.seen("p", RouterInfo(router="p", http_url="", started_at=0.0, version="0.1.0", settings_digest=other))
    now[0] = 0.049  # its timer (due in 0.05 s) runs before the sleep's, with the difference 1 ms short
    await asyncio.sleep(0.1)
    assert peers.settings_mismatch() == []
    now[0] = 0.051
    await asyncio.sleep(0.1)  # nothing else runs check(): only a timer the early one set again
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "peer router p" in warned[0] and other in warned[0], warned
    assert peers.settings_mismatch() == ["p"]


async def test_a_timing_profile_the_router_cannot_load_is_a_ready_warning_naming_the_workers_and_the_fix(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """A shim given its own tables (KVSWITCH_PROFILE_DIR) and a router without them: the router
    logged it once, naming neither worker nor fix, and /ready said nothing while every timing
    decision for those workers went without a model (bounds audit, 2026-12-06)."""
    a = await cluster.add_worker("agg")
    b = await cluster.add_worker("agg")
    for w in (a, b):  # as a shim that loads its profile from its own KVSWITCH_PROFILE_DIR registers
        w.shim.config = msgspec.structs.replace(w.shim.config, timing_profile="mybox:llama-3.1-8b")
        assert w.shim.registration is not None
        w.shim.registration.update()
    router = await cluster.add_ready_router()
    await until(lambda: all(router.registry.get(w.id).timing_profile == "mybox:llama-3.1-8b" for w in (a, b)))  # type: ignore[union-attr]
    status, ready = await _get(http, router, "/ready")
    assert status == 200
    said = [w for w in ready["warnings"] if "'mybox:llama-3.1-8b'" in w]
    assert len(said) == 1 and a.id in said[0] and b.id in said[0] and "KVSWITCH_PROFILE_DIR" in said[0], ready
