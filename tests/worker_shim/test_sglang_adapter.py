"""The SGLang adapter against payloads written from SGLang's formats (fixtures README)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest

from protocol import ConfigError, SamplingParams, block_hashes
from protocol.hashing import chain_salt
from protocol.vllm_events import decode_pub_frames
from tests.protocol.vllm_captures import frames
from worker_shim import Normaliser
from worker_shim.adapters.base import LegRequest
from worker_shim.adapters.sglang import (
    SglangAdapter,
    StreamFolder,
    generate_body,
    limits_from_server_info,
    load_from_metrics,
    openai_body,
)
from worker_shim.adapters.vllm_events import decode_payload
from worker_shim.config import ShimConfig
from worker_shim.engine_events import EngineRemoved, EngineStored
from worker_shim.kv_events_config import EngineEventsConfig, parse_kv_events_config

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"


def test_signed_page_hashes_normalise_to_the_canonical_chain() -> None:
    norm = Normaliser(4)
    states = []
    for f in frames(FIX / "zmq_events_raw.jsonl"):
        _, _, payload = decode_pub_frames(f)
        norm.apply(decode_payload(payload, "sglang"))
        states.append(norm.canonical_hashes())
    system = list(range(10, 18))
    q1 = block_hashes(system + list(range(50, 58)), 4)
    q2 = block_hashes(system + list(range(60, 64)), 4)
    assert states[1] == set(q1) | set(q2)  # both continuations hang off the shared system prompt
    assert states[2] == set(q1[:-1]) | set(q2)
    assert states[3] == set()
    assert states[4] == set(block_hashes([9, 9, 9, 9], 4))
    assert norm.stats.unknown_parent == norm.stats.malformed == 0


SALT = "tenant-a"
TOKENS = list(range(10, 18))  # two pages of 4
# SGLang's salted BlockStored (python/sglang/srt/disaggregation/kv_events.py BlockStoredWithMetadata):
# its metadata map {"cache_salt"} after the positional fields, on every page of a salted request.
SHORT = [
    ["BlockStored", [-11], None, TOKENS[:4], 4, None, "GPU", {"cache_salt": SALT}],
    ["BlockStored", [-12], -11, TOKENS[4:], 4, None, "GPU", {"cache_salt": SALT}],
]
# The longer layout an SGLang test pins (vLLM's field order up to ownership, then the map; its
# extra_keys hold the salt prefixed for another router).
LONG = [
    ["BlockStored", [-21, -22], None, TOKENS, 4, None, "GPU", None, [[f"dynamo-cache-salt:{SALT}"]]]
    + [None] * 5
    + [{"cache_salt": SALT}]
]


@pytest.mark.parametrize("events", [SHORT, LONG], ids=["after-medium", "longer-layout"])
def test_a_salted_chain_normalises_to_the_hashes_the_router_gives_that_cache_salt(events: list[object]) -> None:
    """The salt was ignored (the longer layout) or voided the whole batch (the map read as a
    lora_name): a salted request's cached prefix was never found, or credited to unsalted ones."""
    norm = Normaliser(4)
    norm.apply(decode_payload(msgspec.msgpack.encode([1.0, events, 0]), "sglang"))
    assert norm.canonical_hashes() == set(block_hashes(TOKENS, 4, salt=chain_salt(cache_salt=SALT)))
    assert norm.stats.unknown_parent == norm.stats.malformed == 0


def test_a_salted_page_leaves_its_batchs_unsalted_events_as_they_are() -> None:
    plain = ["BlockStored", [-31], None, [9, 9, 9, 9], 4, None, "GPU"]
    batch = [plain, ["BlockRemoved", [-99], "GPU"], SHORT[0]]
    stored, removed, salted = decode_payload(msgspec.msgpack.encode([1.0, batch, 0]), "sglang")
    assert isinstance(stored, EngineStored) and stored.salt == ""
    assert removed == EngineRemoved(hashes=[-99], medium="GPU")
    assert isinstance(salted, EngineStored) and salted.salt == chain_salt(cache_salt=SALT)


def test_sglangs_own_kv_events_config_with_a_snapshot_endpoint_is_taken() -> None:
    """SGLang's ZmqEventPublisherConfig takes snapshot_endpoint; its JSON was refused as unknown."""
    raw = {"publisher": "zmq", "endpoint": "tcp://*:5557", "snapshot_endpoint": "tcp://*:5600", "topic": "kv"}
    assert parse_kv_events_config("sglang", raw) == EngineEventsConfig("tcp://*:5557", None, "kv")
    with pytest.raises(ConfigError, match="snapshot_endpoint must be a str"):
        parse_kv_events_config("sglang", {**raw, "snapshot_endpoint": 5600})
    with pytest.raises(ConfigError, match=r"unknown key.*snapshot_endpoint.*vllm takes"):
        parse_kv_events_config("vllm", {"enable_kv_cache_events": True, "snapshot_endpoint": "tcp://*:5600"})


def test_the_clients_cache_salt_reaches_sglang_on_both_kinds_of_leg() -> None:
    """The request service counts a leg's prompt as salted by its body's cache_salt; the engine must
    cache it so too, or its Stored events never match what the shim expects."""
    leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(), params={"cache_salt": SALT})
    assert generate_body(leg, None)["cache_salt"] == SALT
    assert "cache_salt" not in generate_body(LegRequest("r", "m", [1, 2, 3], SamplingParams()), None)
    chat = LegRequest(
        "r", "m", [1, 2, 3], SamplingParams(), endpoint="chat", params={"messages": [], "cache_salt": SALT}
    )
    assert openai_body(chat, None)["cache_salt"] == SALT


def test_limits_and_load() -> None:
    info = json.loads((FIX / "get_server_info.json").read_text())
    lim = limits_from_server_info(info)
    assert (lim.block_size, lim.kv_total_blocks, lim.max_num_batched_tokens) == (16, 401408 // 16, 8192)
    text = (FIX / "metrics.txt").read_text()
    got = load_from_metrics(text, lim.kv_total_blocks, info["max_total_num_tokens"])
    assert (got.running, got.waiting, got.kv_usage) == (5, 3, 100913 / 401408)
    assert got.reused_tokens is None, "SGLang exports no reuse counter: the shim's credit check stays off"


def test_kv_use_is_exact_so_a_long_decode_shows_progress() -> None:
    """SGLang's token_usage gauge is rounded to 0.01 (100,913 and 100,929 used tokens both read
    0.25): read from it, a lone decode 16 tokens on looked like no progress to the stall watchdog
    for minutes, and free blocks were off by up to 0.5% of the pool."""
    info = json.loads((FIX / "get_server_info.json").read_text())
    lim, total = limits_from_server_info(info), info["max_total_num_tokens"]
    text = (FIX / "metrics.txt").read_text()
    before = load_from_metrics(text, lim.kv_total_blocks, total)
    after = load_from_metrics(text.replace("} 100913.0", "} 100929.0"), lim.kv_total_blocks, total)
    assert before.kv_usage is not None and after.kv_usage is not None
    assert after.kv_usage - before.kv_usage == pytest.approx(16 / total)
    # Without the server's capacity, or with one sample per DP rank, SGLang's own rounded ratio.
    assert load_from_metrics(text, lim.kv_total_blocks).kv_usage == 0.25
    used = next(line for line in text.splitlines() if line.startswith("sglang:num_used_tokens"))
    ranks = text + used.replace('tp_rank="0"', 'tp_rank="1"') + "\n"
    assert load_from_metrics(ranks, lim.kv_total_blocks, total).kv_usage == 0.25


def test_stream_folding_is_right_for_cumulative_and_incremental_output() -> None:
    for name in ("generate_stream_cumulative.sse", "generate_stream_incremental.sse"):
        folder = StreamFolder()
        pieces = []
        for line in (FIX / name).read_text().splitlines():
            if line.startswith("data: {"):
                pieces.append(folder.fold(msgspec.json.decode(line[6:])))
        assert pieces == [[11], [12], [13, 14]], name
        assert folder.finish_reason == "length" and folder.usage.completion_tokens == 4
        assert folder.usage.cached_tokens == 8


def test_bootstrap_triple_rides_on_both_legs() -> None:
    triple = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
    leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=9), prefill_only=True)
    pre = generate_body(leg, triple)
    assert pre["sampling_params"]["max_new_tokens"] == 1 and pre["stream"] is False
    dec = generate_body(LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=9), transfer=triple), triple)
    assert {k: dec[k] for k in triple} == triple and dec["stream"] is True and dec["rid"] == "r"


async def test_a_prefill_worker_tells_decode_engines_the_bootstrap_host_it_was_given(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The shim reaches its engine at 127.0.0.1; a decode engine on another host told that address
    # reached its own host instead (every remote prefill failed, with no word from the shim).
    leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=9), prefill_only=True)
    for config, host, warned in (
        (_sglang(role="prefill", bootstrap_host="10.0.0.7"), "10.0.0.7", False),
        (_sglang(role="prefill"), "127.0.0.1", True),
    ):
        adapter = SglangAdapter(config.validate())
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            adapter._say_loopback()
            outcome = await adapter.generate(leg, _ignore)
        await adapter.close()
        assert outcome.transfer_params is not None and outcome.transfer_params["bootstrap_host"] == host
        assert any("give --bootstrap-host" in r.getMessage() for r in caplog.records) is warned


def _sglang(**settings: Any) -> ShimConfig:
    return ShimConfig(
        engine="sglang", model="m", engine_url="http://127.0.0.1:9", kv_events="tcp://127.0.0.1:9", **settings
    )


async def _ignore(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
    return None


def test_a_bootstrap_host_is_refused_for_engines_that_take_none() -> None:
    with pytest.raises(ConfigError, match=r"bootstrap_host.*only SGLang"):
        ShimConfig(engine="vllm", model="m", bootstrap_host="10.0.0.7").validate()
    with pytest.raises(ConfigError, match=r"bootstrap_host.*no port"):
        _sglang(bootstrap_host="10.0.0.7:8998").validate()
