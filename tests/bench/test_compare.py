"""`bench compare`: the table and headline ratios over known summaries, the figure, and a smoke run
of the whole comparison (real local cluster: nats, etcd, sims, shims, router) on a tiny slice."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec
import pytest

from bench import compare
from bench.compare import CONFIGURATIONS, CompareSpec, Measurement, format_table, headline_ratios, run_compare
from bench.plot import plot_compare, ttft_cdf
from bench.summary import Percentiles, Slo, Summary
from bench.trace import load_trace, shipped_trace
from bench.virtual.fleet import FleetSpec, VirtualFleet, settings_from_args
from bench.workloads import from_trace
from kvswitch.cluster import ClusterSpec
from protocol.config import RouterSettings


def _summary(ttft_p90: float, goodput: float) -> Summary:
    return Summary(
        requests=10,
        ok=10,
        errors=0,
        duration_s=10.0,
        ttft_s=Percentiles(ttft_p90 / 2, ttft_p90, ttft_p90 * 2),
        itl_s=Percentiles(0.01, 0.02, 0.03),
        tpot_s=Percentiles(0.01, 0.02, 0.03),
        e2e_s=Percentiles(1.0, 2.0, 3.0),
        output_tokens_per_s=100.0,
        requests_per_s=1.0,
        goodput_rps=goodput,
        goodput_fraction=goodput,
        send_lag_p99_s=0.0,
        prefill_mix={"bypass": 0.25, "remote": 0.75},
        prefix_hit_rate=0.5,
        latency_scale=10.0,
        slo=Slo(),
    )


def _m(config: str, run: int, ttft_p90: float, goodput: float, rate: float = 1.0) -> Measurement:
    return Measurement(
        configuration=config,
        rate=rate,
        run=run,
        summary=_summary(ttft_p90, goodput),
        ttft_s=[ttft_p90 / 4, ttft_p90 / 2, ttft_p90],
        setup_s=1.0,
    )


MEASUREMENTS = [
    _m("round_robin", 0, 6.0, 0.2),
    _m("round_robin", 1, 8.0, 0.2),
    _m("round_robin", 2, 7.0, 0.2),
    _m("kv", 0, 2.0, 0.5),
    _m("kv", 1, 2.0, 0.6),
    _m("kv", 2, 2.0, 0.4),
    _m("kv_disagg", 0, 3.0, 0.4),
    _m("ttft_model", 0, 1.0, 0.6),
    _m("ttft_model", 1, 1.0, 0.7),
    _m("ttft_model", 2, 1.0, 0.8),
]


def test_table_reports_median_and_half_range_of_runs() -> None:
    table = format_table(MEASUREMENTS)
    rows = {line.split()[1]: line for line in table.splitlines()[2:]}
    assert set(rows) == {"round_robin", "kv", "kv_disagg", "ttft_model"}
    assert "7±1" in rows["round_robin"]  # TTFT p90 runs 6, 7, 8
    assert "0.5±0.1" in rows["kv"]  # goodput runs 0.4, 0.5, 0.6
    assert " 3 " in rows["kv_disagg"] + " "  # one run: no spread shown


def test_headline_ratios_use_medians() -> None:
    lines = headline_ratios(MEASUREMENTS)
    assert "round_robin / kv TTFT p90 = 3.50x" in lines[0]
    assert "ttft_model goodput / best fixed mode = 1.40x" in lines[1]  # 0.7 / max(0.5, 0.4)


def test_the_ttft_ratio_says_when_failed_requests_are_left_out_of_it() -> None:
    # a configuration that answers its slowest requests with fast errors reads faster: 6.00x, no word
    failing = msgspec.structs.replace(
        _m("kv", 0, 1.0, 0.5), summary=msgspec.structs.replace(_summary(1.0, 0.5), errors=20)
    )
    (line, *_) = headline_ratios([_m("round_robin", 0, 6.0, 0.2), failing])
    assert (
        line
        == "x1: round_robin / kv TTFT p90 = 6.00x (target >= 3x) (0 and 20 requests failed: TTFT over those served)"
    )
    assert headline_ratios(MEASUREMENTS)[0] == "x1: round_robin / kv TTFT p90 = 3.50x (target >= 3x)"


def test_figure_is_a_png(tmp_path: Path) -> None:
    out = plot_compare([*MEASUREMENTS, _m("kv", 0, 3.0, 0.3, rate=2.0)], tmp_path / "sub" / "c.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_configuration_names_its_fleet_and_routing() -> None:
    assert list(CONFIGURATIONS) == [
        "round_robin", "kv", "kv_disagg", "isl_bounding", "prefill_load", "isl_or_load", "ttft_model", "slo_aware",
        "slo_spill",
    ]  # fmt: skip
    for name, config in CONFIGURATIONS.items():
        assert config.fleet == ("agg" if name in ("round_robin", "kv") else "pd")
        assert "--routing" in config.router_args


_MISSING = [m for m in ("router.cli", "worker_shim.cli", "engine_sim.cli") if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(bool(_MISSING), reason=f"compare needs {', '.join(_MISSING)} (not landed yet)")
@pytest.mark.timeout(180)
def test_compare_smoke_on_a_tiny_slice(tmp_path: Path) -> None:
    items = from_trace(load_trace(shipped_trace(), limit=6), scale_tokens=1 / 32)
    spec = CompareSpec(
        items=items,
        configurations=[CONFIGURATIONS["kv"], CONFIGURATIONS["isl_bounding"]],
        prefill=1,
        decode=1,
        speedup=50.0,
        runs=1,
        progress=False,
        log_dir=tmp_path / "logs",
    )
    ms = run_compare(spec)
    assert [m.configuration for m in ms] == ["kv", "isl_bounding"]
    for m in ms:
        assert m.summary.errors == 0 and m.summary.ok == len(items)
        assert len(m.ttft_s) == len(items)
        assert m.summary.prefix_hit_rate is not None  # the sims' counters were scraped
    assert set(ms[0].summary.prefill_mix) == {"agg"}
    assert set(ms[1].summary.prefill_mix) <= {"bypass", "remote"}
    assert "isl_bounding" in format_table(ms)


SLO = Slo(ttft_s=1.0, itl_s=0.05)


def test_a_virtual_compare_runs_its_routers_at_the_slo_goodput_is_judged_at(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RouterSettings] = []

    class Recording(VirtualFleet):
        def __init__(self, spec: FleetSpec) -> None:
            seen.append(spec.settings)
            super().__init__(spec)

    monkeypatch.setattr(compare, "VirtualFleet", Recording)
    items = from_trace(load_trace(shipped_trace(), start_s=990, limit=4), scale_tokens=0.125)
    spec = CompareSpec(items, [CONFIGURATIONS["kv"], CONFIGURATIONS["slo_aware"]], runs=1, slo=SLO, clock="virtual")
    ms = run_compare(spec)
    assert [m.summary.slo for m in ms] == [SLO, SLO]
    assert [(s.slo_ttft_s, s.slo_itl_s) for s in seen] == [(1.0, 0.05), (1.0, 0.05)]


def test_a_live_compare_starts_its_routers_with_the_slo(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[ClusterSpec] = []

    class NoCluster:
        def __init__(self, spec: ClusterSpec) -> None:
            started.append(spec)

        def start(self) -> None:
            raise RuntimeError("not started: the spec is what is checked")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(compare, "LocalCluster", NoCluster)
    spec = CompareSpec([], [CONFIGURATIONS["slo_aware"]], runs=1, slo=SLO, progress=False)
    with pytest.raises(RuntimeError, match="not started"):
        run_compare(spec)
    settings = settings_from_args(started[0].router_args)  # the flags `kvswitch router` is given
    # the engines run spec.speedup (10) times the profile's speed, and the routers predict in real
    # seconds (the shims register the profile at that speed): the SLO in real seconds
    assert spec.speedup == 10.0 and started[0].speedup == 10.0
    assert (settings.slo_ttft_s, settings.slo_itl_s) == pytest.approx((0.1, 0.005))
    assert started[0].router_args[:-4] == list(CONFIGURATIONS["slo_aware"].router_args)


def test_the_ttft_cdf_is_over_every_request_sent() -> None:
    # 3 of 4 served: the curve tops out at 0.75, not 1.0 as if the refused one were served
    x, y = ttft_cdf([0.3, 0.1, 0.2], sent=4)
    assert list(x) == [0.1, 0.2, 0.3]
    assert list(y) == [0.25, 0.5, 0.75]
