"""`--kv-events-config`: the engine's own KV-events JSON, read the way the engine reads it.

vLLM (vllm/config/kv_events.py, 0.32) and SGLang (sglang/srt/disaggregation/kv_events.py) take the
same JSON shape; the operator hands the shim the string the engine was given. Keys and defaults:

    enable_kv_cache_events  vLLM only: false (vLLM publishes nothing unless true)
    publisher               "zmq" or "null"; vLLM: unset means zmq when events are enabled;
                            SGLang: unset means null (nothing published)
    endpoint                "tcp://*:5557": the PUB socket (binds with `*`, `::`, ipc://, inproc://,
                            and for SGLang `0.0.0.0`; connects otherwise, and the shim then binds)
    bind                    SGLang only (0.5.23), None: true binds the PUB, false connects it, None
                            reads the endpoint as above; the shim takes the other side
    format                  SGLang only (0.5.23), "default": "dynamo" namespaces every block hash
                            by the request's extra_key and cache_salt (the same events, other
                            hash values: opaque keys to the shim, so both are read)
    replay_endpoint         None: the ROUTER socket for replay
    snapshot_endpoint       SGLang's main branch (sglang PR #34407), not 0.5.23 (which ignores it),
                            None: the ROUTER socket for placement snapshots, which the shim does
                            not use; when set, such an SGLang adds its publisher's epoch to the
                            live topic (worker_shim/adapters/zmq_events.py reads it)
    topic                   "": the topic frame of every PUB message
    buffer_steps, hwm, max_queue_size: the engine's buffers; nothing the shim needs

A config that makes the engine publish nothing, an unknown key or a wrong type is a ConfigError
naming `kv_events_config`.

vLLM lists each endpoint on GET /kv_event_sources as it was given, except `tcp://*:0`
(RESOLVED_BY_ENGINE), which it lists as the `tcp://<node IP>:<port>` its socket bound
(vllm/distributed/kv_events.py ZmqEventPublisher._bind). `listed_mode` reads the side to take.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol import ConfigError
from protocol.vllm_events import RESOLVED_BY_ENGINE, publisher_binds

if TYPE_CHECKING:  # both import this module's package's config: an import cycle at run time
    from worker_shim.adapters.zmq_bind import BindFailures
    from worker_shim.config import KvEventsMode

__all__ = ["KEYS", "EngineEventsConfig", "listed_mode", "parse_kv_events_config"]


_COMMON = ("publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm", "max_queue_size")
# The keys each engine takes (vLLM's KVEventsConfig; SGLang's ZmqEventPublisherConfig and publisher).
KEYS: dict[str, tuple[str, ...]] = {
    "vllm": ("enable_kv_cache_events", *_COMMON),
    "sglang": (*_COMMON, "bind", "format", "snapshot_endpoint"),
}
# SGLang's KVEventsConfig.format values; each sends the same events, with other hash values.
_FORMATS = ("default", "dynamo")
_SETTING = "kv_events_config"


@dataclass(frozen=True, slots=True)
class EngineEventsConfig:
    endpoint: str
    replay_endpoint: str | None
    topic: str
    # SGLang's `bind`: whether its PUB binds (True) or connects (False); None: its endpoint says.
    binds: bool | None = None


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
    if (form := _typed(data, "format", str, "default")) not in _FORMATS:
        raise ConfigError(_SETTING, data, f"format {form!r}: SGLang takes {' or '.join(map(repr, _FORMATS))}")
    return EngineEventsConfig(
        endpoint=_typed(data, "endpoint", str, "tcp://*:5557"),
        replay_endpoint=_typed(data, "replay_endpoint", str, None),
        topic=_typed(data, "topic", str, ""),
        binds=_typed(data, "bind", bool, None),
    )


async def listed_mode(
    listed: str, given: str | None, mode: KvEventsMode, engine_url: str, binds: BindFailures
) -> KvEventsMode:
    """The side the shim takes of the events endpoint vLLM lists (`listed`), `given` the one the
    engine was started with when the operator gave it: vLLM's rule read on that one. Without it, a
    listed address with no wildcard is either one the engine connects to (nothing holds it yet: the
    shim binds it) or a `tcp://*:0` the engine bound (this host cannot bind it): the second is a
    ConfigError naming --kv-events-mode, since only the operator knows. A bind that fails for now
    (zmq_bind's diagnosis, `binds` its run of failures: a tentative IPv6 address, a name that does
    not resolve yet, a port a connection holds) is a BindPending, its cause said once at WARNING
    naming --kv-events-mode, and the next session looks again: until 2026-12-07 any failed bind was
    a ConfigError, the shim's exit 2."""
    if mode != "auto":
        return mode
    if given is not None:
        return "connect" if publisher_binds(given) else "bind"
    if publisher_binds(listed):
        return "connect"
    failed = await binds.probe(listed)
    if failed is None:
        return "bind"
    exc, found = failed
    if found.outcome != "final":
        said = f"the engine at {engine_url} lists its KV events at {listed}, which this host cannot bind yet ({exc})"
        raise binds.pending("kv_events_mode", mode, f"{said}: {found.why}", found)
    raise ConfigError(
        "kv_events_mode",
        mode,
        f"the engine at {engine_url} lists its KV events at {listed}, which this host cannot bind ({exc}: "
        f"{found.why}): vLLM lists an endpoint of {RESOLVED_BY_ENGINE} so, as the address its PUB bound. Give "
        f"--kv-events-mode connect (or --kv-events-config as the engine was given it); bind if the engine "
        f"connects to {listed}",
    )
