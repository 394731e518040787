"""A shim reading a ZMQ engine's KV events without --kv-replay says at start, at WARNING, that every
reconnection of the event socket then ends its session and re-registers the worker under a new id,
naming the flag. Before 2026-12-07 only docs/worker_shim.md said it (review of 056b6ce, finding 3)."""

from __future__ import annotations

import logging

import pytest

from tests.worker_shim.cluster import said_at_start
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
    said = await said_at_start("--kv-replay", engine, ns, nats_url, etcd_url, caplog, kv_replay=replay)
    if not warned:
        assert said == []
        return
    (record,) = said
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert f"no --kv-replay for the {engine} engine's KV events" in text
    assert "every one ends the session and the worker registers anew under a new id" in text
