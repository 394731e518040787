"""bench.results_file: a benchmark's results on disk after each one, and word of them on failure."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from bench.results_file import ResultsFile


class Row(msgspec.Struct):
    name: str
    value: float


def test_each_result_is_on_disk_when_added(tmp_path: Path) -> None:
    saved = ResultsFile[Row](tmp_path / "out" / "r.json")
    saved.add(Row("a", 1.0))
    assert json.loads(saved.path.read_text()) == [{"name": "a", "value": 1.0}]
    saved.add(Row("b", 2.5))
    assert json.loads(saved.path.read_text()) == [{"name": "a", "value": 1.0}, {"name": "b", "value": 2.5}]
    assert sorted(p.name for p in saved.path.parent.iterdir()) == ["r.json"]


def test_indent_is_kept(tmp_path: Path) -> None:
    saved = ResultsFile[Row](tmp_path / "r.json", indent=2)
    saved.add(Row("a", 1.0))
    assert saved.path.read_text().startswith('[\n  {\n    "name": "a"')


def test_a_failure_says_what_was_kept_and_propagates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = ResultsFile[Row](tmp_path / "r.json")
    with pytest.raises(KeyboardInterrupt), saved.kept_on_failure("bench x"):
        saved.add(Row("a", 1.0))
        raise KeyboardInterrupt
    err = capsys.readouterr().err
    assert f"bench x stopped early: 1 results measured before the failure are in {saved.path}" in err
    with pytest.raises(RuntimeError), ResultsFile[Row](tmp_path / "s.json").kept_on_failure("bench y"):
        raise RuntimeError("first phase")
    assert "bench y stopped early: nothing was measured" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()
