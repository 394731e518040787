"""`ShimConfig`: everything one shim needs besides its NATS and etcd connections.

Field names are the CLI flags' (`engine_url` is `--engine-url`, env `KVSWITCH_ENGINE_URL`, file key
`engine_url`), resolved by `protocol.config.resolve`. `validate()` raises protocol's ConfigError naming
the setting and what it allows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

import msgspec

from discovery.lease import MIN_LEASE_TTL
from protocol import ConfigError, subjects
from protocol.config import MAX_LOAD_PERIOD_S, MIN_LOAD_PERIOD_S, url_problem
from protocol.timing import DEFAULT_PROFILE, TimingModel, profile_dir, profile_names
from protocol.vllm_events import RESOLVED_BY_ENGINE, rank_endpoint
from protocol.zmq_endpoint import split_endpoint
from worker_shim.kv_events_config import parse_kv_events_config
from worker_shim.model_config import read_config

__all__ = ["ENGINES", "KV_EVENTS_MODES", "ROLES", "EngineKind", "KvEventsMode", "ShimConfig"]

EngineKind = Literal["vllm", "trtllm", "sglang"]
ENGINES: tuple[str, ...] = get_args(EngineKind)
ShimRole = Literal["prefill", "decode", "agg"]
ROLES: tuple[str, ...] = get_args(ShimRole)
KvEventsMode = Literal["auto", "bind", "connect"]
KV_EVENTS_MODES: tuple[str, ...] = get_args(KvEventsMode)
# Engines whose adapters read no timing counters: routers cannot calibrate their workers.
UNTIMED_ENGINES: tuple[str, ...] = ("sglang", "trtllm")
_ENDPOINT_FORMS = (
    "a ZMQ endpoint: tcp://HOST:PORT with PORT in 1..65535 (HOST `*` where the engine binds: tcp://*:5557; "
    "an address where it connects: tcp://10.0.0.7:5557; an IPv6 one in brackets: tcp://[fd00::7]:5557), "
    "vLLM's tcp://*:0 (the port it bound, read on /kv_event_sources), ipc://PATH or inproc://NAME"
)
MAX_LEASE_TTL = 9_000_000_000  # etcd's MaxLeaseTTL: "too large lease TTL" past it
_DURATIONS = (
    "reregister_grace_s", "orphan_grace_s", "load_period_s", "events_timeout_s", "drain_grace_s", "health_interval_s",
    "busy_limit_s", "stall_limit_s",
)  # fmt: skip


class ShimConfig(msgspec.Struct, kw_only=True, frozen=True):
    """One shim beside one engine.

    engine: which adapter speaks to the engine (vllm also serves engine_sim).
    engine_url: the engine's HTTP base URL.
    role: prefill, decode or agg: what the router may ask of this worker.
    model: the served model name, sent to the engine and registered in etcd.
    kv_events: the engine's KV event endpoint, exactly as the engine was configured (vLLM's
        `endpoint`); None for engines whose events come over HTTP (trtllm), and for vLLM, which
        lists each rank's on GET /kv_event_sources: the shim reads them there at startup.
    kv_events_mode: auto: vLLM's own rule read backwards: an endpoint with `*` means the engine
        binds, so the shim connects (to the engine_url host); otherwise the engine connects and the
        shim binds that address. bind/connect force one side. SGLang's `bind` in kv_events_config
        sets it (the other side).
    kv_events_topic: the ZMQ topic; frames with any other topic are ignored ("" accepts all).
    kv_replay: the engine's replay endpoint (vLLM's `replay_endpoint`), None disables replay.
    kv_events_config: the engine's own `--kv-events-config` JSON (vLLM or SGLang), verbatim; it sets
        kv_events, kv_replay and kv_events_topic (an explicit flag that disagrees is an error).
    data_parallel_rank: vLLM data parallelism: the rank this shim serves. Its legs name the rank
        (vLLM's X-data-parallel-rank header, its index among the ranks that server runs), its load
        and limits are that rank's (/metrics `engine` label), and its event endpoints are the
        engine's offset by the rank, as vLLM offsets each rank's (TCP port + rank). None: the
        engine's only rank, whose events its batches must name.
    block_size, kv_total_blocks, max_num_batched_tokens: from the engine when it says; a flag that
        disagrees with the engine is a startup error.
    kv_bytes_per_token: registered for the router's transfer-time estimate; None computes it from the
        model's config.json (model_path, or the served model id when it is a local directory).
    model_path: the model's directory (its config.json gives kv_bytes_per_token).
    timing_profile: the latency table the router's cost model uses for this worker; None: the router
        calibrates from what the engine reports, on the default profile's shape. SGLang and
        TensorRT-LLM report nothing to calibrate from: without one they are priced at the default
        profile, said at start (`timing_warning`).
    worker_name: a stable worker id (a subject token) instead of the lease id, so NATS permissions
        can name it in advance; the key is still leased, and a second shim with the name fails.
    lease_ttl: etcd lease TTL in seconds.
    reregister_grace_s: after a lost lease, how long the old worker id's subjects are still served
        (None: 2 x lease_ttl).
    orphan_grace_s: the legs of a router process whose every key under /{ns}/routers/ has been gone
        this long are cancelled (worker_shim.orphaned_legs): it died without its drain.
    load_period_s: a LoadReport goes out on every change and at least this often (at most
        protocol.config.MAX_LOAD_PERIOD_S, the longest a router waits for; at least
        MIN_LOAD_PERIOD_S, as no shim sends more often than that, which routers budget for).
    events_timeout_s: seconds without a connection on the event socket before the shim reports
        events_ok false; a served request with a full block and no Stored event gets two of them,
        the second after a read of the replay socket.
    no_endpoint_probe: send the engine no endpoint probe (worker_shim.endpoint_probe: one request
        of a random prompt per event connection or reset, whose block must show on the stream), so
        event endpoints that are another engine's go undetected; for engines whose every request
        is accounted (quotas, billing).
    http_host, http_port: the shim's own HTTP server (/health, /metrics); port 0 picks a free one.
    drain_grace_s: on SIGTERM, how long in-flight requests may run before they are aborted.
    health_interval_s: how often the engine's /health and load are polled.
    health_failures: consecutive failed health checks (refused, reset, an error status) that mean the
        engine is gone.
    busy_limit_s: how long an engine may leave its health check unanswered (a timeout: loaded, or
        hung) before the worker deregisters; a loaded engine answers late, a hung one never.
    stall_limit_s: how long an engine with work may show no progress (no token, no finished leg, no
        step, no KV change), or answer nothing at all with legs in flight (neither /health nor
        /metrics: frozen, cut off), before the worker deregisters as hung, until it moves again. Longer
        than busy_limit_s: a long prefill on an engine without a step counter shows nothing.
    max_inflight_legs: the most legs served at once; more are refused with a retryable 503
        `overloaded`. Each holds a connection to the engine, a file descriptor: None takes the most
        the open-file limit allows, which a larger value exceeds (refused at start).
    bootstrap_host: SGLang P/D: the address decode engines reach this prefill engine's bootstrap
        server at (default: --engine-url's host, which is right only on one host).
    namespace: the cluster namespace (subjects and keys).
    """

    engine: EngineKind = "vllm"
    engine_url: str = "http://127.0.0.1:8000"
    role: ShimRole = "agg"
    model: str = ""
    kv_events: str | None = None
    kv_events_mode: KvEventsMode = "auto"
    kv_events_topic: str = ""
    kv_replay: str | None = None
    kv_events_config: str | dict[str, Any] | None = None
    data_parallel_rank: int | None = None
    block_size: int | None = None
    kv_total_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    model_path: str | None = None
    timing_profile: str | None = None
    worker_name: str | None = None
    lease_ttl: int = 10
    reregister_grace_s: float | None = None
    orphan_grace_s: float = 20.0
    load_period_s: float = 0.5
    events_timeout_s: float = 5.0
    no_endpoint_probe: bool = False
    http_host: str = "127.0.0.1"
    http_port: int = 0
    drain_grace_s: float = 30.0
    health_interval_s: float = 1.0
    health_failures: int = 2
    busy_limit_s: float = 30.0
    stall_limit_s: float = 120.0
    max_inflight_legs: int | None = None
    bootstrap_host: str | None = None
    namespace: str = subjects.DEFAULT_NAMESPACE

    def validate(self) -> ShimConfig:
        cfg = self._with_kv_events_config() if self.kv_events_config is not None else self
        return cfg._validate()._with_rank_endpoints()

    def _with_rank_endpoints(self) -> ShimConfig:
        """Each data-parallel rank of vLLM publishes on its own endpoints: the configured ones
        offset by the rank (vllm.distributed.kv_events offset_endpoint_port)."""
        rank = self.data_parallel_rank
        if not rank:
            return self
        events, replay = self.kv_events, self.kv_replay
        return msgspec.structs.replace(
            self,
            kv_events=rank_endpoint(events, rank) if events else events,
            kv_replay=rank_endpoint(replay, rank) if replay else replay,
        )

    def _with_kv_events_config(self) -> ShimConfig:
        assert self.kv_events_config is not None
        if self.engine not in ("vllm", "sglang"):
            raise ConfigError(
                "kv_events_config", self.kv_events_config, f"engine {self.engine} takes no ZMQ events config"
            )
        ev = parse_kv_events_config(self.engine, self.kv_events_config)
        for key, value in (("endpoint", ev.endpoint), ("replay_endpoint", ev.replay_endpoint)):
            if value is not None and not _endpoint_ok(value, self.engine):
                raise ConfigError("kv_events_config", self.kv_events_config, f"{key} {value!r}: {_ENDPOINT_FORMS}")
        pairs = (("kv_events", ev.endpoint, "endpoint"), ("kv_replay", ev.replay_endpoint, "replay_endpoint"))
        for flag, value, key in (*pairs, ("kv_events_topic", ev.topic, "topic")):
            given = getattr(self, flag)
            if given not in (None, "") and given != value:
                raise ConfigError(
                    flag, given, f"conflicts with --kv-events-config {key} {value!r}: drop one or make them agree"
                )
        mode = self.kv_events_mode
        if ev.binds is not None:  # SGLang's explicit `bind`: the shim takes the other side
            side: KvEventsMode = "connect" if ev.binds else "bind"
            if mode in ("bind", "connect") and mode != side:
                raise ConfigError(
                    "kv_events_mode",
                    mode,
                    f"conflicts with --kv-events-config bind {str(ev.binds).lower()} (the engine's PUB "
                    f"{'binds' if ev.binds else 'connects'}, so the shim must {side}): drop one or make them agree",
                )
            mode = side if mode == "auto" else mode
        return msgspec.structs.replace(
            self, kv_events=ev.endpoint, kv_replay=ev.replay_endpoint, kv_events_topic=ev.topic, kv_events_mode=mode
        )

    def _validate(self) -> ShimConfig:
        if self.engine not in ENGINES:
            raise ConfigError.one_of("engine", self.engine, ENGINES)
        if self.role not in ROLES:
            raise ConfigError.one_of("role", self.role, ROLES)
        if self.kv_events_mode not in KV_EVENTS_MODES:
            raise ConfigError.one_of("kv_events_mode", self.kv_events_mode, KV_EVENTS_MODES)
        url = urlsplit(self.engine_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError("engine_url", self.engine_url, "an http:// or https:// URL with a host")
        if (problem := url_problem(self.engine_url)) is not None:
            raise ConfigError("engine_url", self.engine_url, problem)
        if not self.model:
            raise ConfigError("model", self.model, "the served model name is required")
        for name in ("kv_events", "kv_replay"):
            value = getattr(self, name)
            if value is not None and not _endpoint_ok(value, self.engine):
                raise ConfigError(name, value, _ENDPOINT_FORMS)
        if self.data_parallel_rank is not None:
            if self.engine != "vllm":
                # SGLang's server info is checked at start: dp_size 1 unless it caches (adapters/sglang.py)
                way_out = (
                    ": drop the flag, one shim serves the whole SGLang server; one with a radix cache must run "
                    "SGLang with --dp-size 1, one server and shim per replica"
                    if self.engine == "sglang"
                    else ""
                )
                raise ConfigError(
                    "data_parallel_rank",
                    self.data_parallel_rank,
                    f"only vLLM takes a rank per request, not {self.engine}{way_out}",
                )
            if self.data_parallel_rank < 0:
                raise ConfigError("data_parallel_rank", self.data_parallel_rank, "must be >= 0")
            for name, key in (("kv_events", "endpoint"), ("kv_replay", "replay_endpoint")):
                value = getattr(self, name)
                if value is None:
                    continue
                if self.data_parallel_rank and value.startswith("ipc://"):
                    raise self._endpoint_error(
                        name, key, value, "vLLM's data-parallel ranks publish on tcp:// or inproc:// only"
                    )
                ranked = rank_endpoint(value, self.data_parallel_rank)
                if not _endpoint_ok(ranked, self.engine):  # ZMQ wraps a port past 65535
                    raise self._endpoint_error(
                        name,
                        key,
                        value,
                        f"rank {self.data_parallel_rank} publishes at {ranked} (port + rank), past 65535",
                    )
        if self.engine == "trtllm":
            self._refuse_zmq_settings()
        if self.engine == "sglang" and self.kv_events is None:
            raise ConfigError("kv_events", None, "engine sglang publishes KV events over ZMQ: give its endpoint")
        for name in ("block_size", "kv_total_blocks", "max_num_batched_tokens", "kv_bytes_per_token"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(name, value, "must be > 0")
        if self.timing_profile is not None:
            # KVSWITCH_PROFILE_DIR naming no directory is the variable's fault, not the flag's: checked
            # here on every call, as load_profile's cache reads it only for a profile not loaded before
            profile_dir()
            try:  # the model the router builds from it: a malformed table fails there for every request
                TimingModel.for_profile(self.timing_profile)
            except ValueError as exc:
                # load_profile's own words: the known names for an unknown one (the router would find
                # no such table), else the table's file and its fault. Until 2026-12-07 a table that
                # does not parse names no profile, and read as "allowed values: ..." like an unknown name.
                raise ConfigError("timing_profile", self.timing_profile, str(exc)) from exc
        # etcd refuses a longer one at every grant, and grants 2 s where 1 is asked, which the
        # shim's own waits and words did not know (until 2026-12-07 it ran so, silently)
        if not MIN_LEASE_TTL <= self.lease_ttl <= MAX_LEASE_TTL:
            raise ConfigError("lease_ttl", self.lease_ttl, f"must be in {MIN_LEASE_TTL}..{MAX_LEASE_TTL} (seconds)")
        for name in _DURATIONS:  # NaN passes every comparison; an infinity waits forever
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(name, value, "must be a finite number of seconds")
        if self.reregister_grace_s is not None and not self.reregister_grace_s >= 0:
            raise ConfigError("reregister_grace_s", self.reregister_grace_s, "must be >= 0 (seconds)")
        if not self.orphan_grace_s >= 0:
            raise ConfigError("orphan_grace_s", self.orphan_grace_s, "must be >= 0 (seconds)")
        if not self.events_timeout_s > 0:
            raise ConfigError("events_timeout_s", self.events_timeout_s, "must be > 0 (seconds)")
        # Routers wait for no longer period (router.load_view), and quarantine a sender of more
        # reports than a shorter one sends (router.sender_budget): the shim read silent on and off.
        if not MIN_LOAD_PERIOD_S <= self.load_period_s <= MAX_LOAD_PERIOD_S:
            raise ConfigError(
                "load_period_s",
                self.load_period_s,
                f"must be in [{MIN_LOAD_PERIOD_S}, {MAX_LOAD_PERIOD_S}] (seconds; routers take more than "
                f"{1 / MIN_LOAD_PERIOD_S:g} reports a second from one worker for a flood)",
            )
        if not 0 <= self.http_port <= 65535:
            raise ConfigError("http_port", self.http_port, "must be in [0, 65535] (0 picks a free port)")
        if self.worker_name is not None:
            try:
                subjects.kv(self.namespace, self.worker_name)
            except ValueError as exc:
                raise ConfigError("worker_name", self.worker_name, "one subject token: [A-Za-z0-9_-]+") from exc
        if not self.drain_grace_s >= 0:
            raise ConfigError("drain_grace_s", self.drain_grace_s, "must be >= 0")
        if not self.health_interval_s > 0:
            raise ConfigError("health_interval_s", self.health_interval_s, "must be > 0")
        if self.health_failures < 1:
            raise ConfigError("health_failures", self.health_failures, "must be >= 1")
        for name in ("busy_limit_s", "stall_limit_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be > 0 (seconds)")
        if self.max_inflight_legs is not None and self.max_inflight_legs < 1:
            raise ConfigError("max_inflight_legs", self.max_inflight_legs, "must be >= 1 (or unset: the fd limit's)")
        if self.bootstrap_host is not None:
            if self.engine != "sglang":
                raise ConfigError("bootstrap_host", self.bootstrap_host, "only SGLang's P/D takes it: drop it")
            if not self.bootstrap_host.strip() or any(c in self.bootstrap_host for c in "/: "):
                raise ConfigError("bootstrap_host", self.bootstrap_host, "a host name or IPv4 address, no port")
        if self.model_path is not None:
            self._check_model_path(self.model_path)
        try:
            subjects.validate_namespace(self.namespace)
        except ValueError as exc:
            raise ConfigError("namespace", self.namespace, str(exc)) from exc
        return self

    def _refuse_zmq_settings(self) -> None:
        """TensorRT-LLM's KV events come over HTTP (adapters/trtllm.py polls /kv_cache_events): the
        ZMQ settings would be read by nothing, as --kv-events-config is refused (above)."""
        given = [("kv_events", self.kv_events), ("kv_replay", self.kv_replay)]
        given += [("kv_events_topic", self.kv_events_topic or None)]
        given += [("kv_events_mode", None if self.kv_events_mode == "auto" else self.kv_events_mode)]
        for name, value in given:
            if value is not None:
                raise ConfigError(
                    name,
                    value,
                    "read with --engine vllm or sglang only, not --engine trtllm, whose KV events the shim polls "
                    "over HTTP: drop it",
                )

    @staticmethod
    def _check_model_path(path: str) -> None:
        """Given and wrong is a typo, a missing mount or a folder that holds no model: said at
        start, not as a WARNING later with the worker registered without its KV size (routers then
        price its transfers at their default profile's). Only a config.json that is missing or no
        JSON object is refused: one whose KV numbers kv_bytes_per_token_of cannot work out is often
        a real model's (LLaVA-1.5 and Gemma-3 leave them to their classes' defaults, GLM-4 names
        them its own way), served with the runtime WARNING. Empty is refused, not read as unset."""
        way_out = (
            "give the model's directory (its config.json gives the KV bytes per token), or --kv-bytes-per-token "
            "and no --model-path"
        )
        if not path:
            raise ConfigError("model_path", path, f"must not be empty: {way_out}")
        if not Path(path).is_dir():
            raise ConfigError("model_path", path, f"not a directory here: {way_out}")
        _, why = read_config(path)
        if why:
            raise ConfigError("model_path", path, f"{why}: {way_out}")

    def timing_warning(self) -> str | None:
        """The WARNING a shim gives at start when routers can only price its worker at the default
        profile: an engine that reports no timing counters, and no timing_profile. A warning, not a
        refusal: KV-aware routing needs no timing, and a model with no measured table would
        otherwise not be served at all."""
        if self.engine not in UNTIMED_ENGINES or self.timing_profile is not None:
            return None
        return (
            f"engine {self.engine} reports no timing counters, so routers cannot calibrate this worker: with no "
            f"--timing-profile they price its prefills and decode steps at the {DEFAULT_PROFILE} table for as long "
            "as it runs (ttft_model, slo_aware, the prefill-backlog room check, kv routing's recompute charge); "
            f"give --timing-profile for its model and GPU (known: {', '.join(profile_names())}; "
            "your own tables in KVSWITCH_PROFILE_DIR)"
        )

    def _endpoint_error(self, name: str, key: str, value: str, why: str) -> ConfigError:
        """An error naming where the endpoint came from: the JSON's `key` when --kv-events-config
        gave it (its values are copied into kv_events and kv_replay first), else the flag."""
        if self.kv_events_config is not None:
            return ConfigError("kv_events_config", self.kv_events_config, f"{key} {value!r}: {why}")
        return ConfigError(name, value, why)

    @property
    def grace_s(self) -> float:
        return 2.0 * self.lease_ttl if self.reregister_grace_s is None else self.reregister_grace_s

    @property
    def engine_host(self) -> str:
        return urlsplit(self.engine_url).hostname or "127.0.0.1"


def _endpoint_ok(endpoint: str, engine: str) -> bool:
    """Whether ZMQ opens `endpoint` (protocol.zmq_endpoint) on one port a peer can know: it binds
    port 0 or `*` to any port, which only vLLM lists (for its `tcp://*:0`)."""
    split = split_endpoint(endpoint)
    if split is None or split.scheme != "tcp":
        return split is not None
    if not split.port:  # vLLM binds its own and lists the port; nobody else can know it
        return endpoint == RESOLVED_BY_ENGINE and engine == "vllm"
    return True
