"""`ShimConfig`: everything one shim needs besides its NATS and etcd connections.

Field names are the CLI flags' (`engine_url` is `--engine-url`, env `KVSWITCH_ENGINE_URL`, file key
`engine_url`), resolved by `protocol.config.resolve`. `validate()` raises protocol's ConfigError naming
the setting and what it allows.
"""

from __future__ import annotations

from typing import Literal, get_args
from urllib.parse import urlsplit

import msgspec

from protocol import ConfigError, subjects

__all__ = ["ENGINES", "KV_EVENTS_MODES", "ROLES", "EngineKind", "KvEventsMode", "ShimConfig"]

EngineKind = Literal["vllm", "trtllm", "sglang"]
ENGINES: tuple[str, ...] = get_args(EngineKind)
ShimRole = Literal["prefill", "decode", "agg"]
ROLES: tuple[str, ...] = get_args(ShimRole)
KvEventsMode = Literal["auto", "bind", "connect"]
KV_EVENTS_MODES: tuple[str, ...] = get_args(KvEventsMode)
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


class ShimConfig(msgspec.Struct, kw_only=True, frozen=True):
    """One shim beside one engine.

    engine: which adapter speaks to the engine (vllm also serves engine_sim).
    engine_url: the engine's HTTP base URL.
    role: prefill, decode or agg: what the router may ask of this worker.
    model: the served model name, sent to the engine and registered in etcd.
    kv_events: the engine's KV event endpoint, exactly as the engine was configured (vLLM's
        `endpoint`); None for engines whose events come over HTTP (trtllm).
    kv_events_mode: auto: vLLM's own rule read backwards: an endpoint with `*` means the engine
        binds, so the shim connects (to the engine_url host); otherwise the engine connects and the
        shim binds that address. bind/connect force one side.
    kv_events_topic: the ZMQ topic; frames with any other topic are ignored ("" accepts all).
    kv_replay: the engine's replay endpoint (vLLM's `replay_endpoint`), None disables replay.
    block_size, kv_total_blocks, max_num_batched_tokens: from the engine when it says; a flag that
        disagrees with the engine is a startup error.
    kv_bytes_per_token: registered for the router's transfer-time estimate; None takes the timing
        profile's.
    timing_profile: the latency table the router's cost model uses for this worker.
    lease_ttl: etcd lease TTL in seconds.
    drain_grace_s: on SIGTERM, how long in-flight requests may run before they are aborted.
    health_interval_s: how often the engine's /health and load are polled.
    health_failures: consecutive failed health checks that mean the engine is gone.
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
    block_size: int | None = None
    kv_total_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    timing_profile: str = "h200:llama-3.1-8b"
    lease_ttl: int = 10
    drain_grace_s: float = 30.0
    health_interval_s: float = 1.0
    health_failures: int = 2
    namespace: str = subjects.DEFAULT_NAMESPACE

    def validate(self) -> ShimConfig:
        if self.engine not in ENGINES:
            raise ConfigError.one_of("engine", self.engine, ENGINES)
        if self.role not in ROLES:
            raise ConfigError.one_of("role", self.role, ROLES)
        if self.kv_events_mode not in KV_EVENTS_MODES:
            raise ConfigError.one_of("kv_events_mode", self.kv_events_mode, KV_EVENTS_MODES)
        url = urlsplit(self.engine_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError("engine_url", self.engine_url, "an http:// or https:// URL with a host")
        if not self.model:
            raise ConfigError("model", self.model, "the served model name is required")
        for name in ("kv_events", "kv_replay"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_ZMQ_SCHEMES):
                raise ConfigError(name, value, "a ZMQ endpoint: tcp://HOST:PORT, ipc://PATH or inproc://NAME")
        if self.engine in ("vllm", "sglang") and self.kv_events is None:
            raise ConfigError(
                "kv_events", None, f"engine {self.engine} publishes KV events over ZMQ: give its endpoint"
            )
        for name in ("block_size", "kv_total_blocks", "max_num_batched_tokens", "kv_bytes_per_token"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(name, value, "must be > 0")
        if self.lease_ttl < 1:
            raise ConfigError("lease_ttl", self.lease_ttl, "must be >= 1 (seconds)")
        if self.drain_grace_s < 0:
            raise ConfigError("drain_grace_s", self.drain_grace_s, "must be >= 0")
        if self.health_interval_s <= 0:
            raise ConfigError("health_interval_s", self.health_interval_s, "must be > 0")
        if self.health_failures < 1:
            raise ConfigError("health_failures", self.health_failures, "must be >= 1")
        try:
            subjects.validate_namespace(self.namespace)
        except ValueError as exc:
            raise ConfigError("namespace", self.namespace, str(exc)) from exc
        return self

    @property
    def engine_host(self) -> str:
        return urlsplit(self.engine_url).hostname or "127.0.0.1"
