"""`kvswitch bench compare`: the same trace slice against one fresh fleet per configuration.

Two clocks. `live` (the default): for every rate factor, configuration and run, a `LocalCluster`
comes up (same fleet size, profile, speed-up and engine settings; a fresh namespace and empty
caches), the engines' prefix counters are scraped, the workload is replayed at `speedup * rate`
(so `rate` 1 is the trace's own arrival rate in simulated time), the counters are scraped again,
and the cluster is torn down. Latencies are reported in simulated time (`latency_scale =
speedup`). Every run replays the same items with the same synthesis seed, so runs differ only by
timing noise; the table reports the median of the runs and half their range (`±`).

`virtual`: each (rate, configuration, run) is a discrete-event replay in one process
(bench.virtual): the same engines' scheduler and timing, shims' normalisation and routers'
planner, with modelled hops instead of processes and sockets, in virtual (simulated) time, so
latencies need no scaling and nothing but the model is measured. Run `r` of a configuration seeds
its routers' random choices and its shims' poll phases with `seed + r`; the same inputs and seed
give byte-identical results.
`jobs` processes run measurements side by side; results keep their order.

Fleets: disaggregated configurations run `prefill` prefill and `decode` decode engines. Aggregated
ones (`round_robin`, `kv`) run `prefill + decode` engines in the `agg` role, so every configuration
has the same number of GPUs and the agg baselines are not handicapped by idle prefill engines.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
import msgspec

from bench.peers import PEERS, Peer, PeerProcess
from bench.process_pool import process_pool
from bench.replay import replay
from bench.stop_signals import held
from bench.summary import PrefixCounters, Slo, Summary, scrape_prefix_counters, summarize
from bench.trace import TokenSynth
from bench.virtual.delays import DEFAULT_DELAYS, Delays
from bench.virtual.fleet import SIMS_MAX_MODEL_LEN, FleetSpec, VirtualFleet, settings_from_args
from bench.workloads import WorkItem
from kvswitch.cluster import ClusterSpec, LocalCluster

__all__ = [
    "CONFIGURATIONS",
    "PEER_CONFIGURATIONS",
    "CompareSpec",
    "Configuration",
    "Measurement",
    "check_prefill_engines",
    "check_spec",
    "format_table",
    "headline_ratios",
    "run_compare",
    "slo_router_args",
]

Fleet = Literal["agg", "pd"]
Clock = Literal["live", "virtual"]
CLOCKS: tuple[str, ...] = ("live", "virtual")
_CONDITIONAL = ("--routing", "kv", "--disagg", "conditional", "--conditional-disagg", "--conditional-disagg-policy")


@dataclass(frozen=True)
class Configuration:
    """kvswitch's router with `router_args`, or (with `peer`) a peer router, on the given fleet."""

    name: str
    router_args: tuple[str, ...]
    fleet: Fleet
    peer: Peer | None = None


# prefill_load and isl_or_load need a busy threshold: 1.0 * max_num_batched_tokens queued.
CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration("round_robin", ("--routing", "round_robin", "--disagg", "never"), "agg"),
        Configuration("kv", ("--routing", "kv", "--disagg", "never"), "agg"),
        Configuration("kv_disagg", ("--routing", "kv", "--disagg", "always"), "pd"),
        Configuration("isl_bounding", (*_CONDITIONAL, "isl_bounding"), "pd"),
        Configuration("prefill_load", (*_CONDITIONAL, "prefill_load", "--prefill-busy-threshold", "1.0"), "pd"),
        Configuration("isl_or_load", (*_CONDITIONAL, "isl_or_load", "--prefill-busy-threshold", "1.0"), "pd"),
        Configuration("ttft_model", (*_CONDITIONAL, "ttft_model"), "pd"),
        Configuration("slo_aware", (*_CONDITIONAL, "slo_aware"), "pd"),
        # slo_aware with prefill workers serving whole requests while no decode worker has room
        Configuration("slo_spill", (*_CONDITIONAL, "slo_aware", "--spill-to-prefill"), "pd"),
    )
}
PEER_CONFIGURATIONS: dict[str, Configuration] = {
    name: Configuration(name, (), peer.fleet, peer) for name, peer in PEERS.items()
}


@dataclass
class CompareSpec:
    items: list[WorkItem]
    configurations: list[Configuration]
    prefill: int = 2
    decode: int = 2
    routers: int = 1
    speedup: float = 10.0
    rates: list[float] = field(default_factory=lambda: [1.0])
    runs: int = 3
    profile: str = "h200:llama-3.1-8b"
    sim_args: list[str] = field(default_factory=list)
    slo: Slo = field(default_factory=Slo)
    synth_seed: int = 0
    ready_timeout_s: float = 90.0
    progress: bool = True
    log_dir: Path | None = None  # each child's output under log_dir/<configuration>/
    clock: Clock = "live"
    delays: Delays = DEFAULT_DELAYS  # virtual clock only
    router_profile: str | None = None  # virtual: what workers register ("" none; None the engines' own)
    max_model_len: int = SIMS_MAX_MODEL_LEN  # virtual: the engines' context limit (live: --sim-arg --max-model-len)
    seed: int = 0  # virtual: routers' random choices and shims' poll phases (run r uses seed + r)
    calibrate: bool = True  # virtual: routers fit engine timing from load reports
    router_profile_error: float = 0.0  # virtual: routers start with engine times (1 + e) x the profile's
    jobs: int = 1  # virtual: measurements run in this many processes


class Measurement(msgspec.Struct, kw_only=True):
    configuration: str
    rate: float
    run: int
    summary: Summary
    ttft_s: list[float]  # simulated seconds, successful requests, for the CDF
    setup_s: float  # wall seconds to bring the cluster up (0 on the virtual clock: results stay deterministic)
    clock: str = "live"
    max_model_len: int | None = None  # virtual clock: the engines' (None: live, or a file from before 2026-12-06)


def slo_router_args(slo: Slo, speedup: float = 1.0) -> list[str]:
    """The routers' flags for the SLO goodput is judged at, so that they protect that one (admission's
    timeout and bound, `slo_aware`'s budgets) and not their defaults. Live engines at `speedup` run
    that much faster than the profile's seconds the SLO is judged in, and their shims register the
    profile at that speed (kvswitch.cluster), so the routers, predicting in real seconds, are given
    the SLO in real seconds too."""
    return ["--slo-ttft-s", repr(slo.ttft_s / speedup), "--slo-itl-s", repr(slo.itl_s / speedup)]


def _cluster_spec(spec: CompareSpec, config: Configuration) -> ClusterSpec:
    agg = config.fleet == "agg"
    return ClusterSpec(
        prefill=0 if agg else spec.prefill,
        decode=0 if agg else spec.decode,
        agg=spec.prefill + spec.decode if agg else 0,
        routers=0 if config.peer is not None else spec.routers,
        speedup=spec.speedup,
        profile=spec.profile,
        router_args=[*config.router_args, *slo_router_args(spec.slo, spec.speedup)],
        sim_args=list(spec.sim_args),
        namespace="bench" + uuid.uuid4().hex[:8],
        log_dir=spec.log_dir / config.name if spec.log_dir is not None else None,
    )


async def _measure(
    spec: CompareSpec, rate: float, cluster: LocalCluster, urls: Sequence[str], *, peer: bool
) -> tuple[Summary, list[float]]:
    async with aiohttp.ClientSession() as session:
        before = await scrape_prefix_counters(session, cluster.sim_urls)
        run = await replay(
            spec.items,
            urls,
            speed=spec.speedup * rate,
            model=cluster.spec.model,
            synth=TokenSynth(spec.synth_seed),
            progress=spec.progress,
            text_prompts=peer,
        )
        after = await scrape_prefix_counters(session, cluster.sim_urls)
    prefix: PrefixCounters = after - before
    summary = summarize(run.results, slo=spec.slo, latency_scale=spec.speedup, prefix=prefix)
    ttfts = sorted(r.ttft_s * spec.speedup for r in run.results if r.ok and r.ttft_s is not None)
    return summary, ttfts


def _drop(m: Measurement) -> None:
    """A measurement no one keeps as it lands (run_one's, _measure_one's default)."""


def run_one(
    spec: CompareSpec, config: Configuration, rate: float, run: int, keep: Callable[[Measurement], None] = _drop
) -> Measurement:
    """One live measurement, given to `keep` before its cluster stops: a signal that stops the run
    there (held to the stop's end, bench.stop_signals) loses nothing measured."""
    started = time.monotonic()
    cluster = LocalCluster(_cluster_spec(spec, config))
    peer: PeerProcess | None = None
    try:
        cluster.start()
        if config.peer is not None:
            log = spec.log_dir / config.name / "peer.log" if spec.log_dir is not None else None
            peer = PeerProcess(
                config.peer, cluster.engines, block_size=cluster.spec.block_size, model=cluster.spec.model, log=log
            )
            peer.start(timeout=spec.ready_timeout_s)
            urls = [peer.url]
        else:
            cluster.wait_ready(timeout=spec.ready_timeout_s)
            urls = cluster.router_urls
        setup = time.monotonic() - started
        summary, ttfts = asyncio.run(_measure(spec, rate, cluster, urls, peer=peer is not None))
        measured = Measurement(
            configuration=config.name, rate=rate, run=run, summary=summary, ttft_s=ttfts, setup_s=setup
        )
        keep(measured)
    finally:
        with held():
            if peer is not None:
                peer.stop()
            cluster.stop()
    return measured


def fleet_spec(spec: CompareSpec, config: Configuration, run: int) -> FleetSpec:
    """The virtual fleet for one configuration: the same shapes as the live cluster's."""
    agg = config.fleet == "agg"
    return FleetSpec(
        prefill=0 if agg else spec.prefill,
        decode=0 if agg else spec.decode,
        agg=spec.prefill + spec.decode if agg else 0,
        routers=spec.routers,
        settings=settings_from_args([*config.router_args, *slo_router_args(spec.slo)]),
        delays=spec.delays,
        profile=spec.profile,
        router_profile=spec.router_profile,
        max_model_len=spec.max_model_len,
        seed=spec.seed + run,
        calibrate=spec.calibrate,
        router_profile_error=spec.router_profile_error,
    )


def run_virtual(spec: CompareSpec, config: Configuration, rate: float, run: int) -> Measurement:
    if config.peer is not None:
        raise ValueError(f"{config.name} is a peer router: it runs on the live clock only")
    fleet = VirtualFleet(fleet_spec(spec, config, run))
    result = fleet.run(spec.items, TokenSynth(spec.synth_seed), rate=rate)
    results = result.results()
    summary = summarize(results, slo=spec.slo, prefix=result.prefix, clock="virtual")
    ttfts = sorted(r.ttft_s for r in results if r.ok and r.ttft_s is not None)
    return Measurement(
        configuration=config.name,
        rate=rate,
        run=run,
        summary=summary,
        ttft_s=ttfts,
        setup_s=0.0,
        clock="virtual",
        max_model_len=spec.max_model_len,
    )


def _measure_one(
    job: tuple[CompareSpec, Configuration, float, int], keep: Callable[[Measurement], None] = _drop
) -> Measurement:
    """One job's measurement, given to `keep` as it lands (a pool's worker has none: the caller keeps
    what it returns)."""
    spec, config, rate, run = job
    print(f"[{config.name} rate x{rate:g} run {run + 1}/{spec.runs}]", file=sys.stderr, flush=True)
    if spec.clock != "virtual":
        return run_one(spec, config, rate, run, keep)
    measured = run_virtual(spec, config, rate, run)
    keep(measured)
    return measured


def check_prefill_engines(
    where: str, prefill: int, configs: Iterable[Configuration], router_args: Sequence[str] = ()
) -> None:
    """Disaggregating configurations on a fleet with no prefill engine, refused before anything runs
    (replay, compare and sweep alike): their routers found no prefill worker, prefilled every request
    on its decode engine, and the run was reported under the disaggregated configuration's name.
    `where`: the flag that gave the fleet; `router_args`: replay's --router-arg, which can make any
    configuration disaggregate."""
    if prefill >= 1:
        return
    names = [c.name for c in configs if _disaggregates(c, router_args)]
    if names:
        raise ValueError(f"{where}: disaggregated configurations need at least one prefill engine: {', '.join(names)}")


def _disaggregates(config: Configuration, router_args: Sequence[str]) -> bool:
    if config.peer is not None:
        return config.fleet == "pd"
    return settings_from_args([*config.router_args, *router_args]).disagg != "never"


def check_spec(spec: CompareSpec) -> None:
    """The run's settings and every configuration's fleet, checked before the first runs (and before
    the CLI creates its output): an impossible fleet surfaced at its turn, after the earlier
    configurations had run, and their results were lost."""
    if spec.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {spec.runs}")
    if spec.clock not in CLOCKS:
        raise ValueError(f"--clock must be one of {', '.join(CLOCKS)}, got {spec.clock!r}")
    if spec.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {spec.jobs}")
    if min(spec.prefill, spec.decode) < 0:
        raise ValueError(f"--prefill and --decode must be >= 0, got {spec.prefill} and {spec.decode}")
    if spec.routers < 1:
        raise ValueError(f"--routers must be >= 1, got {spec.routers}")
    if spec.decode < 1 and (pd := [c.name for c in spec.configurations if c.fleet == "pd"]):
        raise ValueError(f"--decode must be >= 1 for disaggregated configurations ({', '.join(pd)})")
    if spec.prefill + spec.decode < 1 and (agg := [c.name for c in spec.configurations if c.fleet == "agg"]):
        raise ValueError(f"--prefill + --decode must be >= 1 for aggregated configurations ({', '.join(agg)})")
    check_prefill_engines(f"--prefill {spec.prefill}", spec.prefill, spec.configurations)
    if spec.clock == "virtual":
        for config in spec.configurations:
            if config.peer is None:
                fleet_spec(spec, config, 0).validate()


def run_compare(spec: CompareSpec, *, on_measurement: Callable[[Measurement], None] | None = None) -> list[Measurement]:
    """Every (rate, configuration, run), in that nesting, so a partial result still compares
    every configuration at the first rate."""
    check_spec(spec)
    jobs = [(spec, c, rate, run) for rate in spec.rates for run in range(spec.runs) for c in spec.configurations]
    out: list[Measurement] = []

    def keep(m: Measurement) -> None:
        out.append(m)
        if on_measurement is not None:
            on_measurement(m)

    if spec.clock == "virtual" and spec.jobs > 1 and len(jobs) > 1:
        with process_pool(min(spec.jobs, len(jobs))) as pool:
            for m in pool.map(_measure_one, jobs):
                keep(m)
        return out
    for job in jobs:
        _measure_one(job, keep)
    return out


@dataclass
class _Cell:
    values: list[float]

    def __str__(self) -> str:
        if not self.values:
            return "-"
        mid = statistics.median(self.values)
        spread = (max(self.values) - min(self.values)) / 2
        return f"{mid:.3g}" if len(self.values) == 1 else f"{mid:.3g}±{spread:.2g}"

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None


_Metric = Callable[[Summary], float | None]
COLUMNS: list[tuple[str, _Metric]] = [
    ("TTFT p50 s", lambda s: s.ttft_s.p50 if s.ttft_s else None),
    ("TTFT p90 s", lambda s: s.ttft_s.p90 if s.ttft_s else None),
    ("TPOT p90 ms", lambda s: s.tpot_s.p90 * 1e3 if s.tpot_s else None),
    ("tok/s", lambda s: s.output_tokens_per_s),
    ("goodput r/s", lambda s: s.goodput_rps),
    ("in SLO", lambda s: s.goodput_fraction),
    ("hit rate", lambda s: s.prefix_hit_rate),
    ("bypass", lambda s: s.prefill_mix.get("bypass")),
    ("errors", lambda s: float(s.errors)),
]


def _cells(ms: Sequence[Measurement]) -> dict[tuple[float, str], dict[str, _Cell]]:
    table: dict[tuple[float, str], dict[str, _Cell]] = {}
    for m in ms:
        row = table.setdefault((m.rate, m.configuration), {name: _Cell([]) for name, _ in COLUMNS})
        for name, metric in COLUMNS:
            value = metric(m.summary)
            if value is not None:
                row[name].values.append(value)
    return table


def format_table(ms: Sequence[Measurement]) -> str:
    table = _cells(ms)
    header = ["rate", "configuration", *(name for name, _ in COLUMNS)]
    rows = [
        [f"x{rate:g}", config, *(str(cells[name]) for name, _ in COLUMNS)] for (rate, config), cells in table.items()
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header, *rows]
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def headline_ratios(ms: Sequence[Measurement]) -> list[str]:
    """The issue's targets as measured ratios, per rate (medians over runs)."""
    table = _cells(ms)
    out = []
    for rate in sorted({rate for rate, _ in table}):

        def med(config: str, column: str, rate: float = rate) -> float | None:
            cells = table.get((rate, config))
            return cells[column].median if cells else None

        rr, kv = med("round_robin", "TTFT p90 s"), med("kv", "TTFT p90 s")
        if rr is not None and kv:
            # TTFT is over served requests: a configuration that fails its slowest ones fast reads faster
            failed = [med(c, "errors") or 0.0 for c in ("round_robin", "kv")]
            note = f" ({failed[0]:g} and {failed[1]:g} requests failed: TTFT over those served)" if any(failed) else ""
            out.append(f"x{rate:g}: round_robin / kv TTFT p90 = {rr / kv:.2f}x (target >= 3x){note}")
        fixed = [g for g in (med("kv", "goodput r/s"), med("kv_disagg", "goodput r/s")) if g is not None]
        for policy in ("ttft_model", "slo_aware", "slo_spill"):
            goodput = med(policy, "goodput r/s")
            if goodput is not None and fixed and max(fixed) > 0:
                out.append(
                    f"x{rate:g}: {policy} goodput / best fixed mode = {goodput / max(fixed):.2f}x (target >= 1.15x)"
                )
        for name, peer in PEERS.items():
            ours, theirs = med(peer.same_mode_as, "TTFT p90 s"), med(name, "TTFT p90 s")
            ours_tps, theirs_tps = med(peer.same_mode_as, "tok/s"), med(name, "tok/s")
            if ours and theirs and ours_tps and theirs_tps:
                out.append(
                    f"x{rate:g}: {name} / {peer.same_mode_as} TTFT p90 = {theirs / ours:.2f}x, "
                    f"{peer.same_mode_as} / {name} throughput = {ours_tps / theirs_tps:.2f}x"
                )
    return out
