"""Counts read from an engine's metrics: whole numbers or the engine's protocol error naming the series."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol import vllm_metrics as vm
from worker_shim.adapters import sglang as sglang_adapter
from worker_shim.adapters import trtllm as trtllm_adapter
from worker_shim.adapters import vllm as vllm_adapter
from worker_shim.adapters.base import EngineError, EngineLoad
from worker_shim.load_reporter import _unusable
from worker_shim.prom_text import as_count

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# Until 2026-12-07 the adapters called int() on these before the reading's check: NaN raised
# ValueError (an ERROR with a traceback, /health naming no series), +Inf OverflowError, 2.7 read as 2.
BAD = [("nan", "NaN"), ("inf", "+Inf"), ("2.7", "2.7")]


@pytest.mark.parametrize(("value", "count"), [(None, None), (0, 0), (3, 3), (3.0, 3), (-2.0, -2), (2.0**70, 2**70)])
def test_a_whole_number_is_its_count(value: float | None, count: int | None) -> None:
    """A whole float is fine (vLLM prints its counters as 3.0); the range is the reading's check."""
    assert as_count(value, "s") == count


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 2.7, True, "3", [3]])
def test_anything_else_is_the_engines_protocol_error_naming_the_series(value: object) -> None:
    with pytest.raises(EngineError) as err:
        as_count(value, "vllm:num_requests_running")
    assert (err.value.code, err.value.kind) == (502, "engine_protocol")
    assert f"vllm:num_requests_running is {value!r}, not a count" in err.value.message


_RUNNING = 'vllm:num_requests_running{engine="0"} 3\n'
_P2P = f'{vm.total(vm.PROMPT_TOKENS_CACHED_BY_SOURCE)}{{{vm.LABEL_SOURCE}="{vm.SOURCE_P2P}"}}'


@pytest.mark.parametrize(
    "series",
    [
        vm.NUM_REQUESTS_RUNNING,
        vm.NUM_REQUESTS_WAITING,
        vm.total(vm.NUM_PREEMPTIONS),
        vm.total(vm.NIXL_NUM_FAILED_TRANSFERS),
        vm.count(vm.ITERATION_TOKENS),
        vm.histogram_sum(vm.ITERATION_TOKENS),
        vm.histogram_sum(vm.PREFILL_KV_COMPUTED_TOKENS),
        vm.count(vm.PREFILL_TIME),
        vm.count(vm.INTER_TOKEN_LATENCY),
        vm.total(vm.PREFIX_CACHE_HITS),
        vm.total(vm.EXTERNAL_PREFIX_CACHE_HITS),
        vm.total(vm.GENERATION_TOKENS),
        _P2P,
    ],
)
@pytest.mark.parametrize(("said", "value"), BAD, ids=[b[0] for b in BAD])
def test_a_vllm_count_that_is_no_whole_number_names_its_series(series: str, said: str, value: str) -> None:
    labels = '{engine="0"}' if "{" not in series else ""
    running = "" if series == vm.NUM_REQUESTS_RUNNING else _RUNNING
    hits = "" if series != _P2P else f'{vm.total(vm.PREFIX_CACHE_HITS)}{{engine="0"}} 9\n'
    with pytest.raises(EngineError) as err:
        vllm_adapter.load_from_metrics(f"{running}{hits}{series}{labels} {value}\n")
    assert (err.value.code, err.value.kind) == (502, "engine_protocol")
    assert f"{series} is {said}, not a count" in err.value.message


@pytest.mark.parametrize("series", ["sglang:num_running_reqs", "sglang:num_queue_reqs"])
@pytest.mark.parametrize(("said", "value"), BAD, ids=[b[0] for b in BAD])
def test_an_sglang_count_that_is_no_whole_number_names_its_series(series: str, said: str, value: str) -> None:
    text = 'sglang:num_running_reqs{tp_rank="0"} 1\nsglang:num_queue_reqs{tp_rank="0"} 1\n'
    text = text.replace(f'{series}{{tp_rank="0"}} 1', f'{series}{{tp_rank="0"}} {value}')
    with pytest.raises(EngineError) as err:
        sglang_adapter.load_from_metrics(text, 100)
    assert (err.value.code, err.value.kind) == (502, "engine_protocol")
    assert f"{series} is {said}, not a count" in err.value.message


@pytest.mark.parametrize("field", ["numActiveRequests", "numQueuedRequests"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 2.7])
def test_a_trtllm_count_that_is_no_whole_number_names_its_field(field: str, value: float) -> None:
    """Its stats are JSON, whose decoder refuses NaN and infinities: 2.7 is what reaches the reading."""
    stats = [{"numActiveRequests": 1, "numQueuedRequests": 1, "kvCacheStats": {}, field: value}]
    with pytest.raises(EngineError) as err:
        trtllm_adapter.load_from_stats(stats, EngineLoad())
    assert (err.value.code, err.value.kind) == (502, "engine_protocol")
    assert f"{field} is {value!r}, not a count" in err.value.message


@pytest.mark.parametrize(
    "name", sorted(str(p.relative_to(FIXTURES)) for p in (FIXTURES / "vllm-0.32").glob("*/metrics_*.txt"))
)
def test_every_captured_vllm_metrics_reads_as_usable(name: str) -> None:
    """vLLM 0.32 prints every counter as a float (0.0): whole, so each reads as its integer."""
    text = (FIXTURES / name).read_text()
    ranks = [None, 0, 1] if "dp2" in name else [None]
    for rank in ranks:
        assert _unusable(vllm_adapter.load_from_metrics(text, rank)) is None, (name, rank)


def test_the_captured_sglang_and_trtllm_readings_are_usable() -> None:
    load = sglang_adapter.load_from_metrics((FIXTURES / "sglang/metrics.txt").read_text(), 100)
    assert _unusable(load) is None and (load.running, load.waiting) == (5, 3)
    stats = json.loads((FIXTURES / "trtllm/metrics.json").read_text())
    load = trtllm_adapter.load_from_stats(stats, EngineLoad())
    assert _unusable(load) is None and load.kv_total_blocks == stats[-1]["kvCacheStats"]["maxNumBlocks"]
