"""The TTFT floor: hand-computed on small prompts, and below every TTFT a real (virtual) fleet gives."""

from __future__ import annotations

import pytest

from bench.summary import Percentiles, Slo, summarize
from bench.sweep import Fleet, SweepPoint, format_sweep, ratios
from bench.trace import TokenSynth, load_trace, shipped_trace
from bench.ttft_floor import ceiling_cached, floor_p90, ttft_floor
from bench.virtual.fleet import FleetSpec, VirtualFleet, settings_from_args
from bench.workloads import WorkItem, from_trace
from protocol.timing import TimingModel

MODEL = TimingModel.for_profile("h200:llama-3.1-8b")
ENGINE = {"budget": 8192, "block_size": 16, "max_num_seqs": 256}


def _least(new: int, cached: int) -> float:
    # one chunk (new <= 8192): alone, or its marginal beside 0 or 256 decodes
    return min(MODEL.prefill(new, cached), MODEL.marginal(new, cached, 0), MODEL.marginal(new, cached, 256))


def _item(t: float, *segments: tuple[int, int]) -> WorkItem:
    return WorkItem(arrival_s=t, segments=segments, output_len=4, tag=f"t{t:g}")


def test_the_single_cache_ceiling_counts_whole_blocks_of_earlier_prefixes() -> None:
    items = [
        _item(0, (1, 40), (2, 16)),
        _item(1, (1, 40), (3, 16)),  # 40 shared tokens: 2 whole blocks
        _item(2, (4, 48)),  # nothing shared
        _item(3, (1, 40), (2, 16)),  # all 56 shared, but the last token is computed: 3 blocks
    ]
    assert ceiling_cached(items, 16) == [0, 32, 0, 48]


def test_only_what_no_earlier_request_brought_is_computed() -> None:
    items = [
        _item(0, (1, 512), (2, 512)),
        _item(1, (1, 512), (3, 100)),  # the first segment is cached
        _item(2, (1, 512), (2, 512)),  # all of it: the last block is computed again
        _item(3, (9, 512), (2, 512)),  # segment 2 behind another prefix is different tokens
        _item(4, (1, 500)),  # a shorter segment of a known chain counts as cached (errs low)
    ]
    got = ttft_floor(items, MODEL, **ENGINE)
    assert got == [_least(1024, 0), _least(100, 512), _least(16, 1008), _least(1024, 0), _least(4, 496)]
    assert got[1] < got[0] and got[4] < got[0]


def test_a_long_prompt_is_computed_in_chunks_of_the_budget() -> None:
    got = ttft_floor([_item(0, (1, 10_000))], MODEL, **ENGINE)
    assert got == [_least(8192, 0) + _least(10_000 - 8192, 8192)]


def test_arrival_order_decides_what_is_cached() -> None:
    late_first = [_item(1, (1, 512), (2, 512)), _item(0, (1, 512))]
    got = ttft_floor(late_first, MODEL, **ENGINE)
    assert got == [_least(512, 0), _least(512, 512)]


@pytest.mark.parametrize("config", [("--routing", "kv"), ("--routing", "round_robin")])
def test_no_request_a_fleet_serves_beats_the_floor(config: tuple[str, ...]) -> None:
    items = from_trace(load_trace(shipped_trace(), start_s=960, limit=80), scale_tokens=0.25)
    spec = FleetSpec(agg=3, settings=settings_from_args([*config, "--disagg", "never"]), max_model_len=65536)
    run = VirtualFleet(spec).run(items, TokenSynth(0), rate=2.0)
    floor = ttft_floor(
        items, MODEL, budget=spec.max_num_batched_tokens, block_size=spec.block_size, max_num_seqs=spec.max_num_seqs
    )
    served = [(r.ttft_s, f) for r, f in zip(run.results(), floor, strict=True) if r.ok and r.ttft_s is not None]
    assert len(served) == len(items)
    assert all(ttft >= f for ttft, f in served)
    assert sum(ttft < 1.5 * f for ttft, f in served) > 0  # the bound is not vacuous: some requests come close


def test_the_sweep_table_gives_round_robin_over_the_floor() -> None:
    slo = Slo(2.0, 0.025)
    fleet = Fleet(1, 3)
    points = []
    for name, p90 in (("round_robin", 3.0), ("kv", 1.5), ("kv_disagg", 2.0), ("slo_aware", 1.5)):
        summary = summarize([], slo=slo, clock="virtual")
        summary.ttft_s = Percentiles(p90 / 2, p90, p90 * 2)
        points.append(SweepPoint(fleet, 1.0, name, summary))
    assert ratios(points, "slo_aware", 1.2)["1P+3D", 1.0]["rr/floor"] == pytest.approx(2.5)
    assert ratios(points, "slo_aware")["1P+3D", 1.0]["rr/floor"] is None
    table = format_sweep(points, "slo_aware", 1.2)
    assert "rr/floor p90" in table.splitlines()[0] and "2.50x" in table.splitlines()[2]
    assert "rr/floor" not in format_sweep(points, "slo_aware")
    assert floor_p90([_item(0, (1, 512))], MODEL, **ENGINE) == _least(512, 0)
