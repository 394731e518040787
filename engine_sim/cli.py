"""`kvswitch sim`: one simulated vLLM engine, or a fleet of them (`--count N`), until SIGTERM.

Flags carry vLLM's names where vLLM has them. Once up, it prints one JSON line per engine to
stdout: {"index", "url", "events_endpoint", "replay_endpoint", "engine_id"}, so a supervisor can
read where everything listens (handy with port 0). SIGHUP restarts every engine (empty cache,
event seq from 0). Fleet port assignment: engine_sim/fleet.py.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import json
import math
import os
import signal
import sys
from collections.abc import Callable

import zmq

from engine_sim.config import EVENT_FORMS, KV_LOAD_FAILURE_POLICIES, ROLES, KVEventsConfig, SimConfig
from engine_sim.errors import SimConfigError
from engine_sim.fleet import SimFleet, fleet_config, shared_ports
from engine_sim.lora import LoraModule
from engine_sim.server import ServerStatus
from protocol.errors import host_fault, try_listen, why_unbound
from protocol.timing import DEFAULT_PROFILE, check_speedup, profile_names
from protocol.vllm_events import publisher_binds
from protocol.zmq_endpoint import ZmqEndpoint, split_endpoint
from runtime import tune_gc
from runtime.fd_limit import raise_fd_limit

__all__ = ["add_arguments", "config_from_args", "run"]


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if not (value > 0 and math.isfinite(value)):  # NaN fails `> 0` too
            raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except SimConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_module(text: str) -> LoraModule:
    try:
        return LoraModule.parse(text)
    except SimConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos_int, pos_float = _positive(int), _positive(float)
    g = parser.add_argument_group("server (as vllm serve)")
    g.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one (default 8000)")
    g.add_argument("--model", default="sim-llama", help="served model name, and its path (the cards' root)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="as vLLM's: the names the model is served under (the first names it in answers), "
                   "--model then being its path alone")  # fmt: skip
    g.add_argument("--max-model-len", type=pos_int, default=32768)
    g.add_argument("--block-size", type=pos_int, default=16)
    g.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=pos_int,
                   default=None, help="KV blocks (default: what one H200 holds for the profile's model)")  # fmt: skip
    g.add_argument("--max-num-seqs", type=pos_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=pos_int, default=8192)
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cache and reuse prompt prefixes, reporting them as KV events (as vLLM; on by default)",
    )
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details: prefix-cache hits (as vLLM)")  # fmt: skip
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer with an X-Request-Id header, the request's own or a fresh one (as vLLM)")  # fmt: skip
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="count generate requests in flight for GET /load (as vLLM; off, it answers 0)")  # fmt: skip
    g.add_argument(
        "--kv-events-config",
        type=_events_config,
        default=None,
        help='vLLM KVEventsConfig as JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (default: events off, as vLLM)',
    )
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve chat requests whose tool_choice is not 'none' (tools alone make it 'auto'; "
                        "without this flag, vLLM's 400); needs --tool-call-parser. No tool call is formed")  # fmt: skip
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="a tool parser vLLM 0.32 registers (checked with --enable-auto-tool-choice)")  # fmt: skip
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (needed by --lora-modules, as vLLM)")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help='adapters a request may name as its model (name=path or {"name": ..., "path": ...}); '
                        "nothing is loaded, the path is only echoed")  # fmt: skip
    s = parser.add_argument_group("simulation")
    # No argparse choices: a table that does not parse names no profile, and its fault would read as an
    # unknown name. SimConfig.validate says which (exit 2).
    s.add_argument("--profile", default=DEFAULT_PROFILE, help="timing profile: " + ", ".join(profile_names()))
    s.add_argument("--speedup", type=pos_float, default=1.0, help="divide all modelled times by this")
    s.add_argument("--role", choices=ROLES, default="agg", help="informational; decode still prefills without params")
    s.add_argument("--kv-transfer-gbps", type=pos_float, default=50.0, help="KV pull bandwidth, GB/s")
    s.add_argument("--kv-lease-duration", type=pos_float, default=30.0,
                   help="seconds a prefill sim's lease on unpulled KV lasts unless a decode sim holding "
                        "the request renews it (vLLM's kv_connector_extra_config.kv_lease_duration)")  # fmt: skip
    s.add_argument("--kv-load-failure-policy", choices=KV_LOAD_FAILURE_POLICIES, default="fail",
                   help="a failed KV pull: fail the request with a 500 (vLLM's default) or prefill it locally; "
                        "vLLM's kv_transfer_config.kv_load_failure_policy")  # fmt: skip
    s.add_argument("--event-form", choices=EVENT_FORMS, default="map", help="map (vLLM 0.26+) or array (older)")
    s.add_argument("--count", type=pos_int, default=1, help="engines in this process (consecutive ports)")
    f = parser.add_argument_group("faults")
    f.add_argument("--crash-after", type=_non_negative_int, default=None, help="crash on request N+1")
    f.add_argument("--hang-after", type=_non_negative_int, default=None, help="stop stepping from request N+1")
    f.add_argument("--slowdown", type=pos_float, default=1.0, help="multiply step times by F")
    f.add_argument("--drop-event-fraction", type=_fraction, default=0.0, help="skip sending this fraction of batches")
    f.add_argument("--restart-after-crash", dest="restart_after_crash_s", type=pos_float, default=None,
                   help="restart a crashed engine after this many seconds (default: stay down)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> SimConfig:
    events = args.kv_events_config if args.kv_events_config is not None else KVEventsConfig()
    if args.lora_modules and not args.enable_lora:
        # vLLM refuses to start then: its engine has no LoRA manager to load them into.
        raise SimConfigError("lora_modules", args.lora_modules[0].name, "needs --enable-lora, as vLLM's does")
    check_speedup(args.speedup, "--speedup")  # a shim registers the sim's profile at it (`@{S}x`)
    names = args.served_model_name or [args.model]
    config = SimConfig(
        host=args.host,
        port=args.port,
        model=names[0],
        aliases=tuple(names[1:]),
        root=args.model,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_events=events,
        profile=args.profile,
        speedup=args.speedup,
        role=args.role,
        kv_transfer_gbps=args.kv_transfer_gbps,
        kv_lease_duration=args.kv_lease_duration,
        kv_load_failure_policy=args.kv_load_failure_policy,
        event_form=args.event_form,
        crash_after=args.crash_after,
        hang_after=args.hang_after,
        slowdown=args.slowdown,
        drop_event_fraction=args.drop_event_fraction,
        restart_after_crash_s=args.restart_after_crash_s,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_prefix_caching=args.enable_prefix_caching,
        lora_modules=tuple(args.lora_modules),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        runtime_lora_updating=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"),
    ).validate()
    if args.count > 1:
        # engine i listens on --port + i and publishes on the events ports + i (engine_sim/fleet.py)
        try:
            fleet_config(config, args.count - 1).validate()
        except SimConfigError as exc:
            flag = "--" + exc.setting.replace("_", "-")
            got = exc.allowed if exc.setting == "kv_events_config" else f"{exc.value!r}: {exc.allowed}"
            raise SimConfigError("count", args.count, f"its last engine would get {flag} {got}") from None
        if clash := shared_ports(config, args.count):
            raise SimConfigError("count", args.count, clash)
    return config.check_kv_fits_max_model_len()


def _listen_refused(config: SimConfig, count: int, index: int | None, exc: OSError) -> SimConfigError:
    """The flag a failed listen of engine `index` (None: not known) is the fault of, by
    protocol.errors.host_fault's rule: a host that does not resolve or is not this machine's is
    --host's, anything else --port's. It was "cannot listen: [Errno 98] ...", exit 1, naming neither."""
    host, port = config.host, config.port + (index or 0) if config.port else 0
    if host_fault(exc):
        return SimConfigError("host", host, f"cannot listen there: {exc}: give a name or address of this host")
    where = f"engine {index} of --count {count} listens on --port + {index}: " if count > 1 and index else ""
    ports = "free ones" if count > 1 else "a free one"
    said = f"{where}cannot listen on {host}:{port} ({why_unbound(port, exc)})" if port else f"cannot listen: {exc}"
    return SimConfigError("port", config.port, f"{said}: choose another --port, or --port 0 for {ports}")


def _bind_host(split: ZmqEndpoint) -> str | None:
    """The address ZMQ binds for a validated tcp endpoint's host (the sim's sockets set no
    zmq.IPV6: `*` is 0.0.0.0, an IPv4-mapped address its IPv4); None for a name, which ZMQ resolves
    its own way (an interface name too)."""
    if split.wildcard:
        return "0.0.0.0"
    try:
        ip = ipaddress.ip_address(split.host.partition("%")[0])
    except ValueError:
        return None
    return str(ip.ipv4_mapped) if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else str(ip)


def _check_event_ports(config: SimConfig, count: int) -> None:
    """Every engine's KV event port (where its PUB binds) and replay port that another process
    listens on is refused before any engine starts, naming that port and its holder: ZMQ's "Address
    already in use" names neither, and a look after a failed start also found the fleet's own
    ports, still closing in ZMQ's background, and blamed "a process this user cannot see"."""
    if not config.kv_events.active:
        return
    for i in range(count):
        ev = fleet_config(config, i).kv_events
        bound = {
            "endpoint": ev.endpoint if publisher_binds(ev.endpoint) else None,
            "replay_endpoint": ev.replay_endpoint,
        }
        for key, endpoint in bound.items():
            split = split_endpoint(endpoint) if endpoint else None
            if split is None or split.scheme != "tcp" or not split.port or (host := _bind_host(split)) is None:
                continue
            try:
                try_listen(host, split.port)  # SO_REUSEADDR, as ZMQ binds
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    continue  # ZMQ's own bind says it, as before
                which = f"engine {i} of --count {count} binds {key} + {i}" if count > 1 and i else f"it binds {key}"
                raise SimConfigError(
                    "kv_events_config",
                    getattr(config.kv_events, key),
                    f"{which}: cannot bind port {split.port} ({why_unbound(split.port, exc)}): "
                    "give its endpoint and replay_endpoint other ports",
                ) from None


def _check_listen(config: SimConfig, count: int) -> None:
    """Every engine's HTTP address can be listened on now (engine i on --port + i), so a port taken
    or a host not this machine's is refused before any engine starts, naming the flag."""
    for i in range(count):
        try:
            try_listen(config.host, config.port + i if config.port else 0)
        except OSError as exc:
            raise _listen_refused(config, count, i, exc) from None


def run(args: argparse.Namespace) -> int:
    from runtime import run_service

    count = int(args.count)
    try:
        config = config_from_args(args)
        _check_listen(config, count)
        _check_event_ports(config, count)
    except ValueError as exc:  # a SimConfigError, or check_speedup's
        print(f"kvswitch sim: {exc}", file=sys.stderr)
        return 2

    async def main(stop: asyncio.Event) -> int:
        raise_fd_limit()  # a connection per leg of every shim, as vLLM raises its own
        fleet = SimFleet(config, count)
        try:
            await fleet.start()
        except OSError as exc:  # taken since _check_listen
            print(f"kvswitch sim: {_listen_refused(config, count, None, exc)}", file=sys.stderr)
            return 2
        except zmq.ZMQError as exc:  # a port taken since _check_event_ports, or a name's
            print(f"kvswitch sim: --kv-events-config: cannot bind or connect its endpoints: {exc}", file=sys.stderr)
            return 1
        if count > 1:
            tune_gc()
        loop = asyncio.get_running_loop()
        restarts: set[asyncio.Task[None]] = set()

        def on_hup() -> None:
            for s in fleet.servers:
                t = loop.create_task(s.restart())
                restarts.add(t)
                t.add_done_callback(restarts.discard)

        loop.add_signal_handler(signal.SIGHUP, on_hup)
        for line in fleet.describe():
            print(json.dumps(line), flush=True)
        single = fleet.servers[0] if count == 1 and config.restart_after_crash_s is None else None
        crashed = asyncio.ensure_future(single.crashed.wait()) if single is not None else None
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([t for t in (stopping, crashed) if t is not None], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stopping, crashed):
                if t is not None:
                    t.cancel()
            loop.remove_signal_handler(signal.SIGHUP)
            died = single is not None and single.status is ServerStatus.CRASHED
            stop.set()  # a crash stops it as SIGTERM does: within run_service's drain limit
            await fleet.stop()
        return 1 if died else 0

    return run_service(main)
