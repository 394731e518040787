"""The summary math on a fixed five-request JSONL, against values computed by hand:

ok TTFTs sorted [0.2, 0.5, 1.0, 3.0] -> p50 0.75, p90 1.0 + 0.7*2.0 = 2.4, p99 1.0 + 0.97*2.0 = 2.94;
pooled gaps [0.01, 0.01, 0.02, 0.02, 0.03, 0.04] -> p50 0.02, p90 0.035, p99 0.0395;
per-request mean gaps (TPOT) [0.02, 0.03, 0.01] (#3 has one token) -> p50 0.02, p90 0.028, p99 0.0298;
duration: first sent 0.0 to last end 2.0 + 3.01 = 5.01 s; 10 output tokens from 4 ok requests;
SLO (2 s, 25 ms): #0 (TPOT 0.02) and #3 (one token, TTFT 0.2) meet it, #1 (TPOT 0.03), #2 (TTFT 3)
and the error do not -> goodput 2 / 5.01, fraction 2/5; send lags [0, 0, 0.1, 0, 0] -> p99 0.096.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay import RequestResult, read_results, write_results
from bench.summary import PrefixCounters, Slo, format_summary, summarize

DATA = Path(__file__).with_name("data") / "small_results.jsonl"


@pytest.fixture
def results() -> list[RequestResult]:
    return read_results(DATA)


def test_percentiles_interpolate_between_order_statistics(results: list[RequestResult]) -> None:
    s = summarize(results)
    assert s.ttft_s is not None and s.itl_s is not None and s.e2e_s is not None
    assert (s.ttft_s.p50, s.ttft_s.p90, s.ttft_s.p99) == pytest.approx((0.75, 2.4, 2.94))
    assert (s.itl_s.p50, s.itl_s.p90, s.itl_s.p99) == pytest.approx((0.02, 0.035, 0.0395))
    assert s.tpot_s is not None
    assert (s.tpot_s.p50, s.tpot_s.p90, s.tpot_s.p99) == pytest.approx((0.02, 0.028, 0.0298))
    assert s.e2e_s.p50 == pytest.approx((0.56 + 1.06) / 2)


def test_counts_throughput_and_goodput(results: list[RequestResult]) -> None:
    s = summarize(results, slo=Slo(ttft_s=2.0, itl_s=0.025))
    assert (s.requests, s.ok, s.errors) == (5, 4, 1)
    assert s.duration_s == pytest.approx(5.01)
    assert s.output_tokens_per_s == pytest.approx(10 / 5.01)
    assert s.requests_per_s == pytest.approx(4 / 5.01)
    assert s.window_s == pytest.approx(5.0)  # due at 0 to 4 s: four gaps, and one more for the fifth
    assert s.goodput_rps == pytest.approx(2 / 5.0)
    assert s.goodput_fraction == pytest.approx(0.4)
    assert s.send_lag_p99_s == pytest.approx(0.096)
    assert s.prefill_mix == {"bypass": 0.5, "remote": 0.5}


def test_goodput_is_per_second_of_the_arrivals_so_a_late_miss_stretches_nothing() -> None:
    """At one offered load two configurations compare as their counts within the SLOs: per second
    of each run's own duration, one request that missed them and ended late read the configuration
    with more requests within them as the worse."""

    def run(last_e2e_s: float, good: int) -> list[RequestResult]:
        return [
            RequestResult(
                ok=True,
                status=200,
                output_tokens=1,
                ttft_s=0.1 if i < good else 3.0,
                e2e_s=last_e2e_s if i == 9 else 0.1,
                index=i,
                tag="t",
                url="u",
                due_s=float(i),
                sent_s=float(i),
            )
            for i in range(10)
        ]

    slo = Slo(ttft_s=2.0, itl_s=0.025)
    more, fewer = summarize(run(60.0, 8), slo=slo), summarize(run(0.1, 7), slo=slo)
    assert more.duration_s > 6 * fewer.duration_s
    assert (more.window_s, fewer.window_s) == pytest.approx((10.0, 10.0))
    assert more.goodput_rps / fewer.goodput_rps == pytest.approx(8 / 7)
    assert summarize(run(0.1, 10), slo=slo).goodput_rps == pytest.approx(1.0)  # the offered rate, all within


def test_a_burst_has_no_rate_and_its_goodput_is_per_second_of_the_run() -> None:
    # 99 requests due at once and one a millisecond later, each 10 s long: the arrival window
    # (0.001 s) read 100,000 r/s
    results = [
        RequestResult(
            ok=True,
            status=200,
            output_tokens=1,
            ttft_s=0.1,
            e2e_s=10.0,
            index=i,
            tag="t",
            url="u",
            due_s=0.001 if i == 99 else 0.0,
            sent_s=0.0,
        )
        for i in range(100)
    ]
    s = summarize(results, slo=Slo(ttft_s=2.0, itl_s=0.025))
    assert s.window_s == pytest.approx(s.duration_s) and s.goodput_rps == pytest.approx(100 / 10.0, rel=1e-3)


def test_tpot_counts_tokens_not_chunks() -> None:
    # 9 tokens in 4 chunks (1, 2, 3, 3) spanning 0.08 s after the first: 0.01 s per token, where the
    # mean chunk gap would read 0.0267 s and fail a 25 ms SLO
    r = RequestResult(
        ok=True, status=200, output_tokens=9, ttft_s=0.1, itl_s=[0.02, 0.03, 0.03], e2e_s=0.18,
        index=0, tag="t", url="u", due_s=0.0, sent_s=0.0,
    )  # fmt: skip
    s = summarize([r], slo=Slo(ttft_s=2.0, itl_s=0.025))
    assert s.tpot_s is not None and s.tpot_s.p50 == pytest.approx(0.01)
    assert s.goodput_fraction == 1.0


def test_a_looser_slo_admits_more(results: list[RequestResult]) -> None:
    assert summarize(results, slo=Slo(ttft_s=5.0, itl_s=0.05)).goodput_fraction == pytest.approx(0.8)


def test_latency_scale_reports_simulated_time(results: list[RequestResult]) -> None:
    s = summarize(results, latency_scale=10.0)
    assert s.ttft_s is not None and s.ttft_s.p50 == pytest.approx(7.5)
    assert s.duration_s == pytest.approx(50.1)
    assert s.output_tokens_per_s == pytest.approx(10 / 50.1)
    # Scaled TTFTs 5, 10, 30, 2: only the one-token request (TTFT exactly 2 s) is within the SLO.
    assert s.goodput_fraction == pytest.approx(0.2)
    assert s.send_lag_p99_s == pytest.approx(0.096)  # the client's own lag stays in wall time


def test_prefix_hit_rate_is_the_counter_delta() -> None:
    delta = PrefixCounters(queries=220.0, hits=80.0) - PrefixCounters(queries=100.0, hits=50.0)
    assert delta.hit_rate == pytest.approx(0.25)
    assert PrefixCounters().hit_rate is None
    assert summarize([], prefix=delta).prefix_hit_rate == pytest.approx(0.25)


def test_empty_results_summarise_without_dividing_by_zero() -> None:
    s = summarize([])
    assert (s.requests, s.duration_s, s.goodput_rps, s.ttft_s, s.send_lag_p99_s) == (0, 0.0, 0.0, None, None)


def test_results_round_trip_through_jsonl(results: list[RequestResult], tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_results(path, results)
    assert read_results(path) == results


def test_format_names_the_clock_and_the_slo(results: list[RequestResult]) -> None:
    text = format_summary(summarize(results, latency_scale=10.0, prefix=PrefixCounters(4.0, 1.0)))
    assert "simulated time" in text and "TTFT <= 2.0 s" in text and "25.0% of prompt tokens" in text


def test_the_slo_is_printed_as_given(results: list[RequestResult]) -> None:
    """A 0.0058 s TPOT SLO printed as `TPOT <= 6 ms` (rendered to whole milliseconds)."""
    text = format_summary(summarize(results, slo=Slo(0.35, 0.0058)))
    assert "TTFT <= 0.35 s and TPOT <= 5.8 ms" in text
