"""`kvswitch bench overhead`: what a router adds to a request, in one run and one table.

One local cluster: two aggregated engine_sims (one `kvswitch sim --count 2` process), a shim each,
one kvswitch router (`--routing kv --disagg never`), and, when installed, the peer routers
(sglang-router `cache_aware`, vllm-router `kv_aware`) in front of the same two engines. Every
target is measured against the same engines in the same run:

- `direct`: the engines themselves (requests round-robin over both), the baseline;
- `kvswitch`: through the router, router -> NATS -> shim -> engine and back;
- each peer: through the peer, which proxies HTTP to the engines.

Two clients, each at each of its loads, per target:
- aiperf 0.13 (bench.aiperf_client), closed loop at each `--concurrency`, ISL/OSL `--isl/--osl`,
  the same seed (so the same prompts) for every target;
- the router's own open-loop client (kvswitch.client via bench.replay) at each `--rates` req/s
  for `--seconds`, one fresh prompt of `--client-isl` random token ids per request, evenly spaced,
  the same prompts for every target. Peers get the same prompts as text (sglang-router takes no
  token ids).

Before every phase both engines' prefix caches are reset (`POST /reset_prefix_cache`), so every
target meets cold caches with the same prompts. Targets run in turn, in reverse order on odd
repeats, so drift on a shared machine does not favour one side.

Per phase: TTFT p50/p99; ITL p50/p99 (per request: (last token - first token) / (tokens - 1), as
aiperf defines it; percentiles over requests); time to second token (first to second chunk)
p50/p99;
output token throughput; and the CPU time of the kvswitch router, of the two shims together and of
each peer router over the phase's window, from /proc/<pid>/stat (bench.cpu), per request and per
streamed token. A row reports a target minus (or over) `direct` of the same repeat; with repeats,
each cell is the median over repeats `±` half their range. Direct rows show the baseline's own
values (absolute, ms), and the CPU the router and shims spend while not in the path (heartbeats,
load reports, KV events of the direct traffic): the background to read the other rows against.
Client rows also give the open-loop client's send lag (actual send less due time, every request)
p50/p99, absolute.

Latency percentiles are over successful requests, so the verdicts (`target_lines`) look at what
the percentiles leave out before judging them:
- failed requests: a load where kvswitch failed any is MISSED (a router that answers its slowest
  requests with a fast 503 would otherwise look faster); one where direct failed any is not
  judged (the baseline is incomplete);
- a late client: a load where a client phase's send lag p99 exceeds half the inter-arrival gap is
  not judged (`lag_bound_s`);
- time to second token: not measurable when direct's TTST p50 is under a tenth of its ITL p50
  (the engines send their first two tokens together, so a held first token shows in TTFT instead);
- p99 verdicts name their sample count: p99 of 100 requests is about the second-slowest one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bench.aiperf_client import BENCH_VENV, AiperfRun, find_aiperf
from bench.cpu import CpuSampler, CpuWindow
from bench.flag_numbers import check_positive, positive_numbers
from bench.flame import (
    ROUTER_RULES,
    SAMPLE_HZ,
    SHIM_RULES,
    Recording,
    breakdown,
    find_py_spy,
    format_breakdown,
    read_stacks,
)
from bench.peers import PEERS, Peer, PeerProcess, missing_binaries
from bench.replay import RequestResult, replay
from bench.results_file import ResultsFile, fresh_path, stamp
from bench.stop_signals import held
from bench.trace import TokenSynth
from bench.workloads import WorkItem
from kvswitch.cluster import ClusterSpec, LocalCluster
from protocol.timing import check_speedup

__all__ = [
    "OverheadSpec",
    "Phase",
    "Target",
    "add_overhead_parser",
    "client_phase",
    "format_table",
    "overhead_main",
    "reset_prefix_caches",
    "run_client",
    "run_overhead",
    "target_lines",
    "ttft_split_lines",
]

DIRECT = "direct"
KVSWITCH = "kvswitch"
ROUTER_ARGS = ("--routing", "kv", "--disagg", "never")
PEER_NAMES = ("sglang_cache_aware", "vllm_kv_aware")  # the aggregated peers; vllm_pd needs a P/D fleet


@dataclass
class OverheadSpec:
    speedup: float = 5.0
    isl: int = 1024
    osl: int = 64
    concurrencies: list[int] = field(default_factory=lambda: [1, 8, 64])
    requests: int = 100
    rates: list[float] = field(default_factory=lambda: [50.0, 200.0, 500.0])
    seconds: float = 5.0
    client_isl: int = 128
    client_osl: int = 16
    repeats: int = 1
    seed: int = 0
    aiperf: str | None = None  # the executable; None runs the open-loop client only
    peers: list[Peer] = field(default_factory=list)
    out_dir: Path = Path("bench/out")
    keep_logs: bool = False
    shim_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=lambda: list(ROUTER_ARGS))
    py_spy: str | None = None  # set: profile the router and one shim in every kvswitch phase
    profile_dir: Path = Path("bench/out/profiles")


class Phase(msgspec.Struct, kw_only=True):
    """One target at one load in one repeat. Latencies in seconds; `cpu_s` per process group
    (`router`: the target's router process, `shim`: both shims) over the phase's window."""

    tool: str  # "aiperf" or "client"
    load: str  # "c=8" or "200/s"
    target: str
    repeat: int
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    ttst_p50: float
    ttst_p99: float
    tokens_per_s: float
    requests: int  # sent, failed ones included
    tokens: int
    errors: int
    cpu_s: dict[str, float]
    window_s: float
    # the router's Server-Timing medians in ms (parse, route, worker) and `edge`, the median of each
    # request's TTFT less their sum: the client's HTTP hop to the router and back. Client rows only.
    server_ms: dict[str, float] = msgspec.field(default_factory=dict)
    # Client rows only (aiperf is closed loop: no schedule to be late for). Send lag: each request's
    # send less its due time, over every request. `ttft_due_*`: TTFT counted from the due time.
    send_lag_p50: float | None = None
    send_lag_p99: float | None = None
    ttft_due_p50: float | None = None
    ttft_due_p99: float | None = None


@dataclass(frozen=True)
class Target:
    """Where requests go, and which sampler group is its router process."""

    name: str
    urls: list[str]
    router_group: str  # the sampler group of its router process
    text_prompts: bool = False


# --- the open-loop client ------------------------------------------------------------------------


def client_items(rate: float, seconds: float, isl: int, osl: int) -> list[WorkItem]:
    """Evenly spaced requests, each with a prompt of its own (segment id = its index)."""
    n = max(1, round(rate * seconds))
    return [WorkItem(i / rate, ((i, isl),), osl, f"client:{i}") for i in range(n)]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


def client_phase(results: Sequence[RequestResult], *, load: str, target: str, repeat: int, cpu: CpuWindow) -> Phase:
    """A phase's figures from the open-loop client's per-request results."""
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    itl = [sum(r.itl_s) / (r.output_tokens - 1) for r in ok if r.itl_s and r.output_tokens > 1]
    ttst = [r.itl_s[0] for r in ok if r.itl_s]
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in results]
    span = max(ends) - min(r.sent_s for r in results) if results else 0.0
    tokens = sum(r.output_tokens for r in ok)
    lag = [r.sent_s - r.due_s for r in results]
    ttft_due = [r.ttft_s + r.sent_s - r.due_s for r in ok if r.ttft_s is not None]
    return Phase(
        tool="client",
        load=load,
        target=target,
        repeat=repeat,
        ttft_p50=_pct([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        ttft_p99=_pct([r.ttft_s for r in ok if r.ttft_s is not None], 99),
        itl_p50=_pct(itl, 50),
        itl_p99=_pct(itl, 99),
        ttst_p50=_pct(ttst, 50),
        ttst_p99=_pct(ttst, 99),
        tokens_per_s=tokens / span if span > 0 else 0.0,
        requests=len(results),
        tokens=tokens,
        errors=len(results) - len(ok),
        cpu_s=dict(cpu.cpu_s),
        window_s=cpu.wall_s,
        server_ms=_server_ms(ok),
        send_lag_p50=_pct(lag, 50),
        send_lag_p99=_pct(lag, 99),
        ttft_due_p50=_pct(ttft_due, 50),
        ttft_due_p99=_pct(ttft_due, 99),
    )


def rate_lag_bound_s(rate: float) -> float:
    """The send lag p99 a client at `rate` req/s may have: half the gap between due times. A request
    sent later than that is nearer its successor's slot than its own: the requests bunched, and the
    load was not the evenly spaced one the row names. (asyncio's timers wake up to ~1 ms late, so a
    healthy client keeps within it up to 200 req/s; 500 req/s is at its limit.)"""
    return 0.5 / rate


def lag_bound_s(load: str) -> float | None:
    """rate_lag_bound_s of a row's load ("200/s"); None for closed loop."""
    return rate_lag_bound_s(float(load.removesuffix("/s"))) if load.endswith("/s") else None


def _late(p: Phase) -> bool:
    bound = lag_bound_s(p.load)
    return bound is not None and p.send_lag_p99 is not None and p.send_lag_p99 > bound


def _server_ms(ok: Sequence[RequestResult]) -> dict[str, float]:
    parts = ("parse", "route", "worker")
    timed = [r for r in ok if r.ttft_s is not None and set(parts) <= r.server_ms.keys()]
    if not timed:
        return {}
    out = {name: statistics.median(r.server_ms[name] for r in timed) for name in parts}
    out["edge"] = statistics.median((r.ttft_s or 0.0) * 1e3 - sum(r.server_ms[p] for p in parts) for r in timed)
    return out


# --- one run -------------------------------------------------------------------------------------


def reset_prefix_caches(engine_urls: Sequence[str]) -> None:
    for url in engine_urls:
        req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=10) as resp:
            if resp.status != 200:
                raise RuntimeError(f"POST {url}/reset_prefix_cache: HTTP {resp.status}")


def _cpu_of(window: CpuWindow, target: Target) -> dict[str, float]:
    return {"router": window.cpu_s[target.router_group], "shim": window.cpu_s["shim"]}


def run_client(spec: OverheadSpec, target: Target, rate: float, repeat: int, model: str, sampler: CpuSampler) -> Phase:
    items = client_items(rate, spec.seconds, spec.client_isl, spec.client_osl)
    t0 = sampler.sample()
    run = asyncio.run(
        replay(
            items,
            target.urls,
            model=model,
            synth=TokenSynth(spec.seed),
            progress=False,
            text_prompts=target.text_prompts,
            timeout_s=120.0,
        )
    )
    t1 = sampler.sample()
    window = sampler.window(t0, t1)
    window = CpuWindow(_cpu_of(window, target), window.wall_s)
    return client_phase(run.results, load=f"{rate:g}/s", target=target.name, repeat=repeat, cpu=window)


def _run_aiperf(
    aiperf: AiperfRun, target: Target, concurrency: int, repeat: int, sampler: CpuSampler, out: Path
) -> Phase:
    result = aiperf.run(target.urls, concurrency, out / f"{target.name}-c{concurrency}-r{repeat}")
    window = sampler.window(*result.window)
    return Phase(
        tool="aiperf",
        load=f"c={concurrency}",
        target=target.name,
        repeat=repeat,
        ttft_p50=result.ttft_p50,
        ttft_p99=result.ttft_p99,
        itl_p50=result.itl_p50,
        itl_p99=result.itl_p99,
        ttst_p50=result.ttst_p50,
        ttst_p99=result.ttst_p99,
        tokens_per_s=result.output_tokens_per_s,
        requests=result.requests + result.errors,  # aiperf's request_count is the valid ones
        tokens=result.output_tokens,
        errors=result.errors,
        cpu_s=_cpu_of(window, target),
        window_s=window.wall_s,
    )


@contextlib.contextmanager
def _profiled(spec: OverheadSpec, target: Target, groups: dict[str, list[int]], name: str) -> Iterator[None]:
    """py-spy on the router and the first shim while a kvswitch phase runs (with `spec.py_spy`)."""
    if spec.py_spy is None or target.name != KVSWITCH:
        yield
        return
    with (
        Recording(spec.py_spy, groups[KVSWITCH][0], spec.profile_dir / f"router-{name}"),
        Recording(spec.py_spy, groups["shim"][0], spec.profile_dir / f"shim-{name}"),
    ):
        yield


def _pid(cluster: LocalCluster, prefix: str) -> list[int]:
    return [c.proc.pid for c in cluster.children if c.name.startswith(prefix)]


def run_overhead(spec: OverheadSpec, *, on_phase: Callable[[Phase], None] = lambda p: None) -> list[Phase]:
    """Bring the cluster (and peers) up once, measure every (repeat, load, target), tear down."""
    now = stamp()
    log_dir = spec.out_dir / f"overhead-logs-{now}" if spec.keep_logs else None
    cluster = LocalCluster(
        ClusterSpec(
            agg=2,
            routers=1,
            speedup=spec.speedup,
            router_args=list(spec.router_args),
            shim_args=list(spec.shim_args),
            namespace="ovh" + uuid.uuid4().hex[:8],
            log_dir=log_dir,
        )
    )
    peers: list[PeerProcess] = []
    phases: list[Phase] = []
    try:
        cluster.start()
        cluster.wait_ready(timeout=90)
        groups = {KVSWITCH: _pid(cluster, "router-"), "shim": _pid(cluster, "shim-")}
        targets = [Target(DIRECT, cluster.sim_urls, KVSWITCH), Target(KVSWITCH, cluster.router_urls, KVSWITCH)]
        for peer in spec.peers:
            log = log_dir / f"{peer.name}.log" if log_dir is not None else None
            process = PeerProcess(
                peer, cluster.engines, block_size=cluster.spec.block_size, model=cluster.spec.model, log=log
            )
            peers.append(process)
            process.start()
            groups[peer.name] = [process.pid]
            targets.append(Target(peer.name, [process.url], peer.name, text_prompts=True))
        sampler = CpuSampler(groups)
        aiperf = (
            AiperfRun(spec.aiperf, cluster.spec.model, spec.isl, spec.osl, spec.requests, spec.seed,
                      hf_home=spec.out_dir / "hf-home")
            if spec.aiperf is not None
            else None
        )  # fmt: skip
        aiperf_out = spec.out_dir / f"overhead-aiperf-{now}"
        loads: list[tuple[str, float]] = [("aiperf", c) for c in spec.concurrencies] if aiperf is not None else []
        loads += [("client", rate) for rate in spec.rates]
        with sampler.running():
            for repeat in range(spec.repeats):
                for tool, load in loads:
                    for target in targets if repeat % 2 == 0 else targets[::-1]:
                        reset_prefix_caches(cluster.sim_urls)
                        with _profiled(spec, target, groups, f"{tool}-{load:g}-r{repeat}"):
                            if tool == "aiperf" and aiperf is not None:
                                phase = _run_aiperf(aiperf, target, int(load), repeat, sampler, aiperf_out)
                            else:
                                phase = run_client(spec, target, load, repeat, cluster.spec.model, sampler)
                        phases.append(phase)
                        on_phase(phase)
    finally:
        with held():  # each phase is kept as it lands (on_phase)
            for process in peers:
                process.stop()
            cluster.stop()
    return phases


# --- the table -----------------------------------------------------------------------------------


def _cell(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    mid = fmt.format(statistics.median(values))
    spread = fmt.replace("+", "").format((max(values) - min(values)) / 2)
    return mid if len(values) == 1 else f"{mid}±{spread}"


def _per(cpu_s: float, n: int) -> float:
    return cpu_s * 1e6 / n if n else float("nan")


_LATENCIES = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "ttst_p50", "ttst_p99")
HEADER = [
    "tool", "load", "target", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TTST p50", "TTST p99", "thr ratio",
    "router us/req", "router us/tok", "shim us/req", "shim us/tok", "errors", "lag p50", "lag p99",
]  # fmt: skip


def _groups(phases: Sequence[Phase]) -> dict[tuple[str, str], dict[str, dict[int, Phase]]]:
    """(tool, load) -> target -> repeat -> phase, in the order first measured."""
    out: dict[tuple[str, str], dict[str, dict[int, Phase]]] = {}
    for p in phases:
        out.setdefault((p.tool, p.load), {}).setdefault(p.target, {})[p.repeat] = p
    return out


def added(phases: Sequence[Phase], tool: str, load: str, target: str, metric: str) -> list[float]:
    """`metric` of `target` minus direct's, per repeat that has both (seconds)."""
    by_target = _groups(phases).get((tool, load), {})
    base, ours = by_target.get(DIRECT, {}), by_target.get(target, {})
    return [getattr(ours[r], metric) - getattr(base[r], metric) for r in sorted(ours) if r in base]


def throughput_ratios(phases: Sequence[Phase], tool: str, load: str, target: str) -> list[float]:
    by_target = _groups(phases).get((tool, load), {})
    base, ours = by_target.get(DIRECT, {}), by_target.get(target, {})
    return [ours[r].tokens_per_s / base[r].tokens_per_s for r in sorted(ours) if r in base and base[r].tokens_per_s > 0]


def format_table(phases: Sequence[Phase]) -> str:
    """Latencies in ms: added over direct (direct rows: its own values); CPU in µs."""
    rows = []
    for (tool, load), by_target in _groups(phases).items():
        for target, reps in by_target.items():
            runs = list(reps.values())
            if target == DIRECT:
                lat = [_cell([getattr(p, m) * 1e3 for p in runs]) for m in _LATENCIES]
                ratio = "1"
            else:
                lat = [_cell([v * 1e3 for v in added(phases, tool, load, target, m)], "{:+.2f}") for m in _LATENCIES]
                ratio = _cell(throughput_ratios(phases, tool, load, target), "{:.3f}")
            cpu = [
                _cell([_per(p.cpu_s[group], p.tokens if per_token else p.requests) for p in runs], "{:.0f}")
                for group in ("router", "shim")
                for per_token in (False, True)
            ]
            errors = str(sum(p.errors for p in runs))
            # the client's own lateness, absolute; `!` past lag_bound_s in any repeat
            lag = [_cell([p.send_lag_p50 * 1e3 for p in runs if p.send_lag_p50 is not None])]
            lag.append(_cell([p.send_lag_p99 * 1e3 for p in runs if p.send_lag_p99 is not None]))
            lag[1] += "!" if any(_late(p) for p in runs) else ""
            name = target if target != DIRECT else "direct (abs)"
            rows.append([tool, load, name, *lat, ratio, *cpu, errors, *lag])
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = [
        "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in [HEADER, *rows]
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def ttft_split_lines(phases: Sequence[Phase]) -> list[str]:
    """Where kvswitch's added TTFT p50 goes, from its Server-Timing medians (per repeat, then the
    median over repeats): `hop` is `worker` less direct's TTFT p50 (the NATS hop and the shim, as
    the same engines answer both), `edge` the client's HTTP hop to the router and back."""
    out: list[str] = []
    for (tool, load), by_target in _groups(phases).items():
        base, ours = by_target.get(DIRECT, {}), by_target.get(KVSWITCH, {})
        reps = [(base[r], ours[r]) for r in sorted(ours) if r in base and ours[r].server_ms]
        if not reps:
            continue
        parts = {name: statistics.median(o.server_ms[name] for _, o in reps) for name in ("parse", "route", "edge")}
        parts["hop"] = statistics.median(o.server_ms["worker"] - d.ttft_p50 * 1e3 for d, o in reps)
        total = statistics.median((o.ttft_p50 - d.ttft_p50) * 1e3 for d, o in reps)
        out.append(
            f"{tool} {load}: added TTFT p50 {total:+.2f} ms; router parse {parts['parse']:.2f}, route "
            f"{parts['route']:.2f}, NATS + shim hop {parts['hop']:+.2f}, client-router HTTP {parts['edge']:.2f} ms"
        )
    return out


def _verdict(ok: bool, unjudged: str | None = None) -> str:
    return unjudged if unjudged is not None else "met" if ok else "MISSED"


def _unjudged(by_target: dict[str, dict[int, Phase]], target: str) -> str | None:
    """Why `target`'s figures at this load cannot be judged against direct's, or None. The
    percentiles are over successful requests: failures are judged here instead."""
    ours, base = by_target.get(target, {}).values(), by_target.get(DIRECT, {}).values()
    if errors := sum(p.errors for p in ours):
        return f"MISSED ({errors} errors)"
    if errors := sum(p.errors for p in base):
        return f"not judged ({errors} errors in direct)"
    late = _late_note([*base, *ours])
    return f"not judged ({late}; the load was not as named)" if late else None


def _late_note(phases: Sequence[Phase]) -> str | None:
    late = [p for p in phases if _late(p)]
    if not late:
        return None
    worst = max(late, key=lambda p: p.send_lag_p99 or 0.0)
    lag, bound = (worst.send_lag_p99 or 0.0) * 1e3, (lag_bound_s(worst.load) or 0.0) * 1e3
    return f"client late: {worst.target} send lag p99 {lag:.2f} ms > {bound:.2f} ms, half the gap"


def _peer_flaw(reps: dict[int, Phase]) -> str | None:
    """Why a peer is no baseline to be within 1 ms of: it failed requests, or its client was late."""
    if errors := sum(p.errors for p in reps.values()):
        return f"{errors} errors"
    return _late_note(list(reps.values()))


def _p99_of(by_target: dict[str, dict[int, Phase]], target: str) -> str:
    """How many requests a p99 verdict rests on: the fewest successful in any phase it compares."""
    n = min(p.requests - p.errors for t in (DIRECT, target) for p in by_target.get(t, {}).values())
    # linear p99 of n samples lies between the k-th and (k-1)-th slowest
    k = n - math.floor(0.99 * (n - 1)) if n > 0 else 0
    return f"p99 of {n} requests: about the {_ordinal(k)} slowest"


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def target_lines(phases: Sequence[Phase]) -> list[str]:
    """The issue's targets for kvswitch, medians over repeats, each with its verdict, or why it is
    not judged (module docstring)."""
    groups = _groups(phases)
    out: list[str] = []

    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    for tool, load in (("aiperf", "c=8"), ("client", "200/s")):
        p50 = med(added(phases, tool, load, KVSWITCH, "ttft_p50"))
        p99 = med(added(phases, tool, load, KVSWITCH, "ttft_p99"))
        if p50 is not None and p99 is not None:
            by_target = groups[(tool, load)]
            ok = p50 <= 0.002 and p99 <= 0.005
            out.append(
                f"{tool} {load}: added TTFT p50 {p50 * 1e3:+.2f} ms (<= 2), p99 {p99 * 1e3:+.2f} ms (<= 5): "
                f"{_verdict(ok, _unjudged(by_target, KVSWITCH))} ({_p99_of(by_target, KVSWITCH)})"
            )
    for tool, load in groups:
        by_target = groups[(tool, load)]
        unjudged = _unjudged(by_target, KVSWITCH)
        ratio = med(throughput_ratios(phases, tool, load, KVSWITCH))
        ttst = med(added(phases, tool, load, KVSWITCH, "ttst_p50"))
        if ratio is not None:
            # The open-loop client sends at its own rate: tokens per second there is the load it
            # offers (a router adding 100 ms to every request read 0.98x), no throughput verdict.
            why = unjudged or ("not judged: open loop, the rate is the client's" if tool == "client" else None)
            out.append(f"{tool} {load}: throughput {ratio:.3f}x direct (>= 0.97): {_verdict(ratio >= 0.97, why)}")
        ttst99 = med(added(phases, tool, load, KVSWITCH, "ttst_p99"))
        if ttst is not None and ttst99 is not None and not (math.isnan(ttst) or math.isnan(ttst99)):
            met = ttst <= 0.001
            # only a met can be one the data cannot show (_ttst_unmeasurable); a miss is as measured
            why = unjudged or (_ttst_unmeasurable(by_target) if met else None)
            out.append(
                f"{tool} {load}: added time to second token p50 {ttst * 1e3:+.2f} ms (<= 1): "
                f"{_verdict(met, why)} (p99 {ttst99 * 1e3:+.2f} ms)"
            )
        peers = [t for t in by_target if t not in (DIRECT, KVSWITCH)]
        left_out = {t: why for t in peers if (why := _peer_flaw(by_target[t])) is not None}
        note = "".join(f"; {t} left out: {why}" for t, why in left_out.items())
        for metric in ("ttft_p50", "itl_p50"):
            ours = med(added(phases, tool, load, KVSWITCH, metric))
            theirs = [
                (v, t)
                for t in peers
                if t not in left_out and (v := med(added(phases, tool, load, t, metric))) is not None
            ]
            if ours is not None and theirs:
                best, who = min(theirs)
                out.append(
                    f"{tool} {load}: added {metric.replace('_', ' ')} {ours * 1e3:+.2f} ms vs best peer {who} "
                    f"{best * 1e3:+.2f} ms (within 1 ms): {_verdict(ours - best <= 0.001, unjudged)}{note}"
                )
            elif ours is not None and left_out:
                out.append(f"{tool} {load}: added {metric.replace('_', ' ')} vs best peer: not judged{note}")
    return out


def _ttst_unmeasurable(by_target: dict[str, dict[int, Phase]]) -> str | None:
    """Why an added time to second token within target cannot show it met at this load, or None.
    When direct's second token follows its first by under a tenth of a decode step (ITL), the engine
    sent both in one write: a first token held on the way (a coalescing shim) then arrives with the
    second and the hold lands in TTFT, not here. A second token held on its own still shows, so a
    miss is judged as measured."""
    base = list(by_target.get(DIRECT, {}).values())
    ttst = [p.ttst_p50 for p in base if not math.isnan(p.ttst_p50)]
    itl = [p.itl_p50 for p in base if not math.isnan(p.itl_p50)]
    if not ttst or not itl or statistics.median(ttst) >= statistics.median(itl) / 10:
        return None
    return (
        f"not measurable here (direct TTST p50 {statistics.median(ttst) * 1e3:.2f} ms against ITL p50 "
        f"{statistics.median(itl) * 1e3:.2f} ms: the engines send their first two tokens together)"
    )


# --- the command ---------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_overhead_parser(sub: Any) -> None:
    """Adds `overhead` to `kvswitch bench`'s subcommands (an argparse subparsers object)."""
    p = sub.add_parser("overhead", help="what a router adds per request: aiperf and the open-loop client, one table")
    p.add_argument("--speedup", type=float, default=5.0, help="engine_sim speed-up (default 5)")
    p.add_argument("--isl", type=int, default=1024, help="aiperf: prompt tokens (default 1024)")
    p.add_argument("--osl", type=int, default=64, help="aiperf: output tokens (default 64)")
    p.add_argument("--concurrency", default="1,8,64", help="aiperf: comma-separated concurrencies")
    p.add_argument("--requests", type=int, default=100, help="aiperf: requests per phase (at least 4x concurrency)")
    p.add_argument("--rates", default="50,200,500", help="open-loop client: comma-separated req/s")
    p.add_argument("--seconds", type=float, default=5.0, help="open-loop client: seconds per phase")
    p.add_argument("--client-isl", type=int, default=128, help="open-loop client: prompt tokens")
    p.add_argument("--client-osl", type=int, default=16, help="open-loop client: output tokens")
    p.add_argument("--repeats", type=int, default=1, help="measure every phase this many times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aiperf", default=None, help="aiperf executable (default .venv-bench/bin/aiperf, then PATH)")
    p.add_argument("--no-aiperf", action="store_true", help="the open-loop client only")
    p.add_argument("--no-peers", action="store_true", help="leave out sglang-router and vllm-router")
    p.add_argument("--shim-arg", action="append", default=[], help="extra `kvswitch shim` argument (repeat)")
    p.add_argument("--out-dir", type=Path, default=Path("bench/out"), help="results and logs (default bench/out)")
    p.add_argument("--keep-logs", action="store_true", help="keep every child's log under --out-dir")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="py-spy the router and a shim in every kvswitch phase: flame graphs (SVG) and stacks in DIR "
        "(sampling costs CPU: the figures of a profiled run are not the ones to quote)",
    )
    p.add_argument("--py-spy", default=None, help="py-spy executable (default .venv-bench/bin/py-spy, then PATH)")


def _print_profiles(spec: OverheadSpec, phases: Sequence[Phase]) -> None:
    for p in phases:
        if p.target != KVSWITCH:
            continue
        name = f"{p.tool}-{float(p.load.removeprefix('c=').removesuffix('/s')):g}-r{p.repeat}"
        for role, rules in (("router", ROUTER_RULES), ("shim", SHIM_RULES)):
            stacks = spec.profile_dir / f"{role}-{name}.txt"
            # the profiled shim is one of two: half the shims' CPU
            cpu = p.cpu_s[role] / (2 if role == "shim" else 1) * 1e6 / p.requests if p.requests else None
            print(f"\n{role} during {p.tool} {p.load} (py-spy samples, {stacks.with_suffix('.svg')}):")
            with stacks.open() as fh:
                counts = breakdown(read_stacks(fh), rules)
            busy = p.cpu_s[role] / (2 if role == "shim" else 1) / p.window_s
            print(
                f"py-spy found it active in {sum(counts.values()) / (SAMPLE_HZ * p.window_s):.0%} of samples; /proc: "
                f"{busy:.0%} of a core (a gap is time runnable but waiting for a CPU, charged where it was preempted)"
            )
            print(format_breakdown(counts, cpu_us_per_request=cpu))


def _bench_venv_on_path() -> None:
    """`make bench-deps` puts the peers' executables in .venv-bench/bin: look there too."""
    bin_dir = (BENCH_VENV / "bin").resolve()
    if bin_dir.is_dir():
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def overhead_main(args: argparse.Namespace) -> int:
    _bench_venv_on_path()
    concurrencies = [int(c) for c in _floats(args.concurrency)]
    # a NaN or infinite rate passed `<= 0`; '' runs no open-loop phase (docs/benchmarks.md's runs)
    rates = positive_numbers("--rates", args.rates) if args.rates.strip() else []
    if args.repeats < 1 or any(c < 1 for c in concurrencies):
        raise ValueError("--repeats and --concurrency must be >= 1")
    check_positive("--speedup", args.speedup)
    check_speedup(args.speedup, "--speedup")  # its shims register the sims' profile at it
    check_positive("--seconds", args.seconds)
    aiperf = None if args.no_aiperf else find_aiperf(args.aiperf)
    if aiperf is None and not args.no_aiperf:
        raise ValueError("aiperf is not installed: `make bench-deps` (or --aiperf PATH, or --no-aiperf)")
    peers: list[Peer] = []
    if not args.no_peers:
        for name in PEER_NAMES:
            if missing_binaries([PEERS[name]]):
                binary = PEERS[name].binary
                print(f"skipping {name}: no {binary} on PATH or in .venv-bench (make bench-deps)", file=sys.stderr)
            else:
                peers.append(PEERS[name])
    py_spy = find_py_spy(args.py_spy) if args.profile is not None else None
    if args.profile is not None and py_spy is None:
        raise ValueError("--profile needs py-spy: `make bench-deps` (or --py-spy PATH)")
    spec = OverheadSpec(
        speedup=args.speedup, isl=args.isl, osl=args.osl, concurrencies=concurrencies, requests=args.requests,
        rates=rates, seconds=args.seconds, client_isl=args.client_isl, client_osl=args.client_osl,
        repeats=args.repeats, seed=args.seed, aiperf=aiperf, peers=peers, out_dir=args.out_dir,
        keep_logs=args.keep_logs, shim_args=list(args.shim_arg), py_spy=py_spy,
        profile_dir=args.profile or Path("bench/out/profiles"),
    )  # fmt: skip
    started = time.monotonic()
    path = fresh_path(spec.out_dir, "overhead", ".json")
    saved = ResultsFile[Phase](path)

    def progress(p: Phase) -> None:
        saved.add(p)
        lag = f", send lag p99 {p.send_lag_p99 * 1e3:.2f} ms" if p.send_lag_p99 is not None else ""
        print(
            f"[repeat {p.repeat + 1}/{spec.repeats}] {p.tool} {p.load} {p.target}: TTFT p50 {p.ttft_p50 * 1e3:.2f} ms, "
            f"{p.requests} requests, {p.errors} errors{lag}",
            file=sys.stderr,
            flush=True,
        )

    with saved.kept_on_failure("kvswitch bench overhead"):
        phases = run_overhead(spec, on_phase=progress)
    print(
        f"\n2 agg sims at {spec.speedup:g}x; aiperf ISL {spec.isl} OSL {spec.osl}; client ISL {spec.client_isl} "
        f"OSL {spec.client_osl}, {spec.seconds:g} s per rate; {spec.repeats} repeat(s). Latencies: ms added over "
        "direct (direct: absolute), successful requests only; CPU: µs per request / per streamed token; lag: the "
        "client's send less due time, ms (`!`: p99 over half the gap between requests)."
    )
    print(format_table(phases))
    for line in [*target_lines(phases), *ttft_split_lines(phases)]:
        print(line)
    if spec.py_spy is not None:
        _print_profiles(spec, phases)
    print(f"results: {path}\ntotal {time.monotonic() - started:.0f} s wall")
    return 0
