"""A model whose every worker left (a crash, a hung engine deregistered by its shim, a rolling
restart): its requests are a 503 with Retry-After, which clients retry, not a 404 "does not exist"
blaming the router's --namespace (audit router_stream D2)."""

from __future__ import annotations

from typing import Any

import aiohttp

from engine_sim import LoraModule
from router.request_path import NO_WORKER_RETRY_S
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until


async def ask(
    http: aiohttp.ClientSession, router: RouterService, **body: Any
) -> tuple[int, dict[str, Any], str | None]:
    payload = {"prompt": "hello", "max_tokens": 3, **body}
    async with http.post(router.url + "/v1/completions", json=payload) as r:
        return r.status, await r.json(), r.headers.get("Retry-After")


async def test_when_every_worker_of_a_model_left_its_requests_are_a_503_to_retry(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    w = await cluster.add_worker("agg")
    own = await cluster.add_router(config={"model": MODEL})  # --model
    other = await cluster.add_router()  # serves what is registered
    for router in (own, other):
        await cluster.ready(router)
        assert (await ask(http, router, model=MODEL))[0] == 200
    await w.shim.stop()
    await until(lambda: not own.registry.workers() and not other.registry.workers(), what="the worker gone")
    asks: list[tuple[RouterService, dict[str, Any]]] = [(own, {"model": MODEL}), (own, {}), (other, {"model": MODEL})]
    for router, body in asks:
        status, out, retry = await ask(http, router, **body)
        error = out["error"]
        assert (status, error["code"], error["type"]) == (503, 503, "ServiceUnavailableError"), (body, out)
        assert retry == str(NO_WORKER_RETRY_S), (body, retry)
        assert "right now" in error["message"] and "does not exist" not in error["message"], error
        assert "--namespace" not in error["message"], error  # it saw workers: no namespace mismatch
    status, out, _ = await ask(http, other, model="never-served")
    assert status == 404 and "does not exist" in out["error"]["message"], out


async def test_an_adapter_whose_workers_left_is_a_503_while_others_serve_its_base_model(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Its base model is still served, by a worker without the adapter: the router answered 404
    "does not exist", which clients do not retry, through a rolling restart of the adapter's
    workers. Unloaded from a worker still registered, it is a 404, as vLLM answers."""
    sql = await cluster.add_worker("agg", lora_modules=(LoraModule("sql", "/adapters/sql"),))
    chat = await cluster.add_worker(
        "agg", lora_modules=(LoraModule("chat", "/adapters/chat"),), runtime_lora_updating=True
    )
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    for name in ("sql", "chat"):
        status, out, _ = await ask(http, router, model=name)
        assert status == 200, out
    await sql.shim.stop()
    await until(lambda: "sql" not in router.adapters(), what="the adapter's worker gone")
    status, out, retry = await ask(http, router, model="sql")
    assert (status, retry) == (503, str(NO_WORKER_RETRY_S)) and "right now" in out["error"]["message"], out
    assert (await ask(http, router, model=MODEL))[0] == 200

    async with http.post(chat.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}) as r:
        assert r.status == 200
    await until(lambda: "chat" not in router.adapters(), what="the unloaded adapter gone")
    status, out, _ = await ask(http, router, model="chat")
    assert status == 404 and "does not exist" in out["error"]["message"], out


async def test_every_replica_answers_503_for_a_name_whose_workers_left_not_only_the_one_that_served_it(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The departures are the registry's, which every replica sees: behind a load balancer, or from
    a replica restarted in a rolling restart, a client got a final 404 "does not exist" for a name
    listed seconds before, from every replica but the one that had served a request for it (models
    audit F1). An adapter whose workers left while its base model stays served is the same; and
    /ready blames no --namespace on a replica that saw the workers go but served none of them."""
    sql = await cluster.add_worker("agg", lora_modules=(LoraModule("sql", "/adapters/sql"),))
    plain = await cluster.add_worker("agg")
    one = await cluster.add_ready_router()
    two = await cluster.add_ready_router()
    assert (await ask(http, one, model="sql"))[0] == 200  # replica two serves no request for it
    await sql.shim.stop()
    await until(lambda: "sql" not in one.adapters() and "sql" not in two.adapters(), what="the adapter's worker gone")
    for router in (one, two):
        status, out, retry = await ask(http, router, model="sql")
        assert (status, retry) == (503, str(NO_WORKER_RETRY_S)), out
        assert out["error"]["message"].startswith("no worker serves the model `sql` right now"), out
        assert MODEL in router.models()  # its base model still served
    assert (await ask(http, one, model=MODEL))[0] == 200  # not two: only the registry tells it workers were there
    await plain.shim.stop()
    await until(lambda: not one.registry.workers() and not two.registry.workers(), what="the workers gone")
    for router in (one, two):
        for name in (MODEL, "sql"):
            status, out, retry = await ask(http, router, model=name)
            message = out["error"]["message"]
            assert (status, retry) == (503, str(NO_WORKER_RETRY_S)) and "right now" in message, (name, out)
            assert "--namespace" not in message, message  # workers were there: no namespace mismatch
        status, out, _ = await ask(http, router, model="never-served")
        assert status == 404 and "does not exist" in out["error"]["message"], out
        async with http.get(router.url + "/ready") as r:
            problems = (await r.json())["problems"]
        assert r.status == 503 and any("every worker has left" in p for p in problems), problems
        assert not any("--namespace" in p for p in problems), problems


async def test_an_adapter_unloaded_from_its_last_worker_after_another_serving_it_left_is_a_404(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """A worker scaled down with an adapter others still serve is no departure of it: unloaded
    from the one left, the adapter is vLLM's 404 "does not exist", where every replica answered
    the 503 with Retry-After for 10 min."""
    lora = (LoraModule("chat", "/adapters/chat"),)
    first = await cluster.add_worker("agg", lora_modules=lora)
    second = await cluster.add_worker("agg", lora_modules=lora, runtime_lora_updating=True)
    router = await cluster.add_ready_router()
    assert (await ask(http, router, model="chat"))[0] == 200
    await first.shim.stop()
    await until(lambda: len(router.registry.workers()) == 1, what="the first worker gone")
    assert (await ask(http, router, model="chat"))[0] == 200  # the second still serves it
    async with http.post(second.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}) as r:
        assert r.status == 200
    await until(lambda: "chat" not in router.adapters(), what="the unloaded adapter gone")
    status, out, retry = await ask(http, router, model="chat")
    assert (status, retry) == (404, None) and "does not exist" in out["error"]["message"], out
    assert (await ask(http, router, model=MODEL))[0] == 200
