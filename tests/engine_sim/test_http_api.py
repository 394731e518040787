"""The OpenAI HTTP API against the captured vLLM 0.32 responses: shapes, status codes, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict

from engine_sim import KVEventsConfig, SimConfig, SimServer
from engine_sim.errors import SimConfigError
from engine_sim.lora import LoraModule, LoraRequest
from kvswitch.servers import free_ports
from tests.engine_sim.conftest import sim_config
from tests.listen_backlog import connected_while_blocked
from tests.protocol.vllm_captures import fixture_json, fixture_path


def shape(obj: Any) -> Any:
    """Keys (in order) and nesting, with values reduced to their JSON kind (null stays null)."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    if obj is None:
        return None
    return type(obj).__name__.replace("int", "number").replace("float", "number")


def sse_events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def post(sim: SimServer, path: str, body: Any, **kw: str) -> tuple[int, Any, Mapping[str, str]]:
    data = body if isinstance(body, str) else json.dumps(body)
    async with (
        aiohttp.ClientSession() as s,
        s.post(sim.url + path, data=data, headers={"Content-Type": "application/json", **kw}) as r,
    ):
        text = await r.text()
        ctype = r.headers.get("Content-Type", "")
        return r.status, (json.loads(text) if "json" in ctype else text), CIMultiDict(r.headers)


async def get(sim: SimServer, path: str) -> tuple[int, str, Any]:
    async with aiohttp.ClientSession() as s, s.get(sim.url + path) as r:
        return r.status, await r.text(), r.headers


@pytest.mark.parametrize("fixture", ["completion_nonstream_tokenids.json", "completion_nonstream_text.json"])
async def test_completion_matches_vllm_shape(sim: SimServer, fixture: str) -> None:
    prompt: Any = list(range(300, 385)) if "tokenids" in fixture else "hello world this is a tiny test " * 8
    status, body, _ = await post(sim, "/v1/completions", {"model": "sim-llama", "prompt": prompt, "max_tokens": 8})
    assert status == 200
    assert shape(body) == shape(fixture_json(fixture))
    assert body["id"].startswith("cmpl-") and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8


async def test_chat_matches_vllm_shape(sim: SimServer) -> None:
    body_in = {"model": "sim-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    status, body, _ = await post(sim, "/v1/chat/completions", body_in)
    assert status == 200 and shape(body) == shape(fixture_json("chat_completion.json"))
    assert body["id"].startswith("chatcmpl-") and body["usage"]["completion_tokens"] == 8


async def test_completion_stream_matches_vllm_shape(sim: SimServer) -> None:
    captured = sse_events(fixture_path("completion_stream.sse").read_text())
    req = {"prompt": list(range(300, 368)), "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    status, text, headers = await post(sim, "/v1/completions", req)
    assert status == 200 and headers["Content-Type"] == "text/event-stream; charset=utf-8"
    ours = sse_events(text)
    assert len(ours) == len(captured) == 14  # 12 tokens, usage, [DONE]
    assert [shape(e) for e in ours] == [shape(e) for e in captured]
    assert ours[-2]["usage"] == {"prompt_tokens": 68, "total_tokens": 80, "completion_tokens": 12}
    assert ours[-3]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_matches_vllm_shape(sim: SimServer) -> None:
    captured = sse_events(fixture_path("chat_completion_stream.sse").read_text())
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    _, text, _ = await post(sim, "/v1/chat/completions", req)
    ours = sse_events(text)
    assert [shape(e) for e in ours] == [shape(e) for e in captured]


@pytest.mark.parametrize(
    ("fixture", "path", "body"),
    [
        ("error_prompt_too_long_tokenids.json", "/v1/completions", {"prompt": [7] * 2100, "max_tokens": 4}),
        ("error_prompt_too_long_text.json", "/v1/completions", {"prompt": "hello world " * 2000, "max_tokens": 4}),
        ("error_unknown_model.json", "/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
        ("error_unknown_model_chat.json", "/v1/chat/completions",
         {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
        ("error_malformed_json.json", "/v1/completions", '{"model": "x", "prompt": [1,2,'),
    ],
)  # fmt: skip
async def test_errors_match_vllm(fixture: str, path: str, body: Any) -> None:
    captured = fixture_json(fixture)
    async with SimServer(sim_config(max_model_len=2048, model="tiny-llama")) as sim:
        status, ours, _ = await post(sim, path, body)
    assert status == captured["error"]["code"]
    assert shape(ours) == shape(captured)
    for key in ("type", "param", "code"):
        assert ours["error"][key] == captured["error"][key]
    if "unknown_model" not in fixture:  # the alias list names a path in the capture
        assert ours["error"]["message"] == captured["error"]["message"]


async def test_prompt_plus_max_tokens_over_limit_is_length_not_error() -> None:
    captured = fixture_json("error_prompt_plus_max_tokens_too_long.json")
    async with SimServer(sim_config(max_model_len=2048, num_gpu_blocks=256)) as sim:
        status, ours, _ = await post(sim, "/v1/completions", {"prompt": [7] * 2040, "max_tokens": 100})
    assert status == 200 and shape(ours) == shape(captured)
    assert ours["usage"] == captured["usage"] and ours["choices"][0]["finish_reason"] == "length"


async def test_models_health_version_reset(sim: SimServer) -> None:
    status, text, _ = await get(sim, "/v1/models")
    assert status == 200 and shape(json.loads(text)) == shape(fixture_json("v1_models.json"))
    assert json.loads(text)["data"][0]["max_model_len"] == sim.config.max_model_len
    assert (await get(sim, "/health"))[:2] == (200, "")
    assert json.loads((await get(sim, "/version"))[1]) == fixture_json("version_endpoint.json")
    status, body, _ = await post(sim, "/reset_prefix_cache", "")
    assert (status, body) == (200, json.loads(fixture_path("reset_prefix_cache_response.txt").read_text()))


async def test_token_ids_in_and_out(sim: SimServer) -> None:
    prompt = list(range(400, 440))
    _, body, _ = await post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 5
    assert all(t >= 300 for t in choice["token_ids"])
    # Deterministic: the same prompt gives the same tokens, and the text is their decoding.
    _, again, _ = await post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "return_token_ids": True})
    assert again["choices"][0]["token_ids"] == choice["token_ids"]
    from protocol.tokenizer import BuiltinTokenizer

    assert choice["text"] == BuiltinTokenizer().decode(choice["token_ids"])


async def test_batch_of_prompts(sim: SimServer) -> None:
    for batch in (["one two", "three"], [[400, 401], [500, 501, 502]]):
        _, body, _ = await post(sim, "/v1/completions", {"prompt": batch, "max_tokens": 3})
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"]["completion_tokens"] == 6


async def test_stop_string_ends_with_stop_reason(sim: SimServer) -> None:
    prompt = list(range(600, 640))
    _, full, _ = await post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 6})
    words = full["choices"][0]["text"].split(" ")
    stop = " " + words[3]  # the 3rd generated word
    _, body, _ = await post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "stop": [stop]})
    choice = body["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["text"] == full["choices"][0]["text"].split(stop)[0]
    _, text, _ = await post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "stop": stop, "stream": True})
    chunks = [e for e in sse_events(text) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert sim.engine.num_blocks_in_use == 0


async def test_request_id_header_is_used_and_echoed(sim: SimServer) -> None:
    _, body, headers = await post(
        sim, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, **{"X-Request-Id": "abc123"}
    )
    assert body["id"] == "cmpl-abc123" and "X-Request-Id" not in headers  # echoed only with the flag, as vLLM


async def test_concurrent_requests_may_share_a_client_request_id(sim: SimServer) -> None:
    """vLLM keys its requests by the client's id plus a random suffix (vllm#27987), so a client that
    reuses one for concurrent requests gets every answer; so does the sim."""
    body = {"prompt": "hi there", "max_tokens": 8, "ignore_eos": True, "n": 2}
    answers = await asyncio.gather(*(post(sim, "/v1/completions", body, **{"X-Request-Id": "dup"}) for _ in range(3)))
    assert [(status, reply["id"], len(reply["choices"])) for status, reply, _ in answers] == [(200, "cmpl-dup", 2)] * 3


async def test_client_disconnect_aborts_and_frees_blocks() -> None:
    async with SimServer(sim_config(speedup=1.0)) as sim:
        async with aiohttp.ClientSession() as s:
            req = {"prompt": list(range(1000, 1200)), "max_tokens": 10_000, "stream": True}
            async with s.post(sim.url + "/v1/completions", json=req) as r:
                await r.content.readline()  # the first token arrived: the request is running
                assert sim.engine.num_blocks_in_use > 0
        for _ in range(200):  # the server notices the closed socket asynchronously
            if not sim.engine.running:
                break
            await asyncio.sleep(0.01)
        assert not sim.engine.running and sim.engine.num_blocks_in_use == 0
        # vLLM 0.32 drops a client-aborted request's state before its stats: no finish counts it
        # (output_processor.py abort_requests); old: request_success_total{abort} 1.
        assert sum(sim.engine.stats.finished.values()) == sim.engine.stats.e2e.count == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_client_reset_met_in_a_write_of_n_streams_aborts_without_an_error(
    path: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With n > 1 each choice writes from its own task: once the client's reset closed the transport,
    another choice's write in the same turn raises ClientConnectionResetError before the handler is
    cancelled. vLLM logs nothing for a client that left; the sim logged an "Error handling request"
    traceback for it."""
    write = web.StreamResponse.write
    writes = 0

    async def reset_on_the_third(self: web.StreamResponse, data: bytes) -> None:
        nonlocal writes
        writes += 1
        if writes == 3:
            assert self._req is not None and self._req.transport is not None
            self._req.transport.close()
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", reset_on_the_third)
    caplog.set_level(logging.DEBUG)
    chat = "chat" in path
    req: dict[str, Any] = {"max_tokens": 10_000, "stream": True, "n": 4, "ignore_eos": True}
    req.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": list(range(1000, 1200))})
    async with SimServer(sim_config(speedup=1.0)) as sim, aiohttp.ClientSession() as s:
        with contextlib.suppress(aiohttp.ClientError):
            async with s.post(sim.url + path, json=req) as r:
                await r.read()
        for _ in range(200):
            if not sim.engine.running:
                break
            await asyncio.sleep(0.01)
        assert not sim.engine.running and sim.engine.num_blocks_in_use == 0
    assert writes >= 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def test_a_burst_of_connections_waits_in_the_listen_backlog_while_the_engine_is_busy(sim: SimServer) -> None:
    """vLLM listens with uvicorn's backlog of 2048; with aiohttp's default of 128 a shim's burst of
    legs (a connection each) was reset while the sim's loop was busy."""
    host, port = sim.url.removeprefix("http://").split(":")
    assert connected_while_blocked(host, int(port), 300) == 300


async def test_openai_client_non_streaming_and_streaming(sim: SimServer) -> None:
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="none")
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-llama"]
        done = await client.completions.create(model="sim-llama", prompt="hello world", max_tokens=5)
        assert done.choices[0].finish_reason == "length" and done.usage and done.usage.completion_tokens == 5
        parts: list[str] = []
        stream = await client.completions.create(
            model="sim-llama", prompt="hello world", max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            parts.extend(c.text for c in chunk.choices)
        assert "".join(parts) == done.choices[0].text
        chat = await client.chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
        pieces: list[str] = []
        chat_stream = await client.chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        async for chat_chunk in chat_stream:
            pieces.extend(c.delta.content or "" for c in chat_chunk.choices)
        assert "".join(pieces) == chat.choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="sim-llama", prompt=[5] * 40000, max_tokens=1)
    finally:
        await client.close()


# --- LoRA adapters (the bs32 LoRA capture: `--lora-modules tiny-lora=tiny-lora`) ------------------


def lora_config(**changes: Any) -> SimConfig:
    """The captured server's names: base `tiny-llama`, adapter `tiny-lora` at path `tiny-lora`."""
    adapters = (LoraModule("tiny-lora", "tiny-lora"),)
    return sim_config(model="tiny-llama", max_model_len=2048, lora_modules=adapters, **changes)


def without_volatile(models: dict[str, Any]) -> list[dict[str, Any]]:
    """The cards less what vLLM makes afresh per call: `created` and each permission's id and time."""
    out = []
    for card in models["data"]:
        perms = [{k: v for k, v in p.items() if k not in ("id", "created")} for p in card["permission"]]
        out.append({**{k: v for k, v in card.items() if k != "created"}, "permission": perms})
    return out


async def test_models_list_the_base_then_each_adapter_as_vllm() -> None:
    captured = fixture_json("v1_models_lora.json", "bs32")
    async with SimServer(lora_config()) as sim:
        status, text, _ = await get(sim, "/v1/models")
    ours = json.loads(text)
    assert status == 200 and [shape(c) for c in ours["data"]] == [shape(c) for c in captured["data"]]
    assert without_volatile(ours) == without_volatile(captured)  # adapter: root its path, max_model_len null


async def test_a_request_naming_an_adapter_is_served_and_answered_in_its_name() -> None:
    chat = {"model": "tiny-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    stream = {"model": "tiny-lora", "prompt": "hi", "max_tokens": 2, "stream": True}
    async with SimServer(lora_config()) as sim:
        status, done, _ = await post(sim, "/v1/completions", {"model": "tiny-lora", "prompt": "hi", "max_tokens": 2})
        assert status == 200 and done["model"] == "tiny-lora" and done["usage"]["completion_tokens"] == 2
        status, answer, _ = await post(sim, "/v1/chat/completions", chat)
        assert status == 200 and answer["model"] == "tiny-lora"
        _, text, _ = await post(sim, "/v1/completions", stream)
        assert {e["model"] for e in sse_events(text) if e != "[DONE]"} == {"tiny-lora"}
        status, tokens, _ = await post(sim, "/tokenize", {"model": "tiny-lora", "prompt": "hi"})
        assert status == 200
        status, _, _ = await post(sim, "/detokenize", {"model": "tiny-lora", "tokens": tokens["tokens"]})
        assert status == 200
        _, base, _ = await post(sim, "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
        assert base["model"] == "tiny-llama"


async def test_a_model_neither_served_nor_an_adapter_is_vllms_404() -> None:
    captured = fixture_json("error_unknown_model.json", "bs32")
    async with SimServer(lora_config()) as sim:
        status, ours, _ = await post(sim, "/v1/completions", {"model": "nope", "prompt": [1, 2, 3], "max_tokens": 1})
        for path, body in (
            ("/tokenize", {"model": "nope", "prompt": "hi"}),
            ("/detokenize", {"model": "nope", "tokens": [1]}),
        ):
            assert (await post(sim, path, body))[0] == 404
    assert status == 404 and ours == captured  # the alias list names the base model alone


async def test_an_empty_model_name_is_the_served_model_as_in_vllm() -> None:
    # vLLM's _is_model_supported: `not model_name` is served by the base model (a 404 here before)
    async with SimServer(lora_config()) as sim:
        for path, body in (
            ("/v1/completions", {"model": "", "prompt": [1, 2, 3], "max_tokens": 1}),
            ("/v1/chat/completions", {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ):
            status, answer, _ = await post(sim, path, body)
            assert status == 200 and answer["model"] == sim.config.model, answer
        assert (await post(sim, "/tokenize", {"model": "", "prompt": "hi"}))[0] == 200


async def test_an_adapter_request_hits_its_own_cache_not_the_base_models() -> None:
    body = {"model": "tiny-lora", "prompt": list(range(900, 1000)), "max_tokens": 2}
    async with SimServer(lora_config(enable_prompt_tokens_details=True)) as sim:
        _, first, _ = await post(sim, "/v1/completions", body)
        _, again, _ = await post(sim, "/v1/completions", body)
        _, base, _ = await post(sim, "/v1/completions", {**body, "model": "tiny-llama"})
    no_hit = {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None}  # vLLM's miss
    assert first["usage"]["prompt_tokens_details"] == no_hit
    assert again["usage"]["prompt_tokens_details"] == {**no_hit, "cached_tokens": 96}
    assert base["usage"]["prompt_tokens_details"] == no_hit  # same tokens, the adapter's blocks


async def test_adapters_load_and_unload_at_run_time_only_where_vllm_allows_it() -> None:
    load = {"lora_name": "tiny-lora-2", "lora_path": "tiny-lora"}
    completion = {"model": "tiny-lora-2", "prompt": [1, 2, 3], "max_tokens": 1}
    async with SimServer(lora_config()) as sim:
        assert (await post(sim, "/v1/load_lora_adapter", load))[0] == 404, "served only when allowed"
    async with SimServer(lora_config(runtime_lora_updating=True)) as sim:
        assert (await post(sim, "/v1/completions", completion))[0] == 404
        status, text, _ = await post(sim, "/v1/load_lora_adapter", load)
        assert (status, text) == (200, "Success: LoRA adapter 'tiny-lora-2' added successfully.")
        _, models, _ = await get(sim, "/v1/models")
        cards = {c["id"]: (c["root"], c["parent"]) for c in json.loads(models)["data"]}
        assert cards["tiny-lora-2"] == ("tiny-lora", "tiny-llama")
        assert (await post(sim, "/v1/completions", completion))[0] == 200
        assert sim.loras.get("tiny-lora-2") == LoraRequest("tiny-lora-2", 2, "tiny-lora")
        status, err, _ = await post(sim, "/v1/load_lora_adapter", load)
        assert status == 400 and err["error"]["message"] == (
            "The lora adapter 'tiny-lora-2' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True."
        )
        status, text, _ = await post(sim, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-2"})
        assert (status, text) == (200, "Success: LoRA adapter 'tiny-lora-2' removed successfully.")
        assert (await post(sim, "/v1/completions", completion))[0] == 404
        status, err, _ = await post(sim, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-2"})
        assert status == 404 and err["error"]["type"] == "NotFoundError"
        await post(sim, "/v1/load_lora_adapter", {**load, "lora_name": "tiny-lora-3"})
        assert sim.loras.get("tiny-lora-3") == LoraRequest("tiny-lora-3", 3, "tiny-lora"), "ids are never reused"
        status, err, _ = await post(sim, "/v1/load_lora_adapter", {"lora_name": "x"})
        assert status == 400 and "must be provided" in err["error"]["message"]


async def test_a_sim_as_one_data_parallel_rank_names_it_as_vllms_ranks_do() -> None:
    """Rank 1 of a vLLM given these endpoints publishes and replays on their ports plus 1, labels
    its metrics engine="1", and, as vLLM's server for that one rank (external load balancing), reads
    X-data-parallel-rank as an index into its one engine: 0 runs, 1 is out of range (a header that is
    no integer is ignored)."""
    events, replay = free_ports(2), free_ports(2)
    given = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{events}", replay_endpoint=f"tcp://*:{replay}"
    )
    body = {"model": "sim-llama", "prompt": [1, 2, 3], "max_tokens": 1}
    async with SimServer(sim_config(data_parallel_rank=1, kv_events=given)) as sim:
        assert sim.events_endpoint == f"tcp://127.0.0.1:{events + 1}"
        assert sim.replay_endpoint == f"tcp://127.0.0.1:{replay + 1}"
        _, text, _ = await get(sim, "/metrics")
        assert 'engine="1"' in text and 'engine="0"' not in text
        status, err, _ = await post(sim, "/v1/completions", body, **{"X-data-parallel-rank": "1"})
        assert status == 400 and err["error"]["message"] == "data_parallel_rank 1 is out of range [0, 1)."
        for header in ("0", "any"):
            assert (await post(sim, "/v1/completions", body, **{"X-data-parallel-rank": header}))[0] == 200
        assert sim.ranked_requests == 1


def alias_config() -> SimConfig:
    """The captured server (tests/vllm/capture_aliases.py): `--served-model-name tiny-alias tiny-llama`."""
    return lora_config().replace(model="tiny-alias", aliases=("tiny-llama",), root="tiny-llama")


async def test_a_model_served_under_several_names_lists_each_and_answers_in_the_first() -> None:
    captured = fixture_json("v1_models_aliases.json", "bs32")
    prompt = list(range(100, 165))
    async with SimServer(alias_config()) as sim:
        status, text, _ = await get(sim, "/v1/models")
        ours = json.loads(text)
        assert status == 200 and without_volatile(ours) == without_volatile(captured)
        answered = {}
        for name in ("tiny-llama", "tiny-alias", "tiny-lora"):
            status, done, _ = await post(sim, "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 1})
            assert status == 200, done
            answered[name] = done["model"]
        status, error, _ = await post(sim, "/v1/completions", {"model": "nope", "prompt": prompt, "max_tokens": 1})
        hits = sim.runner.scheduler.stats.prefix_cache_hits
    assert answered == {"tiny-llama": "tiny-alias", "tiny-alias": "tiny-alias", "tiny-lora": "tiny-lora"}
    assert fixture_json("completion_alias.json", "bs32")["model"] == "tiny-alias"
    assert status == 404 and error == fixture_json("error_unknown_model_aliases.json", "bs32")
    assert hits == 64, "both names read one cache; the adapter's is its own"


@pytest.mark.parametrize(
    ("names", "needle"),
    [(("a", "a"), "distinct"), (("a", ""), "distinct")],
)
def test_served_names_must_be_distinct(names: tuple[str, str], needle: str) -> None:
    with pytest.raises(SimConfigError, match="--served-model-name") as exc:
        SimConfig(model=names[0], aliases=names[1:]).validate()
    assert needle in str(exc.value)


def test_an_adapter_may_not_take_a_served_name() -> None:
    with pytest.raises(SimConfigError, match="--lora-modules"):
        SimConfig(model="a", aliases=("b",), lora_modules=(LoraModule("b", "/p"),)).validate()


async def test_a_priority_is_served_as_vllm_032_serves_it_under_fcfs(sim: SimServer) -> None:
    # vLLM 0.32 dropped its "Priority scheduling is not enabled" refusal: under the default fcfs
    # policy a body's priority is accepted and has no effect.
    base = {"model": "sim-llama", "prompt": "the cache", "max_tokens": 3, "seed": 1}
    status, plain, _ = await post(sim, "/v1/completions", base)
    status_p, prioritised, _ = await post(sim, "/v1/completions", {**base, "priority": 5})
    assert (status, status_p) == (200, 200)
    assert prioritised["choices"] == plain["choices"]


async def test_an_idle_keep_alive_connection_is_closed_as_vllm_s_uvicorn_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s) between requests; the sim
    kept it for aiohttp's 75 s, so no client pool that outlived vLLM's timeout was ever caught."""
    import engine_sim.server

    monkeypatch.setattr(engine_sim.server, "KEEPALIVE_S", 0.5, raising=False)
    async with SimServer(sim_config()) as sim:
        host, port = sim.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed once idle, within the test's 5 s
        finally:
            writer.close()
