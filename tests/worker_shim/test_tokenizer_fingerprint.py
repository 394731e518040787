"""The tokenizer fingerprint through the engine's /tokenize (vLLM's API), and what the shim registers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from engine_sim.server import SimServer
from protocol.fingerprint import BUILTIN, PROBES, TextProbe, builtin_fingerprint, fingerprint
from protocol.tokenizer import BuiltinTokenizer, apply_chat_template
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_model_config import registered
from worker_shim import EngineError, ShimConfig, tokenizer_probe
from worker_shim.adapters.vllm import VllmAdapter
from worker_shim.tokenizer_probe import transient

_tok = BuiltinTokenizer()

Encode = Callable[[str], list[int]]


def tokenize_app(
    encode: Encode, *, chat_template: bool = True, seen: list[dict[str, Any]] | None = None
) -> web.Application:
    """vLLM's POST /tokenize: a prompt, or messages through the chat template (400 without one)."""

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if seen is not None:
            seen.append(body)
        if "messages" in body:
            try:
                if not chat_template:
                    raise ValueError("no chat template")
                text = apply_chat_template(body["messages"], add_generation_prompt=body["add_generation_prompt"])
            except ValueError as exc:
                return web.json_response({"error": {"message": str(exc), "code": 400}}, status=400)
            ids = encode(text)
        else:
            ids = encode(body["prompt"])
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    return app


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[web.Application], Any]]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> VllmAdapter:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        adapter = VllmAdapter(ShimConfig(engine_url=f"http://127.0.0.1:{port}", model="m", kv_events="tcp://*:1"))
        await adapter.open()
        adapters.append(adapter)
        return adapter

    adapters: list[VllmAdapter] = []
    yield start
    for a in adapters:
        await a.close()
    for r in runners:
        await r.cleanup()


async def test_an_engine_with_the_builtin_vocabulary_matches_the_builtin_fingerprint(serve: Any) -> None:
    seen: list[dict[str, Any]] = []
    adapter = await serve(tokenize_app(_tok.encode, seen=seen))
    assert await adapter.tokenizer_fingerprint() == builtin_fingerprint()
    assert seen == [{"model": "m", **json.loads(json.dumps(p.body()))} for p in PROBES]


def expected(encode: Encode, *, chat_template: bool = True) -> str:
    """The fingerprint tokenize_app(encode, chat_template=...) gives: a chat it refuses counts as refused."""
    results: list[list[int] | None] = []
    for probe in PROBES:
        if isinstance(probe, TextProbe):
            results.append(encode(probe.prompt))
            continue
        try:
            chat = apply_chat_template(probe.messages, add_generation_prompt=probe.add_generation_prompt)
        except ValueError:
            chat = None
        results.append(encode(chat) if chat is not None and chat_template else None)
    return fingerprint(results)


async def test_another_tokenizer_or_no_chat_template_changes_the_fingerprint(serve: Any) -> None:
    def shifted(text: str) -> list[int]:
        return [t + 1 for t in _tok.encode(text)]

    other = await serve(tokenize_app(shifted))
    assert await other.tokenizer_fingerprint() == expected(shifted) != builtin_fingerprint()
    plain = await serve(tokenize_app(_tok.encode, chat_template=False))
    fp = await plain.tokenizer_fingerprint()
    assert fp == expected(_tok.encode, chat_template=False) != builtin_fingerprint()
    assert fp != expected(_tok.encode)


async def test_an_engine_without_tokenize_raises_a_clear_error(serve: Any) -> None:
    adapter = await serve(web.Application())
    with pytest.raises(EngineError, match="404"):
        await adapter.tokenizer_fingerprint()


async def test_the_shim_registers_builtin_or_nothing_with_one_warning(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with SimServer(sim_config()) as sim:
        async with aiohttp.ClientSession() as s, s.post(sim.url + "/tokenize", json={"prompt": "x"}) as r:
            sim_tokenizes = r.status == 200
        async with shim_for(sim, ns, nats_url, etcd_url) as shim:
            for session in range(2):  # the engine restarts in between: a second registration
                await wait_for(shim.registered.is_set, what=f"registration {session + 1}")
                info = await registered(etcd_url, ns)
                assert info.tokenizer == (BUILTIN if sim_tokenizes else "")
                if session == 0:
                    await sim.crash()
                    await wait_for(lambda: not shim.registered.is_set(), what="deregistered")
                    await sim.restart()
            assert shim.sessions == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "tokenizer unknown" in r.getMessage()]
    assert len(warnings) == (0 if sim_tokenizes else 1)


async def test_a_refused_chat_probe_counts_as_refused_but_a_refused_text_probe_is_an_error(serve: Any) -> None:
    async def refuse_tools(request: web.Request) -> web.Response:
        body = await request.json()
        if "tools" in body or ("prompt" not in body and len(body["messages"]) > 2):
            return web.json_response({"error": {"message": "no tools here", "code": 400}}, status=400)
        if "messages" in body:
            ids = _tok.encode(
                apply_chat_template(body["messages"], add_generation_prompt=body["add_generation_prompt"])
            )
        else:
            ids = _tok.encode(body["prompt"])
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None})

    app = web.Application()
    app.router.add_post("/tokenize", refuse_tools)
    adapter = await serve(app)
    fp = await adapter.tokenizer_fingerprint()
    assert fp is not None and fp not in (builtin_fingerprint(), expected(_tok.encode))

    async def refuse_text(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad prompt", "code": 400}}, status=400)

    app = web.Application()
    app.router.add_post("/tokenize", refuse_text)
    with pytest.raises(EngineError, match="400"):
        await (await serve(app)).tokenizer_fingerprint()


async def test_engine_sims_tokenize_gives_the_builtin_fingerprint(serve: Any) -> None:
    async with SimServer(sim_config()) as sim:
        adapter = VllmAdapter(ShimConfig(engine_url=sim.url, model=sim.config.model, kv_events="tcp://*:1"))
        await adapter.open()
        try:
            assert await adapter.tokenizer_fingerprint() == builtin_fingerprint()
        finally:
            await adapter.close()


async def test_a_busy_engines_answer_is_transient_and_one_without_tokenize_is_not(serve: Any) -> None:
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "overloaded", "code": 503}}, status=503)

    app = web.Application()
    app.router.add_post("/tokenize", busy)
    with pytest.raises(EngineError) as failed:
        await (await serve(app)).tokenizer_fingerprint()
    assert transient(failed.value)
    with pytest.raises(EngineError) as refused:
        await (await serve(web.Application())).tokenizer_fingerprint()
    assert refused.value.code == 404 and not transient(refused.value)


@pytest.mark.parametrize("status", [408, 429])
async def test_a_busy_engines_not_now_on_a_chat_probe_is_transient_not_a_refusal(serve: Any, status: int) -> None:
    # A 408 or 429 on a chat probe counted as "no chat template": the worker registered a
    # fingerprint that was not its engine's, and no retry was started.
    async def busy_on_chats(request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            return web.json_response({"error": {"message": "slow down", "code": status}}, status=status)
        ids = _tok.encode(body["prompt"])
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None})

    app = web.Application()
    app.router.add_post("/tokenize", busy_on_chats)
    with pytest.raises(EngineError) as failed:
        await (await serve(app)).tokenizer_fingerprint()
    assert failed.value.code == status and transient(failed.value)


async def test_an_engines_refusal_keeps_its_body_and_retry_after(serve: Any) -> None:
    refusal = {"error": {"message": "slow down", "code": 429}}

    async def busy(request: web.Request) -> web.Response:
        return web.json_response(refusal, status=429, headers={"Retry-After": "7"})

    app = web.Application()
    app.router.add_post("/tokenize", busy)
    with pytest.raises(EngineError) as failed:
        await (await serve(app)).tokenizer_fingerprint()
    assert failed.value.message.endswith("/tokenize answered 429: slow down")
    assert json.loads(failed.value.body) == refusal and failed.value.retry_after_s == 7


def _failing(shim: Any, failures: list[EngineError]) -> list[int]:
    """The shim's adapter's probe failing with `failures` first, one per call; the calls, counted."""
    real = shim.adapter.tokenizer_fingerprint
    calls = [0]

    async def probe() -> str | None:
        calls[0] += 1
        if failures:
            raise failures.pop(0)
        return cast(str | None, await real())

    shim.adapter.tokenizer_fingerprint = probe
    return calls


async def test_a_probe_the_engine_failed_for_now_is_retried_and_registered_under_the_same_lease(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One timed-out /tokenize of a busy vLLM left the worker without a fingerprint, so refused text by
    # every router, for its whole session (audit, 2026-12-07).
    monkeypatch.setattr(tokenizer_probe, "RETRY_S", 0.2)
    caplog.set_level(logging.INFO, logger="worker_shim.tokenizer_probe")
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        timeout = EngineError(503, "engine_unavailable", "http://engine/tokenize: TimeoutError()")
        calls = _failing(shim, [timeout, EngineError(503, "engine_unavailable", "busy")])
        async with shim:
            await wait_for(shim.registered.is_set, what="registration")
            first = await registered(etcd_url, ns)
            assert first.tokenizer == ""
            await wait_for(lambda: shim.tokenizer == BUILTIN, what="the probe again")
            info = await registered(etcd_url, ns)
            for _ in range(100):  # the re-put reaches etcd a moment after the shim has it
                if info.tokenizer == BUILTIN:
                    break
                await asyncio.sleep(0.05)
                info = await registered(etcd_url, ns)
            assert info.tokenizer == BUILTIN
            assert (info.worker, info.epoch, shim.sessions) == (first.worker, first.epoch, 1), "the same registration"
            await asyncio.sleep(0.5)
            assert calls[0] == 3, "no probe once one succeeded"
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "worker_shim.tokenizer_probe"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO], "one episode: its start and its end"
    assert "TimeoutError" in lines[0][1] and "probing again" in lines[0][1]
    assert "on try 3" in lines[1][1] and BUILTIN in lines[1][1]


async def test_an_engine_that_refuses_the_probe_is_not_probed_again(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer_probe, "RETRY_S", 0.05)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        calls = _failing(shim, [EngineError(404, "not_found", "http://engine/tokenize answered 404")])
        async with shim:
            await wait_for(shim.registered.is_set, what="registration")
            await asyncio.sleep(0.5)
            assert (await registered(etcd_url, ns)).tokenizer == "" and calls[0] == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "tokenizer" in r.getMessage()]
    assert len(warned) == 1 and "404" in warned[0] and "probing again" not in warned[0]


async def test_a_retry_the_engine_then_refuses_ends_the_episode_with_a_warning(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer_probe, "RETRY_S", 0.05)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url)
        busy = EngineError(503, "engine_unavailable", "busy")
        calls = _failing(shim, [busy, EngineError(404, "not_found", "http://engine/tokenize answered 404")])
        async with shim:
            await wait_for(shim.registered.is_set, what="registration")
            await wait_for(lambda: calls[0] == 2, what="the second probe")
            await asyncio.sleep(0.3)
            assert calls[0] == 2 and (await registered(etcd_url, ns)).tokenizer == ""
    warned = [r.getMessage() for r in caplog.records if r.name == "worker_shim.tokenizer_probe"]
    assert len(warned) == 2 and "probing again" in warned[0] and "404, on try 2" in warned[1]
