"""End to end through real NATS, etcd, shims and simulated engines: where requests go, and that
both prefill paths produce the right output."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from typing import Any

import aiohttp
import nats
import pytest

from engine_sim import LoraModule
from protocol import GenerateRequest, block_hashes, decode_msg, subjects
from protocol.hashing import chain_salt
from router.policies import Outcome
from router.service import RouterService
from runtime.nats_flush import flush
from tests.router.conftest import BLOCK, MODEL, Cluster, busy_decode_fleet, complete
from tests.router.polling import until


async def _chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> tuple[str, str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 3}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data["choices"][0]["message"]["content"], resp.headers["x-kvswitch-decode-worker"]


async def test_multi_turn_conversations_return_to_the_worker_holding_their_prefix(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    router = await cluster.agg_router(3, disagg="never")
    homes: dict[int, str] = {}
    history: dict[int, list[dict[str, str]]] = {}
    for turn in range(3):
        for conv in range(6):
            # a long system prompt of its own per conversation, distinct from its first block on
            system = {"role": "system", "content": f"{conv} conversation " + "the cache " * 150}
            msgs = history.setdefault(conv, [system])
            msgs.append({"role": "user", "content": f"question {turn} about the router please explain"})
            sent_at = time.time()
            reply, worker = await _chat(http, router.url, msgs)
            hashes = block_hashes(router.tokenizer.encode_chat(msgs), BLOCK)
            msgs.append({"role": "assistant", "content": reply})
            # the next turn is routed on what the index knows: wait until it holds this prompt
            await until(functools.partial(_holds, router, worker, hashes), what="kv events")
            # ... and, since the premise is equal load, until every worker shows idle, the serving one in a
            # report received after the request was sent (one made while it ran can arrive after it ended)
            await until(functools.partial(_idle, router, worker, sent_at), what="idle load reports")
            if turn == 0:
                homes[conv] = worker
            else:
                assert worker == homes[conv], f"conversation {conv} turn {turn} left its prefix"
    assert len(set(homes.values())) > 1, "with equal load, new conversations should spread"


async def test_bypass_and_remote_prefill_produce_the_same_output_as_the_engine(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    reference = await cluster.add_worker("agg")  # the same engine, no router in between
    prompt = list(range(2000, 2200))
    params = {"max_tokens": 6, "temperature": 0.0, "seed": 11}
    async with http.post(reference.sim.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, **params}) as r:
        expected = (await r.json())["choices"][0]["text"]
    await reference.shim.stop()
    cluster.workers.remove(reference)
    await reference.sim.stop()

    remote = await cluster.add_ready_router(disagg="always")
    status, body, headers = await complete(http, remote, prompt, **params)
    assert status == 200, body
    assert headers["x-kvswitch-prefill"] == "remote" and body["kvswitch"]["prefill_worker"] == p.id
    assert body["choices"][0]["text"] == expected
    transferred = d.sim.engine.stats.external_kv_tokens
    assert transferred > 0, "the remote path must hand kv_transfer_params to the decode engine"

    bypass = await cluster.add_ready_router(disagg="never")
    status, body, headers = await complete(http, bypass, prompt, **params)
    assert status == 200, body
    assert headers["x-kvswitch-prefill"] == "agg" and headers["x-kvswitch-decode-worker"] == d.id
    assert body["choices"][0]["text"] == expected
    assert d.sim.engine.stats.external_kv_tokens == transferred, "no kv_transfer_params on the bypass path"


async def test_a_null_transfer_handle_from_a_client_is_served_on_the_remote_path(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """vLLM 0.32 reads `"kv_transfer_params": null` as unset; the router refused it with a 400
    ("set by the router, not by clients"), though a null names no host to pull KV from."""
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    nulls = {"kv_transfer_params": None, "ec_transfer_params": None, "disaggregated_params": None}
    status, body, headers = await complete(http, router, list(range(2000, 2200)), **nulls)
    assert status == 200, body
    assert headers["x-kvswitch-prefill"] == "remote" and body["kvswitch"]["prefill_worker"] == p.id
    assert d.sim.engine.stats.external_kv_tokens > 0, "the router's own handle reached the decode engine"


async def test_an_empty_transfer_handle_from_a_client_is_served_on_the_remote_path(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """vLLM 0.32 passes a handle on only when truthy: `{}` is unset to it, as a null is, and names
    no host. The router refused it with its 400 until 2026-12-06."""
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    empties: dict[str, Any] = {"kv_transfer_params": {}, "ec_transfer_params": {}}
    status, body, headers = await complete(http, router, list(range(2300, 2500)), **empties)
    assert status == 200, body
    assert headers["x-kvswitch-prefill"] == "remote" and body["kvswitch"]["prefill_worker"] == p.id
    assert d.sim.engine.stats.external_kv_tokens > 0, "the router's own handle reached the decode engine"
    status, body, _ = await complete(http, router, [1, 2, 3], disaggregated_params={})
    assert status == 400 and body["error"]["param"] == "disaggregated_params", "TensorRT-LLM's is no vLLM handle"


async def test_conditional_bypass_prefills_on_the_decode_worker(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(conditional_disagg=True, eff_isl_threshold=4096)
    prompt = list(range(5000, 5640))  # 40 blocks
    status, body, headers = await complete(http, router, prompt)
    assert (status, headers["x-kvswitch-prefill"], body["kvswitch"]["outcome"]) == (200, "remote", "declined_policy")
    await until(lambda: len(router.index.worker_hashes(d.id)) >= 40, what="decode blocks indexed")
    prefilled = p.sim.engine.stats.prompt_tokens
    transferred = d.sim.engine.stats.external_kv_tokens
    status, body, headers = await complete(http, router, [*prompt, 7, 8, 9])
    assert (status, headers["x-kvswitch-prefill"], body["kvswitch"]["outcome"]) == (200, "bypass", "bypass_isl")
    assert p.sim.engine.stats.prompt_tokens == prefilled, "a bypassed prompt must not reach the prefill worker"
    assert d.sim.engine.stats.external_kv_tokens == transferred
    assert router.disagg.counts == Counter({"declined_policy": 1, "bypass_isl": 1})


async def test_what_a_transfer_handle_cannot_serve_prefills_on_the_decode_worker(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """A prefill leg's handle names one sequence's blocks: given to a batch, vLLM would load the
    first prompt's KV for every prompt. Transferred KV comes without the prompt's logits, which
    prompt logprobs need (vLLM's decode engine crashes on them). Such requests prefill on the
    decode worker; the answers are what the engine gives for the same body directly."""
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    bodies = [
        ({"prompt": [list(range(100, 400)), list(range(1000, 1300))], "max_tokens": 4}, "bypass_sequences"),
        ({"prompt": list(range(2000, 2300)), "max_tokens": 4, "n": 2}, "bypass_sequences"),
        ({"prompt": list(range(4000, 4300)), "max_tokens": 2, "prompt_logprobs": 1}, "bypass_prompt_logprobs"),
        ({"prompt": list(range(5000, 5300)), "max_tokens": 2, "echo": True, "logprobs": 1}, "bypass_prompt_logprobs"),
    ]
    for body, outcome in bodies:
        request = {"model": MODEL, "temperature": 0.8, "seed": 5, **body}
        async with http.post(router.url + "/v1/completions", json=request) as r:
            routed = await r.json()
            assert r.status == 200, routed
            assert (r.headers["x-kvswitch-prefill"], routed["kvswitch"]["outcome"]) == ("bypass", outcome)
        async with http.post(d.sim.url + "/v1/completions", json=request) as r:
            direct = await r.json()
        for key in ("text", "logprobs", "prompt_logprobs"):
            assert [c[key] for c in routed["choices"]] == [c[key] for c in direct["choices"]], key
    assert p.sim.engine.stats.prompt_tokens == p.shim.probe.prompt_tokens, "no prefill leg (its endpoint probe only)"
    assert d.sim.engine.stats.external_kv_tokens == 0, "no transfer handle"
    status, body, headers = await complete(http, router, list(range(3000, 3300)))
    assert (status, headers["x-kvswitch-prefill"]) == (200, "remote"), "one sequence still goes remote"


async def test_a_salted_prefix_is_held_only_for_the_same_cache_salt(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """vLLM's cache_salt keeps tenants' caches apart: the engine shares no block across salts,
    and the router credits a worker with a salted prefix only for a request with the same salt."""
    await cluster.add_worker("agg")
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    prompt = list(range(7000, 7640))  # 40 blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-1"}
    async with http.post(router.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        holder = r.headers["x-kvswitch-decode-worker"]
    await until(lambda: len(router.index.worker_hashes(holder)) >= 40, what="the salted chain indexed")
    salted = set(block_hashes(prompt, BLOCK, salt="\x00tenant-1"))
    assert salted <= router.index.worker_hashes(holder), "the shim learnt the salt from the engine's events"
    for salt, held in (("tenant-1", 40), ("tenant-2", 0), (None, 0)):
        probe = {k: v for k, v in {**body, "cache_salt": salt}.items() if v is not None}
        async with http.post(router.url + "/debug/route", json=probe) as r:
            plan = await r.json()
        overlap = {c["worker"]: c["overlap_blocks"] for c in plan["decode_candidates"]}
        assert overlap[holder] == held, (salt, plan)


async def test_slo_aware_holds_a_request_while_its_decode_worker_has_no_tpot_room(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # Once one request runs on the only decode worker it has no room for another, which waits at
    # admission until the first ends, then is served.
    router, d, first = await busy_decode_fleet(cluster, http)
    second = asyncio.create_task(complete(http, router, list(range(1000, 1064))))
    await until(lambda: router.path.admission.depth == 1, what="the second request waiting at admission")
    await asyncio.sleep(0.3)
    assert not second.done() and not first.done()
    status, body, _ = await first
    assert status == 200 and body["usage"]["completion_tokens"] == 400
    status, body, headers = await second
    assert status == 200, body
    assert headers["x-kvswitch-decode-worker"] == d.id


async def test_with_spill_on_the_prefill_worker_serves_a_whole_request_while_the_decode_worker_has_no_room(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # The case above with spill_to_prefill on: instead of waiting, the second request is prefilled
    # and decoded on the prefill worker (an agg leg on its gen.agg subject).
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode", speedup=1.0)
    router = await cluster.add_ready_router(
        conditional_disagg=True,
        conditional_disagg_policy="slo_aware",
        slo_itl_s=0.001,
        slo_ttft_s=20.0,
        spill_to_prefill=True,
    )
    first = asyncio.create_task(complete(http, router, list(range(64)), max_tokens=400, ignore_eos=True))
    await until(lambda: router.view.load(d.id).running >= 1, what="the first request running on d")
    status, body, headers = await complete(http, router, list(range(1000, 1064)), max_tokens=32, ignore_eos=True)
    assert status == 200, body
    assert not first.done(), "the spilled request must not have waited for the first one"
    assert (headers["x-kvswitch-decode-worker"], headers["x-kvswitch-prefill"]) == (p.id, "agg")
    assert body["usage"]["completion_tokens"] == 32  # decoded there, not a one-token prefill leg
    assert p.sim.engine.stats.generation_tokens == 32 + p.shim.probe.output_tokens  # and its endpoint probe's
    assert router.disagg.counts[Outcome.SPILLED_TO_PREFILL] == 1
    status, body, _ = await first
    assert status == 200 and body["usage"]["completion_tokens"] == 400


async def test_client_bypass_annotation_is_stripped(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    nc = await nats.connect(cluster.nats_url)
    seen: list[GenerateRequest] = []
    await nc.subscribe(subjects.gen(router.ns, "decode", d.id), cb=functools.partial(_collect, out=seen))
    await flush(nc)
    status, _, headers = await complete(http, router, list(range(300)), annotations=["bypass_remote_prefill", "x"])
    await nc.close()
    assert status == 200 and headers["x-kvswitch-prefill"] == "remote"
    assert seen and seen[0].disagg is not None
    assert seen[0].annotations == ["x"]
    assert d.sim.engine.stats.external_kv_tokens > 0


def _holds(router: RouterService, worker: str, hashes: list[int]) -> bool:
    return router.index.find_matches(hashes).get(worker, 0) == len(hashes)


def _idle(router: RouterService, served_by: str, since: float) -> bool:
    loads = [router.view.load(w.worker) for w in router.registry.workers()]
    fresh = all(
        x.report_age_s is not None and time.time() - x.report_age_s > since for x in loads if x.worker == served_by
    )
    return fresh and all(x.running == x.waiting == x.active_blocks == 0 for x in loads)


async def _collect(msg: object, out: list[GenerateRequest]) -> None:
    out.append(decode_msg(msg.data, GenerateRequest))  # type: ignore[attr-defined]


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any, str]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json(), r.headers.get("x-kvswitch-decode-worker", "")


async def test_a_lora_adapters_requests_run_where_it_is_served_under_a_prefix_of_its_own(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM keys an adapter's blocks by its name: the router sends a request naming an adapter only
    to workers serving it, and credits a worker with an adapter's prefix only for that adapter. An
    adapter loaded at run time is routed to once the shim reads /v1/models again, and refused once
    unloaded."""
    monkeypatch.setattr("worker_shim.shim.ADAPTERS_POLL_S", 0.2)
    a = await cluster.add_worker("agg", lora_modules=(LoraModule("sql", "/adapters/sql"),))
    b = await cluster.add_worker("agg", runtime_lora_updating=True)
    router = await cluster.add_ready_router()
    async with http.get(router.url + "/v1/models") as r:
        assert {c["id"]: c["parent"] for c in (await r.json())["data"]} == {MODEL: None, "sql": MODEL}
    prompt = list(range(7000, 7640))  # 40 blocks
    body = {"model": "sql", "prompt": prompt, "max_tokens": 2}
    for _ in range(3):
        status, out, worker = await _post(http, router.url + "/v1/completions", body)
        assert (status, worker, out["model"]) == (200, a.id, "sql"), out
    salted = set(block_hashes(prompt, BLOCK, salt=chain_salt("sql")))
    await until(lambda: salted <= router.index.worker_hashes(a.id), what="the adapter's chain indexed")
    _, plan, _ = await _post(http, router.url + "/debug/route", {**body, "model": MODEL})
    assert {c["worker"]: c["overlap_blocks"] for c in plan["decode_candidates"]} == {a.id: 0, b.id: 0}

    async with http.post(b.sim.url + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/c"}) as r:
        assert r.status == 200
    await until(lambda: "chat" in router.adapters(), what="the adapter loaded at run time registered")
    status, out, worker = await _post(http, router.url + "/v1/completions", {**body, "model": "chat"})
    assert (status, worker) == (200, b.id), out
    async with http.post(b.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}) as r:
        assert r.status == 200
    await until(lambda: "chat" not in router.adapters(), what="the unloaded adapter gone")
    status, out, _ = await _post(http, router.url + "/v1/completions", {**body, "model": "chat"})
    assert status == 404 and out["error"]["param"] == "model" and "sql" in out["error"]["message"]


async def test_a_model_served_under_two_names_is_routed_by_either_on_one_chain(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """vLLM's --served-model-name with two names, the shim given the second: requests naming the
    other go only to that worker, both names read one cache, and the worker's LoRA adapter (whose
    parent vLLM names by the first name) is registered (tests/fixtures/vllm-0.32/bs32/
    v1_models_aliases.json)."""
    a = await cluster.add_worker(
        "agg", model="first-name", aliases=(MODEL,), lora_modules=(LoraModule("sql", "/s"),), shim={"model": MODEL}
    )
    b = await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    info = router.registry.get(a.id)
    assert info is not None and (info.model, info.aliases, info.adapters) == (MODEL, ["first-name"], ["sql"])
    async with http.get(router.url + "/v1/models") as r:
        cards = {c["id"]: (c["root"], c["parent"]) for c in (await r.json())["data"]}
    assert cards == {MODEL: (MODEL, None), "first-name": (MODEL, None), "sql": ("sql", MODEL)}
    a.shim.credit.min_legs = a.shim.credit.min_tokens = 1
    prompt = list(range(8000, 8640))  # 40 blocks
    plain = set(block_hashes(prompt, BLOCK))

    async def by_first_name() -> None:
        body = {"model": "first-name", "prompt": prompt, "max_tokens": 2}
        status, out, worker = await _post(http, router.url + "/v1/completions", body)
        assert (status, worker, out["model"]) == (200, a.id, "first-name"), out

    await by_first_name()
    # The shim promises a leg what its own index holds at dispatch: the repeat goes once the first's
    # KV events are in (the router has them from the shim), not while they may be on their way.
    await until(lambda: plain <= router.index.worker_hashes(a.id), what="the prompt indexed on the plain chain")
    await by_first_name()
    # The shim too reads the alias's prompt on the model's chain: it promised the repeat 39 blocks.
    await until(lambda: a.shim.credit.predicted_total == 39 * BLOCK, what="the shim's promise judged")
    _, plan, _ = await _post(http, router.url + "/debug/route", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert {c["worker"]: c["overlap_blocks"] for c in plan["decode_candidates"]} == {a.id: 40, b.id: 0}
    status, out, _ = await _post(http, router.url + "/v1/completions", {"model": "nope", "prompt": prompt})
    assert status == 404 and "first-name" in out["error"]["message"]


async def test_an_adapters_prefill_leg_goes_only_to_a_prefill_worker_serving_it(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("worker_shim.shim.ADAPTERS_POLL_S", 0.2)
    p = await cluster.add_worker("prefill", runtime_lora_updating=True)
    d = await cluster.add_worker("decode", lora_modules=(LoraModule("sql", "/adapters/sql"),))
    router = await cluster.add_ready_router(disagg="always")
    body = {"model": "sql", "prompt": list(range(2000, 2300)), "max_tokens": 3}
    status, out, worker = await _post(http, router.url + "/v1/completions", body)
    assert (status, worker, out["kvswitch"]["outcome"]) == (200, d.id, "no_prefill_pool"), out
    assert p.sim.engine.stats.prompt_tokens == p.shim.probe.prompt_tokens  # its endpoint probe only
    assert d.sim.engine.stats.external_kv_tokens == 0
    async with http.post(p.sim.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/s"}) as r:
        assert r.status == 200
    await until(lambda: router.registry.get(p.id).adapters == ["sql"], what="the prefill worker's adapter")  # type: ignore[union-attr]
    status, out, worker = await _post(http, router.url + "/v1/completions", {**body, "prompt": list(range(3000, 3300))})
    assert (status, worker, out["kvswitch"]["prefill_worker"]) == (200, d.id, p.id), out
    assert d.sim.engine.stats.external_kv_tokens > 0, "the adapter's KV came from the prefill worker"


async def test_an_adapter_unloaded_since_its_shim_looked_is_served_by_another_worker(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router's view of adapters lags the engines' by up to the shims' poll: a request sent to a
    worker whose engine unloaded the adapter meanwhile (its 404) is retried on the next worker; a
    prefill leg falls back to the decode worker. Unloaded everywhere, the engine's 404 is the answer."""
    monkeypatch.setattr("worker_shim.shim.ADAPTERS_POLL_S", 3600.0)  # the shims never look again
    lora: dict[str, Any] = {"lora_modules": (LoraModule("sql", "/adapters/sql"),), "runtime_lora_updating": True}
    a = await cluster.add_worker("agg", **lora)
    b = await cluster.add_worker("agg", **lora)
    router = await cluster.add_ready_router()
    body = {"model": "sql", "prompt": list(range(4000, 4640)), "max_tokens": 2}
    status, out, holder = await _post(http, router.url + "/v1/completions", body)
    assert status == 200, out
    await until(lambda: len(router.index.worker_hashes(holder)) >= 40, what="the adapter's prefix indexed")
    held, other = (a, b) if holder == a.id else (b, a)
    async with http.post(held.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
        assert r.status == 200
    retries = router.path.dispatcher.retries
    status, out, worker = await _post(http, router.url + "/v1/completions", body)  # to the prefix holder first
    assert (status, worker) == (200, other.id), out
    assert router.path.dispatcher.retries == retries + 1
    async with http.post(other.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
        assert r.status == 200
    status, out, _ = await _post(http, router.url + "/v1/completions", body)
    assert status == 404 and out["error"]["param"] == "model" and "sql" in out["error"]["message"], out


async def test_a_prefill_leg_for_an_adapter_its_worker_unloaded_falls_back_to_the_decode_worker(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("worker_shim.shim.ADAPTERS_POLL_S", 3600.0)
    lora: dict[str, Any] = {"lora_modules": (LoraModule("sql", "/adapters/sql"),), "runtime_lora_updating": True}
    p = await cluster.add_worker("prefill", **lora)
    d = await cluster.add_worker("decode", **lora)
    router = await cluster.add_ready_router(disagg="always")
    async with http.post(p.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
        assert r.status == 200
    body = {"model": "sql", "prompt": list(range(5000, 5300)), "max_tokens": 2}
    status, out, worker = await _post(http, router.url + "/v1/completions", body)
    assert (status, worker, out["kvswitch"]["outcome"]) == (200, d.id, "fallback_prefill_failed"), out


async def test_a_chat_echo_or_a_beam_search_prefills_on_the_decode_worker(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """vLLM 0.32 gives a chat echo prompt_logprobs (top_logprobs, 0 by default), which transferred
    KV cannot serve; its beam search passes no kv_transfer_params between the legs. Neither takes a
    prefill leg. The router routes no embeddings: `prompt_embeds` is a 400 naming it."""
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    content = " ".join(f"w{i}" for i in range(300))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    completion = {"model": MODEL, "prompt": list(range(100, 400)), "max_tokens": 2}
    requests = [
        ("/v1/chat/completions", {**chat, "echo": True}, "bypass_prompt_logprobs"),
        ("/v1/chat/completions", {**chat, "echo": True, "logprobs": True, "top_logprobs": 2}, "bypass_prompt_logprobs"),
        ("/v1/completions", {**completion, "use_beam_search": True}, "bypass_beam_search"),
        ("/v1/chat/completions", {**chat, "use_beam_search": True}, "bypass_beam_search"),
    ]
    for endpoint, body, outcome in requests:
        async with http.post(router.url + endpoint, json=body) as r:
            routed = await r.json()
            assert r.status == 200, routed
            assert (r.headers["x-kvswitch-prefill"], routed["kvswitch"]["outcome"]) == ("bypass", outcome), body
    assert p.sim.engine.stats.prompt_tokens == p.shim.probe.prompt_tokens, "no prefill leg (its endpoint probe only)"
    assert d.sim.engine.stats.external_kv_tokens == 0, "no transfer handle"
    assert router.disagg.counts[Outcome.BYPASS_BEAM_SEARCH] == 2
    for path in ("/v1/completions", "/debug/route"):
        async with http.post(router.url + path, json={**completion, "prompt_embeds": "AAAA"}) as r:
            refused = await r.json()
            assert (r.status, refused["error"]["param"]) == (400, "prompt_embeds"), refused
