"""A worker's registration says whether its engine prefills a bypass leg (WorkerInfo.local_prefill):
an SGLang decode server waits for a prefill peer's KV and cannot; vLLM and TensorRT-LLM decode
engines, and every engine in the other roles, can."""

from __future__ import annotations

import dataclasses

import pytest

from protocol.config import EtcdSettings, NatsSettings
from worker_shim.config import ShimConfig, ShimRole
from worker_shim.shim import WorkerShim


@pytest.mark.parametrize(
    ("engine", "role", "local"),
    [
        ("sglang", "decode", False),
        ("sglang", "prefill", True),
        ("sglang", "agg", True),
        ("vllm", "decode", True),
        ("trtllm", "decode", True),
    ],
)
def test_the_record_says_whether_its_engine_prefills_locally(engine: str, role: ShimRole, local: bool) -> None:
    extra: dict[str, str] = {"bootstrap_host": "10.0.0.5"} if engine == "sglang" and role == "prefill" else {}
    if engine != "trtllm":  # TensorRT-LLM's events are polled over HTTP: the ZMQ flag is refused with it
        extra["kv_events"] = "tcp://127.0.0.1:9"
    cfg = ShimConfig(engine=engine, model="m", role=role, **extra)  # type: ignore[arg-type]
    shim = WorkerShim(cfg.validate(), NatsSettings(servers=["nats://127.0.0.1:1"]), EtcdSettings(endpoints=["x"]))
    shim.limits = dataclasses.replace(shim.limits, block_size=16)
    assert shim._info("w1").local_prefill is local
