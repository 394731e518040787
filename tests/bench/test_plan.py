"""`kvswitch plan`: the candidates it tries, the ranking, and the winner's exact settings."""

from __future__ import annotations

import pytest

from bench.compare import CONFIGURATIONS
from bench.plan import Candidate, Result, candidates, rank, settings_text
from bench.summary import Percentiles, Slo, Summary
from bench.virtual.fleet import settings_from_args
from kvswitch.cli import main


def test_agg_configurations_run_once_and_disaggregated_ones_on_every_split() -> None:
    got = candidates(4, [CONFIGURATIONS["kv"], CONFIGURATIONS["slo_aware"]], [1, 2, 3])
    assert got == [
        Candidate("kv", 0, 0, 4),
        Candidate("slo_aware", 1, 3, 0),
        Candidate("slo_aware", 2, 2, 0),
        Candidate("slo_aware", 3, 1, 0),
    ]
    assert [c.fleet for c in got] == ["4 agg", "1P+3D", "2P+2D", "3P+1D"]


def _summary(goodput: float, p90: float) -> Summary:
    return Summary(
        requests=1, ok=1, errors=0, duration_s=1.0, ttft_s=Percentiles(p90 / 2, p90, p90), itl_s=None, tpot_s=None,
        e2e_s=None, output_tokens_per_s=1.0, requests_per_s=1.0, goodput_rps=goodput, goodput_fraction=1.0,
        send_lag_p99_s=None, prefill_mix={}, prefix_hit_rate=None, latency_scale=1.0, slo=Slo(),
    )  # fmt: skip


def test_rank_by_goodput_then_ttft_p90() -> None:
    a, b, c = Candidate("kv", 0, 0, 2), Candidate("kv_disagg", 1, 1, 0), Candidate("slo_aware", 1, 1, 0)
    ranked = rank([Result(a, _summary(3.0, 1.0)), Result(b, _summary(4.0, 2.0)), Result(c, _summary(4.0, 1.5))])
    assert [r.candidate for r in ranked] == [c, b, a]


def test_the_winners_settings_are_the_routers_own_flags() -> None:
    text = settings_text(Candidate("slo_aware", 2, 6, 0), "h200:llama-3.1-8b", Slo(3.0, 0.05))
    flags = "--routing kv --disagg conditional --conditional-disagg --conditional-disagg-policy slo_aware"
    assert f"kvswitch up --prefill 2 --decode 6 --profile h200:llama-3.1-8b {flags}" in text
    assert "--slo-ttft-s 3 --slo-itl-s 0.05" in text
    assert "KVSWITCH_CONDITIONAL_DISAGG=true" in text and "KVSWITCH_CONDITIONAL_DISAGG_POLICY=slo_aware" in text
    assert "KVSWITCH_SLO_TTFT_S=3.0" in text and "x2" in text and "x6" in text
    # the flags printed are valid router settings, naming the SLOs the plan ranked with
    line = next(ln for ln in text.splitlines() if "router flags" in ln)
    settings = settings_from_args(line.split("...", 1)[1].split())
    assert settings.conditional.conditional_disagg_policy == "slo_aware" and settings.slo_ttft_s == 3.0


def test_a_small_plan_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--gpus", "2", "--start", "980", "--limit", "20", "--scale-tokens", "0.125", "--jobs", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 agg" in out and "1P+1D" in out and "winner:" in out
    assert out.count("slo_aware") >= 1 and out.count("kv_disagg") >= 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpus", "4", "--policies", "kv,nope"], "unknown nope"),
        (["--gpus", "4", "--splits", "0,4"], "prefill counts must be in 1..3"),
    ],
)
def test_bad_arguments_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err
