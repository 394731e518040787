"""`kvswitch bench replay | summary | compare | overhead | replicas`.

kvswitch bench replay --url http://127.0.0.1:8080 --speed 10 --limit 200 --latency-scale 10
kvswitch bench replay --url URL --workload shared-prefix --groups 8 --prompts-per-group 16
kvswitch bench summary bench/out/replay-....jsonl --latency-scale 10
kvswitch bench compare --prefill 2 --decode 2 --rates 0.5,1,2 --runs 3
kvswitch bench compare --demo          # what `make demo` runs: <= 3 minutes on 2 cores
kvswitch bench chaos --scenarios all   # faults under load against a local cluster (docs/reliability.md)
kvswitch bench overhead --repeats 3    # what a router adds per request (docs/benchmarks.md, "Overhead")
kvswitch bench replicas                # one replica's ceiling, the peer cost, N replicas
kvswitch bench compare --clock virtual --scale-tokens 1 --start 0   # the whole trace, simulated
kvswitch bench replay --clock virtual --agg 4 --configuration kv --workload shared-prefix
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from bench.flag_numbers import check_non_negative, check_positive, positive_numbers
from bench.overhead import add_overhead_parser, overhead_main
from bench.replicas import add_replicas_parser, replicas_main
from bench.results_file import check_out_dir, stamp
from bench.stop_signals import signals_unwind
from bench.summary import PrefixCounters, Slo, format_summary, results_clock, scrape_prefix_counters, summarize
from bench.trace import TraceError, selected_records, shipped_trace
from bench.virtual.delays import DEFAULT_DELAYS, Delays
from bench.workloads import WorkItem, from_trace, multi_turn, shared_prefix
from protocol.config import url_problem
from protocol.timing import check_speedup
from worker_shim.credit_check import SHORT_BELOW, CreditCheck

__all__ = ["DEMO", "add_arguments", "check_out", "run"]

OUT_DIR = Path("bench/out")

# `compare --demo`: the last 40 s of the shipped trace (155 requests; 62% of their blocks repeat an
# earlier block of the slice) at 1/4 token scale, at the trace's rate and twice it, five
# configurations, one run each, 1 prefill + 1 decode engine at 5x speed (at 10x this 2-core box is
# CPU-bound and queues that the model would not). About 90 s on a 2-core machine; docs/benchmarks.md
# says what it does and does not show.
DEMO: dict[str, Any] = {
    "start": 980.0,
    "duration": 40.0,
    "scale_tokens": 0.25,
    "prefill": 1,
    "decode": 1,
    "speedup": 5.0,
    "rates": "1,2",
    "runs": 1,
    "configs": "round_robin,kv,kv_disagg,isl_bounding,ttft_model",
}
# The full comparison: the trace's last 120 s (513 requests, 67% block reuse within the slice).
COMPARE_DEFAULTS: dict[str, Any] = {
    "start": 900.0,
    "duration": 120.0,
    "scale_tokens": 0.25,
    "prefill": 2,
    "decode": 2,
    "speedup": 10.0,
    "rates": "0.5,1,2",
    "runs": 3,
    "configs": "all",
}
# `compare --clock virtual --demo` (what `make demo` adds): full token scale, the trace's last 200 s
# (839 requests, 17 M prompt tokens), 1 prefill + 4 decode engines, five configurations, at the
# trace's rate. About a minute on 2 cores.
VIRTUAL_DEMO: dict[str, Any] = {
    "start": 822.0,
    "scale_tokens": 1.0,
    "prefill": 1,
    "decode": 4,
    "rates": "1",
    "runs": 1,
    "configs": "round_robin,kv,kv_disagg,ttft_model,slo_aware",
}
# `compare --clock virtual`: the benchmark figure, the whole shipped trace (3,993 requests,
# 61 M prompt tokens over 1,022 s) at full token scale on 1 prefill + 4 decode engines (5 agg
# engines for the agg configurations), every kvswitch configuration, at the trace's own rate.
VIRTUAL_DEFAULTS: dict[str, Any] = {
    "start": 0.0,
    "scale_tokens": 1.0,
    "prefill": 1,
    "decode": 4,
    "rates": "1",
    "runs": 1,
    "configs": "all",
}


# A flag that only one --clock or --workload reads, as (setting, the values that read it, the flag's
# action): given with another value it would do nothing, so `_refuse_unread` refuses it.
Owned = list[tuple[str, tuple[str, ...], argparse.Action]]
LIVE, VIRTUAL = ("live",), ("virtual",)
TRACE, SYNTHETIC = ("trace",), ("shared-prefix", "multi-turn")


def _add_workload_args(p: argparse.ArgumentParser, owned: Owned, *, compare: bool) -> None:
    g = p.add_argument_group("workload")
    trace = [
        g.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL trace (default: the shipped one)"),
        g.add_argument("--start", type=float, default=None, help="skip the trace's first S seconds"),
    ]
    g.add_argument("--duration", type=float, default=None, help="only requests arriving in the first S trace seconds")
    g.add_argument("--limit", type=int, default=None, help="only the first N requests")
    trace += [
        g.add_argument(
            "--scale-tokens",
            type=float,
            default=None,
            help="expand each 512-token trace block to round(512*F) tokens: prompts F times as long (F > 1 lengthens)",
        ),
        g.add_argument("--max-input-len", type=int, default=None, help="cut trace prompts to at most N tokens"),
    ]
    g.add_argument("--seed", type=int, default=0, help="token synthesis and synthetic workload seed")
    if compare:
        return
    g.add_argument("--workload", choices=["trace", "shared-prefix", "multi-turn"], default="trace")
    owned += [("workload", TRACE, a) for a in trace]
    shared = [
        g.add_argument("--groups", type=int, default=8, help="shared-prefix: system prompts"),
        g.add_argument("--prompts-per-group", type=int, default=16),
    ]
    synthetic = [
        g.add_argument("--system-len", type=int, default=2048, help="shared-prefix / multi-turn system prompt tokens"),
        g.add_argument("--question-len", type=int, default=128, help="shared-prefix question / multi-turn user tokens"),
        g.add_argument("--output-len", type=int, default=64, help="synthetic workloads: tokens generated per request"),
        g.add_argument(
            "--rate", type=float, default=4.0, help="synthetic workloads: requests (or sessions) per second"
        ),
    ]
    multi = [
        g.add_argument("--sessions", type=int, default=16, help="multi-turn: sessions"),
        g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session"),
        g.add_argument("--turn-gap", type=float, default=5.0, help="multi-turn: seconds between a session's turns"),
    ]
    owned += [("workload", ("shared-prefix",), a) for a in shared]
    owned += [("workload", SYNTHETIC, a) for a in synthetic]
    owned += [("workload", ("multi-turn",), a) for a in multi]


def _refuse_unread(args: argparse.Namespace) -> None:
    """Refuse, before anything runs, every flag given away from its default that the chosen --clock
    or --workload does not read: the run would measure something other than what was asked."""
    unread = [
        f"{'/'.join(action.option_strings)} is for --{setting} {'/'.join(values)} only, not --{setting} {chosen}"
        for setting, values, action in getattr(args, "owned_flags", ())
        if (chosen := getattr(args, setting)) not in values and getattr(args, action.dest) != action.default
    ]
    if unread:
        raise ValueError("; ".join(unread))


def _add_clock_args(p: argparse.ArgumentParser, owned: Owned) -> None:
    g = p.add_argument_group(
        "virtual clock (--clock virtual: one process, modelled hops, simulated time)",
        "The virtual routers take their settings from the configuration's flags (and replay's --router-arg)"
        " alone: KVSWITCH_* variables and config files do not reach them, so a run depends on its command.",
    )
    g.add_argument("--clock", choices=["live", "virtual"], default="live", help="live processes, or the virtual clock")
    virtual: list[argparse.Action] = []
    for name in Delays.__struct_fields__:
        flag = "--" + name.removesuffix("_s").replace("_", "-") + "-delay"
        default = getattr(DEFAULT_DELAYS, name)
        text = f"seconds (default {default:g})"
        virtual.append(g.add_argument(flag, dest=name, type=float, default=None, metavar="S", help=text))
    virtual += [
        g.add_argument(
            "--router-profile",
            default=None,
            help="the timing profile workers register for the routers' cost model"
            " ('none': none; default: the engines')",
        ),
        g.add_argument(
            "--router-seed",
            type=int,
            default=0,
            help="routers' random choices and the virtual shims' poll phases (run r uses seed + r)",
        ),
        g.add_argument(
            "--calibrate",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="routers fit each engine's timing from its load reports (router.calibration; the default)",
        ),
        g.add_argument(
            "--router-profile-error",
            type=float,
            default=0.0,
            metavar="E",
            help="routers start with every engine time (1 + E) times their profile's (robustness runs)",
        ),
    ]
    owned += [("clock", VIRTUAL, a) for a in virtual]


def _add_max_model_len(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> argparse.Action:
    return p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="virtual engines' max_model_len: longer requests are errors (default: the sims' 32768, raised to"
        " the workload's longest request, and said so, if one engine's KV cache holds it; `kvswitch plan` and"
        " `kvswitch up` keep 32768)",
    )


def _check_engines(args: argparse.Namespace) -> None:
    """--profile, --router-profile and --max-model-len, before anything runs: an unknown --profile
    failed at the first measurement, naming no flag, and an unknown --router-profile ran to the end
    (exit 0) with routers that had no cost model."""
    from bench.virtual.fleet import check_max_model_len, check_profile

    check_profile("--profile", args.profile)
    if getattr(args, "router_profile", None) is not None:
        check_profile("--router-profile", args.router_profile, none=True)
    if getattr(args, "max_model_len", None) is not None:
        check_max_model_len(args.max_model_len, args.profile)


def _max_model_len(args: argparse.Namespace, items: list[WorkItem]) -> tuple[int, str | None]:
    """--max-model-len, or the sims' 32768 raised to the workload's longest request (what the
    published virtual figures ran with); and, when raised, the line that says so, printed with the
    results: the engines are then unlike `kvswitch up`'s, and `kvswitch plan`'s rows, at 32768,
    count those requests as errors. A raised value one engine's KV cache cannot hold is refused
    as --max-model-len's is: its request waited for blocks for ever, and the run never ended."""
    from bench.virtual.fleet import SIMS_MAX_MODEL_LEN, check_max_model_len

    if args.max_model_len is not None:
        return int(args.max_model_len), None
    longest = max((item.input_len + item.output_len for item in items), default=0)
    if longest <= SIMS_MAX_MODEL_LEN:
        return SIMS_MAX_MODEL_LEN, None
    raised_from = f"max_model_len {longest}, raised from the sims' {SIMS_MAX_MODEL_LEN} to the longest request,"
    try:
        check_max_model_len(longest, args.profile, what=raised_from)
    except ValueError as exc:
        hint = "set --max-model-len (longer requests are then errors) or lower --scale-tokens"
        raise ValueError(f"{exc}; {hint}") from None
    over = sum(item.input_len + item.output_len > SIMS_MAX_MODEL_LEN for item in items)
    return longest, (
        f"max_model_len {longest}: raised from the sims' {SIMS_MAX_MODEL_LEN} to the longest request ({over} of "
        f"{len(items)} requests are longer; `kvswitch plan` and `kvswitch up` refuse them); --max-model-len sets it"
    )


def _delays(args: argparse.Namespace) -> Delays:
    given = {name: getattr(args, name) for name in Delays.__struct_fields__ if getattr(args, name) is not None}
    return msgspec.structs.replace(DEFAULT_DELAYS, **given).validate()


def _router_profile(args: argparse.Namespace) -> str | None:
    if args.router_profile is None:
        return None
    return "" if args.router_profile == "none" else args.router_profile


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, seconds (default 2)")
    p.add_argument("--slo-itl", type=float, default=0.025, help="goodput SLO on mean ITL, seconds (default 0.025)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = "{replay,summary,compare,sweep,chaos,overhead,replicas}"
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar=commands)
    from bench import chaos

    chaos.add_arguments(sub.add_parser("chaos", help="faults injected into a local cluster under load; one table"))

    rp = sub.add_parser("replay", help="replay a trace or synthetic workload against router URLs")
    owned: Owned = []
    live = [
        rp.add_argument("--url", action="append", default=[], help="router (or engine) base URL; repeat for replicas"),
        rp.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)"),
    ]
    rp.add_argument("--speed", type=float, default=1.0, help="divide arrival times by this factor (on either clock)")
    live += [
        rp.add_argument(
            "--latency-scale", type=float, default=1.0, help="multiply latencies by this (the sims' --speedup)"
        ),
        rp.add_argument(
            "--metrics-url", action="append", default=[], help="engine URL whose /metrics has prefix counters"
        ),
        rp.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds"),
        rp.add_argument(
            "--prompt-format",
            choices=["ids", "text"],
            default="ids",
            help="send token ids, or their text in the built-in tokenizer (for routers that take text only)",
        ),
    ]
    owned += [("clock", LIVE, a) for a in live]
    rp.add_argument("--out", type=Path, default=None, help="JSONL of per-request results (default bench/out/...)")
    rp.add_argument("--no-progress", action="store_true")
    _add_clock_args(rp, owned)
    fg = rp.add_argument_group("virtual fleet (--clock virtual)")
    fleet = [
        fg.add_argument("--prefill", type=int, default=0, help="prefill engines"),
        fg.add_argument("--decode", type=int, default=0, help="decode engines"),
        fg.add_argument("--agg", type=int, default=0, help="aggregated engines"),
        fg.add_argument("--routers", type=int, default=1, help="router replicas"),
        fg.add_argument("--profile", default="h200:llama-3.1-8b", help="the engines' timing profile"),
        fg.add_argument("--configuration", default="kv", help="router settings: a `compare` configuration's flags"),
        fg.add_argument("--router-arg", action="append", default=[], help="one more `kvswitch router` flag (repeat)"),
        _add_max_model_len(fg),
    ]
    owned += [("clock", VIRTUAL, a) for a in fleet]
    _add_workload_args(rp, owned, compare=False)
    _add_slo_args(rp)
    rp.set_defaults(owned_flags=owned)

    sp = sub.add_parser("summary", help="summarise a replay's JSONL again (other SLO or scale)")
    sp.add_argument("results", type=Path)
    sp.add_argument("--latency-scale", type=float, default=1.0)
    _add_slo_args(sp)

    cp = sub.add_parser("compare", help="one local cluster per configuration; table and PNG")
    cp.add_argument("--demo", action="store_true", help="the short preset `make demo` runs")
    cp.add_argument("--prefill", type=int, default=None, help="prefill engines (disagg configurations)")
    cp.add_argument("--decode", type=int, default=None, help="decode engines (agg ones get prefill+decode agg engines)")
    cp.add_argument("--routers", type=int, default=1)
    speedup = cp.add_argument(
        "--speedup", type=float, default=None, help="engine speed-up; replay runs at speedup x rate"
    )
    cp.add_argument("--rates", default=None, help="comma-separated rate factors (1 = the trace's own rate)")
    cp.add_argument("--runs", type=int, default=None, help="runs per configuration and rate")
    cp.add_argument("--configs", default=None, help="comma-separated configurations, or `all`")
    cp.add_argument("--profile", default="h200:llama-3.1-8b")
    sim_arg = cp.add_argument("--sim-arg", action="append", default=[], help="extra `kvswitch sim` argument (repeat)")
    cp.add_argument("--out-dir", type=Path, default=OUT_DIR)
    cp.add_argument("--no-progress", action="store_true")
    keep_logs = cp.add_argument("--keep-logs", action="store_true", help="keep every child's log under --out-dir")
    owned = [("clock", LIVE, a) for a in (speedup, sim_arg, keep_logs)]
    _add_clock_args(cp, owned)
    jobs = cp.add_argument("--jobs", type=int, default=2, help="virtual clock: measurements run in this many processes")
    owned += [("clock", VIRTUAL, jobs), ("clock", VIRTUAL, _add_max_model_len(cp))]
    _add_workload_args(cp, owned, compare=True)
    _add_slo_args(cp)
    cp.set_defaults(owned_flags=owned)
    add_overhead_parser(sub)
    add_replicas_parser(sub)

    wp = sub.add_parser("sweep", help="configurations x fleets x loads on the virtual clock; table and heat maps")
    wp.add_argument("--fleets", default="1P+3D,2P+2D,2P+6D,4P+12D", help="comma-separated PP+DD fleets")
    wp.add_argument("--rates", default="0.5,1,2,4", help="comma-separated load factors")
    wp.add_argument("--configs", default="round_robin,kv,kv_disagg,slo_aware", help="comma-separated configurations")
    wp.add_argument("--policy", default="slo_aware", help="the conditional policy the ratios are for")
    wp.add_argument("--profile", default="h200:llama-3.1-8b")
    wp.add_argument("--jobs", type=int, default=2, help="measurements run in this many processes")
    wp.add_argument("--out-dir", type=Path, default=OUT_DIR)
    _add_max_model_len(wp)
    owned = []
    _add_workload_args(wp, owned, compare=False)
    _add_slo_args(wp)
    wp.set_defaults(owned_flags=owned)


def check_out(flag: str, out: Path) -> Path:
    """A file written after the run: a place it cannot go is refused before, naming `flag`."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {out}: cannot create {out.parent}: {exc.strerror or exc}") from None
    if out.is_dir():
        raise ValueError(f"{flag} {out}: a directory; give a file name")
    if not os.access(out if out.exists() else out.parent, os.W_OK):
        raise ValueError(f"{flag} {out}: not writable")
    return out


def _replay_out(args: argparse.Namespace) -> Path:
    """Where a replay writes, checked once the replay's own flags passed (a refused command
    creates nothing)."""
    return check_out("--out", args.out or OUT_DIR / f"replay-{stamp()}.jsonl")


def _check_slo(args: argparse.Namespace) -> None:
    """Checked here, so that the message names the bench's flags, not the router's they become."""
    check_positive("--slo-ttft", args.slo_ttft)
    check_positive("--slo-itl", args.slo_itl)


# replay's, compare's and sweep's numbers that must be finite and > 0 (those each has): aiohttp
# reads a --timeout of 0, a negative or NaN as no limit, the trace reader a NaN --duration as the
# whole trace, and an infinite --speed, --speedup or --rate sends every request at once.
_POSITIVE = ("--duration", "--speed", "--speedup", "--timeout", "--rate")


def _check_workload_numbers(args: argparse.Namespace) -> None:
    for flag in _POSITIVE:
        if (value := getattr(args, flag[2:].replace("-", "_"), None)) is not None:
            check_positive(flag, value)
    if (speedup := getattr(args, "speedup", None)) is not None:  # the shims register the profile at it
        check_speedup(speedup, "--speedup")
    if (gap := getattr(args, "turn_gap", None)) is not None:  # NaN seconds made NaN arrival times
        check_non_negative("--turn-gap", gap)
    # The synthesis refused one only at the first measurement, naming no flag: on the live clock after
    # NATS, etcd and the sims had started.
    if (seed := getattr(args, "seed", None)) is not None and seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")


def _check_replay_urls(args: argparse.Namespace) -> None:
    """--url and --metrics-url as aiohttp will take them: http(s), a host, a port in range."""
    for flag, urls in (("--url", args.url), ("--metrics-url", args.metrics_url)):
        for url in urls:
            if urlsplit(url).scheme not in ("http", "https"):
                raise ValueError(f"{flag} {url!r}: must be an http:// or https:// URL")
            if (problem := url_problem(url)) is not None:
                raise ValueError(f"{flag} {url!r}: {problem}")


def _trace_items(args: argparse.Namespace) -> list[WorkItem]:
    trace = args.trace or shipped_trace()
    # `is None`, not `or`: an `or` default read 0 as unset (--scale-tokens 0 ran at 1.0)
    start = 0.0 if args.start is None else args.start
    check_non_negative("--start", start)
    records = selected_records(trace, limit=args.limit, duration_s=args.duration, start_s=start)
    scale = 1.0 if args.scale_tokens is None else args.scale_tokens
    return from_trace(records, scale_tokens=scale, max_input_len=args.max_input_len)


def _replay_items(args: argparse.Namespace) -> list[WorkItem]:
    if args.workload == "trace":
        return _trace_items(args)
    if args.workload == "shared-prefix":
        items = shared_prefix(
            groups=args.groups,
            prompts_per_group=args.prompts_per_group,
            system_len=args.system_len,
            question_len=args.question_len,
            output_len=args.output_len,
            rate=args.rate,
            seed=args.seed,
        )
    else:
        items = multi_turn(
            sessions=args.sessions,
            turns=args.turns,
            system_len=args.system_len,
            user_len=args.question_len,
            answer_len=args.output_len,
            session_rate=args.rate,
            turn_gap_s=args.turn_gap,
            seed=args.seed,
        )
    if args.duration is not None:
        items = [i for i in items if i.arrival_s < args.duration]
    return items[: args.limit] if args.limit is not None else items


def _credit_line(checks: list[CreditCheck]) -> str:
    """What the shims' credit checks (worker_shim.credit_check) judged over the replay."""
    windows, short = sum(c.windows for c in checks), sum(c.short_windows for c in checks)
    lowest = min((c.lowest for c in checks if c.lowest is not None), default=None)
    promised, reused = sum(c.predicted_total for c in checks), sum(c.reused_total for c in checks)
    return (
        f"shim credit check: {windows} windows judged, {short} short (below {SHORT_BELOW:g}), lowest "
        f"{'-' if lowest is None else f'{lowest:.2f}'}; reused {reused:,} of {promised:,} promised tokens"
    )


def _replay_virtual(args: argparse.Namespace, items: list[WorkItem]) -> int:
    from bench.compare import CONFIGURATIONS, check_prefill_engines, slo_router_args
    from bench.replay import write_results
    from bench.trace import TokenSynth
    from bench.ttft_floor import ceiling_cached
    from bench.virtual.fleet import FleetSpec, VirtualFleet, check_span, settings_from_args

    check_span("--speed", items, args.speed)
    config = CONFIGURATIONS.get(args.configuration)
    if config is None:
        raise ValueError(f"--configuration: unknown {args.configuration}; allowed: {', '.join(CONFIGURATIONS)}")
    try:
        settings_from_args(args.router_arg)
    except ValueError as exc:
        raise ValueError(f"--router-arg {shlex.join(args.router_arg)}: {exc}") from None
    check_prefill_engines(f"--prefill {args.prefill}", args.prefill, [config], args.router_arg)
    engine_len, raised = _max_model_len(args, items)
    slo = Slo(args.slo_ttft, args.slo_itl)
    spec = FleetSpec(
        prefill=args.prefill,
        decode=args.decode,
        agg=args.agg,
        routers=args.routers,
        settings=settings_from_args([*config.router_args, *slo_router_args(slo), *args.router_arg]),
        delays=_delays(args),
        profile=args.profile,
        router_profile=_router_profile(args),
        max_model_len=engine_len,
        seed=args.router_seed,
        calibrate=args.calibrate,
        router_profile_error=args.router_profile_error,
    )
    started = time.monotonic()
    fleet = VirtualFleet(spec)
    args.out = _replay_out(args)  # once the fleet's flags passed: a refused command creates nothing
    run = fleet.run(items, TokenSynth(args.seed), rate=args.speed)
    results = run.results()
    write_results(args.out, results)
    summary = summarize(results, slo=slo, prefix=run.prefix, clock="virtual")
    print(format_summary(summary))
    reach = run.reach
    if reach.prompt:
        ordered = sorted(items, key=lambda i: i.arrival_s)
        ceiling = sum(ceiling_cached(ordered, spec.block_size)) / max(sum(i.input_len for i in ordered), 1)
        print(
            f"prefix reach {reach.held / reach.prompt:.1%} held, {reach.with_room / reach.prompt:.1%} with room, "
            f"{reach.chosen / reach.prompt:.1%} chosen, of {reach.prompt:,} prompt tokens routed (routers' view); "
            f"one never-evicting cache {ceiling:.1%}"
        )
    print(_credit_line([shim.credit for shim in fleet.shims.values()]))
    if raised:
        print(raised)
    print(f"per-request results: {args.out}")
    print(f"virtual clock: {run.virtual_s:.1f} s simulated in {time.monotonic() - started:.1f} s wall")
    return 0 if summary.ok else 1


async def _replay(args: argparse.Namespace, items: list[WorkItem]) -> int:
    from bench.replay import replay, write_results
    from bench.trace import TokenSynth

    args.out = _replay_out(args)
    async with aiohttp.ClientSession() as session:
        before = await scrape_prefix_counters(session, args.metrics_url) if args.metrics_url else None
        run = await replay(
            items,
            args.url,
            speed=args.speed,
            model=args.model,
            synth=TokenSynth(args.seed),
            timeout_s=args.timeout,
            progress=not args.no_progress,
            text_prompts=args.prompt_format == "text",
        )
        after = await scrape_prefix_counters(session, args.metrics_url) if args.metrics_url else None
    prefix: PrefixCounters | None = after - before if after is not None and before is not None else None
    write_results(args.out, run.results)
    summary = summarize(
        run.results, slo=Slo(args.slo_ttft, args.slo_itl), latency_scale=args.latency_scale, prefix=prefix
    )
    print(format_summary(summary))
    print(f"per-request results: {args.out}")
    return 0 if summary.ok else 1


def _compare(args: argparse.Namespace) -> int:
    from bench.compare import (
        CONFIGURATIONS,
        PEER_CONFIGURATIONS,
        CompareSpec,
        Measurement,
        check_spec,
        format_table,
        headline_ratios,
        run_compare,
    )
    from bench.peers import missing_binaries
    from bench.results_file import ResultsFile, fresh_path
    from bench.virtual.fleet import SIMS_MAX_MODEL_LEN, check_span

    plot_compare = _plotting().plot_compare

    virtual = args.clock == "virtual"
    preset = (VIRTUAL_DEMO if virtual else DEMO) if args.demo else (VIRTUAL_DEFAULTS if virtual else COMPARE_DEFAULTS)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # A repeat ran the same measurement again and read as ±0 spread: once each, in order, as plan's lists.
    rates = list(dict.fromkeys(positive_numbers("--rates", args.rates)))
    known = {**CONFIGURATIONS, **PEER_CONFIGURATIONS}
    names = list(dict.fromkeys(n.strip() for n in args.configs.split(",") if n.strip()))
    if names == ["all"]:
        names = [*CONFIGURATIONS] if virtual else [*CONFIGURATIONS, *PEER_CONFIGURATIONS]
    elif "all" in names:
        raise ValueError(f"--configs: `all` stands alone (every configuration), got {args.configs!r}")
    if not names:
        raise ValueError(f"--configs: none given; allowed: {', '.join(known)}, or all")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(known)}, or all alone")
    if virtual and (peers := [n for n in names if known[n].peer is not None]):
        raise ValueError(f"--configs: {', '.join(peers)} are peer routers; they run on the live clock only")
    configurations = []
    for name in names:
        peer = known[name].peer
        if peer is not None and missing_binaries([peer]):
            print(f"skipping {name}: {peer.binary} is not installed (pip install kvswitch[peers])", file=sys.stderr)
            continue
        configurations.append(known[name])
    items = _trace_items(args)
    if virtual:
        for rate in rates:
            check_span("--rates", items, rate)
    sim_args = list(args.sim_arg)
    engine_len, raised = SIMS_MAX_MODEL_LEN, None
    if virtual or "--max-model-len" not in sim_args:  # live: one given by --sim-arg is the user's, as given
        engine_len, raised = _max_model_len(args, items)
    if not virtual and raised:  # the live sims run at the length the raised line says, checked alike
        sim_args += ["--max-model-len", str(engine_len)]
    spec = CompareSpec(
        items=items,
        configurations=configurations,
        prefill=args.prefill,
        decode=args.decode,
        routers=args.routers,
        speedup=args.speedup,
        rates=rates,
        runs=args.runs,
        profile=args.profile,
        sim_args=sim_args,
        slo=Slo(args.slo_ttft, args.slo_itl),
        synth_seed=args.seed,
        progress=not args.no_progress,
        log_dir=args.out_dir / f"logs-{stamp()}" if args.keep_logs else None,
        clock=args.clock,
        delays=_delays(args),
        router_profile=_router_profile(args),
        max_model_len=engine_len if virtual else SIMS_MAX_MODEL_LEN,
        seed=args.router_seed,
        jobs=args.jobs,
        calibrate=args.calibrate,
        router_profile_error=args.router_profile_error,
    )
    check_spec(spec)
    check_out_dir("--out-dir", args.out_dir)  # last: a command refused before creates nothing
    started = time.monotonic()
    json_path = fresh_path(args.out_dir, "compare", ".json")
    saved = ResultsFile[Measurement](json_path)
    with saved.kept_on_failure("kvswitch bench compare"):
        measurements = run_compare(spec, on_measurement=saved.add)
    engines = "virtual clock" if args.clock == "virtual" else f"sims at {args.speedup:g}x"
    title = (
        f"{len(spec.items)} trace requests, scale {args.scale_tokens}, {args.prefill}P+{args.decode}D "
        f"{args.profile} {engines}"
    )
    png = plot_compare(measurements, json_path.with_suffix(".png"), title=title)
    print()
    print(title)
    print(format_table(measurements))
    for line in headline_ratios(measurements):
        print(line)
    if raised:
        print(raised)
    print(f"results: {json_path}\nfigure:  {png}\ntotal {time.monotonic() - started:.0f} s wall")
    return 0


def _plotting() -> Any:
    """bench.plot, or a ValueError naming the extra: matplotlib is optional (the runtime image leaves
    it out), and its absence was a traceback."""
    try:
        from bench import plot
    except ModuleNotFoundError as exc:
        raise ValueError(f"the figures need {exc.name}: pip install 'kvswitch[plot]'") from None
    return plot


def _sweep(args: argparse.Namespace) -> int:
    from bench.compare import CONFIGURATIONS, check_prefill_engines
    from bench.results_file import fresh_path
    from bench.sweep import format_sweep, parse_fleets, run_sweep, write_points
    from bench.ttft_floor import floor_p90
    from bench.virtual.fleet import FleetSpec, check_span
    from protocol.timing import TimingModel

    plot_sweep = _plotting().plot_sweep

    names = list(dict.fromkeys(n.strip() for n in args.configs.split(",") if n.strip()))
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        raise ValueError(f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(CONFIGURATIONS)}")
    if args.policy not in names:
        raise ValueError(f"--policy {args.policy} must be one of --configs ({', '.join(names)})")
    if args.scale_tokens is None:
        args.scale_tokens = 1.0
    rates = list(dict.fromkeys(positive_numbers("--rates", args.rates)))
    fleets = list(dict.fromkeys(parse_fleets(args.fleets)))  # a repeat once, as --rates and --configs
    # Aggregated configurations run P + D engines, so 0P+1D is one aggregated engine for them.
    bare = [f for f in fleets if f.prefill < 1]
    if bare:
        where = f"--fleets {','.join(f.name for f in bare)}"
        check_prefill_engines(where, 0, [CONFIGURATIONS[n] for n in names])
    items = _replay_items(args)
    if not items:
        raise ValueError("the workload is empty")
    for rate in rates:
        check_span("--rates", items, rate)
    engine_len, raised = _max_model_len(args, items)
    check_out_dir("--out-dir", args.out_dir)  # last: a command refused before creates nothing
    started = time.monotonic()
    points = run_sweep(
        items,
        fleets,
        rates,
        [CONFIGURATIONS[n] for n in names],
        slo=Slo(args.slo_ttft, args.slo_itl),
        max_model_len=engine_len,
        profile=args.profile,
        seed=args.seed,
        jobs=args.jobs,
    )
    json_path = fresh_path(args.out_dir, "sweep", ".json")
    write_points(json_path, points)
    title = f"{len(items)} requests ({args.workload}), scale {args.scale_tokens}, {args.profile}, virtual clock"
    png = plot_sweep(points, args.policy, json_path.with_suffix(".png"), title=title)
    print()
    print(title)
    engine = FleetSpec()
    floor = floor_p90(
        items,
        TimingModel.for_profile(args.profile),
        budget=engine.max_num_batched_tokens,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
    )
    print(format_sweep(points, args.policy, floor))
    print(
        f"TTFT floor p90 {floor:.3g} s: every request on an engine holding every earlier prefix "
        "(bench.ttft_floor); rr/floor is the most any router could beat round_robin by"
    )
    if raised:
        print(raised)
    print(f"results: {json_path}\nfigure:  {png}\ntotal {time.monotonic() - started:.0f} s wall")
    return 0


def run(args: argparse.Namespace) -> int:
    with signals_unwind(f"kvswitch bench {args.bench_command}", exits=True):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.bench_command == "chaos":
        from bench import chaos

        return chaos.run(args)
    try:
        _refuse_unread(args)
        if args.bench_command in ("replay", "summary", "compare", "sweep"):
            _check_slo(args)
        if args.bench_command in ("replay", "compare", "sweep"):
            _check_workload_numbers(args)
        if args.bench_command in ("compare", "sweep") or (args.bench_command == "replay" and args.clock == "virtual"):
            _check_engines(args)
        if args.bench_command == "replay":
            if args.clock == "live":
                if not args.url:
                    raise ValueError("--url is required (or --clock virtual)")
                _check_replay_urls(args)
                check_positive("--latency-scale", args.latency_scale)
            items = _replay_items(args)
            if args.clock == "virtual":
                return _replay_virtual(args, items)
            return asyncio.run(_replay(args, items))
        if args.bench_command == "summary":
            from bench.replay import read_results

            check_positive("--latency-scale", args.latency_scale)
            results = read_results(args.results)
            if not results:
                # A zero goodput printed with rc 0 reads as a measured figure.
                raise ValueError(f"{args.results} holds no results (a `bench replay` that ran no request?)")
            clock = results_clock(results)
            if clock == "virtual" and args.latency_scale != 1.0:
                raise ValueError(f"--latency-scale is for live-clock results; {args.results} holds virtual-clock ones")
            slo = Slo(args.slo_ttft, args.slo_itl)
            print(format_summary(summarize(results, slo=slo, latency_scale=args.latency_scale, clock=clock)))
            return 0
        if args.bench_command == "overhead":
            return overhead_main(args)
        if args.bench_command == "replicas":
            return replicas_main(args)
        if args.bench_command == "sweep":
            return _sweep(args)
        return _compare(args)
    except (TraceError, ValueError, OSError, RuntimeError, aiohttp.ClientError, msgspec.DecodeError) as exc:
        print(f"kvswitch bench {args.bench_command}: {exc}", file=sys.stderr)
        return 2
