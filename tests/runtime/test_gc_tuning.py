"""Every service runs with the collector tuned: what exists when it starts is frozen out of the
collector's view, and young collections run every 50,000 allocations, not every 700."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_a_service_starts_with_its_startup_heap_frozen_and_young_collections_rarer() -> None:
    code = textwrap.dedent(
        """
        import gc, json, sys
        before = {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}
        from runtime import run_service

        async def main(stop):
            print(json.dumps({**{k + "_before": v for k, v in before.items()},
                              "threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                              "tracked_young": gc.get_count()[0]}))

        raise SystemExit(run_service(main))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    seen = json.loads(done.stdout)
    assert seen["threshold_before"][0] == 700 and seen["frozen_before"] == 0  # the interpreter's defaults
    assert seen["threshold"] == [50_000, 20, 100]
    assert seen["frozen"] > 10_000  # the imported modules' objects, at least
    assert seen["tracked_young"] < 5_000  # only what the loop allocated since
