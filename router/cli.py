"""`kvswitch router`: one router replica.

Every RouterSettings field is a flag of the same name (`--eff-isl-threshold`, `--routing`, ...),
as are the NATS and etcd settings with their prefixes (`--nats-servers`, `--etcd-endpoints`).
Each setting resolves CLI > KVSWITCH_* environment > `--config FILE` > default
(protocol.config.resolve); RouterSettings are also live-tunable at /{ns}/config/router.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import os
import sys
from typing import Any

import msgspec

from protocol import ConfigError, subjects
from protocol.config import (
    ConditionalDisaggConfig,
    EtcdSettings,
    NatsSettings,
    RouterSettings,
    add_flags,
    check_file_keys,
    file_keys,
    load_file,
    resolve,
)
from router.api_keys import ApiKeys, ApiKeysError
from runtime import run_service, start_or_stop

__all__ = ["add_arguments", "build_config", "run"]

log = logging.getLogger("kvswitch.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help=f"subject/key prefix (default {subjects.DEFAULT_NAMESPACE})")
    parser.add_argument(
        "--http-host", default="127.0.0.1", help="address of the OpenAI front door (another needs --api-keys-file)"
    )
    parser.add_argument(
        "--api-keys-file", default=None, metavar="FILE",
        help="clients must send `Authorization: Bearer <key>` with a key from FILE (one per line; reloaded on change)",
    )  # fmt: skip
    parser.add_argument(
        "--no-api-keys", action="store_true",
        help="serve a non-loopback --http-host without API keys (behind a gateway that authenticates)",
    )  # fmt: skip
    parser.add_argument("--http-port", type=int, default=8080, help="port of the OpenAI front door (0: a free one)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer.json or its directory (default: built-in)")
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat template a client sends (refused with 400 by default, as vLLM does); "
        "give the engines the same flag",
    )
    parser.add_argument("--model", default=None, help="serve only this model; also the default for requests")
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML or TOML settings file")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="deadline of a request, seconds")
    parser.add_argument(
        "--max-body-bytes", type=int, default=16 * 1024 * 1024, help="largest request body accepted (else 413)"
    )
    parser.add_argument(
        "--body-timeout-s", type=float, default=30.0, help="seconds a client has to send its request body (else 408)"
    )
    parser.add_argument(
        "--no-calibration", action="store_true",
        help="predict engine times from the workers' timing profiles as registered (default: fit each "
        "worker's speed against its profile from its load reports)",
    )  # fmt: skip
    routing = parser.add_argument_group("routing (live-tunable at /{ns}/config/router)")
    add_flags(routing, RouterSettings)
    conn = parser.add_argument_group("NATS and etcd")
    add_flags(conn, NatsSettings, "nats_")
    add_flags(conn, EtcdSettings, "etcd_")


_ROUTER_FIELDS = {f.name for f in msgspec.structs.fields(RouterSettings)} | {
    f.name for f in msgspec.structs.fields(ConditionalDisaggConfig)
}


def build_config(args: argparse.Namespace) -> Any:
    """A RouterConfig from parsed flags; ConfigError for any invalid setting."""
    from router.http_api import HttpLimits
    from router.service import RouterConfig

    given = vars(args)
    if not 0 <= args.http_port <= 65535:
        raise ConfigError("http_port", args.http_port, "must be in [0, 65535] (0 picks a free port)")
    if not 0 < args.request_timeout < math.inf:  # 0 or less would time out every request; NaN fails too
        raise ConfigError("request_timeout", args.request_timeout, "must be a number of seconds > 0")
    try:
        limits = HttpLimits(max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s)
    except ValueError as exc:
        name = "max_body_bytes" if "max_body_bytes" in str(exc) else "body_timeout_s"
        raise ConfigError(name, getattr(args, name), str(exc)) from exc
    file = load_file(args.config) if args.config else {}
    known = file_keys(RouterSettings) | file_keys(NatsSettings, "nats_") | file_keys(EtcdSettings, "etcd_")
    check_file_keys(file, known | {"api_keys_file", "namespace"}, args.config)
    overrides = {k: v for k, v in given.items() if k in _ROUTER_FIELDS and v is not None}
    nats = resolve(NatsSettings, cli=given, file=file, setting_prefix="nats_")
    etcd = resolve(EtcdSettings, cli=given, file=file, setting_prefix="etcd_")
    resolve(RouterSettings, cli=overrides, file=file)  # fail at startup, naming the flag
    keys_file = args.api_keys_file or os.environ.get("KVSWITCH_API_KEYS_FILE") or file.get("api_keys_file")
    if keys_file is None and not args.no_api_keys and not _loopback(args.http_host):
        raise ConfigError(
            "api_keys_file",
            None,
            f"--http-host {args.http_host} serves beyond this machine: give --api-keys-file FILE, or --no-api-keys "
            "behind a gateway that authenticates",
        )
    if keys_file is not None:
        try:
            ApiKeys(keys_file)
        except ApiKeysError as exc:
            raise ConfigError("api_keys_file", keys_file, str(exc)) from exc
    ns = args.namespace or file.get("namespace") or subjects.DEFAULT_NAMESPACE
    try:
        subjects.validate_namespace(ns)
    except ValueError as exc:
        raise ConfigError("namespace", ns, "must match [A-Za-z0-9_-]+") from exc
    return RouterConfig(
        ns=ns,
        nats=nats,
        etcd=etcd,
        http_host=args.http_host,
        http_port=args.http_port,
        tokenizer=args.tokenizer,
        model=args.model,
        overrides=overrides,
        file_settings=file,
        request_timeout_s=args.request_timeout,
        api_keys_file=keys_file,
        http_limits=limits,
        calibrate=not args.no_calibration,
        trust_request_chat_template=args.trust_request_chat_template,
    )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"kvswitch router: {exc}", file=sys.stderr)
        return 2

    async def main(stop: asyncio.Event) -> int:
        from discovery import DiscoveryError
        from router.service import RouterService
        from router.tokenization import TokenizerError

        try:
            service = RouterService(config)
        except (ConfigError, TokenizerError) as exc:
            log.error("%s", exc)
            return 2
        try:
            if not await start_or_stop(service.start(), stop):
                log.info("stopped before the router could start")
                return 1
        except DiscoveryError as exc:
            log.error("%s (check --etcd-endpoints and the server)", exc)
            return 1
        except ConfigError as exc:
            log.error("%s", exc)
            return 2
        try:
            log.info("router %s listening on %s", service.router_id, service.url)
            await stop.wait()
            log.info("draining")
        finally:
            await service.stop()
        return 0

    return run_service(main, service="kvswitch-router", drain_limit_s=config.drain_s + 30.0)
