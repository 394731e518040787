"""What the router credits a worker with is what its engine reuses, for a prompt truncated to the
context (truncate_prompt_tokens -1) and for a LoRA adapter re-pointed at another path: /debug/route's
overlap against the engine's own `cached_tokens` (enable_prompt_tokens_details), end to end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from protocol import block_hashes
from protocol.hashing import chain_salt
from protocol.tokenizer import BuiltinTokenizer
from router.request_parsing import parse_request, prompt_ids
from router.service import RouterService
from router.tokenization import BuiltinPromptTokenizer, Tokenization
from tests.router.conftest import BLOCK, MODEL, Cluster, Worker
from tests.router.polling import until

LONG = list(range(3000, 3700))  # 700 ids: longer than the sims' context of 512
CONTEXT = 512


async def probe(
    http: aiohttp.ClientSession, router: RouterService, w: Worker, path: str, body: dict[str, Any]
) -> tuple[int, int]:
    """(the tokens the router credits `w` with for `body`, the tokens `w`'s engine then reused)."""
    async with http.post(router.url + "/debug/route", json=body) as r:
        plan = await r.json()
        assert r.status == 200, plan
    overlap = {c["worker"]: c["overlap_blocks"] for c in plan["decode_candidates"]}[w.id]
    async with http.post(router.url + path, json=body) as r:
        out = await r.json()
        assert r.status == 200 and r.headers["x-kvswitch-decode-worker"] == w.id, out
    return overlap * BLOCK, out["usage"]["prompt_tokens_details"]["cached_tokens"]


def held(router: RouterService, w: Worker, ids: list[int], salt: str = "") -> bool:
    """The router's index holds `ids`' last full block for `w`: the engine's events came in."""
    return block_hashes(ids, BLOCK, salt=salt)[-1] in router.index.worker_hashes(w.id)


# --- truncate_prompt_tokens -1 -----------------------------------------------------------------------


TEXT = " ".join(f"w{i}" for i in range(200))  # about 1,000 tokens
MESSAGES = [{"role": "user", "content": " ".join(f"c{i}" for i in range(200))}]


@pytest.mark.parametrize(
    ("path", "body", "kept"),
    [
        ("/v1/completions", {"prompt": LONG}, LONG[-(CONTEXT - 1) :]),
        ("/v1/completions", {"prompt": LONG, "truncation_side": "right"}, LONG[: CONTEXT - 1]),
        ("/v1/completions", {"prompt": TEXT}, BuiltinTokenizer().encode(TEXT)[-(CONTEXT - 1) :]),
        ("/v1/chat/completions", {"messages": MESSAGES},
         BuiltinPromptTokenizer().encode_chat(MESSAGES)[-(CONTEXT - 1) :]),
    ],
    ids=["ids", "ids-right", "text", "chat"],
)  # fmt: skip
async def test_a_prompt_truncated_to_the_context_is_routed_as_the_engine_keeps_it(
    cluster: Cluster, http: aiohttp.ClientSession, path: str, body: dict[str, Any], kept: list[int]
) -> None:
    """vLLM resolves -1 to the context less the token held for output (511 of max_model_len 512).
    The router hashed the whole 700-id prompt: it credited nothing while the engine reused 496."""
    w = await cluster.add_worker("agg", enable_prompt_tokens_details=True, max_model_len=CONTEXT)
    router = await cluster.add_ready_router()
    assert router.max_model_len(MODEL) == CONTEXT
    request = {"model": MODEL, "max_tokens": 2, "truncate_prompt_tokens": -1, **body}
    assert await probe(http, router, w, path, request) == (0, 0)
    await until(lambda: held(router, w, kept), what="the kept ids' blocks indexed")
    assert await probe(http, router, w, path, request) == (496, 496)


@pytest.fixture
def tok() -> Iterator[Tokenization]:
    tokenization = Tokenization(BuiltinPromptTokenizer())
    yield tokenization
    tokenization.close()


async def test_minus_one_resolves_from_max_model_len_as_vllms_tokenize_params(tok: Tokenization) -> None:
    """The context less one token when output is asked for, the whole context when none is (a
    chat request with no limit, a completion's max_tokens 0); without a registered max_model_len
    the prompt is routed whole, as before."""
    rendered = BuiltinPromptTokenizer().encode_chat(MESSAGES)

    async def routed(body: dict[str, Any], length: int | None) -> list[int]:
        parsed = parse_request({"truncate_prompt_tokens": -1, **body}, chat="messages" in body)
        return (await prompt_ids(tok, parsed, length))[0]

    assert await routed({"prompt": LONG}, CONTEXT) == LONG[-511:]
    assert await routed({"prompt": LONG, "max_tokens": None}, CONTEXT) == LONG[-511:]  # 16, vLLM's default
    assert await routed({"prompt": LONG, "max_tokens": 0}, CONTEXT) == LONG[-512:]
    assert await routed({"prompt": LONG, "truncation_side": "right"}, CONTEXT) == LONG[:511]
    assert await routed({"prompt": LONG}, None) == LONG
    assert await routed({"prompt": LONG[:100]}, CONTEXT) == LONG[:100]
    assert await routed({"prompt": TEXT}, CONTEXT) == BuiltinTokenizer().encode(TEXT)[-511:]
    assert len(rendered) > CONTEXT
    assert await routed({"messages": MESSAGES}, CONTEXT) == rendered[-512:]
    assert await routed({"messages": MESSAGES, "max_completion_tokens": 5}, CONTEXT) == rendered[-511:]
    assert await routed({"messages": MESSAGES, "max_tokens": 5}, None) == rendered


# --- a LoRA adapter re-pointed at another path ------------------------------------------------------

PROMPT = list(range(7000, 7000 + 40 * BLOCK + 5))  # 40 full blocks and 5


@pytest.mark.parametrize("how", ["load_inplace", "unload_then_load"])
async def test_a_repointed_adapter_is_credited_only_with_what_the_engine_reuses(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    """vLLM 0.32 hashes an adapter's blocks by its path too: re-pointed, the adapter reuses none of
    its old KV, though its events name it alone. The shim sees the path change on /v1/models and
    tells routers the old chains are gone; they credited them before."""
    monkeypatch.setattr("worker_shim.shim.ADAPTERS_POLL_S", 0.2)
    w = await cluster.add_worker("agg", enable_prompt_tokens_details=True, runtime_lora_updating=True)
    router = await cluster.add_ready_router(pending_ttl_s=0.3)
    sim = w.sim.url
    async with http.post(sim + "/v1/load_lora_adapter", json={"lora_name": "C", "lora_path": "/c1"}) as r:
        assert r.status == 200, await r.text()
    await until(lambda: "C" in router.adapters(), what="C registered")
    body = {"model": "C", "prompt": PROMPT, "max_tokens": 2}
    ours = chain_salt("C")
    assert await probe(http, router, w, "/v1/completions", body) == (0, 0)
    await until(lambda: held(router, w, PROMPT, ours), what="C's blocks indexed")
    assert await probe(http, router, w, "/v1/completions", body) == (640, 640)

    caplog.set_level(logging.INFO, logger="worker_shim.shim")
    if how == "load_inplace":
        repoint = {"lora_name": "C", "lora_path": "/c2", "load_inplace": True}
        async with http.post(sim + "/v1/load_lora_adapter", json=repoint) as r:
            assert r.status == 200, await r.text()
    else:
        async with http.post(sim + "/v1/unload_lora_adapter", json={"lora_name": "C"}) as r:
            assert r.status == 200, await r.text()
        await until(lambda: "C" not in router.adapters(), what="C gone")
        async with http.post(sim + "/v1/load_lora_adapter", json={"lora_name": "C", "lora_path": "/c2"}) as r:
            assert r.status == 200, await r.text()
        await until(lambda: "C" in router.adapters(), what="C back")
    await until(lambda: not held(router, w, PROMPT, ours), timeout=10, what="C's old blocks dropped")
    await asyncio.sleep(0.4)  # the router's own pending credit for them expired too
    assert await probe(http, router, w, "/v1/completions", body) == (0, 0)
    await until(lambda: held(router, w, PROMPT, ours), what="C's new blocks indexed")
    assert await probe(http, router, w, "/v1/completions", body) == (640, 640)
    said = [r.getMessage() for r in caplog.records if "LoRA adapter C" in r.getMessage()]
    assert len(said) == 1 and "from /c1, so 40 cached blocks are withdrawn" in said[0], said
    assert all(r.levelno == logging.INFO for r in caplog.records if "LoRA adapter C" in r.getMessage())

    # The router routes no adapter loading: it says where that goes, as for vLLM's other routes.
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        async with http.post(router.url + route, json={"lora_name": "D", "lora_path": "/d"}) as r:
            out = await r.json()
        assert r.status == 404 and "send other vLLM endpoints to an engine directly" in out["error"]["message"]


async def test_an_adapter_loaded_again_from_its_old_path_is_credited_again(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unloaded, then loaded from the same path: vLLM hashes its blocks as before and reuses what it
    still holds, so the shim takes back the chains it withdrew (from the engine's replay)."""
    monkeypatch.setattr("worker_shim.shim.ADAPTERS_POLL_S", 0.2)
    w = await cluster.add_worker("agg", enable_prompt_tokens_details=True, runtime_lora_updating=True)
    router = await cluster.add_ready_router(pending_ttl_s=0.3)
    load = {"lora_name": "C", "lora_path": "/c1"}
    async with http.post(w.sim.url + "/v1/load_lora_adapter", json=load) as r:
        assert r.status == 200, await r.text()
    await until(lambda: "C" in router.adapters(), what="C registered")
    body = {"model": "C", "prompt": PROMPT, "max_tokens": 2}
    ours = chain_salt("C")
    assert await probe(http, router, w, "/v1/completions", body) == (0, 0)
    await until(lambda: held(router, w, PROMPT, ours), what="C's blocks indexed")
    async with http.post(w.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "C"}) as r:
        assert r.status == 200, await r.text()
    await until(lambda: not held(router, w, PROMPT, ours), timeout=10, what="C's blocks withdrawn")
    async with http.post(w.sim.url + "/v1/load_lora_adapter", json=load) as r:
        assert r.status == 200, await r.text()
    await until(lambda: held(router, w, PROMPT, ours), timeout=10, what="C's blocks back")
    await asyncio.sleep(0.4)  # no pending credit left: only the index's
    assert await probe(http, router, w, "/v1/completions", body) == (640, 640)
