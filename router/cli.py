"""`kvswitch router`: one router replica.

Every RouterSettings field is a flag of the same name (`--eff-isl-threshold`, `--routing`, ...),
as are the NATS and etcd settings with their prefixes (`--nats-servers`, `--etcd-endpoints`).
Each setting, the process's own (`ProcessSettings`: --namespace, --http-port, --model, ...)
included, resolves CLI > KVSWITCH_* environment > `--config FILE` > default
(protocol.config.resolve); RouterSettings are also live-tunable at /{ns}/config/router.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from protocol import ConfigError, subjects
from protocol.config import (
    MAX_RESPONSE_TTL_S,
    ConditionalDisaggConfig,
    EtcdSettings,
    NatsSettings,
    RouterSettings,
    add_flags,
    check_file_keys,
    check_flag_only_env,
    check_shared_keys,
    file_keys,
    load_file,
    resolve,
)
from protocol.errors import listen_error, setting_names, try_listen
from protocol.kv_budget import KV_BATCH_BURST, KV_BATCHES_PER_S, KV_MIB_BURST, KV_MIB_PER_S
from router.api_keys import ApiKeys, ApiKeysError
from router.client_buffers import CLIENT_BUFFER_MIB, CLIENT_BUFFER_MIB_RANGE
from router.content_format import CONTENT_FORMATS
from router.kv_ingest import MIN_ENTRY_LIMIT
from router.replica_sync import SYNC_SNAPSHOT_S, SYNC_SNAPSHOT_S_RANGE
from router.route_info import ROUTE_INFO, check_route_info
from router.sender_budget import KvBudget
from runtime import LogConfigError, configure_logging, run_service, start_or_stop
from runtime.fd_limit import raise_fd_limit

if TYPE_CHECKING:
    from router.service import RouterService

__all__ = ["ProcessSettings", "add_arguments", "build_config", "run"]

log = logging.getLogger("kvswitch.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help=f"subject/key prefix (default {subjects.DEFAULT_NAMESPACE})")
    parser.add_argument(
        "--http-host", default=None,
        help="address of the OpenAI front door (default 127.0.0.1; another needs --api-keys-file)",
    )  # fmt: skip
    parser.add_argument(
        "--api-keys-file", default=None, metavar="FILE",
        help="clients must send `Authorization: Bearer <key>` with a key from FILE (one per line; reloaded on change)",
    )  # fmt: skip
    parser.add_argument(
        "--debug-api-keys-file", default=None, metavar="FILE",
        help="operator keys for /debug/route, /debug/index and /debug/workers, one per line; with --api-keys-file and "
        "without this, /debug/* is closed (403)",
    )  # fmt: skip
    parser.add_argument(
        "--route-info", default=None, metavar="{" + ",".join(ROUTE_INFO) + "}",
        help="who gets a routed answer's x-kvswitch-* headers and `kvswitch` member, which follow the cached "
        "prefixes of other clients' prompts: all, operator (an operator key's requests only) or off "
        "(default: operator with --api-keys-file, else all)",
    )  # fmt: skip
    parser.add_argument(
        "--no-api-keys", action="store_true",
        help="serve a non-loopback --http-host without API keys (behind a gateway that authenticates)",
    )  # fmt: skip
    parser.add_argument(
        "--http-port", type=int, default=None, help="port of the OpenAI front door (default 8080; 0: a free one)"
    )
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer.json or its directory (default: built-in)")
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat template a client sends (refused with 400 by default, as vLLM does); "
        "give the engines the same flag",
    )
    parser.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default=None,
        help="how the chat template takes message content, as the engines' flag of that name says: text "
        "('string') or a list of parts ('openai'); 'auto' (default) detects it from the template, as vLLM does",
    )
    parser.add_argument(
        "--exclude-tools-when-tool-choice-none", action="store_true",
        help="the engines' flag of that name, when they were given it: a request with tool_choice 'none' is "
        "rendered without its tools, as the engines render it",
    )  # fmt: skip
    parser.add_argument(
        "--default-chat-template-kwargs", default=None, metavar="JSON",
        help="the engines' flag of that name, as they were given it (a JSON object): the router renders chats "
        "with it to route them, and its tokenizer fingerprint matches the engines' only with it",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="serve only this model; also the default for requests")
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML or TOML settings file")
    parser.add_argument("--request-timeout", type=float, default=None, help="deadline of a request, seconds (600)")
    parser.add_argument(
        "--max-body-bytes", type=int, default=None, help="largest request body accepted (else 413; default 16 MiB)"
    )
    parser.add_argument(
        "--body-timeout-s", type=float, default=None,
        help="seconds a client has to send its request body (else 408; default 30)",
    )  # fmt: skip
    parser.add_argument(
        "--idle-timeout-s", type=float, default=None,
        help="seconds a connection may go without completing a request head, first or next, before it "
        "is closed (default 75)",
    )  # fmt: skip
    parser.add_argument(
        "--no-calibration", action="store_true",
        help="predict engine times from the workers' timing profiles as registered (default: fit each "
        "worker's speed against its profile from its load reports)",
    )  # fmt: skip
    parser.add_argument(
        "--index-limit-per-worker", type=int, default=None, metavar="ENTRIES",
        help=f"KV index entries any worker may have (default {MIN_ENTRY_LIMIT}, ~170 MB; more when its "
        "kv_total_blocks says so): raise it for workers whose CPU or disk KV tier holds more",
    )  # fmt: skip
    parser.add_argument(
        "--kv-budget-batches-per-s", type=float, default=None, metavar="N",
        help=f"KV event batches a second any worker's subject may carry before the rest is dropped and the "
        f"sender quarantined (default {KV_BATCHES_PER_S:g}; a shim seals about 200)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-budget-batch-burst", type=float, default=None, metavar="N",
        help=f"the batches a worker's subject may carry at once above that rate (default {KV_BATCH_BURST:g})",
    )  # fmt: skip
    parser.add_argument(
        "--kv-budget-mib-per-s", type=float, default=None, metavar="MIB",
        help=f"KV event MiB a second any worker's subject may carry (default {KV_MIB_PER_S:g})",
    )  # fmt: skip
    parser.add_argument(
        "--kv-budget-mib-burst", type=float, default=None, metavar="MIB",
        help=f"the MiB a worker's subject may carry at once above that rate (default {KV_MIB_BURST:g})",
    )  # fmt: skip
    parser.add_argument(
        "--client-buffer-mib", type=int, default=None, metavar="MIB",
        help=f"the most MiB this router holds for all its clients at once: streamed chunks not yet taken and "
        f"whole answers being written; past it the client furthest behind is cut (default {CLIENT_BUFFER_MIB}; "
        f"{CLIENT_BUFFER_MIB_RANGE[0]} to {CLIENT_BUFFER_MIB_RANGE[1]})",
    )  # fmt: skip
    parser.add_argument(
        "--sync-snapshot-s", type=float, default=None, metavar="S",
        help=f"how often this router sends its peers a snapshot of its live bookings, which heals a sync message "
        f"lost on the way within that (default {SYNC_SNAPSHOT_S:g}; {SYNC_SNAPSHOT_S_RANGE[0]:g} to "
        f"{SYNC_SNAPSHOT_S_RANGE[1]:g})",
    )  # fmt: skip
    routing = parser.add_argument_group("routing (live-tunable at /{ns}/config/router)")
    add_flags(routing, RouterSettings)
    conn = parser.add_argument_group("NATS and etcd")
    add_flags(conn, NatsSettings, "nats_")
    add_flags(conn, EtcdSettings, "etcd_")


_ROUTER_FIELDS = {f.name for f in msgspec.structs.fields(RouterSettings)} | {
    f.name for f in msgspec.structs.fields(ConditionalDisaggConfig)
}


# The least --index-limit-per-worker: below it, an honest worker whose kv_total_blocks is not (yet)
# said would be refused for a few thousand cached blocks.
_LEAST_INDEX_LIMIT = 4096


class ProcessSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The replica's own settings (not live-tunable), layered as every setting is: flag >
    KVSWITCH_<NAME> > --config file > default (docs/router.md, "Flags")."""

    namespace: str = subjects.DEFAULT_NAMESPACE
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    api_keys_file: str | None = None
    debug_api_keys_file: str | None = None
    route_info: str | None = None  # router.route_info.route_info_mode's default when unset
    tokenizer: str | None = None
    model: str | None = None
    request_timeout: float = 600.0
    max_body_bytes: int = 16 * 1024 * 1024
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 75.0
    no_calibration: bool = False
    chat_template_content_format: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag of that name
    # vLLM's flag: JSON text from the command line or environment, a mapping from a config file
    default_chat_template_kwargs: dict[str, Any] | str | None = None
    index_limit_per_worker: int = MIN_ENTRY_LIMIT  # router.kv_ingest's floor of a worker's index entries
    kv_budget_batches_per_s: float = KV_BATCHES_PER_S  # router.sender_budget's, for KV event senders
    kv_budget_batch_burst: float = KV_BATCH_BURST
    kv_budget_mib_per_s: float = KV_MIB_PER_S
    kv_budget_mib_burst: float = KV_MIB_BURST
    sync_snapshot_s: float = SYNC_SNAPSHOT_S  # router.replica_sync's snapshot period
    client_buffer_mib: int = CLIENT_BUFFER_MIB  # router.client_buffers' budget

    @property
    def kv_budget(self) -> KvBudget:
        return KvBudget(
            self.kv_budget_batches_per_s, self.kv_budget_batch_burst, self.kv_budget_mib_per_s, self.kv_budget_mib_burst
        )

    def validate(self) -> ProcessSettings:
        try:
            subjects.validate_namespace(self.namespace)  # "" too: it must not fall back to the default
        except ValueError as exc:
            raise ConfigError("namespace", self.namespace, "must match [A-Za-z0-9_-]+") from exc
        if not 0 <= self.http_port <= 65535:
            raise ConfigError("http_port", self.http_port, "must be in [0, 65535] (0 picks a free port)")
        # 0 or less would time out every request; NaN fails too. A day or more would outlive a worker's
        # leave to reply (kvswitch secrets --response-ttl, at most a day): its late chunks refused.
        if not 0 < self.request_timeout < MAX_RESPONSE_TTL_S:
            raise ConfigError(
                "request_timeout",
                self.request_timeout,
                f"must be a number of seconds > 0 and < {MAX_RESPONSE_TTL_S} (a day: kvswitch secrets --response-ttl, "
                "at most that, must be above it)",
            )
        if self.index_limit_per_worker < _LEAST_INDEX_LIMIT:
            raise ConfigError(
                "index_limit_per_worker",
                self.index_limit_per_worker,
                f"must be >= {_LEAST_INDEX_LIMIT} entries (default {MIN_ENTRY_LIMIT}; raise it for workers whose "
                "CPU or disk KV tier holds more)",
            )
        self.kv_budget.validate()
        least, most = SYNC_SNAPSHOT_S_RANGE
        if not least <= self.sync_snapshot_s <= most:  # NaN fails both
            raise ConfigError(
                "sync_snapshot_s",
                self.sync_snapshot_s,
                f"must be a number of seconds in [{least:g}, {most:g}] (default {SYNC_SNAPSHOT_S:g}): each snapshot "
                "holds every live booking of this router and every peer reads it; at most half the 600 s after "
                "which a peer drops a booking no snapshot named",
            )
        least, most = CLIENT_BUFFER_MIB_RANGE
        if not least <= self.client_buffer_mib <= most:
            raise ConfigError(
                "client_buffer_mib",
                self.client_buffer_mib,
                f"must be a whole number of MiB in [{least}, {most}] (default {CLIENT_BUFFER_MIB}): the most held "
                "for all clients at once; at least one stream's own limit (8 MiB)",
            )
        # The one check of --route-info as the flag, KVSWITCH_ROUTE_INFO or --config gives it
        # (argparse's `choices` saw the flag alone, and said it in words of its own).
        check_route_info(self.route_info)
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ConfigError.one_of("chat_template_content_format", self.chat_template_content_format, CONTENT_FORMATS)
        if self.chat_template_content_format != "auto" and self.tokenizer is None:
            # the built-in tokenizer renders message content as it is (as --default-chat-template-kwargs,
            # refused in _template_kwargs): this would be read by nothing
            raise ConfigError(
                "chat_template_content_format",
                self.chat_template_content_format,
                "read with --tokenizer only: the built-in tokenizer's ChatML (engine_sim's) takes message content as "
                "it is; give --tokenizer, or drop it",
            )
        unset = {
            "model": "leave it out to serve every registered model",  # "" would 404 every request
            "tokenizer": "leave it out for the built-in tokenizer",
            "api_keys_file": "name a file",
            "debug_api_keys_file": "name a file",
        }
        for name, hint in unset.items():
            if getattr(self, name) == "":
                raise ConfigError(name, "", f"must not be empty: {hint}")
        if self.default_chat_template_kwargs is not None:
            kwargs = _template_kwargs(self.default_chat_template_kwargs, self.tokenizer)
            return msgspec.structs.replace(self, default_chat_template_kwargs=kwargs)
        return self


# What the router takes no default for, and why: a request's own field or vLLM's own argument
# always wins over it, or (`messages`) every chat would fail, or (`chat_template`, which vLLM
# renders with where neither the request nor --chat-template names one) the router reads the
# template from the tokenizer folder.
_NOT_DEFAULTS = {
    "messages": "every chat would fail in vLLM too",
    "add_generation_prompt": "a request's own always wins in vLLM",
    "continue_final_message": "a request's own always wins in vLLM",
    "tokenize": "vLLM's own argument always wins",
    "chat_template": "vLLM renders with it, but the router reads the chat template from the --tokenizer folder: "
    "save it there as chat_template.jinja",
}


def _template_kwargs(given: dict[str, Any] | str, tokenizer: str | None) -> dict[str, Any]:
    """--default-chat-template-kwargs as vLLM takes it (a JSON object), checked."""
    name = "default_chat_template_kwargs"
    value: Any = given
    if isinstance(given, str):
        try:
            value = json.loads(given)
        except ValueError as exc:
            raise ConfigError(name, given, f"must be a JSON object, as vLLM's flag takes it ({exc})") from exc
    if not isinstance(value, dict):
        raise ConfigError(name, given, 'must be a JSON object as vLLM takes it, e.g. {"enable_thinking": false}')
    if tokenizer is None:
        raise ConfigError(name, given, "needs --tokenizer: the built-in tokenizer's ChatML (engine_sim's) takes none")
    for key, why in _NOT_DEFAULTS.items():
        if key in value:
            raise ConfigError(name, given, f"must not set {key!r}: {why}")
    for key in ("tools", "documents"):
        if value.get(key) is not None and not (
            isinstance(value[key], list) and all(isinstance(x, dict) for x in value[key])
        ):
            raise ConfigError(name, given, f"{key!r} must be a list of JSON objects")
    return value


def build_config(args: argparse.Namespace) -> Any:
    """A RouterConfig from parsed flags; ConfigError for any invalid setting."""
    from router.http_api import HttpLimits
    from router.service import RouterConfig

    given = vars(args)
    check_flag_only_env(given)  # those of protocol.errors.FLAG_ONLY this process has: --config and two switches
    file = load_file(args.config) if args.config else {}
    known = file_keys(RouterSettings) | file_keys(NatsSettings, "nats_") | file_keys(EtcdSettings, "etcd_")
    check_file_keys(file, known | file_keys(ProcessSettings), args.config)
    check_shared_keys(file, args.config, (NatsSettings, "nats_"), (EtcdSettings, "etcd_"))
    cli = {k: given.get(k) for k in file_keys(ProcessSettings)}
    cli["no_calibration"] = True if args.no_calibration else None  # an absent store_true flag is not "off"
    cli["exclude_tools_when_tool_choice_none"] = True if args.exclude_tools_when_tool_choice_none else None
    proc = resolve(ProcessSettings, cli=cli, file=file)
    try:
        limits = HttpLimits(
            max_body_bytes=proc.max_body_bytes, body_timeout_s=proc.body_timeout_s, idle_timeout_s=proc.idle_timeout_s
        )
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]  # each HttpLimits refusal starts with its field's name
        raise ConfigError(name, getattr(proc, name), str(exc)) from exc
    overrides = {k: v for k, v in given.items() if k in _ROUTER_FIELDS and v is not None}
    nats = resolve(NatsSettings, cli=given, file=file, setting_prefix="nats_", file_name=args.config)
    etcd = resolve(EtcdSettings, cli=given, file=file, setting_prefix="etcd_")
    settings = resolve(RouterSettings, cli=overrides, file=file)  # fail at startup, naming the flag
    if settings.prefill_timeout_s >= proc.request_timeout:
        raise ConfigError(
            "prefill_timeout_s",
            settings.prefill_timeout_s,
            f"must be < --request-timeout ({proc.request_timeout:g} s), else the fallback to a local prefill "
            "never comes before the request's deadline",
        )
    _check_host(proc.http_host)
    keys_file = proc.api_keys_file
    if keys_file is not None and args.no_api_keys:
        raise ConfigError(
            "no_api_keys",
            True,
            f"read without an API keys file only, and {setting_names('api_keys_file')} gives {keys_file}, whose keys "
            "are then required: drop one",
        )
    if keys_file is None and not args.no_api_keys and not _loopback(proc.http_host):
        raise ConfigError(
            "api_keys_file",
            None,
            f"--http-host {proc.http_host} serves beyond this machine: give --api-keys-file FILE, or --no-api-keys "
            "behind a gateway that authenticates",
        )
    for name, path in (("api_keys_file", keys_file), ("debug_api_keys_file", proc.debug_api_keys_file)):
        if path is not None:
            try:
                ApiKeys(path)
            except ApiKeysError as exc:
                raise ConfigError(name, path, str(exc)) from exc
    return RouterConfig(
        ns=proc.namespace,
        nats=nats,
        etcd=etcd,
        http_host=proc.http_host,
        http_port=proc.http_port,
        tokenizer=proc.tokenizer,
        model=proc.model,
        overrides=overrides,
        file_settings=file,
        request_timeout_s=proc.request_timeout,
        api_keys_file=keys_file,
        debug_api_keys_file=proc.debug_api_keys_file,
        route_info=proc.route_info,
        http_limits=limits,
        calibrate=not proc.no_calibration,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_content_format=proc.chat_template_content_format,
        exclude_tools_when_tool_choice_none=proc.exclude_tools_when_tool_choice_none,
        default_chat_template_kwargs=proc.default_chat_template_kwargs,
        index_limit_per_worker=proc.index_limit_per_worker,
        kv_budget=proc.kv_budget,
        sync_snapshot_s=proc.sync_snapshot_s,
        client_buffer_bytes=proc.client_buffer_mib << 20,
    )


def _check_host(host: str) -> None:
    """ConfigError naming --http-host when it does not resolve or is no address of this machine:
    checked before the API keys, whose refusal would otherwise blame a bad host on a missing
    --api-keys-file. Port 0 binds nothing in use; the port itself is checked at start."""
    try:
        try_listen(host, 0)
    except OSError as exc:
        problem = listen_error(host, 0, exc)
        if problem.setting == "http_host":
            raise problem from exc
        # any other failure is the start's to name, with the real port (router.service)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    try:
        configure_logging()  # before the settings: resolving them may say a NATS credential was set aside
        config = build_config(args)
    except (ConfigError, LogConfigError) as exc:
        print(f"kvswitch router: {exc}", file=sys.stderr)
        return 2

    services: list[RouterService] = []  # the RouterService, once made: on_abort revokes its lease

    async def main(stop: asyncio.Event) -> int:
        from discovery import DiscoveryError
        from router.service import RouterService
        from router.tokenization import TokenizerError

        raise_fd_limit()  # a descriptor per client connection: router.client_connections caps them below it
        try:
            service = RouterService(config)
            services.append(service)
        except TokenizerError as exc:
            # loading --tokenizer failed (the path, or its chat template): name the flag, as a ConfigError does
            why = exc.why if exc.what == config.tokenizer else str(exc)
            print(f"kvswitch router: {ConfigError('tokenizer', config.tokenizer, why)}", file=sys.stderr)
            return 2
        except ConfigError as exc:
            print(f"kvswitch router: {exc}", file=sys.stderr)
            return 2
        try:
            if not await start_or_stop(service.start(), stop):
                log.info("stopped during start (starting)")  # its start's cleanup stopped what it started
                return 0  # a stop asked for, as after the start
        except DiscoveryError as exc:
            log.error("%s (check --etcd-endpoints and the server)", exc)
            return 1
        except ConfigError as exc:
            log.error("%s", exc)
            return 2
        log.info("router %s listening on %s", service.router_id, service.url)
        return await service.serve(stop)  # 1 when it broke (RouterService.broken): for its supervisor to restart it

    # The drain, then the lease revocation and the NATS drain (docs/deployment.md, "Stopping a
    # router"); past that, exit 130 with the lease revoked, before Kubernetes' 30 s grace kills it.
    # A broken router's stop too: serve() sets `stop`, which starts this limit as a SIGTERM does.
    return run_service(
        main,
        service="kvswitch-router",
        drain_limit_s=config.drain_s + 10.0,
        on_abort=lambda: services[0].revoke_now() if services else None,
    )
