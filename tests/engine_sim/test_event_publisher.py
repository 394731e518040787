"""Golden tests: what the sim publishes (events, frames, replay) matches the real vLLM 0.32 captures.

The wire format itself is pinned in tests/protocol/test_vllm_events.py; these check that the sim's
block pool and publisher produce it.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
import pytest

from engine_sim import SimServer
from engine_sim.lora import LoraModule
from engine_sim.request import SimRequest
from engine_sim.scheduler import Scheduler
from protocol.vllm_events import REPLAY_END, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, encode_batch
from tests.engine_sim.conftest import Subscriber, connected_subscriber, decode_payload, replay, sim_config
from tests.protocol.vllm_captures import fixture_lines


def _captured_events() -> dict[str, dict[str, Any]]:
    """First captured event of each type, decoded without a schema."""
    out: dict[str, dict[str, Any]] = {}
    for rec in fixture_lines("zmq_events_decoded.jsonl"):
        for ev in rec["payload"][1]:
            out.setdefault(ev["type"], ev)
    return out


def _emitted_events() -> list[KVEvent]:
    """Events from a real scheduler run: stores, an eviction, and a reset."""
    sched = Scheduler(num_gpu_blocks=4, block_size=16, hash_seed="0")
    for i, base in enumerate((1000, 2000)):
        sched.add_request(SimRequest(f"r{i}", list(range(base, base + 48)), max_tokens=1))
        while sched.step().num_scheduled_tokens:
            pass
    sched.reset_prefix_cache()
    return sched.take_events()


def test_block_stored_matches_vllm_map_form() -> None:
    captured = _captured_events()["BlockStored"]
    ours = next(e for e in _emitted_events() if isinstance(e, BlockStored))
    decoded = decode_payload(encode_batch(1.0, [ours]))[1][0]
    assert list(decoded) == list(captured)  # same fields, same order, nothing omitted
    assert decoded["medium"] == captured["medium"] == "GPU"
    assert decoded["extra_keys"] == [None] * len(decoded["block_hashes"])
    assert (decoded["group_idx"], decoded["kv_cache_spec_kind"]) == (
        captured["group_idx"],
        captured["kv_cache_spec_kind"],
    )
    assert len(decoded["token_ids"]) == decoded["block_size"] * len(decoded["block_hashes"])


def test_block_removed_matches_vllm_map_form() -> None:
    captured = _captured_events()["BlockRemoved"]
    ours = next(e for e in _emitted_events() if isinstance(e, BlockRemoved))
    decoded = decode_payload(encode_batch(1.0, [ours]))[1][0]
    assert list(decoded) == list(captured)
    assert len(decoded["block_hashes"]) == 1  # one hash per removal, as captured


def test_all_blocks_cleared_matches_vllm_map_form() -> None:
    captured = _captured_events()["AllBlocksCleared"]
    ours = [e for e in _emitted_events() if isinstance(e, AllBlocksCleared)]
    assert len(ours) == 1
    assert decode_payload(encode_batch(1.0, ours))[1] == [captured]


def test_batch_matches_vllm_layout() -> None:
    raw = bytes.fromhex(fixture_lines("zmq_events_raw.jsonl")[0]["frames_hex"][2])
    ours = encode_batch(1795990426.28, _emitted_events()[:1])
    # fixarray(3), then a float64 timestamp: the same leading bytes as the capture.
    assert ours[:2] == raw[:2] == b"\x93\xcb"
    ts, events, rank = decode_payload(ours)
    assert isinstance(ts, float) and rank == 0 and events[0]["type"] == "BlockStored"


async def _complete(sim: SimServer, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}) as r,
    ):
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


@pytest.mark.parametrize("form", ["map", "array"])
async def test_live_frames_match_vllm_frame_layout(form: str) -> None:
    captured = fixture_lines("zmq_events_raw.jsonl")[0]["frames_hex"]
    async with SimServer(sim_config(event_form=form)) as sim:
        sub = await connected_subscriber(sim)
        try:
            await _complete(sim, list(range(500, 580)))
            (msg,) = await sub.wait_for(1)
        finally:
            sub.close()
    assert len(msg) == len(captured) == 3
    assert msg[0] == bytes.fromhex(captured[0]) == b"kv-events"
    assert msg[1] == (0).to_bytes(8, "big")  # seq starts at 0, 8-byte big-endian
    ts, events, rank = decode_payload(msg[2])
    assert rank == 0 and isinstance(ts, float)
    if form == "map":
        assert events[0]["type"] == "BlockStored" and len(events[0]["block_hashes"]) == 5
    else:
        assert events[0][0] == "BlockStored" and len(events[0][1]) == 5 and events[0][6] == "GPU"


async def test_replay_replies_match_vllm() -> None:
    captured = fixture_lines("replay_from_8_excerpt.jsonl")
    assert captured[0]["request_frames_hex"] == ["", (8).to_bytes(8, "big").hex()]
    cap_reply, cap_end = captured[1]["frames_hex"], captured[-1]["frames_hex"]
    async with SimServer(sim_config()) as sim:
        sub = await connected_subscriber(sim)
        try:
            for i in range(4):
                await _complete(sim, list(range(1000 * (i + 1), 1000 * (i + 1) + 40)))
            live = await sub.wait_for(4)
        finally:
            sub.close()
        assert sim.replay_endpoint is not None
        from_0 = await replay(sim.replay_endpoint, 0)
        from_2 = await replay(sim.replay_endpoint, 2)
        future = await replay(sim.replay_endpoint, 1_000_000)
        # vLLM reads a seq frame of any length (int.from_bytes); the sim ignored these, and its
        # client waited for the timeout.
        short = [await replay(sim.replay_endpoint, seq) for seq in (b"\x00\x00\x00\x02", b"")]
    assert short == [from_2, from_0]
    assert len(from_0[0]) == len(cap_reply) == 4
    assert from_0[0][0] == b"" and from_0[0][1] == b"kv-events"
    assert [int.from_bytes(f[2], "big") for f in from_0[:-1]] == [0, 1, 2, 3]
    assert [f[3] for f in from_0[:-1]] == [m[2] for m in live]  # replayed payloads are byte-identical
    assert [int.from_bytes(f[2], "big") for f in from_2[:-1]] == [2, 3]
    assert from_0[-1] == from_2[-1] == [bytes.fromhex(h) for h in cap_end] == REPLAY_END
    assert (
        future
        == [REPLAY_END]
        == [[bytes.fromhex(h) for h in fixture_lines("replay_from_future.jsonl")[1]["frames_hex"]]]
    )


def _opaque_hashes(batches: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Events with each block hash replaced by the order it was first seen in: engine hashes are
    opaque (seeded apart), but which blocks share one is the contract."""
    seen: dict[int, int] = {}
    return [
        [{**e, "block_hashes": [seen.setdefault(h, len(seen)) for h in e["block_hashes"]]} for e in events]
        for events in batches
    ]


async def test_lora_events_match_vllms_capture() -> None:
    """vLLM 0.32's own events for one prompt completed as adapter `tiny-lora`, the base model, the
    adapter again (a hit: nothing stored), the adapter with a cache_salt, and adapter `tiny-lora-2`
    (lora_id 3: the capture's id 2 went to a failed lookup, a placeholder takes it here)."""
    replies = fixture_lines("lora_replay_from_0.jsonl", "bs32")[1:-1]
    captured = [decode_payload(bytes.fromhex(r["frames_hex"][3])) for r in replies]
    adapters = (LoraModule("tiny-lora", "tiny-lora"), LoraModule("unused", "x"), LoraModule("tiny-lora-2", "tiny-lora"))
    cfg = sim_config(model="tiny-llama", block_size=32, max_model_len=2048, lora_modules=adapters)
    async with SimServer(cfg) as sim, aiohttp.ClientSession() as s:
        for model, salt in (("tiny-lora", None), ("tiny-llama", None), ("tiny-lora", None),
                            ("tiny-lora", "tenant-1"), ("tiny-lora-2", None)):  # fmt: skip
            body: dict[str, Any] = {"model": model, "prompt": list(range(100, 165)), "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            async with s.post(sim.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        assert sim.replay_endpoint is not None
        ours = [decode_payload(f[3]) for f in (await replay(sim.replay_endpoint, 0))[:-1]]
    assert [b[2] for b in ours] == [b[2] for b in captured]  # data_parallel_rank
    assert _opaque_hashes([b[1] for b in ours]) == _opaque_hashes([b[1] for b in captured])


async def test_pub_connects_when_endpoint_has_no_wildcard() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    sub = Subscriber(endpoint, bind=True)  # vLLM's rule: no `*` → the PUB connects, the subscriber binds
    try:
        cfg = sim_config()
        cfg = cfg.replace(kv_events=msgspec.structs.replace(cfg.kv_events, endpoint=endpoint))
        async with SimServer(cfg) as sim:
            assert sim.events_endpoint == endpoint
            # Connect is asynchronous: publish until the first batch arrives, then check the seq.
            for i in range(50):
                await _complete(sim, list(range(3000 + 100 * i, 3000 + 100 * i + 32)), 1)
                if sub.messages or await _got_one(sub):
                    break
        assert sub.messages and int.from_bytes(sub.messages[0][1], "big") >= 0
    finally:
        sub.close()


async def _got_one(sub: Subscriber) -> bool:
    try:
        await sub.wait_for(1, timeout=0.1)
        return True
    except TimeoutError:
        return False
