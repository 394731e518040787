"""One adapter per engine kind, behind one interface (`base.EngineAdapter`); `make_adapter` picks it."""

from __future__ import annotations

from worker_shim.adapters.base import (
    EngineAdapter,
    EngineCold,
    EngineError,
    EngineHealth,
    EngineLimits,
    EngineLoad,
    LegOutcome,
    LegRequest,
    ModelCard,
)
from worker_shim.config import ShimConfig

__all__ = [
    "EngineAdapter",
    "EngineCold",
    "EngineError",
    "EngineHealth",
    "EngineLimits",
    "EngineLoad",
    "LegOutcome",
    "LegRequest",
    "ModelCard",
    "make_adapter",
]


def make_adapter(config: ShimConfig) -> EngineAdapter:
    if config.engine == "vllm":
        from worker_shim.adapters.vllm import VllmAdapter

        return VllmAdapter(config)
    if config.engine == "trtllm":
        from worker_shim.adapters.trtllm import TrtllmAdapter

        return TrtllmAdapter(config)
    from worker_shim.adapters.sglang import SglangAdapter

    return SglangAdapter(config)
