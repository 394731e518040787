"""The shim says each warning once: the texts it keeps for that are capped, since one can name
what keeps changing (the LoRA adapters an engine lists)."""

from __future__ import annotations

import logging

import pytest

from protocol.config import EtcdSettings, NatsSettings
from worker_shim import ShimConfig, WorkerShim
from worker_shim.adapters.base import ModelCard


def test_adapter_sets_listed_by_an_engine_that_cannot_route_them_keep_a_bounded_set_of_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shim = WorkerShim(
        ShimConfig(engine="sglang", engine_url="http://127.0.0.1:1", model="base", kv_events="tcp://127.0.0.1:1"),
        NatsSettings(servers=["nats://127.0.0.1:1"]),
        EtcdSettings(endpoints=["http://127.0.0.1:1"]),
    )
    logging.disable(logging.WARNING)  # 2,000 warnings, one per adapter set
    try:
        for i in range(2000):  # one poll per change: tenant i loaded, tenant i - 1 unloaded
            shim._take_served_names({"base": ModelCard(root="/m"), f"tenant-{i}": ModelCard(parent="base", root="/a")})
    finally:
        logging.disable(logging.NOTSET)
    assert len(shim._said) <= 1024
    assert shim.adapters == []  # none routed by name on sglang
    # Past the bound a new warning is still said (before: nothing more was, 2026-12-05's first cap).
    with caplog.at_level(logging.WARNING, logger="worker_shim.shim"):
        shim._say_once(logging.WARNING, "a warning never said before")
    assert "a warning never said before" in caplog.text
