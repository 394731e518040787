"""How close the routers' calibration comes to the engines' own speed, on the virtual clock.

The virtual engines run the very profile the routers price with, so every factor the calibration
fits (router.calibration) should be 1.0. This replays one workload on one fleet and prints, per
worker role, the RMS of log(k) over every fit a router made after WARM_S (0 is exact; 0.1 is about
10% off), and each worker's last factors:

    python -m bench.calibration_check --workload trace --config slo_aware
    python -m bench.calibration_check --workload multi-turn --config slo_spill

`trace`: the whole shipped trace on 1P+4D, as `kvswitch bench compare --clock virtual` runs it;
`multi-turn`: docs/benchmarks.md's multi-turn point (200 sessions of 4 turns over a 4 k system
prompt, 1P+3D at x2), as `kvswitch bench sweep --workload multi-turn` runs it. Each fit is read
from `Calibration.factors()` after each load report a router observes.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.compare import CONFIGURATIONS, slo_router_args
from bench.summary import Slo
from bench.trace import TokenSynth, load_trace, shipped_trace
from bench.virtual.fleet import FleetSpec, VirtualFleet, settings_from_args
from bench.workloads import WorkItem, from_trace, multi_turn
from protocol.messages import LoadReport, WorkerInfo
from router.calibration import Calibration

WARM_S = 30.0  # virtual seconds before fits count: the first windows start from the prior
PROFILE = "h200:llama-3.1-8b"


@dataclass(slots=True)
class Fits:
    """Every (virtual time, k_d, k_p) a router's calibration reached, per worker."""

    clock: Callable[[], float]
    seen: dict[str, float] = field(default_factory=dict)  # busy seconds observed at the last fit
    fits: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)

    def watch(self, calibration: Calibration) -> None:
        observe = calibration.observe

        def observed(info: WorkerInfo | None, report: LoadReport) -> None:
            observe(info, report)
            for worker, (k_d, k_p, busy_s) in calibration.factors().items():
                if busy_s != self.seen.get(worker):
                    self.seen[worker] = busy_s
                    self.fits.setdefault(worker, []).append((self.clock(), k_d, k_p))

        calibration.observe = observed  # type: ignore[method-assign]

    def rms_log(self, role: str) -> tuple[float, float, int]:
        """(k_d's, k_p's RMS of log k, fits counted) over `role`'s workers after WARM_S."""
        points = [
            (k_d, k_p) for w, fits in self.fits.items() if w.startswith(role) for t, k_d, k_p in fits if t >= WARM_S
        ]
        if not points:
            return math.nan, math.nan, 0
        n = len(points)
        return (
            math.sqrt(sum(math.log(k_d) ** 2 for k_d, _ in points) / n),
            math.sqrt(sum(math.log(k_p) ** 2 for _, k_p in points) / n),
            n,
        )


def _workload(name: str) -> tuple[list[WorkItem], int, int, int, float]:
    """(items, prefill workers, decode workers, max_model_len, rate)."""
    if name == "trace":
        items = from_trace(load_trace(shipped_trace()))
        return items, 1, 4, max(32768, *(i.input_len + i.output_len for i in items)), 1.0
    items = multi_turn(
        sessions=200, turns=4, system_len=4096, user_len=512, answer_len=512, session_rate=2, turn_gap_s=10, seed=0
    )
    return items, 1, 3, 32768, 2.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.calibration_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workload", choices=["trace", "multi-turn"], default="trace")
    parser.add_argument("--config", choices=sorted(CONFIGURATIONS), default="slo_aware")
    args = parser.parse_args(argv)
    items, prefill, decode, max_model_len, rate = _workload(args.workload)
    config = CONFIGURATIONS[args.config]
    if config.fleet == "agg":
        parser.error(f"--config {args.config} runs aggregated engines; pick one with prefill and decode workers")
    settings = settings_from_args([*config.router_args, *slo_router_args(Slo())])
    fleet = VirtualFleet(
        FleetSpec(prefill=prefill, decode=decode, settings=settings, profile=PROFILE, max_model_len=max_model_len)
    )
    fits = Fits(lambda: fleet.clock.now)
    for router in fleet.routers:
        if router.calibration is not None:
            fits.watch(router.calibration)
    fleet.run(items, TokenSynth(0), rate=rate)
    print(
        f"{args.workload}, {args.config}, {prefill}P+{decode}D at x{rate:g}: RMS of log k over fits after {WARM_S:g} s"
    )
    for role in ("decode", "prefill"):
        k_d, k_p, n = fits.rms_log(role)
        print(f"  {role:<8} k_d {k_d:.3f}  k_p {k_p:.3f}  ({n} fits)")
    for worker, worker_fits in sorted(fits.fits.items()):
        _, k_d, k_p = worker_fits[-1]
        print(f"  {worker}: last k_d {k_d:.2f}, k_p {k_p:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
