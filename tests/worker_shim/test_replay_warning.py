"""A shim reading a ZMQ engine's KV events without --kv-replay says at start, at WARNING, that every
reconnection of the event socket then ends its session and re-registers the worker under a new id,
naming the flag. Before 2026-12-07 only docs/worker_shim.md said it (review of 056b6ce, finding 3)."""

from __future__ import annotations

import logging

import pytest

from protocol.config import EtcdSettings, NatsSettings
from worker_shim import ShimConfig, WorkerShim
from worker_shim.config import EngineKind


@pytest.mark.parametrize(
    ("engine", "replay", "warned"),
    [
        ("sglang", None, True),
        ("vllm", None, True),
        ("vllm", "tcp://127.0.0.1:10", False),
        ("sglang", "tcp://127.0.0.1:10", False),
        ("trtllm", None, False),
    ],
)
async def test_a_zmq_engine_without_kv_replay_is_said_at_start(
    engine: EngineKind,
    replay: str | None,
    warned: bool,
    ns: str,
    nats_url: str,
    etcd_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = ShimConfig(
        engine=engine,
        engine_url="http://127.0.0.1:9",  # no engine: the shim starts and waits for one
        model="m",
        kv_events="tcp://127.0.0.1:9" if engine != "trtllm" else None,
        kv_replay=replay,
        namespace=ns,
    )
    shim = WorkerShim(cfg, NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url]))
    with caplog.at_level(logging.WARNING, logger="worker_shim.shim"):
        async with shim:
            pass
    said = [r for r in caplog.records if "--kv-replay" in r.getMessage()]
    if not warned:
        assert said == []
        return
    (record,) = said
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert f"no --kv-replay for the {engine} engine's KV events" in text
    assert "every one ends the session and the worker registers anew under a new id" in text
