"""`kvswitch router`: one router replica.

Every RouterSettings field is a flag of the same name (`--eff-isl-threshold`, `--routing`, ...),
as are the NATS and etcd settings with their prefixes (`--nats-servers`, `--etcd-endpoints`).
Each setting resolves CLI > KVSWITCH_* environment > `--config FILE` > default
(protocol.config.resolve); RouterSettings are also live-tunable at /{ns}/config/router.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import types
from typing import Any, Literal, Union, get_args, get_origin

import msgspec

from kvswitch.runtime import run_service
from protocol import ConfigError, subjects
from protocol.config import ConditionalDisaggConfig, EtcdSettings, NatsSettings, RouterSettings, load_file, resolve

__all__ = ["add_arguments", "build_config", "run"]

log = logging.getLogger("kvswitch.router")


def _base_type(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _add_struct(parser: argparse._ActionsContainer, schema: type[msgspec.Struct], prefix: str = "") -> None:
    for f in msgspec.structs.fields(schema):
        tp = _base_type(f.type)
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            _add_struct(parser, tp, prefix)
            continue
        flag = "--" + (prefix + f.name).replace("_", "-")
        dest = prefix + f.name
        if tp is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None)
        elif get_origin(tp) is Literal:
            parser.add_argument(flag, dest=dest, choices=[str(c) for c in get_args(tp)], default=None)
        elif get_origin(tp) is list:
            parser.add_argument(flag, dest=dest, type=_csv, default=None, metavar="A,B")
        else:
            parser.add_argument(flag, dest=dest, type=tp if tp in (int, float) else str, default=None)


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help=f"subject/key prefix (default {subjects.DEFAULT_NAMESPACE})")
    parser.add_argument("--http-host", default="0.0.0.0", help="address of the OpenAI front door")
    parser.add_argument("--http-port", type=int, default=8080, help="port of the OpenAI front door (0: a free one)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer.json or its directory (default: built-in)")
    parser.add_argument("--model", default=None, help="serve only this model; also the default for requests")
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML or TOML settings file")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="deadline of a request, seconds")
    routing = parser.add_argument_group("routing (live-tunable at /{ns}/config/router)")
    _add_struct(routing, RouterSettings)
    conn = parser.add_argument_group("NATS and etcd")
    _add_struct(conn, NatsSettings, "nats_")
    _add_struct(conn, EtcdSettings, "etcd_")


_ROUTER_FIELDS = {f.name for f in msgspec.structs.fields(RouterSettings)} | {
    f.name for f in msgspec.structs.fields(ConditionalDisaggConfig)
}


def build_config(args: argparse.Namespace) -> Any:
    """A RouterConfig from parsed flags; ConfigError for any invalid setting."""
    from router.service import RouterConfig

    given = vars(args)
    file = load_file(args.config) if args.config else {}
    overrides = {k: v for k, v in given.items() if k in _ROUTER_FIELDS and v is not None}
    nats = resolve(NatsSettings, cli=given, file=file, setting_prefix="nats_")
    etcd = resolve(EtcdSettings, cli=given, file=file, setting_prefix="etcd_")
    resolve(RouterSettings, cli=overrides, file=file)  # fail at startup, naming the flag
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
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"kvswitch router: {exc}", file=sys.stderr)
        return 2

    async def main(stop: asyncio.Event) -> int:
        from router.service import RouterService
        from router.tokenization import TokenizerError

        try:
            service = RouterService(config)
        except (ConfigError, TokenizerError) as exc:
            log.error("%s", exc)
            return 2
        async with service:
            log.info("router %s listening on %s", service.router_id, service.url)
            await stop.wait()
            log.info("draining")
        return 0

    return run_service(main)
