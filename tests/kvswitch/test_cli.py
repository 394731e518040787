from __future__ import annotations

import subprocess
import sys


def _kvswitch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvswitch", *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_subcommand() -> None:
    out = _kvswitch("--help")
    assert out.returncode == 0
    for sub in ("up", "sim", "shim", "router", "bench"):
        assert f"  {sub} " in out.stdout


def test_unknown_subcommand_is_refused_with_the_choices() -> None:
    out = _kvswitch("launch")
    assert out.returncode == 2
    assert "unknown command 'launch'" in out.stderr and "up, sim, shim, router, bench" in out.stderr


def test_version() -> None:
    assert _kvswitch("--version").stdout.startswith("kvswitch ")
