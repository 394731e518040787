"""The one `kvswitch` command. Each subcommand lives in its own package's `cli` module, which
exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only when chosen, so
`kvswitch sim` does not pay for the router's imports."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Sequence

from kvswitch.environment import check_environment
from kvswitch.flags import FlagParser
from protocol.errors import VariableError
from protocol.version import BUILD
from runtime import stop_signals_held

__all__ = ["main", "subcommand_parser"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvswitch.up", "run a local cluster: nats, etcd, simulated engines, shims and routers"),
    "sim": ("engine_sim.cli", "a simulated engine that speaks vLLM's wire protocols"),
    "shim": ("worker_shim.cli", "the sidecar beside an engine: events, load, requests"),
    "router": ("router.cli", "a router replica: the OpenAI front door and the prefix index"),
    "bench": ("bench.cli", "trace replay, comparisons and micro-benchmarks"),
    "secrets": ("kvswitch.deploy_secrets", "a deployment's NATS nkeys and permissions, TLS certificates, etcd users"),
    "plan": ("bench.plan", "split N GPUs between prefill and decode for a trace, on the virtual clock"),
}
_SERVICES = {"router", "shim", "sim"}
"""Those whose `run` ends in runtime.run_service: a stop signal is held back while they load, and
said by run_service as a stop during start (`kvswitch up` holds its own through its checks)."""
_READ_ENVIRONMENT = {"router", "shim"}
"""Those whose settings a `KVSWITCH_*` variable gives too: a bad choice names it (kvswitch.flags)."""


def _top_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="kvswitch",
        description="KV-cache-aware router with conditional disaggregation.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands:\n" + "\n".join(f"  {n:<8} {h}" for n, (_, h) in SUBCOMMANDS.items()),
    )
    parser.add_argument("--version", action="version", version=f"kvswitch {BUILD}")
    parser.add_argument(
        "command", choices=list(SUBCOMMANDS), metavar="COMMAND", help="one of: " + ", ".join(SUBCOMMANDS)
    )
    return parser


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The parser `kvswitch NAME` parses its flags with (deployment files are checked against it)."""
    module_name, help_text = SUBCOMMANDS[name]
    parser = FlagParser(prog=f"kvswitch {name}", description=help_text, reads_environment=name in _READ_ENVIRONMENT)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not args or args[0].startswith("-"):
        top.parse_args(args or ["--help"])
        return 2
    name = args[0]
    if name not in SUBCOMMANDS:
        top.error(f"unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    with stop_signals_held() if name in _SERVICES else contextlib.nullcontext():
        return _run(name, args)


def _run(name: str, args: list[str]) -> int:
    try:
        check_environment()  # before any parser is built: some list KVSWITCH_PROFILE_DIR's tables
    except VariableError as exc:
        print(f"kvswitch {name}: {exc}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"kvswitch {name}: not available in this build ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    parser = subcommand_parser(name)
    if getattr(module, "PASSES_UNKNOWN_ARGS", False):
        # `kvswitch up` hands flags it does not know to its routers, which validate them.
        ns, extra = parser.parse_known_args(args[1:])
        ns.extra = extra
    else:
        ns = parser.parse_args(args[1:])
    return int(module.run(ns))


if __name__ == "__main__":
    sys.exit(main())
