"""`kvswitch plan`: how to split N GPUs between prefill and decode for a trace, and which policy.

    kvswitch plan --trace F --gpus N [--profile P] [--rate R] [--policies kv,kv_disagg,slo_aware]

Every candidate runs the trace on the virtual clock (bench.virtual: engine_sim's scheduler and
timing for the engines, the router's own planner), at the trace's arrival rate times `--rate`:
each aggregated configuration (`kv`, `round_robin`) on N aggregated engines, each disaggregated
one (`kv_disagg`, `slo_aware`, any conditional policy) on every split P prefill + (N - P) decode
engines, P = 1 .. N - 1 (or `--splits`). The engines are the sims `kvswitch up` and
docker-compose.yml start, at their max_model_len (`--max-model-len`, 32768 as theirs by default):
longer requests are errors, as they would be there.
Every candidate replays the same requests, so they are ranked by how many finish within both SLOs,
then by fewer errors, then by TTFT p90; the winner's exact `kvswitch up` command, router flags,
docker-compose router command and engine copies (each shim's worker name, nkey file, secrets'
--workers) follow the table, and `reproduce:`, the `kvswitch bench replay
--clock virtual` that measures its row again. The routers are given the SLOs the ranking uses.
When no candidate serves a single request within the SLOs there is no winner: the table, a line
saying so, and exit status 1.

A full trace takes a minute or two of CPU per candidate; `--jobs` runs candidates side by side and
`--start/--duration/--limit` narrow the trace.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.cli import check_out
from bench.compare import CONFIGURATIONS, Configuration
from bench.flag_numbers import check_positive
from bench.process_pool import process_pool
from bench.stop_signals import signals_unwind
from bench.summary import Slo, Summary, summarize
from bench.trace import TokenSynth, TraceError, selected_records, shipped_trace
from bench.virtual.fleet import (
    SIMS_MAX_MODEL_LEN,
    FleetSpec,
    VirtualFleet,
    check_max_model_len,
    check_span,
    settings_from_args,
)
from bench.workloads import WorkItem, from_trace
from protocol import ConfigError
from protocol.config import RouterSettings, flat_names
from protocol.timing import DEFAULT_PROFILE

__all__ = ["Candidate", "add_arguments", "reproduce_command", "run"]

DEFAULT_POLICIES = "kv,kv_disagg,slo_aware"
NO_WINNER = 1  # exit status when no candidate serves any request within the SLOs (2: bad arguments)


class Candidate(msgspec.Struct, frozen=True):
    configuration: str
    prefill: int
    decode: int
    agg: int

    @property
    def fleet(self) -> str:
        return f"{self.agg} agg" if self.agg else f"{self.prefill}P+{self.decode}D"


class Result(msgspec.Struct):
    candidate: Candidate
    summary: Summary


@dataclass(frozen=True)
class _Job:
    candidate: Candidate
    items: list[WorkItem]
    profile: str
    rate: float
    slo: Slo
    seed: int
    max_model_len: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL trace (default: the shipped one)")
    parser.add_argument("--gpus", type=int, required=True, help="engines (GPUs) to split")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="the engines' timing profile")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=SIMS_MAX_MODEL_LEN,
        metavar="TOKENS",
        help="the engines' max_model_len: longer requests are errors (default: the sims' 32768)",
    )
    parser.add_argument("--rate", type=float, default=1.0, help="times the trace's arrival rate")
    parser.add_argument(
        "--policies", default=None, help=f"comma-separated `bench compare` configurations (default {DEFAULT_POLICIES})"
    )
    parser.add_argument("--splits", default=None, help="comma-separated prefill counts to try (default 1 .. N-1)")
    parser.add_argument("--start", type=float, default=0.0, help="skip the trace's first S seconds")
    parser.add_argument("--duration", type=float, default=None, help="only the first S seconds (after --start)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests")
    parser.add_argument("--scale-tokens", type=float, default=1.0, help="512*F tokens per trace block")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds")
    parser.add_argument("--slo-itl", type=float, default=0.025, help="TPOT SLO, seconds")
    parser.add_argument("--jobs", type=int, default=2, help="candidates run in this many processes")
    parser.add_argument("--seed", type=int, default=0, help="token synthesis and routers' random choices")
    parser.add_argument("--out", type=Path, default=None, help="also write every candidate's summary as JSON")


def candidates(gpus: int, policies: list[Configuration], splits: list[int]) -> list[Candidate]:
    out = []
    for config in policies:
        if config.fleet == "agg":
            out.append(Candidate(config.name, 0, 0, gpus))
        else:
            out += [Candidate(config.name, p, gpus - p, 0) for p in splits]
    return out


def _number(x: float) -> str:
    """`x` as a flag's value that reads back as `x`: short (`2`, `0.025`) where that is exact."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def _router_args(config: Configuration, slo: Slo) -> list[str]:
    return [*config.router_args, "--slo-ttft-s", _number(slo.ttft_s), "--slo-itl-s", _number(slo.itl_s)]


def _measure(job: _Job) -> Result:
    c = job.candidate
    print(f"[{c.configuration} on {c.fleet}]", file=sys.stderr, flush=True)
    spec = FleetSpec(
        prefill=c.prefill,
        decode=c.decode,
        agg=c.agg,
        settings=settings_from_args(_router_args(CONFIGURATIONS[c.configuration], job.slo)),
        profile=job.profile,
        max_model_len=job.max_model_len,
        seed=job.seed,
    )
    done = VirtualFleet(spec).run(job.items, TokenSynth(job.seed), rate=job.rate)
    return Result(c, summarize(done.results(), slo=job.slo, prefix=done.prefix, clock="virtual"))


def in_slo(s: Summary) -> int:
    """Requests within both SLOs: a count, so that equal candidates tie and the tie-breaks run."""
    return round(s.goodput_fraction * s.requests)


def rank(results: list[Result]) -> list[Result]:
    """Most requests within the SLOs, then fewest errors, then lowest TTFT p90. The count, not goodput
    per second: the candidates replay the same arrivals, so goodput's denominator (the arrival window,
    since 2026-12-06 05:15) is the same for all and orders them as the count does, but as a float
    two equal candidates could differ in its last digit and skip the tie-breaks."""

    def key(r: Result) -> tuple[int, int, float]:
        p90 = r.summary.ttft_s.p90 if r.summary.ttft_s is not None else float("inf")
        return (-in_slo(r.summary), r.summary.errors, p90)

    return sorted(results, key=key)


def format_ranking(results: list[Result]) -> str:
    header = ["rank", "fleet", "policy", "in SLO", "goodput r/s", "TTFT p50 s", "TTFT p90 s", "TPOT p90 ms", "errors"]
    rows = [header]
    for i, r in enumerate(results, 1):
        s = r.summary
        rows.append(
            [
                str(i),
                r.candidate.fleet,
                r.candidate.configuration,
                str(in_slo(s)),
                f"{s.goodput_rps:.3g}",
                f"{s.ttft_s.p50:.3g}" if s.ttft_s else "-",
                f"{s.ttft_s.p90:.3g}" if s.ttft_s else "-",
                f"{s.tpot_s.p90 * 1e3:.3g}" if s.tpot_s else "-",
                str(s.errors),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    left = (1, 2)  # fleet and policy read better left-aligned
    lines = [
        "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def settings_text(winner: Candidate, profile: str, slo: Slo, max_model_len: int = SIMS_MAX_MODEL_LEN) -> str:
    """The winner as commands: the local cluster, the routers' flags and environment, docker-compose.yml's
    router command, the engines."""
    config = CONFIGURATIONS[winner.configuration]
    args = _router_args(config, slo)
    settings = settings_from_args(args)
    defaults = RouterSettings()
    env = []
    for name in flat_names(RouterSettings):
        value = _flat(settings, name)
        if value != _flat(defaults, name):
            env.append(f"KVSWITCH_{name.upper()}={str(value).lower() if isinstance(value, bool) else value}")
    fleet = f"--agg {winner.agg}" if winner.agg else f"--prefill {winner.prefill} --decode {winner.decode}"
    engine_len = "" if max_model_len == SIMS_MAX_MODEL_LEN else f" --max-model-len {max_model_len}"
    engines = (
        f"{winner.agg} engines in the agg role (`--role agg`), each with its shim"
        if winner.agg
        else f"{winner.prefill} engines with `--role prefill` and {winner.decode} with `--role decode`, "
        "each with its shim"
    )
    # The sims and shims default to DEFAULT_PROFILE (the shims by registering none, which the routers
    # read as it): any other goes on both, as `kvswitch up` gives it, or the fleet is not the one ranked.
    sim_flags = ("" if profile == DEFAULT_PROFILE else f" --profile {profile}") + engine_len
    if sim_flags:
        engines += f", each sim with `{sim_flags.strip()}`"
    if profile != DEFAULT_PROFILE:
        engines += f" and each shim with `--timing-profile {profile}`"
    return "\n".join(
        [
            f"winner: {winner.configuration} on {winner.fleet}",
            f"  local cluster:  kvswitch up {fleet} --profile {profile}{engine_len} {' '.join(args)}",
            f"  router flags:   kvswitch router ... {' '.join(args)}",
            f"  router env:     {' '.join(env) if env else '(the defaults)'} (routers started without policy flags)",
            "  compose:        router-1's and router-2's `command:` (its flags override any environment):",
            *(f"    {router}:      command: {_compose_router_command(args, router)}" for router in COMPOSE_ROUTERS),
            f"  engines:        {engines}",
            *_compose_engines(winner),
        ]
    )


def _compose_engines(winner: Candidate) -> list[str]:
    """docker-compose.yml's engines for the winner's fleet. Each engine is a net-*/sim-*/shim-* trio,
    and each shim a NATS identity of its own: a copied trio keeping `--worker-name prefill-0` and its
    nkey file is refused by the NATS server and the routers as a second prefill-0, and a name missing
    from the secrets service's --workers has no nkey file."""
    pools = [("agg", winner.agg)] if winner.agg else [("prefill", winner.prefill), ("decode", winner.decode)]
    names = [f"{role}-{i}" for role, count in pools for i in range(count)]
    lines = []
    if winner.agg:
        lines.append(
            "  compose:        docker-compose.yml ships prefill and decode engines only; run the local cluster above "
            f"(`kvswitch up --agg {winner.agg}`), or deploy/k8s, or in compose make the trio's sim and shim "
            "`--role agg` and copy it as below"
        )
    for role, count in pools:
        trio = "net-prefill/sim-prefill/shim-prefill" if role != "decode" else "net-decode/sim-decode/shim-decode"
        copies = ", ".join(f"{role}-{i}" for i in range(count))
        lines.append(f"  {role + ' copies:':<16}the {trio} trio x{count}, one per worker: {copies}")
    lines += [
        "    each copy NAME: services net-NAME, sim-NAME and shim-NAME (sim and shim with network_mode "
        '"service:net-NAME"); its shim with `--worker-name NAME` and '
        "`--nats-nkey-file /var/lib/kvswitch/worker-NAME.nk`",
        f"  secrets:        the secrets service's `--workers, {json.dumps(','.join(names))}` "
        "(a NATS identity per shim)",
    ]
    return lines


def reproduce_command(winner: Candidate, args: argparse.Namespace) -> str:
    """The `kvswitch bench replay --clock virtual` that measures the winner's row again: the same
    requests, rate, fleet, router flags, engines (`--max-model-len`: replay's own default raises it
    to the longest request) and seeds (plan's --seed is both the synthesis's and the routers')."""
    fleet = (
        ["--agg", str(winner.agg)] if winner.agg else ["--prefill", str(winner.prefill), "--decode", str(winner.decode)]
    )
    argv = ["kvswitch", "bench", "replay", "--clock", "virtual", *fleet, "--configuration", winner.configuration]
    argv += ["--profile", args.profile, "--max-model-len", str(args.max_model_len), "--speed", _number(args.rate)]
    argv += ["--seed", str(args.seed), "--router-seed", str(args.seed)]
    if args.trace is not None:
        argv += ["--trace", str(args.trace)]
    argv += ["--start", _number(args.start), "--scale-tokens", _number(args.scale_tokens)]
    if args.duration is not None:
        argv += ["--duration", _number(args.duration)]
    if args.limit is not None:
        argv += ["--limit", str(args.limit)]
    argv += ["--slo-ttft", _number(args.slo_ttft), "--slo-itl", _number(args.slo_itl)]
    return shlex.join(argv)


COMPOSE_ROUTERS = ("router-1", "router-2")  # docker-compose.yml's, each its own NATS identity


def _compose_router_command(args: list[str], router: str) -> str:
    """docker-compose.yml's command for `router` with the winner's flags in place of its
    --conditional-disagg; JSON strings, so YAML reads every item as a string."""
    command = ["router", "--http-host", "0.0.0.0", "--http-port", "8080", "--model", "sim-llama", *args]
    command += [
        "--nats-nkey-file",
        f"/var/lib/kvswitch/router-{router}.nk",
        "--api-keys-file",
        "/var/lib/kvswitch/api-keys",
    ]
    return json.dumps(command)


def _flat(settings: RouterSettings, name: str) -> object:
    if name in RouterSettings.__struct_fields__:
        return getattr(settings, name)
    return getattr(settings.conditional, name)


def run(args: argparse.Namespace) -> int:
    try:
        with signals_unwind("kvswitch plan", exits=True):  # a pool's workers outlived a plain SIGTERM
            return _plan(args)
    except (TraceError, ValueError, ConfigError, OSError) as exc:
        print(f"kvswitch plan: {exc}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    # Checked here, so that the messages name plan's flags rather than the router's or the fleet's.
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    positive = [("--rate", args.rate), ("--slo-ttft", args.slo_ttft), ("--slo-itl", args.slo_itl)]
    if args.duration is not None:
        positive.append(("--duration", args.duration))
    for flag, value in positive:
        check_positive(flag, value)
    if not 0 <= args.start < math.inf:
        raise ValueError(f"--start must be a finite number of seconds >= 0, got {args.start:g}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.out is not None:
        check_out("--out", args.out)
    check_max_model_len(args.max_model_len, args.profile)
    policies = DEFAULT_POLICIES if args.policies is None else args.policies
    names = list(dict.fromkeys(n.strip() for n in policies.split(",") if n.strip()))
    if not names:
        raise ValueError(f"--policies: none given; allowed: {', '.join(CONFIGURATIONS)}")
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(unknown)}; allowed: {', '.join(CONFIGURATIONS)}")
    if args.gpus < 2 and (split := [n for n in names if CONFIGURATIONS[n].fleet != "agg"]):
        # Named in --policies they are refused, as one alone always was; the default's are skipped, said so.
        if args.policies is not None:
            raise ValueError(
                f"--policies {','.join(split)}: a split needs --gpus >= 2 (a prefill and a decode engine); "
                "with --gpus 1 only aggregated configurations fit"
            )
        print(f"skipping {', '.join(split)}: a split needs --gpus >= 2", file=sys.stderr)
        names = [n for n in names if n not in split]
    splits = _splits(args.splits, args.gpus) if args.splits else list(range(1, args.gpus))
    trace = args.trace or shipped_trace()
    records = selected_records(trace, limit=args.limit, duration_s=args.duration, start_s=args.start)
    items = from_trace(records, scale_tokens=args.scale_tokens)
    check_span("--rate", items, args.rate)
    slo = Slo(args.slo_ttft, args.slo_itl)
    todo = candidates(args.gpus, [CONFIGURATIONS[n] for n in names], splits)
    jobs = [_Job(c, items, args.profile, args.rate, slo, args.seed, args.max_model_len) for c in todo]
    started = time.monotonic()
    if args.jobs > 1 and len(jobs) > 1:
        with process_pool(min(args.jobs, len(jobs))) as pool:
            results = list(pool.map(_measure, jobs))
    else:
        results = [_measure(job) for job in jobs]
    ranked = rank(results)
    print()
    print(
        f"{len(items)} requests ({args.trace or 'shipped trace'}), {args.gpus} GPUs of {args.profile}, "
        f"rate x{args.rate:g}, SLO TTFT {slo.ttft_s:g} s / TPOT {slo.itl_s * 1e3:g} ms, virtual clock"
    )
    print(format_ranking(ranked))
    print()
    best = ranked[0]
    if in_slo(best.summary) == 0:
        print(f"no candidate meets the SLO (TTFT {slo.ttft_s:g} s, TPOT {slo.itl_s * 1e3:g} ms) for any request")
    else:
        print(settings_text(best.candidate, args.profile, slo, args.max_model_len))
        print(f"  reproduce:      {reproduce_command(best.candidate, args)}")
    if args.out is not None:
        args.out.write_bytes(msgspec.json.encode(ranked))
        print(f"results: {args.out}")
    print(f"{len(jobs)} candidates in {time.monotonic() - started:.0f} s wall")
    return 0 if in_slo(best.summary) else NO_WINNER


def _splits(text: str, gpus: int) -> list[int]:
    if gpus < 2:
        raise ValueError(f"--splits: a split needs >= 2 GPUs, got --gpus {gpus}")
    try:
        splits = list(dict.fromkeys(int(p) for p in text.split(",") if p.strip()))
    except ValueError:
        raise ValueError(f"--splits: comma-separated prefill counts, got {text!r}") from None
    if not splits:
        raise ValueError(f"--splits: none given, got {text!r}")
    bad = [p for p in splits if not 1 <= p < gpus]
    if bad:
        raise ValueError(f"--splits: prefill counts must be in 1..{gpus - 1}, got {', '.join(map(str, bad))}")
    return splits
