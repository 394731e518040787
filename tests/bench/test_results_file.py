"""bench.results_file: a benchmark's results on disk after each one, and word of them on failure."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest

from bench.results_file import ResultsFile, fresh_path


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


def test_fresh_paths_in_one_second_are_distinct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # two sweeps finishing in the same second wrote one file: the second's results replaced the first's
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261206-020000")
    paths = [fresh_path(tmp_path / "out", "sweep", ".json") for _ in range(3)]
    assert [p.name for p in paths] == ["sweep-20261206-020000.json", "sweep-20261206-020000-2.json",
                                       "sweep-20261206-020000-3.json"]  # fmt: skip
    assert all(p.exists() for p in paths)


def test_a_reserved_path_with_nothing_measured_is_removed(tmp_path: Path) -> None:
    saved = ResultsFile[Row](fresh_path(tmp_path, "compare", ".json"))
    with pytest.raises(RuntimeError), saved.kept_on_failure("bench z"):
        raise RuntimeError("refused")
    assert list(tmp_path.iterdir()) == []
