"""The TensorRT-LLM adapter against payloads written from trtllm-serve's formats (fixtures README)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protocol import SamplingParams, block_hashes
from worker_shim import EngineLoad, Normaliser
from worker_shim.adapters.base import LegRequest
from worker_shim.adapters.trtllm import disagg_body, limits_from_stats, load_from_stats
from worker_shim.adapters.trtllm_events import TrtllmEventTracker

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "trtllm"


def load(name: str) -> Any:
    return json.loads((FIX / name).read_text())


def test_events_normalise_through_the_parent_chain() -> None:
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    batch = tracker.fold(load("kv_cache_events_poll1.json"))
    assert batch.reset and batch.complete  # `created` at event 0: a fresh engine, nothing missed
    norm.reset(exact=batch.complete)
    norm.apply(batch.events)
    chain = block_hashes(list(range(1, 13)), 4)
    assert norm.canonical_hashes() == {chain[0], chain[1], *block_hashes(list(range(100, 104)), 4)}
    assert tracker.kv_total_blocks == 512 and tracker.ignored == 1  # the `updated` event


def test_an_event_id_gap_resets_as_incomplete() -> None:
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    norm.apply(tracker.fold(load("kv_cache_events_poll1.json")).events)
    batch = tracker.fold(load("kv_cache_events_poll2_gap.json"))
    assert batch.reset and not batch.complete and tracker.gaps == 1
    norm.reset(exact=batch.complete)
    norm.apply(batch.events)
    assert norm.canonical_hashes() == set(block_hashes([7, 7, 7, 7], 4))


def test_event_ids_going_back_mean_a_restart() -> None:
    tracker = TrtllmEventTracker()
    tracker.fold(load("kv_cache_events_poll1.json"))
    again = tracker.fold([e for e in load("kv_cache_events_poll1.json") if e["data"]["type"] != "created"])
    assert again.reset and tracker.restarts == 1


def test_limits_and_load_from_iteration_stats() -> None:
    stats = load("metrics.json")
    lim = limits_from_stats(stats)
    assert (lim.block_size, lim.kv_total_blocks) == (32, 512)
    got = load_from_stats(stats, EngineLoad())
    assert (got.running, got.waiting, got.kv_total_blocks) == (4, 2, 512) and got.kv_usage == 112 / 512
    previous = EngineLoad(running=9)
    assert load_from_stats([], previous) is previous  # no iteration since the last read


def test_disaggregated_params_per_leg() -> None:
    s = SamplingParams(max_tokens=20)
    ctx = disagg_body(LegRequest("r", "m", [1, 2], s, prefill_only=True))
    assert ctx["disaggregated_params"] == {"request_type": "context_only"} and ctx["max_tokens"] == 1
    handle = load("completion_context_only.json")["choices"][0]["disaggregated_params"]
    gen = disagg_body(LegRequest("r", "m", [1, 2], s, transfer=handle))
    assert gen["disaggregated_params"]["request_type"] == "generation_only"
    assert gen["disaggregated_params"]["ctx_request_id"] == 77 and gen["stream"] is True
    assert disagg_body(LegRequest("r", "m", [1], s))["disaggregated_params"] == {
        "request_type": "context_and_generation"
    }
