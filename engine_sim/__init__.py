"""A simulated engine that speaks vLLM 0.32's wire protocols (OpenAI HTTP API, ZMQ KV events,
Prometheus metrics, NixlConnector-style kv_transfer_params) with step times calibrated to an H200.

In-process API (tests, benchmarks, the local cluster):

    from engine_sim import SimConfig, SimServer, SimFleet, KVEventsConfig, LoraModule

See docs/engine_sim.md for the behaviour, the timing model and its error against the profiles.
"""

from engine_sim.config import EVENT_FORMS, ROLES, KVEventsConfig, SimConfig
from engine_sim.errors import PromptTooLongError, SimConfigError, SimRequestError
from engine_sim.faults import Faults
from engine_sim.fleet import SimFleet, fleet_config
from engine_sim.lora import LoraModule
from engine_sim.runner import EngineRunner, RequestStream
from engine_sim.scheduler import Scheduler, StepOutput, StepResult
from engine_sim.server import ServerStatus, SimServer
from protocol.timing import TimingModel, load_profile

Engine = Scheduler
"""The synchronous engine core (`SimServer.engine`)."""

__all__ = [
    "EVENT_FORMS",
    "ROLES",
    "Engine",
    "EngineRunner",
    "Faults",
    "KVEventsConfig",
    "LoraModule",
    "PromptTooLongError",
    "RequestStream",
    "Scheduler",
    "ServerStatus",
    "SimConfig",
    "SimConfigError",
    "SimFleet",
    "SimRequestError",
    "SimServer",
    "StepOutput",
    "StepResult",
    "TimingModel",
    "fleet_config",
    "load_profile",
]
