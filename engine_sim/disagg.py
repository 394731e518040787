"""NixlConnector-style disaggregation between sims: where a decode sim pulls prefilled KV from.

A prefill sim finishing a `do_remote_decode` request returns vLLM's kv_transfer_params
(`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`,
`remote_request_id`, `tp_size`) and keeps those blocks pinned. A decode sim given those params
waits the modelled transfer time and then "pulls": it tells the prefill sim the read is done, which
frees the pin. The prefill sim answers whether the blocks were still there; if not (timed out,
restarted, unknown engine), the decode sim prefills locally, as vLLM's recompute policy does.

How the pull reaches the prefill sim:
- same process (fleet mode, tests): a registry of live sims by engine id, a direct call;
- another process: `POST http://{remote_host}:{remote_port}/sim/kv_pull` with JSON
  `{"remote_engine_id", "remote_request_id", "remote_block_ids"}` → 200 `{"released": true}` or
  404 `{"released": false}`. remote_host/remote_port are the prefill sim's HTTP address.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol

import aiohttp

__all__ = ["PULL_PATH", "PinHolder", "pull", "register", "unregister"]

log = logging.getLogger("engine_sim.disagg")

PULL_PATH = "/sim/kv_pull"


class PinHolder(Protocol):
    def release_pin(self, request_id: str | None, block_ids: list[int] | None = None) -> bool: ...


_registry: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(engine_id: str, holder: PinHolder) -> None:
    _registry[engine_id] = holder


def unregister(engine_id: str) -> None:
    _registry.pop(engine_id, None)


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
