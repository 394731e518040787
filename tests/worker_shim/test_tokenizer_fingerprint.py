"""The tokenizer fingerprint through the engine's /tokenize (vLLM's API), and what the shim registers."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from engine_sim.server import SimServer
from protocol.fingerprint import BUILTIN, PROBES, TextProbe, builtin_fingerprint, fingerprint
from protocol.tokenizer import BuiltinTokenizer, apply_chat_template
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_model_config import registered
from worker_shim import EngineError, ShimConfig
from worker_shim.adapters.vllm import VllmAdapter

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
