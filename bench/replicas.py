"""`kvswitch bench replicas`: one router replica's ceiling, what each replica pays for its peers'
requests, and a model of N replicas checked at N = 1, 2, 3.

1. **Ceiling.** One replica pinned to one core (`--core`), the open-loop client (bench.overhead)
   at rising `--rates`, direct and through the router at each, same prompts, caches reset before
   each phase. The ceiling is the highest rate at which added TTFT p50 <= 2 ms and p99 <= 5 ms
   hold with no failed request and the client on schedule (send lag p99 within half the gap
   between requests, bench.overhead.rate_lag_bound_s). The router's CPU per request at each rate is
   `c_own` (everything one replica does for a request it serves, including the KV events and load
   reports that request causes).
2. **Peer cost.** N replicas, every request sent to replica 0 at `--check-rate`: each other
   replica's CPU over the phase, less its own CPU over an idle window as long just before, per
   request of replica 0, is `c_peer`: what a replica pays for a request it does not serve (the
   peer's booking messages on `{ns}.router.sync`, and the KV events and load reports that request
   causes, which every replica ingests).
3. **Model.** At a total rate R spread over N replicas, each replica spends
       cpu(N, R) = R/N * c_own + R * (N-1)/N * c_peer      (core-seconds per second)
   checked by spreading `--check-rate` round-robin over N = 1, 2, 3 replicas and comparing each
   replica's measured CPU with the prediction. If one replica meets the latency targets up to R1
   req/s (its ceiling, using u = R1 * c_own of its core), N replicas on N cores meet them up to
       R_max(N) = N * R1 / (1 + (N-1) * c_peer / c_own)
   which tends to R1 * c_own / c_peer however many cores are added: the peer cost caps scaling.
   NATS's own CPU per request (its fan-out of KV events, load reports and sync messages to N
   replicas) is measured too, since it grows with N and shares the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cpu import CpuSampler, pin_process
from bench.flag_numbers import check_positive, positive_numbers
from bench.flame import ROUTER_RULES, Recording, breakdown, find_py_spy, format_breakdown, read_stacks
from bench.overhead import (
    ROUTER_ARGS,
    OverheadSpec,
    Phase,
    Target,
    lag_bound_s,
    rate_lag_bound_s,
    reset_prefix_caches,
    run_client,
)
from bench.results_file import check_out_dir, stamp
from bench.stop_signals import held
from kvswitch.cluster import ClusterSpec, LocalCluster
from protocol.timing import check_speedup

__all__ = ["ReplicaSpec", "add_replicas_parser", "predicted_cpu", "project", "r_max", "replicas_main"]

CORES = [1, 2, 3, 4, 8, 12, 16]
TTFT_P50_TARGET_S = 0.002
TTFT_P99_TARGET_S = 0.005


@dataclass
class ReplicaSpec:
    rates: list[float] = field(default_factory=lambda: [10.0, 25.0, 50.0, 100.0, 200.0])
    check_rate: float = 40.0
    replicas: list[int] = field(default_factory=lambda: [1, 2, 3])
    seconds: float = 5.0
    speedup: float = 5.0
    client_isl: int = 128
    client_osl: int = 16
    core: int | None = None  # pin the ceiling's router here (default: the last CPU)
    py_spy: str | None = None  # set: profile replica 1 while replica 0 serves everything
    profile_dir: Path = Path("bench/out/profiles")
    seed: int = 0
    log_dir: Path | None = None


def r_max(n: int, r1: float, c_own: float, c_peer: float) -> float:
    """The model's highest total rate for `n` replicas on `n` cores (module docstring, 3)."""
    return n * r1 / (1 + (n - 1) * c_peer / c_own)


def predicted_cpu(n: int, rate: float, c_own: float, c_peer: float) -> float:
    """Core-seconds per second one of `n` replicas spends at total `rate` (module docstring, 3)."""
    return rate / n * c_own + rate * (n - 1) / n * c_peer


def project(r1: float, c_own: float, c_peer: float, cores: Sequence[int]) -> list[tuple[int, float]]:
    return [(n, r_max(n, r1, c_own, c_peer)) for n in cores]


class _Cluster:
    """A LocalCluster with `routers` replicas and a sampler over its processes."""

    def __init__(self, spec: ReplicaSpec, routers: int) -> None:
        self.cluster = LocalCluster(
            ClusterSpec(
                agg=2,
                routers=routers,
                speedup=spec.speedup,
                router_args=list(ROUTER_ARGS),
                namespace="rep" + uuid.uuid4().hex[:8],
                log_dir=spec.log_dir / f"n{routers}" if spec.log_dir is not None else None,
            )
        )
        self.sampler: CpuSampler | None = None

    def __enter__(self) -> _Cluster:
        try:
            self.cluster.start()
            self.cluster.wait_ready(timeout=90)
        except BaseException:
            with held():
                self.cluster.stop()
            raise
        c = self.cluster
        routers = [ch.proc.pid for ch in c.children if ch.name.startswith("router-")]
        groups = {f"router-{i}": [pid] for i, pid in enumerate(routers)}
        groups["shim"] = [ch.proc.pid for ch in c.children if ch.name.startswith("shim-")]
        assert c.nats is not None
        groups["nats"] = [pid for node in c.nats.nodes if (pid := node.pid) is not None]
        self.sampler = CpuSampler(groups)
        return self

    def __exit__(self, *exc: object) -> None:
        with held():
            self.cluster.stop()

    @property
    def routers(self) -> list[str]:
        return self.cluster.router_urls

    def pid(self, router: int) -> int:
        assert self.sampler is not None
        return self.sampler.groups[f"router-{router}"][0]

    def phase(self, spec: ReplicaSpec, urls: list[str], rate: float, name: str) -> tuple[Phase, dict[str, float]]:
        """One open-loop phase; the phase and every group's CPU seconds over it."""
        assert self.sampler is not None
        reset_prefix_caches(self.cluster.sim_urls)
        ospec = OverheadSpec(
            seconds=spec.seconds, client_isl=spec.client_isl, client_osl=spec.client_osl, seed=spec.seed
        )
        t0 = self.sampler.sample()
        phase = run_client(ospec, Target(name, urls, "router-0"), rate, 0, self.cluster.spec.model, self.sampler)
        t1 = self.sampler.sample()
        return phase, dict(self.sampler.window(t0, t1).cpu_s)

    def idle(self, seconds: float) -> dict[str, float]:
        assert self.sampler is not None
        t0 = self.sampler.sample()
        time.sleep(seconds)
        return dict(self.sampler.window(t0, self.sampler.sample()).cpu_s)


@dataclass
class CeilingStep:
    rate: float
    added_p50_s: float
    added_p99_s: float
    c_own_s: float  # router CPU seconds per request
    errors: int  # kvswitch's failed requests: the step is missed
    direct_errors: int = 0  # the bare sims' failed requests: the step is not judged
    send_lag_p99_s: float = 0.0  # the later of the two client phases (bench.overhead.rate_lag_bound_s)
    samples: int = 0  # successful requests in the smaller phase: what p99 rests on

    @property
    def late(self) -> bool:
        """The client could not keep to the schedule: the rate was not the one named."""
        return self.send_lag_p99_s > rate_lag_bound_s(self.rate)

    @property
    def ok(self) -> bool:
        # A rate the client did not deliver cannot count as held: not judged, so not in R1.
        return (
            self.errors == 0
            and self.direct_errors == 0
            and not self.late
            and self.added_p50_s <= TTFT_P50_TARGET_S
            and self.added_p99_s <= TTFT_P99_TARGET_S
        )


def measure_ceiling(spec: ReplicaSpec) -> list[CeilingStep]:
    steps = []
    with _Cluster(spec, 1) as c:
        core = spec.core if spec.core is not None else max(os.sched_getaffinity(0))
        pin_process(c.pid(0), {core})  # every thread of the router, not only its main one
        for rate in spec.rates:
            direct, _ = c.phase(spec, c.cluster.sim_urls, rate, "direct")
            routed, cpu = c.phase(spec, c.routers, rate, "kvswitch")
            steps.append(
                CeilingStep(
                    rate=rate,
                    added_p50_s=routed.ttft_p50 - direct.ttft_p50,
                    added_p99_s=routed.ttft_p99 - direct.ttft_p99,
                    c_own_s=cpu["router-0"] / routed.requests,
                    errors=routed.errors,
                    direct_errors=direct.errors,
                    send_lag_p99_s=max(direct.send_lag_p99 or 0.0, routed.send_lag_p99 or 0.0),
                    samples=min(direct.requests - direct.errors, routed.requests - routed.errors),
                )
            )
            print(f"  ceiling: {_step_line(steps[-1])}", file=sys.stderr, flush=True)
    return steps


def _step_line(s: CeilingStep) -> str:
    if s.errors:
        verdict = f"  (MISSED: {s.errors} errors)"
    elif s.direct_errors:
        verdict = f"  (not judged: {s.direct_errors} errors in direct)"
    elif s.late:
        bound = rate_lag_bound_s(s.rate) * 1e3
        verdict = f"  (not judged: client late, send lag p99 {s.send_lag_p99_s * 1e3:.2f} ms > {bound:.2f} ms)"
    else:
        verdict = "" if s.ok else "  (targets missed)"
    return (
        f"{s.rate:g} req/s: added TTFT p50 {s.added_p50_s * 1e3:+.2f} ms, p99 {s.added_p99_s * 1e3:+.2f} ms "
        f"(of {s.samples} requests), router {s.c_own_s * 1e6:.0f} us/req, send lag p99 "
        f"{s.send_lag_p99_s * 1e3:.2f} ms, {s.errors} errors{verdict}"
    )


@dataclass
class ReplicaRun:
    n: int
    requests: int
    c_own_s: float | None  # N = 1: the router's CPU per request at the check rate
    c_peer_s: list[float]  # per idle replica, one-sided phase
    spread_cpu_s: list[float]  # per replica, spread phase, core-seconds per second
    nats_s_per_request: float
    wall_s: float


def measure_replicas(spec: ReplicaSpec, n: int) -> ReplicaRun:
    with _Cluster(spec, n) as c:
        rate = spec.check_rate
        idle = c.idle(spec.seconds)
        with contextlib.ExitStack() as stack:
            if spec.py_spy is not None and n > 1:
                stack.enter_context(Recording(spec.py_spy, c.pid(1), spec.profile_dir / f"peer-replica-n{n}"))
            one_sided, cpu_one = c.phase(spec, c.routers[:1], rate, "router-0 only")
        _check_served(one_sided, "router-0 only", n)
        peers = [
            (cpu_one[f"router-{i}"] - idle[f"router-{i}"]) / one_sided.requests for i in range(1, n)
        ]  # fmt: skip
        spread, cpu_spread = c.phase(spec, c.routers, rate, "spread")
        _check_served(spread, "spread", n)
        wall = spread.window_s
        return ReplicaRun(
            n=n,
            requests=spread.requests,
            c_own_s=cpu_one["router-0"] / one_sided.requests if n == 1 else None,
            c_peer_s=peers,
            spread_cpu_s=[cpu_spread[f"router-{i}"] / wall for i in range(n)],
            nats_s_per_request=cpu_spread["nats"] / spread.requests,
            wall_s=wall,
        )


class ModelPhaseError(ValueError):
    """A phase the N-replica model is built from was not served as asked: its per-request CPU
    would be that of failures, or of a load the client did not deliver."""


def _check_served(phase: Phase, name: str, n: int) -> None:
    if phase.errors:
        raise ModelPhaseError(
            f"{phase.errors} of {phase.requests} requests failed in the {name!r} phase with {n} replicas: the model "
            "divides CPU by requests served; rerun at a lower --check-rate"
        )
    bound = lag_bound_s(phase.load)
    if bound is not None and phase.send_lag_p99 is not None and phase.send_lag_p99 > bound:
        raise ModelPhaseError(
            f"the client fell behind its schedule in the {name!r} phase with {n} replicas (send lag p99 "
            f"{(phase.send_lag_p99 or 0) * 1e3:.1f} ms): rerun at a lower --check-rate or on a quieter machine"
        )
    if not phase.requests:
        raise ModelPhaseError(f"the {name!r} phase with {n} replicas sent no request: give more --seconds")


def add_replicas_parser(sub: Any) -> None:
    """Adds `replicas` to `kvswitch bench`'s subcommands (an argparse subparsers object)."""
    p = sub.add_parser("replicas", help="one replica's ceiling on one core, the peer cost, the N-replica model")
    p.add_argument("--rates", default="10,25,50,100,200", help="ceiling sweep, req/s (default 10,25,50,100,200)")
    p.add_argument(
        "--check-rate", type=float, default=40.0, help="total req/s of the peer-cost and model phases (default 40)"
    )
    p.add_argument("--replicas", default="1,2,3", help="replica counts to check the model at, 1 first (default 1,2,3)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per phase, each rate and each N (default 5)")
    p.add_argument("--speedup", type=float, default=5.0, help="engine_sim speed-up (default 5)")
    p.add_argument("--client-isl", type=int, default=128, help="open-loop client: prompt tokens (default 128)")
    p.add_argument("--client-osl", type=int, default=16, help="open-loop client: output tokens (default 16)")
    p.add_argument("--core", type=int, default=None, help="CPU to pin the ceiling's router to (default: the last)")
    p.add_argument("--out-dir", type=Path, default=Path("bench/out"), help="--keep-logs' directory (default bench/out)")
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep every child's log under --out-dir, in replicas-logs-<stamp>/n<N>/ (N: the replica count)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="py-spy replica 1 while replica 0 serves everything: what the peer cost is made of",
    )
    p.add_argument("--py-spy", default=None, help="py-spy executable (default .venv-bench/bin/py-spy, then PATH)")


def replicas_main(args: argparse.Namespace) -> int:
    ns = [int(x) for x in args.replicas.split(",")]
    if ns[0] != 1 or any(n < 1 for n in ns):
        raise ValueError(f"--replicas must start with 1 (it measures c_own), got {args.replicas}")
    rates = positive_numbers("--rates", args.rates)
    for flag, value in (("--check-rate", args.check_rate), ("--seconds", args.seconds), ("--speedup", args.speedup)):
        check_positive(flag, value)
    check_speedup(args.speedup, "--speedup")  # its shims register the sims' profile at it
    spec = ReplicaSpec(
        rates=rates, check_rate=args.check_rate, replicas=ns,
        seconds=args.seconds, speedup=args.speedup, client_isl=args.client_isl, client_osl=args.client_osl,
        core=args.core,
        log_dir=args.out_dir / f"replicas-logs-{stamp()}" if args.keep_logs else None,
        py_spy=find_py_spy(args.py_spy) if args.profile is not None else None,
        profile_dir=args.profile or Path("bench/out/profiles"),
    )  # fmt: skip
    if args.profile is not None and spec.py_spy is None:
        raise ValueError("--profile needs py-spy: `make bench-deps` (or --py-spy PATH)")
    if spec.log_dir is not None:  # --keep-logs
        check_out_dir("--out-dir", args.out_dir)  # last: a command refused before creates nothing
        print(f"logs: {spec.log_dir}", file=sys.stderr, flush=True)
    started = time.monotonic()
    steps = measure_ceiling(spec)
    runs = [measure_replicas(spec, n) for n in spec.replicas]
    base = runs[0]
    assert base.c_own_s is not None
    c_own = base.c_own_s
    if c_own <= 0:  # /proc counts CPU in clock ticks (10 ms): none in the whole phase
        raise ModelPhaseError(
            f"router-0 used no measurable CPU (under one {1e3 / os.sysconf('SC_CLK_TCK'):g} ms clock tick) over "
            f"{base.requests} requests: give more --seconds or a higher --check-rate"
        )
    c_peer = statistics.median(p for r in runs for p in r.c_peer_s) if any(r.c_peer_s for r in runs) else 0.0
    held = [s.rate for s in steps if s.ok]
    r1 = max(held) if held else 0.0
    print(
        f"\nceiling: one replica pinned to one core, open-loop ISL {spec.client_isl} OSL {spec.client_osl}, "
        f"{spec.seconds:g} s per rate"
    )
    for s in steps:
        print("  " + _step_line(s))
    print(
        f"  => R1 = {r1:g} req/s (highest rate with added TTFT p50 <= 2 ms and p99 <= 5 ms, no errors, the client "
        "on schedule)"
    )
    print(f"\nc_own  = {c_own * 1e6:.0f} us of router CPU per request it serves (N=1, {spec.check_rate:g} req/s)")
    per_n = ", ".join(f"N={r.n}: " + "/".join(f"{p * 1e6:.0f}" for p in r.c_peer_s) for r in runs if r.c_peer_s)
    print(f"c_peer = {c_peer * 1e6:.0f} us per request a peer serves (median; {per_n or 'no peers measured'})")
    print(f"\nmodel check at {spec.check_rate:g} req/s spread round-robin (CPU per replica, % of a core):")
    print("  N  measured per replica       predicted  NATS us/req")
    for r in runs:
        measured = " ".join(f"{x:.1%}" for x in r.spread_cpu_s)
        predicted = predicted_cpu(r.n, spec.check_rate, c_own, c_peer)
        print(f"  {r.n}  {measured:<24} {predicted:9.1%}  {r.nats_s_per_request * 1e6:11.0f}")
    # A full core per replica (u = 1): R1 = 1 / c_own. With a latency ceiling R1 measured, u = R1 * c_own.
    full = 1 / c_own
    print("\nprojection, R_max(N) = N * R1 / (1 + (N-1) * c_peer / c_own), N replicas on N cores (req/s):")
    print(f"  {'N':>3} {'each core 100% busy':>20} {'latency ceiling R1':>19}")
    for (n, cpu_bound), (_, latency) in zip(
        project(full, c_own, c_peer, CORES), project(r1, c_own, c_peer, CORES), strict=True
    ):
        print(f"  {n:>3} {cpu_bound:>20.0f} {latency:>19.0f}")
    if c_peer > 0:
        print(f"  limit, any N: R1 * c_own / c_peer = {full * c_own / c_peer:.0f} and {r1 * c_own / c_peer:.0f}")
    for r in runs:
        stacks = spec.profile_dir / f"peer-replica-n{r.n}.txt"
        if spec.py_spy is not None and r.n > 1 and stacks.exists():
            print(f"\nreplica 1 of {r.n} while replica 0 serves everything ({stacks.with_suffix('.svg')}):")
            with stacks.open() as fh:
                counts = breakdown(read_stacks(fh), ROUTER_RULES)
            print(format_breakdown(counts, cpu_us_per_request=r.c_peer_s[0] * 1e6))
    print(f"total {time.monotonic() - started:.0f} s wall")
    return 0
