"""`kvswitch shim`: run one worker shim beside one engine until SIGTERM/SIGINT.

Every setting layers CLI flag > env `KVSWITCH_<NAME>` > `--config` file (YAML/TOML) > default;
NATS and etcd settings use the `nats_` / `etcd_` prefixes (`--nats-servers`, `KVSWITCH_NATS_SERVERS`).
Exit status: 0 after a clean drain, 2 for a configuration error (including a flag that disagrees
with what the engine reports).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from protocol import ConfigError
from protocol.config import (
    EtcdSettings,
    NatsSettings,
    add_flags,
    check_file_keys,
    check_flag_only_env,
    check_shared_keys,
    file_keys,
    load_file,
    resolve,
)
from worker_shim.config import ENGINES, KV_EVENTS_MODES, ROLES, ShimConfig

__all__ = ["add_arguments", "run"]

log = logging.getLogger("kvswitch.shim")
_SHIM_FLAGS: list[tuple[str, type, str]] = [
    ("engine_url", str, "the engine's HTTP base URL, e.g. http://127.0.0.1:8000"),
    ("model", str, "the served model name"),
    ("kv_events", str, "the engine's KV event endpoint as the engine was given it, e.g. tcp://*:5557"),
    ("kv_events_topic", str, "the engine's KV event topic ('' accepts all)"),
    ("kv_replay", str, "the engine's KV replay endpoint, e.g. tcp://*:5558"),
    (
        "kv_events_config",
        str,
        "the engine's own --kv-events-config JSON (vLLM or SGLang), verbatim; sets --kv-events, --kv-replay "
        "and --kv-events-topic",
    ),
    (
        "data_parallel_rank",
        int,
        "vLLM with --data-parallel-size: the one rank this shim serves (one shim per rank); the event "
        "endpoints are offset by it as vLLM offsets them",
    ),
    ("block_size", int, "tokens per KV block, when the engine does not report it"),
    ("kv_total_blocks", int, "KV capacity in blocks, when the engine does not report it"),
    ("max_num_batched_tokens", int, "the engine's per-step token budget (vLLM does not report it)"),
    ("kv_bytes_per_token", int, "KV bytes per token (default: from the model's config.json)"),
    ("model_path", str, "the model's directory, whose config.json gives kv_bytes_per_token"),
    (
        "timing_profile",
        str,
        "the latency table the router uses for this worker (default: none: on vLLM the router calibrates the "
        "default profile's shape to the engine; SGLang and TensorRT-LLM report nothing to calibrate from, so "
        "theirs is priced at the default profile, with a WARNING)",
    ),
    ("worker_name", str, "a stable worker id instead of the lease id (one subject token); must be unique"),
    ("lease_ttl", int, "etcd lease TTL in seconds, 2..9000000000 (default 10; etcd grants no less than 2)"),
    ("reregister_grace_s", float, "seconds the old worker id is still served after a lost lease (default 2 x TTL)"),
    (
        "orphan_grace_s",
        float,
        "seconds a router process may have no key in etcd before its legs here are cancelled (default 20)",
    ),
    ("load_period_s", float, "load reports go out on change and at least this often (default 0.5; 0.05..60)"),
    ("events_timeout_s", float, "seconds without KV events before events_ok is false (x2 after a request; default 5)"),
    ("http_host", str, "the shim's /health and /metrics listen here (default 127.0.0.1)"),
    ("http_port", int, "... on this port (default 0: a free port, registered as shim_url)"),
    ("drain_grace_s", float, "seconds in-flight requests may finish after SIGTERM (default 30)"),
    ("health_interval_s", float, "seconds between engine health checks (default 1)"),
    ("health_failures", int, "failed health checks in a row that deregister the worker (default 2)"),
    ("busy_limit_s", float, "seconds an engine may leave its health check unanswered before deregistering (30)"),
    (
        "stall_limit_s",
        float,
        "seconds an engine with work may show no progress, or answer nothing with legs in flight, before "
        "deregistering as hung (120)",
    ),
    (
        "max_inflight_legs",
        int,
        "the most legs served at once, more get a retryable 503 (default: the most the open-file limit allows, "
        "one descriptor each)",
    ),
    (
        "bootstrap_host",
        str,
        "SGLang P/D: the address decode engines reach this prefill engine's bootstrap server at "
        "(default: --engine-url's host, right only on one host)",
    ),
    ("namespace", str, "cluster namespace for subjects and keys (default kvswitch)"),
]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or TOML file with any of the settings below")
    parser.add_argument("--engine", choices=ENGINES, help="engine kind (default vllm; engine_sim is vllm)")
    parser.add_argument("--role", choices=ROLES, help="prefill, decode or agg (default agg)")
    parser.add_argument(
        "--no-endpoint-probe",
        action="store_true",
        help="send the engine no endpoint probe (one tiny request per KV event connection or reset, whose "
        "block must show on the events read; default: sent, so event endpoints that are another engine's are "
        "reported as other_engine); for engines where every request is accounted",
    )
    parser.add_argument(
        "--kv-events-mode",
        choices=KV_EVENTS_MODES,
        help="auto (default): bind when the engine's endpoint has no `*`, connect when it has; or force one",
    )
    for name, kind, text in _SHIM_FLAGS:
        parser.add_argument(_flag(name), type=kind, help=text)
    add_flags(parser.add_argument_group("NATS"), NatsSettings, "nats_")
    add_flags(parser.add_argument_group("etcd"), EtcdSettings, "etcd_")


def resolve_settings(args: argparse.Namespace) -> tuple[ShimConfig, NatsSettings, EtcdSettings]:
    cli: dict[str, Any] = dict(vars(args))
    cli["no_endpoint_probe"] = True if args.no_endpoint_probe else None  # absent is not "off": env, file
    check_flag_only_env(cli)  # KVSWITCH_CONFIG would be ignored: the file is named by flag only
    file = load_file(args.config) if args.config else {}
    known = file_keys(ShimConfig) | file_keys(NatsSettings, "nats_") | file_keys(EtcdSettings, "etcd_")
    check_file_keys(file, known, args.config)
    check_shared_keys(file, args.config, (NatsSettings, "nats_"), (EtcdSettings, "etcd_"))
    shim = resolve(ShimConfig, cli=cli, file=file)
    nats = resolve(NatsSettings, cli=cli, file=file, setting_prefix="nats_", file_name=args.config)
    etcd = resolve(EtcdSettings, cli=cli, file=file, setting_prefix="etcd_")
    return shim, nats, etcd


def run(args: argparse.Namespace) -> int:
    from runtime import LogConfigError, configure_logging, run_service, start_or_stop

    try:
        configure_logging()  # before the settings: resolving them may say a NATS credential was set aside
        shim_cfg, nats, etcd = resolve_settings(args)
    except (ConfigError, LogConfigError) as exc:
        print(f"kvswitch shim: {exc}", file=sys.stderr)
        return 2
    from discovery import DiscoveryError
    from runtime.fd_limit import raise_fd_limit
    from worker_shim.shim import WorkerShim

    shims: list[WorkerShim] = []  # the one shim, once made: on_abort revokes its lease

    async def main(stop: asyncio.Event) -> int:
        raise_fd_limit()
        shim = WorkerShim(shim_cfg, nats, etcd)
        shims.append(shim)
        try:
            if not await start_or_stop(shim.start(), stop):
                log.info("stopped during start (starting)")  # its start's cleanup stopped what it started
                return 0  # a stop asked for, as after the start
        except ConfigError as exc:
            print(f"kvswitch shim: {exc}", file=sys.stderr)
            return 2
        except DiscoveryError as exc:
            log.error("%s (check --etcd-endpoints and the server)", exc)
            return 1
        try:
            stopped = asyncio.create_task(stop.wait())
            done = asyncio.create_task(shim.done.wait())
            await asyncio.wait([stopped, done], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            done.cancel()
        finally:
            # A shim that gave up (shim.done) stops as on SIGTERM: setting `stop` starts
            # run_service's drain limit, which bounds its stop as it bounds a signal's.
            stop.set()
            await shim.stop()
        if isinstance(shim.failure, ConfigError):
            print(f"kvswitch shim: {shim.failure}", file=sys.stderr)
            return 2
        return 0

    # The in-flight grace, then the lease revocation and NATS drain, each bounded by their own timeouts;
    # past that, exit 130 with the lease revoked, whether a signal or the shim itself began the stop.
    return run_service(
        main,
        service="kvswitch-shim",
        drain_limit_s=shim_cfg.drain_grace_s + 30.0,
        on_abort=lambda: shims[0].revoke_now() if shims else None,
    )
