"""`kvswitch up`: the embedded default, a whole cluster on one machine.

Flags it does not know itself are router flags (e.g. `--conditional-disagg`,
`--conditional-disagg-policy ttft_model`): they are checked against the router's own parser at
once and passed to every replica. A flag refused before anything starts is one line and exit
status 2, as argparse's own. A log it cannot open in --log-dir when a process starts (a directory
of that name) is exit 1 naming --log-dir, as any failure to start: a shim's log is named by its
port, known only then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import importlib
import itertools
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from kvswitch.cluster import POOLS, STOP_GRACE_S, ClusterSpec, LocalCluster, RestartPolicy, shim_argv
from kvswitch.flags import FlagParser, long_flags, unknown_flags
from kvswitch.nats_auth import RESPONSE_TTL_S
from kvswitch.servers import FREE_PORTS_ENV, ServerError, port_range, symlinked
from protocol import ConfigError, subjects
from protocol.config import RouterSettings, resolve
from protocol.errors import try_listen, why_unbound
from protocol.timing import check_speedup, profile_names

__all__ = ["PASSES_UNKNOWN_ARGS", "UpFlagError", "add_arguments", "check_log_dir", "run"]

PASSES_UNKNOWN_ARGS = True
# How often the supervisor looks for children and servers that exited (it wakes at each restart
# due as well). It looked every half back-off: at 0.001 s it spun at 92% of a core, idle (review
# of the restarts, 2026-12-06); a back-off below MIN_BACKOFF_S is refused still.
WATCH_S = 0.5
CHECK_S = 5.0  # how often it probes the cluster's health, saying a change in its health line
MIN_BACKOFF_S = 0.1
log = logging.getLogger("kvswitch.up")
_EPILOG = (
    "Any other flag is a router flag, given to every router replica: `kvswitch router --help` lists them "
    "(e.g. kvswitch up --prefill 1 --decode 2 --conditional-disagg). Without --agg, --prefill or --decode only NATS "
    "and etcd start, for shims and routers of your own."
)
_NO_WORKERS = (
    "kvswitch up: no workers, so no routers: add simulated ones with --agg N (or --prefill P --decode D), "
    "or start `kvswitch shim` and `kvswitch router` against the NATS and etcd above"
)
# --secure's servers admit only the credentials it made: a router started by hand without them was
# refused by etcd ("etcd_user ... = None: etcd ... has authentication on").
_OWN_SECURE = (
    ", with the credentials --secure made for one of each (an nkey seed each, the etcd user and password in the "
    "--config file; all removed when up stops). Add your engine's flags to the shim's (--engine-url, --model, "
    "--kv-events, ...):"
)


class UpFlagError(SystemExit):
    """A flag `kvswitch up` refuses before anything starts: exit status 2, as argparse's own
    refusals; `run` prints the message (str of it)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_sim import SimConfig  # here, not at import: only `kvswitch up` itself pays for it

    max_model_len = SimConfig().max_model_len
    parser.epilog = _EPILOG
    parser.add_argument("--nats-port", type=int, default=0, help="NATS client port (0: a free one)")
    parser.add_argument("--etcd-port", type=int, default=0, help="etcd client port (0: a free one)")
    parser.add_argument("--namespace", default="kvswitch", help="prefix of every subject and key")
    parser.add_argument("--prefill", type=int, default=0, metavar="P", help="simulated prefill workers")
    parser.add_argument("--decode", type=int, default=0, metavar="D", help="simulated decode workers")
    parser.add_argument("--agg", type=int, default=0, metavar="A", help="simulated aggregated workers")
    parser.add_argument("--routers", type=int, default=None, metavar="R",
                        help="router replicas, which need workers (default: 1 with workers, else 0)")  # fmt: skip
    parser.add_argument("--http-port", type=int, default=8080, help="first router's port; the next ones follow")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="simulated engines run this many times faster than --profile (0.001..1000000); "
                             "their shims register the profile at this speed, so the routers predict in real "
                             "seconds, and the router flags --slo-ttft-s and --slo-itl-s, passed on unchanged, "
                             "are real seconds too (divide an SLO in the profile's seconds by it)")  # fmt: skip
    parser.add_argument("--model", default="sim-llama", help="served model name")
    # No argparse choices: a table that does not parse names no profile, and its fault would read as an
    # unknown name. The sims' own check (_max_model_len_args: SimConfig.validate) says which (exit 2).
    parser.add_argument("--profile", default="h200:llama-3.1-8b",
                        help="engine timing profile: " + ", ".join(profile_names()))  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=max_model_len, metavar="TOKENS",
                        help="the simulated engines' max_model_len, as vLLM's flag: a longer request is refused "
                             f"with 400 (default {max_model_len}, the sims' own)")  # fmt: skip
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters every simulated engine serves, as vLLM's flag takes them; requests "
                             "may name them as their model")  # fmt: skip
    parser.add_argument(
        "--log-dir",
        default=None,
        help="write the output of each child and of NATS and etcd to DIR/<name>.log (nats-0, etcd-0, sim-agg, "
        "router-0, ...; default: a temporary directory removed at exit)",
    )
    parser.add_argument("--demo", action="store_true", help="bring the cluster up, show it healthy, take it down")
    default = RestartPolicy()
    parser.add_argument("--no-restart", action="store_true",
                        help="leave a child (sim, shim, router) or a nats/etcd server that exits down, as "
                             "dead in the health line (default: restart it as it was started)")  # fmt: skip
    parser.add_argument("--restart-backoff-s", type=float, default=default.first_s, metavar="SECONDS",
                        help=f"wait before restarting what exited, doubled at each exit in a row up to "
                             f"{default.most_s:.0f} s (or SECONDS if more); after {default.failures} exits in a "
                             f"row, each within {default.settled_s:.0f} s of its start, it is given up "
                             f"(default {default.first_s})")  # fmt: skip
    ha = parser.add_argument_group("high availability and security")
    ha.add_argument("--nats-nodes", type=int, default=1, metavar="N", help="NATS cluster members (3 for HA)")
    ha.add_argument("--etcd-members", type=int, default=1, metavar="N", help="etcd cluster members (3 for HA)")
    ha.add_argument("--secure", action="store_true",
                    help="TLS on NATS and etcd (fresh CAs; NATS routes and etcd peers each their own), etcd "
                         "users, and per-worker NATS permissions")  # fmt: skip


def _spec(args: argparse.Namespace) -> ClusterSpec:
    for name in ("prefill", "decode", "agg"):
        if getattr(args, name) < 0:
            raise UpFlagError(f"kvswitch up: --{name} must be >= 0, got {getattr(args, name)}")
    workers = args.prefill + args.decode + args.agg
    routers = args.routers if args.routers is not None else (1 if workers else 0)
    if routers < 0:
        raise UpFlagError(f"kvswitch up: --routers must be >= 0, got {routers}")
    if args.demo and not routers:
        raise UpFlagError("kvswitch up: --demo sends its requests through a router: drop --routers 0 or --demo")
    if routers and not workers:
        # A router is ready only once a worker registers: up would wait for one that never comes.
        raise UpFlagError(
            f"kvswitch up: --routers {routers} needs simulated workers: add --agg, --prefill or --decode "
            "(or drop --routers to run NATS and etcd alone, for routers and shims of your own)"
        )
    if routers and not args.decode + args.agg:
        # The router answers only through decode or agg workers: /ready would never pass.
        raise UpFlagError(
            f"kvswitch up: --prefill {args.prefill} needs --decode or --agg: prefill workers serve no request "
            "alone (or --routers 0 for prefill sims beside routers and decode workers of your own)"
        )
    try:
        check_speedup(args.speedup, "--speedup")  # the shims register the sims' profile at it
    except ValueError as exc:
        raise UpFlagError(f"kvswitch up: {exc}") from None
    for name in ("nats_port", "etcd_port", "http_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise UpFlagError(f"kvswitch up: --{name.replace('_', '-')} must be in 0..65535 (0: a free one), "
                             f"got {getattr(args, name)}")  # fmt: skip
    for name in ("nats_nodes", "etcd_members"):
        if getattr(args, name) < 1:
            raise UpFlagError(f"kvswitch up: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    # Member i of each listens on its port flag + i: past 65535, NATS died "invalid port 65536" after
    # it started, and etcd was "not healthy" after 30 s.
    for flag, first, count_flag, count, member in [
        ("--http-port", args.http_port, "--routers", routers, "router"),
        ("--nats-port", args.nats_port, "--nats-nodes", args.nats_nodes, "NATS node"),
        ("--etcd-port", args.etcd_port, "--etcd-members", args.etcd_members, "etcd member"),
    ]:
        if first and first + count - 1 > 65535:
            raise UpFlagError(
                f"kvswitch up: {flag} {first} leaves no port for {member} {count - 1} of {count_flag} {count} "
                f"({member} i listens on {flag} + i): at most {65536 - count}"
            )
    _check_draw(args, workers, routers)
    try:
        subjects.validate_namespace(args.namespace)  # as the router and the shims check it
    except ValueError:
        raise UpFlagError(f"kvswitch up: --namespace must match [A-Za-z0-9_-]+, got {args.namespace!r}") from None
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is not None:
        try:
            check_log_dir(log_dir, _log_names(args, routers))
        except ValueError as exc:
            raise UpFlagError(f"kvswitch up: {exc}") from None
    if not args.model.strip():
        raise UpFlagError("kvswitch up: --model must name the served model, got an empty name")
    restart = _restart_policy(args)
    sim_args = [*_max_model_len_args(args), *_lora_args(args.lora_modules, args.model)]
    extra: list[str] = list(getattr(args, "extra", []))
    spec = ClusterSpec(
        nats_port=args.nats_port, etcd_port=args.etcd_port, namespace=args.namespace,
        prefill=args.prefill, decode=args.decode, agg=args.agg, routers=routers,
        http_port=args.http_port if routers else 0, speedup=args.speedup, model=args.model,
        profile=args.profile, router_args=extra, sim_args=sim_args,
        log_dir=log_dir,
        nats_nodes=args.nats_nodes, etcd_members=args.etcd_members, etcd_auth=args.secure, nats_auth=args.secure,
        restart=restart,
    )  # fmt: skip
    # Every child's settings as it will resolve them (flags, then the KVSWITCH_* variables it
    # inherits), by its own rules: what it would refuse at its start is refused now, before NATS,
    # etcd and the sims start (a shim's refusal was exit 1 after them all, its words in its log).
    with _stand_ins(args) as connection:
        if extra or routers:
            settings, spec.router_file = _check_router_args(extra, args, connection)
            if routers:
                _check_pools(args, settings)
        _check_shims(spec, connection)
    return spec


def _check_draw(args: argparse.Namespace, workers: int, routers: int) -> None:
    """Every port drawn from the free-port range (`free_ports`) is drawn in one draw of consecutive
    ports before anything starts (LocalCluster.start, ClusterSpec.drawn_ports): the workers' (3
    each), the routers' without --http-port, and NATS's and etcd's; none is a port a flag asks for,
    which splits the range where it lies in it. More than its longest run of ports holds is refused
    now, naming the flags, not after NATS and etcd started."""
    n, m = args.nats_nodes, args.etcd_members
    spec = ClusterSpec(
        nats_port=args.nats_port, etcd_port=args.etcd_port, nats_nodes=n, etcd_members=m, prefill=args.prefill,
        decode=args.decode, agg=args.agg, routers=routers, http_port=args.http_port if routers else 0,
    )  # fmt: skip
    block, servers = spec.drawn_ports()
    drawn = block - 3 * workers
    need = block + servers
    try:
        low, high = port_range()
    except ServerError as exc:
        raise UpFlagError(f"kvswitch up: {exc}") from None
    asked = [(spec.http_port, routers), (args.nats_port, n), (args.etcd_port, m)]
    flagged = sorted({p for first, count in asked if first for p in range(first, first + count) if low <= p < high})
    edges = [low - 1, *flagged, high]
    room = max(b - a - 1 for a, b in itertools.pairwise(edges))  # the longest run between them
    if need <= room:
        return
    given = os.environ.get(FREE_PORTS_ENV)
    where = f"{FREE_PORTS_ENV}={given}" if given else "10000 up to net.ipv4.ip_local_port_range's low end"
    if flagged:
        shown = ", ".join(map(str, flagged[:3])) + (", ..." if len(flagged) > 3 else "")
        where += f", split by the {len(flagged)} asked for by flag: {shown}"
    takers = (
        [f"--agg {args.agg} --prefill {args.prefill} --decode {args.decode} (3 ports per worker)"] if workers else []
    )
    if drawn:
        takers.append(f"--routers {routers} (1 port each, without --http-port)")
    takers.append(
        f"NATS and etcd ({servers} for --nats-nodes {n} and --etcd-members {m}: a monitor port per NATS node, a route "
        "port per node of a cluster, a peer port per etcd member, and a client port each without --nats-port or "
        "--etcd-port)"
    )
    most = (room - servers - drawn) // 3
    routed = " with these routers" if drawn else ""
    fits = f"at most {most} workers{routed}" if most > 0 else f"no worker fits{routed}: give a wider range"
    if not workers:
        fits = "give a wider range"
    taking = ", ".join(takers[:-1]) + " and " + takers[-1] if len(takers) > 1 else takers[0]
    raise UpFlagError(
        f"kvswitch up: {taking} take {need} consecutive ports, more than the {room} in a row of {low}-{high} "
        f"({where}): {fits}"
    )


def _restart_policy(args: argparse.Namespace) -> RestartPolicy | None:
    first = args.restart_backoff_s
    if not MIN_BACKOFF_S <= first < math.inf:
        raise UpFlagError(
            f"kvswitch up: --restart-backoff-s must be a finite number of seconds >= {MIN_BACKOFF_S:g}, got {first}"
        )
    if args.no_restart:
        if first != RestartPolicy.first_s:
            raise UpFlagError("kvswitch up: --restart-backoff-s has no effect with --no-restart: drop one")
        return None
    return RestartPolicy(first_s=first, most_s=max(RestartPolicy.most_s, first))


def _max_model_len_args(args: argparse.Namespace) -> list[str]:
    """The sims' --max-model-len, checked now by the sim's own rules (vLLM's: the KV cache holds one
    request that long), so a bad value is refused before anything starts."""
    from engine_sim import SimConfig, SimConfigError

    config = SimConfig(model=args.model, profile=args.profile, max_model_len=args.max_model_len,
                       block_size=ClusterSpec.block_size)  # fmt: skip
    try:
        config.validate()
    except SimConfigError as exc:
        raise UpFlagError(f"kvswitch up: {exc}") from None
    try:
        config.check_kv_fits_max_model_len()
    except SimConfigError:
        raise UpFlagError(
            f"kvswitch up: --max-model-len {args.max_model_len} does not fit one simulated engine's KV cache "
            f"({config.usable_gpu_blocks} blocks of {config.block_size} tokens for --profile {args.profile}): "
            f"at most {config.longest_max_model_len}"
        ) from None
    return ["--max-model-len", str(args.max_model_len)]


def _lora_args(modules: list[str], model: str) -> list[str]:
    """The sims' LoRA flags, checked now by the sim's own rules (so a bad value is refused before
    anything starts)."""
    if not modules:
        return []
    from engine_sim import LoraModule, SimConfig, SimConfigError

    try:
        SimConfig(model=model, lora_modules=tuple(LoraModule.parse(m) for m in modules)).validate()
    except SimConfigError as exc:
        raise UpFlagError(f"kvswitch up: {exc}") from None
    return ["--enable-lora", "--lora-modules", *modules]


def _log_names(args: argparse.Namespace, routers: int) -> list[str]:
    """The logs `kvswitch up` writes in --log-dir (LocalCluster: its servers' and its children's), as
    patterns: a shim's is named by its engine's port, drawn only at its start."""
    pools = [role for role in POOLS if getattr(args, role)]
    return [
        *(f"nats-{i}.log" for i in range(args.nats_nodes)), *(f"etcd-{i}.log" for i in range(args.etcd_members)),
        *(f"sim-{role}.log" for role in pools), *(f"shim-{role}-*.log" for role in pools),
        *(f"router-{i}.log" for i in range(routers)),
    ]  # fmt: skip


def check_log_dir(log_dir: Path, names: list[str]) -> None:
    """Children write their logs there: a directory that cannot be made or written is refused now
    (ValueError naming --log-dir), not at the first child, after NATS and etcd started. Written, not
    asked (os.access): root is allowed everywhere by the mode bits, yet not in /sys or /proc. So is a
    symlink in the place of a log of `names` (fnmatch patterns), which every log's open refuses
    (servers.open_log): it was a bare "Too many levels of symbolic links", exit 1, once NATS had
    started. `bench chaos --log-dir` is checked so too."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--log-dir {log_dir}: cannot create it: {exc.strerror or exc}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=log_dir, prefix=".kvswitch-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"--log-dir {log_dir}: not writable: {exc.strerror or exc}") from None
    with os.scandir(log_dir) as entries:
        linked = sorted(
            e.name for e in entries if e.is_symlink() and any(fnmatch.fnmatchcase(e.name, n) for n in names)
        )
    if linked:
        raise ValueError(f"--log-dir {log_dir}: {symlinked(log_dir / linked[0])}")


def _check_ports(spec: ClusterSpec) -> None:
    """The ports asked for are free now, bound as their servers bind them (SO_REUSEADDR: a port
    left in TIME_WAIT is free): one held by another process, another `kvswitch up` most often, is
    refused before anything starts, naming its flag (nats-server and etcd would each say it in a
    log line of their own, after the others started)."""
    asked = [
        ("--http-port", spec.http_port, spec.routers, "router"),
        ("--nats-port", spec.nats_port, spec.nats_nodes, "NATS node"),
        ("--etcd-port", spec.etcd_port, spec.etcd_members, "etcd member"),
    ]
    taken = [(flag, first, count) for flag, first, count, _ in asked if first]
    for i, (flag, first, count) in enumerate(taken):
        for other, start, n in taken[i + 1 :]:
            if first < start + n and start < first + count:
                raise UpFlagError(
                    f"kvswitch up: {flag} {first} and {other} {start} overlap: {_ports(flag, first, count)} and "
                    f"{_ports(other, start, n)}: choose ports apart, or 0 for free ones"
                )
    for flag, first, count, what in asked:
        for port in range(first, first + count) if first else ():
            try:
                try_listen("127.0.0.1", port)
            except OSError as exc:
                raise UpFlagError(
                    f"kvswitch up: {flag} {first}: {what} {port - first} cannot listen on 127.0.0.1:{port} "
                    f"({why_unbound(port, exc)}): choose another {flag}, or 0 for free ones"
                ) from None


def _ports(flag: str, first: int, count: int) -> str:
    """The ports `flag` takes, in words ("--nats-port takes 4222-4224 (--nats-nodes 3)")."""
    took = f"{first}" if count == 1 else f"{first}-{first + count - 1}"
    counted = {"--http-port": "--routers", "--nats-port": "--nats-nodes", "--etcd-port": "--etcd-members"}[flag]
    return f"{flag} takes {took} ({counted} {count})"


# Router flags `kvswitch up` gives every replica itself (LocalCluster._start_router) and has no flag of
# its own for (those it has, --namespace, --http-port, --model, never reach the router's parser): one
# given again would point the routers away from the cluster's own NATS and etcd, or their address.
_UP_SETS = ("http_host",)
_UP_SETS_PREFIXES = ("nats_", "etcd_")


class _RouterFlags(FlagParser):
    """The router's parser, for the flags `up` passes on: a refusal is raised, for `up` to say."""

    def error(self, message: str) -> NoReturn:
        raise UpFlagError(f"kvswitch up: {message} (a router flag: see kvswitch router --help)")


def _unknown_flags(unknown: list[str], router: argparse.ArgumentParser) -> str:
    """Why `unknown` (what neither parser took) is refused, with the nearest flags of either for
    each flag in it."""
    own = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(own)
    flags = ", ".join(unknown_flags(unknown, long_flags(own, router))) or " ".join(unknown)
    return (
        f"kvswitch up: unrecognized arguments: {' '.join(unknown)}: {flags} is neither a flag of kvswitch up "
        "(kvswitch up --help) nor a router flag it passes on (kvswitch router --help)"
    )


def _check_router_args(
    extra: list[str], args: argparse.Namespace, connection: dict[str, Any]
) -> tuple[RouterSettings, dict[str, Any]]:
    """The routers' settings, resolved now by the router's own rules from `extra` and the
    environment, as each replica will resolve them: contradictory flags are refused before
    anything starts. With them, the mapping of the --config file the check read ({} without one)."""
    try:
        router_cli = importlib.import_module("router.cli")
    except ImportError as exc:
        raise UpFlagError(f"kvswitch up: unknown arguments {extra} (the router is not installed)") from exc
    parser = _RouterFlags(prog="kvswitch up (router flags)", reads_environment=True)
    router_cli.add_arguments(parser)
    ns, unknown = parser.parse_known_args(extra)
    if unknown:
        raise UpFlagError(_unknown_flags(unknown, parser))
    if ns.tokenizer is not None:
        # Simulated engines tokenize with the built-in tokenizer alone: a router with another
        # would refuse every text prompt (its fingerprint matches no worker's) on a cluster up
        # reports healthy.
        raise UpFlagError(
            f"kvswitch up: --tokenizer {ns.tokenizer}: the simulated engines of kvswitch up tokenize with the "
            "built-in tokenizer only, so a router with another would refuse every text prompt: drop --tokenizer "
            "(give it to `kvswitch router` in front of real engines)"
        )
    for dest, value in vars(ns).items():
        if value != parser.get_default(dest) and (dest in _UP_SETS or dest.startswith(_UP_SETS_PREFIXES)):
            flag = "--" + dest.replace("_", "-")
            raise UpFlagError(
                f"kvswitch up: {flag} is set by kvswitch up itself (its own NATS and etcd, the routers on "
                "127.0.0.1 from --http-port): drop it"
            )
    # Their argv as LocalCluster gives it (_start_router): its own NATS and etcd as flags, which win
    # over the KVSWITCH_NATS_*/ETCD_* variables.
    vars(ns).update(connection, http_host="127.0.0.1", http_port=args.http_port, model=args.model)
    if args.secure:
        ns.etcd_user, ns.etcd_password = "router", "-"  # LocalCluster._child_env
    try:
        config = router_cli.build_config(ns)
        if args.secure:
            _check_response_ttl(config.request_timeout_s)
        settings = resolve(RouterSettings, cli=config.overrides, file=config.file_settings)
    except ConfigError as exc:
        raise UpFlagError(f"kvswitch up: {exc}") from None
    return settings, config.file_settings


def _check_response_ttl(request_timeout_s: float) -> None:
    """ConfigError for a router deadline at or above the worker reply permission --secure writes
    (NatsAuthPlan's response TTL): nats-server refuses a worker's replies to a request once it
    expires, so a request running past it failed. Refused, not a TTL derived from the deadline:
    up's secure cluster keeps the TTL `kvswitch secrets` writes by default, and that is where a
    longer one is given (docs/security.md)."""
    ttl = RESPONSE_TTL_S
    if request_timeout_s >= ttl:
        raise ConfigError(
            "request_timeout",
            request_timeout_s,
            f"must be < {ttl} s with --secure, the NATS response TTL it writes (a worker's leave to reply to a "
            f"request): nats-server refuses replies past it, failing longer requests; give --request-timeout below "
            f"{ttl}, or drop --secure (for a longer one, run your own servers with kvswitch secrets --response-ttl "
            "above it)",
        )


def _check_pools(args: argparse.Namespace, settings: RouterSettings) -> None:
    """The routers disaggregate exactly when there are prefill workers to do it: `always` or the
    policy on (conditional_disagg) with none was aggregated without a word (bench.compare refuses
    the same), and prefill workers under disagg=never got no request. disagg=conditional with the
    policy off is the default, `always` where prefill workers exist, aggregated where none do."""
    if not args.prefill and settings.disagg == "always":
        why = _NO_PREFILL.format(what="prefills every request remotely")
        raise UpFlagError(f"kvswitch up: {ConfigError('disagg', 'always', why)}")
    if not args.prefill and settings.conditional.conditional_disagg:
        why = _NO_PREFILL.format(what="has its policy choose a remote prefill or a local one per request")
        raise UpFlagError(f"kvswitch up: {ConfigError('conditional_disagg', True, why)}")
    if args.prefill and settings.disagg == "never":
        raise UpFlagError(
            f"kvswitch up: --prefill {args.prefill}: its prefill workers get no request under disagg=never (--disagg, "
            "KVSWITCH_DISAGG): drop --prefill, or give --disagg always or conditional"
        )


_NO_PREFILL = (
    "{what}, and --prefill is 0: add --prefill P beside --decode D, or drop it (aggregated workers need neither)"
)


def _check_shims(spec: ClusterSpec, connection: dict[str, Any]) -> None:
    """Each pool's shim settings, resolved now by the shim's own rules from its argv
    (kvswitch.cluster.shim_argv) and the environment it inherits, as it will resolve them."""
    shim_cli = importlib.import_module("worker_shim.cli")
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="kvswitch shim")
    shim_cli.add_arguments(parser)
    for role in POOLS:
        if not getattr(spec, role):
            continue
        # The sims' ports, drawn only at the start, stood in for by any.
        ns = parser.parse_args(
            shim_argv(spec, role, "http://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3")[1:]
        )
        vars(ns).update(connection)
        if spec.nats_auth:
            ns.worker_name = f"{role}-0"
        if spec.etcd_auth:
            ns.etcd_user, ns.etcd_password = "worker", "-"  # LocalCluster._child_env
        try:
            shim_cli.resolve_settings(ns)
        except ConfigError as exc:
            raise UpFlagError(f"kvswitch up: its {role} shims: {exc}") from None


@contextlib.contextmanager
def _stand_ins(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The NATS and etcd flags LocalCluster gives its routers and shims (_connection_args), as
    settings: with --secure, files it writes only once it starts stand in, of the same kinds (a CA
    and an nkey seed), for each child reads what they hold."""
    nats, etcd = ("tls", "https") if args.secure else ("nats", "http")
    connection: dict[str, Any] = {
        "namespace": args.namespace,
        "nats_servers": [f"{nats}://127.0.0.1:{args.nats_port or 4222}"],
        "etcd_endpoints": [f"{etcd}://127.0.0.1:{args.etcd_port or 2379}"],
    }
    with tempfile.TemporaryDirectory(prefix="kvswitch-up-check-") as tmp:
        if args.secure:
            from kvswitch.certs import write_tls
            from kvswitch.nats_auth import NatsIdentity

            seed = Path(tmp, "check.nk")
            seed.write_text(NatsIdentity.create("check", "worker").seed)
            ca = str(write_tls(Path(tmp), ["127.0.0.1"]).ca)
            connection.update(nats_tls_ca=ca, etcd_tls_ca=ca, nats_nkey_file=str(seed))
        yield connection


# How long a restarted child may take to serve again (a router's /ready) before it is down, not restarting.
RESTART_GRACE_S = 30.0


class _HealthLog:
    """What `kvswitch up` says of its cluster's health at each check: a change at once (a child or
    a server that died, with its exit status and last output), the same trouble again at most every
    `every_s`, with how many checks found it meanwhile. `watch`, between checks, restarts what
    exited when the cluster has a restart policy: a WARNING for each exit it restarts, an ERROR for
    one given up and for each restart that could not start its process."""

    def __init__(
        self, cluster: LocalCluster, said: str, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cluster = cluster
        self.every_s = every_s
        self._clock = clock
        self._line = said  # the health line said last
        self._said_at = clock()
        self._held = 0
        self._level = logging.ERROR  # the level it was said at

    def watch(self) -> None:
        """Say each new exit once, and restart what is due (cheap: no probe, for every tick)."""
        now, policy = self._clock(), self.cluster.spec.restart
        for name, died, backoff in self.cluster.note_exits(now):
            self._line = ""  # the next check says the health line, "healthy again" once restarted
            what = "server" if name in dict(self.cluster.servers()) else "child"
            if policy is None:
                log.error("%s exited: %s", what, died)
            elif backoff.given_up:
                log.error(
                    "%s exited: %s; given up: it exited %d times in a row, each within %.0fs of its start: see its "
                    "output above (a bad flag? a port another process holds?); the rest of the cluster runs on, "
                    "restart kvswitch up to try it again",
                    what, died, backoff.failures, policy.settled_s,
                )  # fmt: skip
            else:
                assert backoff.restart_at is not None
                log.warning(
                    "%s exited: %s; restarting it in %.1fs (exit %d in a row; given up at %d)",
                    what, died, backoff.restart_at - now, backoff.failures, policy.failures,
                )  # fmt: skip
        for name, failed, backoff in self.cluster.restart_due(now):
            if failed is None:
                log.info("restarted %s", name)
                continue
            what = "server" if name in dict(self.cluster.servers()) else "child"
            assert policy is not None  # a restart is tried only under a policy
            if backoff.given_up:
                log.error(
                    "%s %s could not be restarted: %s; given up: it exited or could not be started %d times in a "
                    "row, each within %.0fs of its start; the rest of the cluster runs on, restart kvswitch up to "
                    "try it again",
                    what, name, failed, backoff.failures, policy.settled_s,
                )  # fmt: skip
            else:
                assert backoff.restart_at is not None
                log.error(
                    "%s %s could not be restarted: %s; trying again in %.1fs (counted as exit %d in a row; given up "
                    "at %d)",
                    what, name, failed, backoff.restart_at - now, backoff.failures, policy.failures,
                )  # fmt: skip

    def check(self) -> None:
        self.watch()
        self.probe()

    def probe(self) -> None:
        """Say the cluster's health line when it changed, or the same trouble again at most every
        `every_s` (`check` without `watch`). Children restarting within their back-off (and
        RESTART_GRACE_S to serve again) are a WARNING: the restart is under way, and its exit was
        said. An ERROR once any stays down past that, at once, or for anything else down."""
        (line, healthy), now = self.cluster.health(), self._clock()
        level = logging.WARNING if self.cluster.restarting_only(now, RESTART_GRACE_S) else logging.ERROR
        if line != self._line or (not healthy and level > self._level):
            if healthy:
                log.info("healthy again: %s", line)
            else:
                log.log(level, "unhealthy: %s", line)
            self._line, self._said_at, self._held, self._level = line, now, 0, level
        elif not healthy:
            self._held += 1
            if now - self._said_at >= self.every_s:
                log.log(level, "still unhealthy (%d checks in %.0fs): %s", self._held, now - self._said_at, line)
                self._said_at, self._held, self._level = now, 0, level


class _PartFaults:
    """One part of supervision (watching for exits and restarts, or the health check) that raises:
    a fault no restart foresaw. A fault is its exception's type and the line that raised it, not its
    message: one naming a pid, a port or a time is the same fault each round (keyed on its text, it
    was new each round, a traceback every 0.5 s). A new fault since the part last worked is an ERROR
    at once, with its traceback if none was shown for `every_s` (else without, saying so: distinct
    faults never flood tracebacks either); the same one again at most every `every_s` with how many
    times it came meanwhile. Only the part's own success ends its counts: a health check failing
    every 5 s between working watch rounds was "works again" each time, and never stopped.
    `bound_s` without one that works is a supervisor that no longer supervises: `failed` then says
    why, for `kvswitch up` to stop and exit 1."""

    def __init__(self, what: str, every_s: float, bound_s: float, clock: Callable[[], float]) -> None:
        self.what, self.every_s, self.bound_s, self._clock = what, every_s, bound_s, clock
        self._since: float | None = None  # its first failure since it last worked
        self._said: dict[tuple[str, str, int], tuple[float, int]] = {}  # per fault: when said last, how many since
        self._traced_at: float | None = None  # its last traceback, kept across `ok` (alternating must not flood)

    def failed(self, exc: Exception) -> str | None:
        """Count a failure with `exc`; the fault to stop for once none worked for `bound_s`."""
        now = self._clock()
        fault = f"{type(exc).__name__}: {exc}"
        self._since = now if self._since is None else self._since
        failing = now - self._since
        if failing >= self.bound_s:
            return f"{self.what} failed for {failing:.0f}s, none working since, the last with {fault}"
        key = _fault_key(exc)
        said = self._said.get(key)
        if said is None:
            self._said[key] = (now, 0)
            if self._traced_at is None or now - self._traced_at >= self.every_s:
                self._traced_at = now
                log.error(
                    "%s failed: %s; the cluster runs on, and is stopped if none works for %.0fs",
                    self.what, fault, self.bound_s, exc_info=exc,
                )  # fmt: skip
            else:
                log.error(
                    "%s failed: %s; raised at %s:%d, its traceback not shown (one every %.0fs at most, the last "
                    "%.0fs ago); the cluster runs on, and is stopped if none works for %.0fs",
                    self.what, fault, key[1], key[2], self.every_s, now - self._traced_at, self.bound_s,
                )  # fmt: skip
        elif now - said[0] >= self.every_s:
            log.error(
                "%s failed again (%d times in %.0fs), the last with %s; none worked for %.0fs, the cluster is "
                "stopped at %.0fs",
                self.what, said[1] + 1, now - said[0], fault, failing, self.bound_s,
            )  # fmt: skip
            self._said[key] = (now, 0)
        else:
            self._said[key] = (said[0], said[1] + 1)
        return None

    def ok(self) -> None:
        if self._since is not None:
            log.info("%s works again, after %.0fs failing", self.what, self._clock() - self._since)
            self._since = None
            self._said.clear()


def _fault_key(exc: Exception) -> tuple[str, str, int]:
    """`exc`'s type and the file and line that raised it; one never raised has no line (its type alone)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = (frames[-1].filename, frames[-1].lineno or 0) if frames else ("", 0)
    return (f"{type(exc).__module__}.{type(exc).__qualname__}", *where)


class _RoundFaults:
    """The faults of each part of a supervision round, counted apart (`_PartFaults`)."""

    def __init__(
        self, every_s: float = 30.0, bound_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.watch = _PartFaults("watching for exits and restarts", every_s, bound_s, clock)
        self.check = _PartFaults("the health check", every_s, bound_s, clock)


def _tried(part: _PartFaults, call: Callable[[], None]) -> str | None:
    """`call`, its failure counted in `part` (not BaseException: a KeyboardInterrupt or a
    cancellation still ends the supervision); the fault to stop for, if any."""
    try:
        call()
    except Exception as exc:
        return part.failed(exc)
    part.ok()
    return None


async def _supervise(
    cluster: LocalCluster, health: _HealthLog, stop: asyncio.Event, faults: _RoundFaults | None = None
) -> str | None:
    """Until `stop`: exits are looked for each tick (a poll of each process), and at each restart
    due; health is probed every CHECK_S. A part of a round that raises (a fault no restart foresaw)
    is logged (`_PartFaults`) and the rest goes on: one process's trouble must not take the cluster
    down. A part that works for none of `faults.bound_s` ends it early: the fault, for the caller to
    stop the cluster and exit 1 (None when `stop` ended it)."""
    faults = faults or _RoundFaults()
    tick = CHECK_S if cluster.spec.restart is None else WATCH_S
    next_check = time.monotonic() + CHECK_S
    while not stop.is_set():
        due = cluster.next_restart()
        wait = tick if due is None else min(tick, max(0.0, due - time.monotonic()))
        # The round runs after the wait, not in its `except TimeoutError:`: a fault's traceback
        # carried the wait's CancelledError and TimeoutError, chained.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=wait)
        if stop.is_set():
            break
        fault = _tried(faults.watch, health.watch)
        if fault is None and time.monotonic() >= next_check:
            next_check = time.monotonic() + CHECK_S
            fault = _tried(faults.check, health.probe)
        if fault is not None:
            return fault
    return None


async def _demo(cluster: LocalCluster, spec: ClusterSpec, stop: asyncio.Event) -> int:
    """The demo's requests and counters, raced against `stop`: a SIGTERM or Ctrl-C meanwhile is
    heard at once, not after requests that may each wait up to their 60 s timeout."""
    if not cluster.router_urls:
        return 0 if cluster.healthy() else 1
    from kvswitch.demo import decision_counts, format_results, run_demo_requests
    from runtime import cancel_and_wait

    async def demo(url: str) -> int:
        results = await run_demo_requests(url, spec.model)
        print(format_results(results, await decision_counts(url)), flush=True)
        return 0 if cluster.healthy() and all(r.ok for _, r in results) else 1

    running = asyncio.create_task(demo(cluster.router_urls[0]), name="demo-requests")
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([running, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if running.done():
        return running.result()
    await cancel_and_wait(running)
    if not running.cancelled():
        running.result()  # its error, raised as awaiting it did
    print("kvswitch up: --demo stopped before its requests ended", file=sys.stderr, flush=True)
    return 1


async def _start(cluster: LocalCluster, spec: ClusterSpec, stop: asyncio.Event) -> bool:
    """Start the cluster and wait until it routes, on a thread, so a SIGTERM meanwhile is heard at
    once: False when it came first (the start is abandoned; the caller stops what did start)."""

    def start() -> None:
        cluster.start(stop_if_failed=False)  # up's own stop: it says what a second signal does
        if spec.routers:
            cluster.wait_ready(timeout=120)

    starting = asyncio.ensure_future(asyncio.to_thread(start))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not starting.done():
        cluster.abandon_start()
        with contextlib.suppress(ServerError):
            await starting
        return False
    starting.result()
    return True


async def _serve(args: argparse.Namespace, cluster: LocalCluster, spec: ClusterSpec, stop: asyncio.Event) -> int:
    """Start the cluster, then run its demo or supervise it until `stop`: the exit status."""
    try:
        if not await _start(cluster, spec, stop):
            return 0
    except ServerError as exc:
        print(f"kvswitch up: {exc}", file=sys.stderr, flush=True)
        return 1
    print(cluster.describe(), flush=True)
    said = cluster.health_line()
    print(said, flush=True)
    if not spec.prefill + spec.decode + spec.agg:
        own = cluster.own_commands()
        print(_NO_WORKERS + (_OWN_SECURE if own else ""), *(f"  {line}" for line in own), sep="\n", flush=True)
    if args.demo:
        return await _demo(cluster, spec, stop)
    print("kvswitch up: Ctrl-C or SIGTERM to stop", flush=True)
    fault = await _supervise(cluster, _HealthLog(cluster, said), stop)
    if fault is None:
        return 0
    log.error("%s; stopping the cluster", fault)
    print(f"kvswitch up: {fault}: the cluster is no longer supervised, so it is stopped", file=sys.stderr,
          flush=True)  # fmt: skip
    return 1


_AGAIN = "; a second SIGTERM or Ctrl-C kills everything now"


def _stopped(killed: list[str]) -> str:
    """The line that ends a stop: whether a child had to be killed (its requests in flight cut)."""
    if not killed:
        return "kvswitch up: stopped"
    one = len(killed) == 1
    return (
        f"kvswitch up: stopped, but killed {len(killed)} {'child' if one else 'children'} that did not stop within "
        f"{STOP_GRACE_S:.0f}s of SIGTERM ({', '.join(killed)}): what {'it' if one else 'they'} served was cut; exit 1"
    )


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def run(args: argparse.Namespace) -> int:
    if args.demo and not (args.prefill or args.decode or args.agg):
        args.prefill, args.decode = 1, 2
        args.speedup = args.speedup if args.speedup != 1.0 else 10.0
        if not getattr(args, "extra", []):
            args.extra = ["--conditional-disagg"]
    # SIGTERM and SIGINT are held back (blocked) until run_service handles them: during
    # the checks (a second or so, importing the router's and the shim's settings) a SIGTERM killed
    # up outright, leaving their directory in $TMPDIR (with --secure a CA and an nkey seed), and a
    # Ctrl-C was a traceback. One that came meanwhile stops up once they are done, their directory
    # removed, before anything starts.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        try:
            spec = _spec(args)
            _check_ports(spec)
        except UpFlagError as exc:
            print(exc, file=sys.stderr, flush=True)
            return 2
        if came := _taken(_STOP_SIGNALS):
            print(f"kvswitch up: {came} during its checks: stopped before anything started", file=sys.stderr,
                  flush=True)  # fmt: skip
            return 0
        return _up(args, spec)
    finally:
        _taken(_STOP_SIGNALS)  # held back still (an error), not delivered: a SIGTERM's default kills
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _taken(signals: set[signal.Signals]) -> str:
    """The names of `signals` that came while held back (blocked), taken: not delivered once unblocked."""
    came = sorted(signal.sigpending() & signals)
    for sig in came:
        signal.sigwait({sig})
    return " and ".join(sig.name for sig in came)


def _kill_everything(cluster: LocalCluster, tls_dir: str | None) -> None:
    """A second signal while stopping exits at once, past `main`'s finally: take everything down.
    The TLS directory (its CA key) is removed even when the kill fails."""
    try:
        cluster.kill()
    finally:
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)


def _up(args: argparse.Namespace, spec: ClusterSpec) -> int:
    """Run the cluster `spec` until a signal (or its demo's end); run_service lets the stop signals
    through once it handles them (one that came before is its "stopped during start")."""
    from runtime import run_service

    cluster = LocalCluster(spec)
    tls_dir: str | None = None

    def abort() -> None:
        _kill_everything(cluster, tls_dir)

    async def main(stop: asyncio.Event) -> int:
        nonlocal tls_dir
        tls_dir = tempfile.mkdtemp(prefix="kvswitch-tls-") if args.secure else None
        if tls_dir is not None:
            from kvswitch.certs import write_tls

            spec.tls = write_tls(Path(tls_dir), ["127.0.0.1", "localhost"])
        try:
            code = await _serve(args, cluster, spec, stop)
        finally:
            # A stop of up's own (the demo done, a start that failed) is bounded as a SIGTERM's:
            # setting `stop` starts run_service's drain limit.
            stop.set()
            # On a thread: a stop takes up to a tier's grace per tier, and a second SIGTERM
            # meanwhile must still be heard (it exits at once, after `abort`).
            killed = await asyncio.to_thread(cluster.stop, again=_AGAIN)
            if tls_dir is not None:
                shutil.rmtree(tls_dir, ignore_errors=True)
            print(_stopped(killed), file=sys.stderr, flush=True)
        # A child killed is a stop that cut what it served: not a clean one, for a supervisor to see.
        return code or (1 if killed else 0)

    # Draining is the tiered stop: three tiers of children, each up to its grace, then the servers.
    return run_service(main, drain_limit_s=4 * STOP_GRACE_S, on_abort=abort)
