"""bench.bench_index_memory's verdict: the RSS per entry it measured against its target (the target
was a constant nothing read; the table's header said "2 GB" whatever the fleet)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.bench_index_memory import TARGET_BYTES_PER_ENTRY, report, verdict


def _row(rss_per_entry: float, entries: int = 1000) -> dict[str, Any]:
    return {
        "sharing": "low",
        "core": "C",
        "entries": entries,
        "distinct": entries,
        "rss": rss_per_entry * entries,
        "peak": 2 * rss_per_entry * entries,
        "reported": rss_per_entry * entries,
        "build_s": 1.0,
        "match_own_us": 1.0,
        "match_miss_us": 1.0,
        "clear_ms": 1.0,
        "list_ms": 1.0,
    }


@pytest.mark.parametrize(
    ("per_entry", "said"),
    [
        (41.0, "41.0 B of RSS per entry (peak 82.0), target <= 125 B: met (3.05x margin)"),
        (TARGET_BYTES_PER_ENTRY, "target <= 125 B: met (1.00x margin)"),
        (166.9, "166.9 B of RSS per entry (peak 333.8), target <= 125 B: missed (0.75x margin)"),
        (0.0, "target <= 125 B: met"),  # a fleet too small to move the RSS
    ],
)
def test_the_verdict_compares_rss_per_entry_with_the_target(per_entry: float, said: str) -> None:
    assert verdict(_row(per_entry)).endswith(said)


def test_the_report_states_the_target_for_its_fleet_and_a_verdict_per_row(capsys: pytest.CaptureFixture[str]) -> None:
    report([_row(41.0, 10 * 64), _row(200.0, 10 * 64)], workers=10, blocks=64)
    lines = capsys.readouterr().out.splitlines()
    assert "target <= 125 B of RSS per entry (0.00 GB in all)" in lines[0]
    assert [line.rpartition(": ")[2].split()[0] for line in lines[-2:]] == ["met", "missed"]
