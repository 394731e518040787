"""`--kv-events-config`: the engine's own KV-events JSON, read the way the engine reads it.

vLLM (vllm/config/kv_events.py, 0.32) and SGLang (sglang/srt/disaggregation/kv_events.py) take the
same JSON shape; the operator hands the shim the string the engine was given. Keys and defaults:

    enable_kv_cache_events  vLLM only: false (vLLM publishes nothing unless true)
    publisher               "zmq" or "null"; vLLM: unset means zmq when events are enabled;
                            SGLang: unset means null (nothing published)
    endpoint                "tcp://*:5557": the PUB socket (binds with `*`, `::`, ipc://, inproc://,
                            and for SGLang `0.0.0.0`; connects otherwise, and the shim then binds)
    replay_endpoint         None: the ROUTER socket for replay
    snapshot_endpoint       SGLang only, None: the ROUTER socket for placement snapshots, which the
                            shim does not use; when set, SGLang adds its publisher's epoch to the
                            live topic (worker_shim/adapters/zmq_events.py reads it)
    topic                   "": the topic frame of every PUB message
    buffer_steps, hwm, max_queue_size: the engine's buffers; nothing the shim needs

A config that makes the engine publish nothing, an unknown key or a wrong type is a ConfigError
naming `kv_events_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol import ConfigError

__all__ = ["KEYS", "EngineEventsConfig", "parse_kv_events_config"]

_COMMON = ("publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm", "max_queue_size")
# The keys each engine takes (vLLM's KVEventsConfig; SGLang's ZmqEventPublisherConfig and publisher).
KEYS: dict[str, tuple[str, ...]] = {
    "vllm": ("enable_kv_cache_events", *_COMMON),
    "sglang": (*_COMMON, "snapshot_endpoint"),
}
_SETTING = "kv_events_config"


@dataclass(frozen=True, slots=True)
class EngineEventsConfig:
    endpoint: str
    replay_endpoint: str | None
    topic: str


def _load(raw: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(_SETTING, raw, f"not JSON ({exc.msg}); give it exactly as the engine was given it") from exc
    if not isinstance(data, dict):
        raise ConfigError(_SETTING, raw, 'a JSON object such as {"enable_kv_cache_events": true, ...}')
    return data


def _typed(data: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = data.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise ConfigError(_SETTING, data, f"{key} must be a {kind.__name__}, got {value!r}")
    return value


def parse_kv_events_config(engine: str, raw: str | dict[str, Any]) -> EngineEventsConfig:
    """The endpoints and topic the engine publishes on; ConfigError if it publishes nothing."""
    data = _load(raw)
    allowed = KEYS[engine]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(_SETTING, data, f"unknown key(s) {', '.join(unknown)}; {engine} takes {', '.join(allowed)}")
    publisher = _typed(data, "publisher", str, None)
    if engine == "vllm":
        enabled = _typed(data, "enable_kv_cache_events", bool, False)
        if not enabled:
            raise ConfigError(
                _SETTING, data, "enable_kv_cache_events is not true: vLLM publishes no KV events; set it to true"
            )
        publisher = publisher or "zmq"
    else:
        publisher = publisher or "null"
    if publisher != "zmq":
        raise ConfigError(_SETTING, data, f'publisher {publisher!r} publishes nothing: the shim needs "zmq"')
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        _typed(data, key, int, None)
    _typed(data, "snapshot_endpoint", str, None)
    return EngineEventsConfig(
        endpoint=_typed(data, "endpoint", str, "tcp://*:5557"),
        replay_endpoint=_typed(data, "replay_endpoint", str, None),
        topic=_typed(data, "topic", str, ""),
    )
