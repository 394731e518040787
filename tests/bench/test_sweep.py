"""`bench sweep`: fleets parse, the ratios are the targets' (checked on known summaries), and a tiny
sweep produces its table and heat maps."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.compare import CONFIGURATIONS
from bench.plot import plot_sweep
from bench.replay import RequestResult
from bench.summary import Percentiles, Slo, Summary, summarize
from bench.sweep import Fleet, SweepPoint, format_sweep, parse_fleets, ratios, read_points, run_sweep, write_points
from bench.trace import load_trace, shipped_trace
from bench.workloads import from_trace


def test_fleets_parse_and_bad_ones_are_named() -> None:
    assert parse_fleets("1P+3D, 4P+12D") == [Fleet(1, 3), Fleet(4, 12)]
    with pytest.raises(ValueError, match="'2P2D' is not PP"):
        parse_fleets("2P2D")
    with pytest.raises(ValueError, match="D >= 1"):
        parse_fleets("2P+0D")


def test_a_fleet_without_a_prefill_engine_parses_for_aggregated_configurations() -> None:
    """0P+1D is one aggregated engine; the sweep refuses it for disaggregated configurations
    (tests/bench/test_cli.py)."""
    assert parse_fleets("0P+1D") == [Fleet(0, 1)]


def _s(goodput: float, p90: float, ok: int = 8, errors: int = 0) -> Summary:
    """A one-second run: `ok + errors` requests sent, `ok` answered, `goodput` of them in SLO."""
    return Summary(
        requests=ok + errors, ok=ok, errors=errors, duration_s=1.0, ttft_s=Percentiles(p90, p90, p90), itl_s=None,
        tpot_s=None, e2e_s=None, output_tokens_per_s=1.0, requests_per_s=float(ok), goodput_rps=goodput,
        goodput_fraction=goodput / (ok + errors), send_lag_p99_s=None, prefill_mix={}, prefix_hit_rate=None,
        latency_scale=1.0, slo=Slo(), window_s=1.0,
    )  # fmt: skip


def test_ratios_are_the_targets() -> None:
    f = Fleet(1, 3)
    points = [
        SweepPoint(f, 1.0, "round_robin", _s(1.0, 6.0)),
        SweepPoint(f, 1.0, "kv", _s(4.0, 1.5, ok=6, errors=2)),
        SweepPoint(f, 1.0, "kv_disagg", _s(2.0, 3.0)),
        SweepPoint(f, 1.0, "slo_aware", _s(5.0, 1.0)),
    ]
    cell = ratios(points, "slo_aware")["1P+3D", 1.0]
    # ceiling: the better fixed mode (kv) was sent 8 r/s (2 of them refused), 4 of them in SLO
    assert cell == {"kv/rr": 4.0, "rr/floor": None, "policy/best": 1.25, "diverge": 0.5, "ceiling": 2.0}
    table = format_sweep(points, "slo_aware")
    assert "4.00x" in table and "1.25x" in table and "0.50" in table and "2.00x" in table
    assert table.splitlines()[0].split()[-1] == "ceiling/best"


def _result(i: int, *, ok: bool, in_slo: bool) -> RequestResult:
    """Request `i`, sent at i/10 s: answered in 0.11 s (TTFT 0.1 s, or 5 s when out of SLO), or
    refused (429) at once."""
    return RequestResult(
        ok=ok, status=200 if ok else 429, output_tokens=2 if ok else 0, ttft_s=(0.1 if in_slo else 5.0) if ok else None,
        itl_s=[0.01] if ok else [], e2e_s=0.11 if ok else 0.001, index=i, tag="t", url="u", due_s=i / 10, sent_s=i / 10,
    )  # fmt: skip


def test_the_ceiling_counts_the_requests_the_best_mode_refused() -> None:
    # 1,000 requests over 100 s; kv answers 900 (100 refused), 800 within the SLOs: goodput 8 r/s.
    # A policy serving all 1,000 within them reaches 10 r/s, 1.25x: the ceiling, not 900/800.
    def run(answered: int, in_slo: int) -> Summary:
        return summarize([_result(i, ok=i < answered, in_slo=i < in_slo) for i in range(1000)], clock="virtual")

    f = Fleet(2, 2)
    kv, perfect = run(900, 800), run(1000, 1000)
    points = [SweepPoint(f, 1.0, "kv", kv), SweepPoint(f, 1.0, "kv_disagg", run(900, 700))]
    points.append(SweepPoint(f, 1.0, "slo_spill", perfect))
    cell = ratios(points, "slo_spill")["2P+2D", 1.0]
    assert cell["ceiling"] == pytest.approx(1000 / kv.window_s / kv.goodput_rps)
    assert cell["ceiling"] == pytest.approx(1.25)
    assert cell["policy/best"] == pytest.approx(
        1.25
    )  # the same arrivals: its run ending 0.1 s later counts for nothing


def test_a_tiny_sweep_writes_its_table_and_heat_maps(tmp_path: Path) -> None:
    items = from_trace(load_trace(shipped_trace(), start_s=990, limit=12), scale_tokens=0.125)
    configs = [CONFIGURATIONS[n] for n in ("round_robin", "kv", "kv_disagg", "slo_aware")]
    points = run_sweep(items, [Fleet(1, 1)], [1.0, 2.0], configs, slo=Slo(), jobs=1)
    assert len(points) == 8 and all(p.summary.ok == len(items) for p in points)
    write_points(tmp_path / "s.json", points)
    assert read_points(tmp_path / "s.json") == points
    png = plot_sweep(points, "slo_aware", tmp_path / "s.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
