"""NixlConnector-style disaggregation between sims: where a decode sim pulls prefilled KV from.

A prefill sim finishing a `do_remote_decode` request returns vLLM's kv_transfer_params
(`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`,
`remote_request_id`, `tp_size`) and keeps those blocks pinned under a lease, as vLLM 0.32 does
(`kv_connector_extra_config.kv_lease_duration`, 30 s by default). A decode sim given those params
renews the lease with heartbeats from when it takes the request until its pull starts. The pull
waits the modelled transfer time and tells the prefill sim the read is done, which frees the pin. A
decode request aborted before its pull sends the same message, so the prefill blocks are freed at
once (vLLM's notification with no block ids). A lease nobody renews (the decode engine died or hung)
runs out and the prefill sim frees the blocks. The prefill sim answers a pull with whether the
blocks were still there; if not (expired, restarted, unknown engine), the decode sim fails the
request or prefills locally, per its kv_load_failure_policy.

How the messages reach the prefill sim:
- same process (fleet mode, tests): a registry of live sims by engine id, a direct call;
- another process, at remote_host:remote_port (the prefill sim's HTTP address):
  `POST /sim/kv_pull` with JSON `{"remote_engine_id", "remote_request_id", "remote_block_ids"}`
  → 200 `{"released": true}` or 404 `{"released": false}`;
  `POST /sim/kv_heartbeat` with JSON `{"remote_engine_id", "remote_request_ids": [...]}`
  → 200 `{"renewed": N}` (the leases still held and renewed), 404 for another engine id.
Either route answers 400 to a body that is not a JSON object.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol

import aiohttp

__all__ = [
    "HEARTBEAT_PATH",
    "MIN_HEARTBEAT_INTERVAL",
    "PULL_PATH",
    "PinHolder",
    "heartbeat_interval",
    "is_local",
    "lease_extension",
    "pull",
    "register",
    "renew",
    "unregister",
]

log = logging.getLogger("engine_sim.disagg")

PULL_PATH = "/sim/kv_pull"
HEARTBEAT_PATH = "/sim/kv_heartbeat"
# vLLM's heartbeat interval is 0 for a lease under 6 s: a heartbeat every scheduler step. The sim
# beats on its own timer, so it floors the interval here (well under any nonzero extension, 1 s).
MIN_HEARTBEAT_INTERVAL = 0.1


def heartbeat_interval(kv_lease_duration: float) -> float:
    """How often a decode engine with this lease heartbeats (vLLM 0.32's `lease // 6`)."""
    return max(kv_lease_duration // 6, MIN_HEARTBEAT_INTERVAL)


def lease_extension(kv_lease_duration: float) -> float:
    """How far a heartbeat extends a lease on a prefill engine with this lease, from when it
    arrives (vLLM 0.32's `lease * 2 // 3`: 0 for a 1 s lease, whose heartbeats extend nothing)."""
    return kv_lease_duration * 2 // 3


class PinHolder(Protocol):
    def release_pin(self, request_id: str | None, block_ids: list[list[int]] | None = None) -> bool: ...

    def renew_pins(self, request_ids: list[str]) -> int: ...


_registry: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(engine_id: str, holder: PinHolder) -> None:
    _registry[engine_id] = holder


def unregister(engine_id: str) -> None:
    _registry.pop(engine_id, None)


def is_local(params: dict[str, Any]) -> bool:
    """The prefill sim `params` name runs in this process (no HTTP needed to reach it)."""
    return _registry.get(str(params.get("remote_engine_id"))) is not None


async def pull(params: dict[str, Any], session: aiohttp.ClientSession | None) -> bool:
    """Finish reading the KV that `params` names; True when the prefill side still held it."""
    engine_id = params.get("remote_engine_id")
    request_id = params.get("remote_request_id")
    block_ids = params.get("remote_block_ids")
    holder = _registry.get(str(engine_id))
    if holder is not None:
        return bool(holder.release_pin(request_id, block_ids))
    host, port = params.get("remote_host"), params.get("remote_port")
    if not host or not port or session is None:
        return False
    url = f"http://{host}:{port}{PULL_PATH}"
    body = {"remote_engine_id": engine_id, "remote_request_id": request_id, "remote_block_ids": block_ids}
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("kv pull from %s failed: %s", url, exc)
        return False


async def renew(params: dict[str, Any], request_ids: list[str], session: aiohttp.ClientSession | None) -> None:
    """One heartbeat to the prefill sim `params` name: the leases of `request_ids` (its request
    ids) run on. Lost heartbeats are only logged, as vLLM's are: the lease then runs out."""
    engine_id = params.get("remote_engine_id")
    holder = _registry.get(str(engine_id))
    if holder is not None:
        holder.renew_pins(request_ids)
        return
    host, port = params.get("remote_host"), params.get("remote_port")
    if not host or not port or session is None:
        return
    url = f"http://{host}:{port}{HEARTBEAT_PATH}"
    body = {"remote_engine_id": engine_id, "remote_request_ids": request_ids}
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=5)):
            pass
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.debug("kv heartbeat to %s failed: %s", url, exc)
