"""A shim before an engine that reports no timing counters (SGLang, TensorRT-LLM) says at start, at
WARNING, that routers price its worker at the default profile until it is given --timing-profile.
Before 2026-12-05 nothing said it, and the flag's help promised that the router calibrates."""

from __future__ import annotations

import logging

import pytest

from protocol.timing import DEFAULT_PROFILE, profile_names
from tests.worker_shim.cluster import said_at_start
from worker_shim.config import EngineKind


@pytest.mark.parametrize(
    ("engine", "profile", "warned"),
    [("sglang", None, True), ("trtllm", None, True), ("sglang", "h200:qwen2.5-32b", False), ("vllm", None, False)],
)
async def test_an_engine_without_timing_counters_and_no_profile_is_said_at_start(
    engine: EngineKind,
    profile: str | None,
    warned: bool,
    ns: str,
    nats_url: str,
    etcd_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    said = await said_at_start("--timing-profile", engine, ns, nats_url, etcd_url, caplog, timing_profile=profile)
    if not warned:
        assert said == []
        return
    (record,) = said
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert f"engine {engine} reports no timing counters" in text and f"at the {DEFAULT_PROFILE} table" in text
    assert f"known: {', '.join(profile_names())}" in text
