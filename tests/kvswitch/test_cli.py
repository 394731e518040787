from __future__ import annotations

import subprocess
import sys

from protocol.version import BUILD


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
    assert _kvswitch("--version").stdout.strip() == f"kvswitch {BUILD}"


def test_a_drain_that_hangs_is_cut_at_its_limit() -> None:
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import asyncio, os, signal
        from runtime import run_service

        async def main(stop):
            asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
            await stop.wait()
            await asyncio.sleep(3600)  # a drain that never ends

        raise SystemExit(run_service(main, drain_limit_s=0.5))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 130
    assert "still draining after" in done.stderr
