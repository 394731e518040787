"""aiperf as a subprocess: its command line and the figures read from its export (a trimmed real
export of aiperf 0.13 against engine_sim, tests/bench/data/aiperf_*)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.aiperf_client import AiperfError, AiperfRun, parse_export
from bench.hf_tokenizer import HUB_NAME

DATA = Path(__file__).parent / "data"


def _export() -> tuple[dict[str, object], list[dict[str, object]]]:
    summary = json.loads((DATA / "aiperf_summary.json").read_text())
    records = [json.loads(line) for line in (DATA / "aiperf_records.jsonl").read_text().splitlines()]
    return summary, records


def test_figures_are_aiperfs_in_seconds_and_the_window_spans_profiling_requests_only() -> None:
    summary, records = _export()
    result = parse_export(summary, records)
    assert result.ttft_p50 == pytest.approx(15.2124255e-3)
    assert result.ttft_p99 == pytest.approx(70.60233884e-3)
    assert result.itl_p50 == pytest.approx(1.1406945793650793e-3)
    assert result.ttst_p99 == pytest.approx(12.261054839999998e-3)
    assert (result.requests, result.output_tokens, result.errors) == (20, 1280, 0)
    assert result.output_tokens_per_s == pytest.approx(2381.304500409143)
    # the warm-up record (an earlier start) is left out of the window
    assert result.window == pytest.approx((1796102372.410763214, 1796102372.53923668), abs=1e-6)


def test_an_export_without_profiling_requests_is_an_error() -> None:
    summary, records = _export()
    warmup_only = [r for r in records if r["metadata"]["benchmark_phase"] == "warmup"]  # type: ignore[index]
    with pytest.raises(AiperfError, match="no profiling-phase request"):
        parse_export(summary, warmup_only)


def test_a_missing_metric_is_an_error_naming_it() -> None:
    summary, records = _export()
    del summary["time_to_second_token"]
    with pytest.raises(AiperfError, match="time_to_second_token"):
        parse_export(summary, records)


def test_command_line_fixes_lengths_seed_tokenizer_and_lists_every_url(tmp_path: Path) -> None:
    run = AiperfRun("aiperf", "sim-llama", isl=1024, osl=64, requests=100, seed=7, hf_home=tmp_path)
    argv = run.argv(["http://a:1", "http://b:2"], 64, tmp_path / "out")
    joined = " ".join(argv)
    assert "--url http://a:1 --url http://b:2" in joined
    assert f"--tokenizer {HUB_NAME}" in joined
    assert "--concurrency 64 --request-count 256" in joined  # at least 4x the concurrency
    for flag in ("--isl 1024 --isl-stddev 0", "--osl 64 --osl-stddev 0", "--random-seed 7", "ignore_eos:true"):
        assert flag in joined
    assert "--streaming" in argv and "--use-server-token-count" in argv


def test_a_failing_aiperf_is_an_error_pointing_at_its_log(tmp_path: Path) -> None:
    run = AiperfRun("/bin/false", "m", isl=8, osl=2, requests=1, seed=0, hf_home=tmp_path / "hf")
    with pytest.raises(AiperfError, match=r"exited with 1; see .*aiperf\.log"):
        run.run(["http://127.0.0.1:9"], 1, tmp_path / "out")
