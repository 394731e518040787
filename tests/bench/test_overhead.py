"""`bench overhead`: a phase's figures from known per-request results, the table and the targets
over known phases, and one short run of the whole command on a real local cluster."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.cpu import CpuWindow
from bench.overhead import (
    DIRECT,
    KVSWITCH,
    OverheadSpec,
    Phase,
    added,
    client_items,
    client_phase,
    format_table,
    run_overhead,
    target_lines,
    ttft_split_lines,
)
from bench.replay import RequestResult


def _result(
    i: int, ttft: float, gaps: list[float], tokens: int, ok: bool = True, server_ms: dict[str, float] | None = None
) -> RequestResult:
    return RequestResult(
        server_ms=server_ms or {},
        ok=ok,
        ttft_s=ttft if ok else None,
        itl_s=gaps,
        e2e_s=ttft + sum(gaps),
        output_tokens=tokens,
        index=i,
        tag="t",
        url="u",
        due_s=float(i),
        sent_s=float(i),
    )


def test_client_phase_figures_from_known_results() -> None:
    results = [
        _result(0, 0.010, [0.002, 0.004], tokens=3),  # ITL (0.006) / 2 gaps = 3 ms, TTST 2 ms
        _result(1, 0.020, [0.001], tokens=3),  # two tokens in its second chunk: 1 ms / 2 = 0.5 ms
        _result(2, 0.030, [0.003, 0.003, 0.003], tokens=4),  # 3 ms
        _result(3, 0.0, [], tokens=0, ok=False),
    ]
    cpu = CpuWindow({"router": 0.03, "shim": 0.01}, wall_s=4.0)
    phase = client_phase(results, load="50/s", target=KVSWITCH, repeat=0, cpu=cpu)
    assert phase.ttft_p50 == pytest.approx(0.020)
    assert phase.ttft_p99 == pytest.approx(0.010 + 0.99 * 0.020)  # linear between order statistics
    assert phase.itl_p50 == pytest.approx(0.003)
    assert phase.ttst_p50 == pytest.approx(0.002)
    assert phase.ttst_p99 == pytest.approx(0.001 + 0.99 * 0.002)
    assert (phase.requests, phase.tokens, phase.errors) == (4, 10, 1)
    # first send at 0 s; last end at 2 + 0.030 + 0.009
    assert phase.tokens_per_s == pytest.approx(10 / 3.0)  # request 3 ended at 3 + 0 s
    assert phase.cpu_s == {"router": 0.03, "shim": 0.01} and phase.window_s == 4.0
    assert phase.server_ms == {}  # no Server-Timing header: nothing to split


def test_client_phase_splits_ttft_by_the_routers_server_timing() -> None:
    results = [
        # edge 1.3 ms: a metric the router does not send (a proxy's, say) is no part of it
        _result(0, 0.010, [], 1, server_ms={"parse": 0.5, "route": 0.2, "worker": 8.0, "proxy": 5.0}),
        _result(1, 0.012, [], 1, server_ms={"parse": 0.7, "route": 0.4, "worker": 9.0}),  # edge 1.9 ms
        _result(2, 0.020, [], 1, server_ms={"parse": 0.9, "route": 0.6, "worker": 10.0}),  # edge 8.5 ms
        _result(3, 0.001, [], 1, server_ms={"parse": 0.1}),  # a partial header: left out
    ]
    phase = client_phase(results, load="50/s", target=KVSWITCH, repeat=0, cpu=CpuWindow({}, wall_s=1.0))
    assert phase.server_ms == pytest.approx({"parse": 0.7, "route": 0.4, "worker": 9.0, "edge": 1.9})


def test_client_items_are_evenly_spaced_with_a_prompt_each() -> None:
    items = client_items(rate=200.0, seconds=0.05, isl=128, osl=16)
    assert [i.arrival_s for i in items] == pytest.approx([n * 0.005 for n in range(10)])
    assert len({i.segments for i in items}) == len(items) and all(i.input_len == 128 for i in items)


def _phase(target: str, repeat: int, ttft_p50: float, *, tool: str = "aiperf", load: str = "c=8", **kw: Any) -> Phase:
    values: dict[str, Any] = {
        "ttft_p99": ttft_p50 * 2,
        "itl_p50": 0.001,
        "itl_p99": 0.002,
        "ttst_p50": 0.001,
        "ttst_p99": 0.002,
        "tokens_per_s": 1000.0,
        **kw,
    }
    return Phase(
        tool=tool,
        load=load,
        target=target,
        repeat=repeat,
        ttft_p50=ttft_p50,
        requests=100,
        tokens=6400,
        errors=0,
        cpu_s={"router": 0.5, "shim": 0.32},
        window_s=10.0,
        **values,
    )


PHASES = [
    _phase(DIRECT, 0, 0.010),
    _phase(KVSWITCH, 0, 0.011, tokens_per_s=990.0, ttst_p50=0.0015),
    _phase("sglang_cache_aware", 0, 0.0102, tokens_per_s=1000.0),
    _phase(DIRECT, 1, 0.012),
    _phase(KVSWITCH, 1, 0.0150, tokens_per_s=950.0, ttst_p50=0.0015),
    _phase("sglang_cache_aware", 1, 0.0124),
]


def test_added_is_per_repeat_against_direct_of_the_same_repeat() -> None:
    assert added(PHASES, "aiperf", "c=8", KVSWITCH, "ttft_p50") == pytest.approx([0.001, 0.003])
    assert added(PHASES, "aiperf", "c=8", KVSWITCH, "ttst_p50") == pytest.approx([0.0005, 0.0005])
    assert added(PHASES, "client", "c=8", KVSWITCH, "ttft_p50") == []


def test_table_cells_are_medians_with_half_the_range_and_cpu_per_unit() -> None:
    table = format_table(PHASES)
    kvswitch = next(line for line in table.splitlines() if " kvswitch " in line).split()
    # TTFT p50 added: median of +1 and +3 ms, ±1; throughput: median of 0.99 and 0.95
    assert kvswitch[3] == "+2.00±1.00"
    assert kvswitch[9] == "0.970±0.020"
    # router 0.5 s over 100 requests / 6,400 tokens; shims 0.32 s
    assert kvswitch[10:14] == ["5000±0", "78±0", "3200±0", "50±0"]
    direct = next(line for line in table.splitlines() if "direct (abs)" in line).split()
    assert direct[4] == "11.00±1.00"  # the baseline's own TTFT p50, ms


def test_targets_report_each_verdict_with_its_figure() -> None:
    lines = "\n".join(target_lines(PHASES))
    assert "aiperf c=8: added TTFT p50 +2.00 ms (<= 2), p99 +4.00 ms (<= 5): met" in lines
    assert "aiperf c=8: throughput 0.970x direct (>= 0.97): met" in lines
    assert "added time to second token p50 +0.50 ms (<= 1): met (p99 +0.00 ms)" in lines
    # best peer adds +0.3 ms TTFT p50 (median of 0.2 and 0.4); ours +2.0: 1.7 ms behind
    assert "added ttft p50 +2.00 ms vs best peer sglang_cache_aware +0.30 ms (within 1 ms): MISSED" in lines


def test_the_added_ttft_splits_into_the_routers_parts_and_the_hops() -> None:
    timed = {"parse": 0.3, "route": 0.2, "worker": 12.0, "edge": 1.0}
    phases = [
        _phase(DIRECT, 0, 0.010, tool="client", load="50/s"),
        _phase(KVSWITCH, 0, 0.0135, tool="client", load="50/s", server_ms=timed),
        _phase(DIRECT, 1, 0.011, tool="client", load="50/s"),
        _phase(KVSWITCH, 1, 0.0145, tool="client", load="50/s", server_ms={**timed, "worker": 12.4}),
        *PHASES,  # aiperf rows carry no Server-Timing: no line for them
    ]
    # added +3.5 ms both times; hop = worker less direct's TTFT: 2.0 and 1.4, median 1.7
    assert ttft_split_lines(phases) == [
        "client 50/s: added TTFT p50 +3.50 ms; router parse 0.30, route 0.20, NATS + shim hop +1.70, "
        "client-router HTTP 1.00 ms"
    ]


def test_missing_values_print_as_a_dash_not_nan() -> None:
    phases = [_phase(DIRECT, 0, 0.01, ttst_p50=math.nan), _phase(KVSWITCH, 0, 0.012, ttst_p50=math.nan)]
    assert added(phases, "aiperf", "c=8", KVSWITCH, "ttst_p50") != []
    row = next(line for line in format_table(phases).splitlines() if " kvswitch " in line).split()
    assert row[7] == "-" and "nan" not in format_table(phases)


def test_one_short_run_on_a_real_cluster_measures_both_targets(tmp_path: Path) -> None:
    spec = OverheadSpec(rates=[20.0], seconds=1.0, client_osl=4, aiperf=None, out_dir=tmp_path, speedup=10.0)
    phases = run_overhead(spec)
    assert [(p.tool, p.load, p.target) for p in phases] == [("client", "20/s", DIRECT), ("client", "20/s", KVSWITCH)]
    direct, routed = phases
    assert direct.errors == routed.errors == 0
    assert direct.tokens == routed.tokens == 20 * 4
    # the router and the shims did the routed phase's work; the direct phase bypassed them
    assert routed.cpu_s["router"] > 0 and routed.cpu_s["shim"] > 0
    assert routed.cpu_s["router"] > direct.cpu_s["router"]
    # the router timed its part of every request; an engine reached directly sends no Server-Timing
    assert direct.server_ms == {} and set(routed.server_ms) == {"parse", "route", "worker", "edge"}
    assert routed.server_ms["worker"] > 0 and routed.server_ms["parse"] > 0 and routed.server_ms["route"] > 0
