"""`kvswitch bench sweep`: configurations x fleets x loads on the virtual clock, as a table and heat maps.

    kvswitch bench sweep --fleets 1P+3D,2P+2D,2P+6D,4P+12D --rates 0.5,1,2,4 \\
        --configs round_robin,kv,kv_disagg,slo_aware [--workload trace|shared-prefix|multi-turn]

Every (fleet, rate, configuration) is one replay (bench.virtual) of the same workload at `rate`
times its arrival rate; aggregated configurations run P + D aggregated engines, disaggregated ones
P prefill + D decode, so each fleet compares equal GPU counts. Per (fleet, rate) the table gives
each configuration's goodput and the two ratios the routing targets are stated in:

- `kv / rr`: round_robin's TTFT p90 over kv's (target >= 3x at >= 4 decode workers);
- `rr / floor` (when the floor is given): round_robin's TTFT p90 over the workload's TTFT floor p90
  (bench.ttft_floor), the most any router could improve on round robin there;
- `policy / best fixed`: the conditional policy's goodput over the better of always-agg (`kv`) and
  always-disagg (`kv_disagg`) (targets >= 1.15x where those two diverge by more than
  `DIVERGE`, and never below 0.95x).

The heat maps (fleet x load) show both ratios. `--out-dir` keeps every measurement as JSON.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.compare import Configuration, slo_router_args
from bench.process_pool import process_pool
from bench.summary import Slo, Summary, summarize
from bench.trace import TokenSynth
from bench.virtual.fleet import SIMS_MAX_MODEL_LEN, FleetSpec, VirtualFleet, settings_from_args
from bench.workloads import WorkItem

__all__ = ["DIVERGE", "Fleet", "SweepPoint", "format_sweep", "parse_fleets", "ratios", "run_sweep"]

DIVERGE = 0.10
"""Always-agg and always-disagg "diverge" where the worse one's goodput is more than 10% below the
better one's: there the choice of mode matters, and a conditional policy must beat both by 1.15x."""

_FLEET = re.compile(r"(\d+)P\+(\d+)D")


class Fleet(msgspec.Struct, frozen=True):
    prefill: int
    decode: int

    @property
    def name(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


def parse_fleets(text: str) -> list[Fleet]:
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = _FLEET.fullmatch(part)
        if m is None or int(m.group(2)) < 1:
            raise ValueError(f"--fleets: {part!r} is not PP+DD with D >= 1 (e.g. 2P+6D)")
        out.append(Fleet(int(m.group(1)), int(m.group(2))))
    if not out:  # zero points ran, a `[]` results file was written, and only the plot refused
        raise ValueError(f"--fleets {text!r} names no fleet (e.g. 1P+3D,2P+6D)")
    return out


class SweepPoint(msgspec.Struct, frozen=True):
    fleet: Fleet
    rate: float
    configuration: str
    summary: Summary
    max_model_len: int | None = None  # the engines' (None: a file from before 2026-12-06)


@dataclass(frozen=True)
class _Job:
    fleet: Fleet
    rate: float
    config: Configuration
    items: Sequence[WorkItem]
    slo: Slo
    profile: str
    seed: int
    max_model_len: int


def _measure(job: _Job) -> SweepPoint:
    f, c = job.fleet, job.config
    print(f"[{c.name} on {f.name} at x{job.rate:g}]", file=sys.stderr, flush=True)
    agg = c.fleet == "agg"
    spec = FleetSpec(
        prefill=0 if agg else f.prefill,
        decode=0 if agg else f.decode,
        agg=f.prefill + f.decode if agg else 0,
        settings=settings_from_args([*c.router_args, *slo_router_args(job.slo)]),
        profile=job.profile,
        max_model_len=job.max_model_len,
        seed=job.seed,
    )
    run = VirtualFleet(spec).run(job.items, TokenSynth(job.seed), rate=job.rate)
    summary = summarize(run.results(), slo=job.slo, prefix=run.prefix, clock="virtual")
    return SweepPoint(f, job.rate, c.name, summary, job.max_model_len)


def run_sweep(
    items: Sequence[WorkItem],
    fleets: Sequence[Fleet],
    rates: Sequence[float],
    configs: Sequence[Configuration],
    *,
    slo: Slo,
    max_model_len: int = SIMS_MAX_MODEL_LEN,
    profile: str = "h200:llama-3.1-8b",
    seed: int = 0,
    jobs: int = 2,
) -> list[SweepPoint]:
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    todo = [_Job(f, r, c, items, slo, profile, seed, max_model_len) for f in fleets for r in rates for c in configs]
    if jobs > 1 and len(todo) > 1:
        with process_pool(min(jobs, len(todo))) as pool:
            return list(pool.map(_measure, todo))
    return [_measure(j) for j in todo]


def _goodput(points: Sequence[SweepPoint], fleet: Fleet, rate: float, config: str) -> Summary | None:
    return next((p.summary for p in points if p.fleet == fleet and p.rate == rate and p.configuration == config), None)


def ratios(
    points: Sequence[SweepPoint], policy: str, floor_p90: float | None = None
) -> dict[tuple[str, float], dict[str, float | None]]:
    """Per (fleet, rate): `kv/rr` (round_robin TTFT p90 / kv's), `rr/floor` (round_robin's TTFT p90
    over `floor_p90`, when given), `policy/best` (the policy's goodput over max(kv, kv_disagg)),
    `diverge` (1 - min/max of those two goodputs) and `ceiling` (every request the better one was
    sent, errors and 429s included, per second of the arrival window, over its goodput: what a policy could
    reach over it with every request within the SLOs; where it is under 1.15, the 1.15x target
    cannot be met)."""
    out: dict[tuple[str, float], dict[str, float | None]] = {}
    for fleet in dict.fromkeys(p.fleet for p in points):
        for rate in sorted({p.rate for p in points}):
            rr, kv = _goodput(points, fleet, rate, "round_robin"), _goodput(points, fleet, rate, "kv")
            disagg, mine = _goodput(points, fleet, rate, "kv_disagg"), _goodput(points, fleet, rate, policy)
            cell: dict[str, float | None] = dict.fromkeys(("kv/rr", "rr/floor", "policy/best", "diverge", "ceiling"))
            if rr is not None and kv is not None and rr.ttft_s is not None and kv.ttft_s is not None:
                cell["kv/rr"] = rr.ttft_s.p90 / kv.ttft_s.p90 if kv.ttft_s.p90 > 0 else None
            if rr is not None and rr.ttft_s is not None and floor_p90:
                cell["rr/floor"] = rr.ttft_s.p90 / floor_p90
            if kv is not None and disagg is not None:
                best = max(kv.goodput_rps, disagg.goodput_rps)
                if best > 0:
                    cell["diverge"] = 1 - min(kv.goodput_rps, disagg.goodput_rps) / best
                    fixed = max(kv, disagg, key=lambda x: x.goodput_rps)
                    cell["ceiling"] = fixed.requests / fixed.window_s / best
                    if mine is not None:
                        cell["policy/best"] = mine.goodput_rps / best
            out[fleet.name, rate] = cell
    return out


def format_sweep(points: Sequence[SweepPoint], policy: str, floor_p90: float | None = None) -> str:
    """The table; with `floor_p90` (bench.ttft_floor) it gains the `rr/floor` column."""
    configs = list(dict.fromkeys(p.configuration for p in points))
    cells = ratios(points, policy, floor_p90)
    keys = ["kv/rr", *(["rr/floor"] if floor_p90 else []), "policy/best", "diverge", "ceiling"]
    names = {
        "kv/rr": "kv/rr p90",
        "rr/floor": "rr/floor p90",
        "policy/best": f"{policy}/best",
        "diverge": "diverge",
        "ceiling": "ceiling/best",
    }
    header = ["fleet", "rate", *(f"{c} r/s" for c in configs), *(names[k] for k in keys)]
    rows = [header]
    for (fleet_name, rate), cell in cells.items():
        fleet = next(p.fleet for p in points if p.fleet.name == fleet_name)
        row = [fleet_name, f"x{rate:g}"]
        for c in configs:
            s = _goodput(points, fleet, rate, c)
            row.append(f"{s.goodput_rps:.3g}" if s is not None else "-")
        for key in keys:
            value = cell[key]
            row.append("-" if value is None else f"{value:.2f}" + ("x" if key != "diverge" else ""))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_points(path: Path, points: Sequence[SweepPoint]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(list(points)))


def read_points(path: Path) -> list[SweepPoint]:
    return msgspec.json.decode(path.read_bytes(), type=list[SweepPoint])
