"""The worker shim: the sidecar beside an engine (vLLM, TensorRT-LLM, SGLang, engine_sim).

It turns the engine's KV events into canonical `KvEventBatch`es on `{ns}.kv.{worker}`, answers
`{ns}.kvstate.{worker}`, reports load on `{ns}.load.{worker}`, serves requests on
`{ns}.gen.{role}.{worker}` and keeps the worker registered in etcd while the engine is healthy.
"""

from worker_shim.adapters import EngineAdapter, EngineError, EngineLimits, EngineLoad, make_adapter
from worker_shim.config import ENGINES, ShimConfig
from worker_shim.decode_context import DecodeContext
from worker_shim.engine_events import EngineBatch, EngineCleared, EngineRemoved, EngineStored
from worker_shim.normaliser import Normaliser
from worker_shim.shim import ShimStatus, WorkerShim

__all__ = [
    "ENGINES",
    "DecodeContext",
    "EngineAdapter",
    "EngineBatch",
    "EngineCleared",
    "EngineError",
    "EngineLimits",
    "EngineLoad",
    "EngineRemoved",
    "EngineStored",
    "Normaliser",
    "ShimConfig",
    "ShimStatus",
    "WorkerShim",
    "make_adapter",
]
