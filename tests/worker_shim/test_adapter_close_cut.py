"""An engine adapter's close cancelled again while it waits on its own tasks (the SGLang adapter's
prefill requests, the TensorRT-LLM adapter's /metrics read, any HTTP adapter's late health probe):
cancel_and_wait passes the cut on and raises it once they ended, and what came after it was
skipped, the HTTP session left open. It now runs though the wait was cut (runtime.StopSteps),
and the cut is raised after it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.lost_cancellation import cut_while_it_waits, runs_on
from worker_shim.adapters.sglang import SglangAdapter
from worker_shim.adapters.trtllm import TrtllmAdapter
from worker_shim.adapters.vllm import VllmAdapter
from worker_shim.config import ShimConfig


async def _cut_close(adapter: SglangAdapter | TrtllmAdapter | VllmAdapter, lost: list[str]) -> None:
    session = adapter.session
    task = await cut_while_it_waits(adapter.close(), lost, "engine call")
    assert task.cancelled(), "the cut was not raised once the close was done"
    assert session.closed and adapter._session is None, "the session was left open"


async def test_an_sglang_close_cut_while_its_prefill_requests_end_still_closes_its_session() -> None:
    adapter = SglangAdapter(
        ShimConfig(engine="sglang", model="m", engine_url="http://127.0.0.1:9", kv_events="tcp://127.0.0.1:9")
    )
    await adapter.open()
    lost: list[str] = []
    leg: asyncio.Task[Any] = asyncio.create_task(runs_on(lost, "engine call"))
    adapter._background.add(leg)
    await _cut_close(adapter, lost)


async def test_a_trtllm_close_cut_while_its_metrics_read_ends_still_closes_its_session() -> None:
    adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m"))
    await adapter.open()
    lost: list[str] = []
    read: asyncio.Task[Any] = asyncio.create_task(runs_on(lost, "engine call"))
    adapter._metrics = read
    await _cut_close(adapter, lost)


@pytest.mark.parametrize("kind", ["sglang", "vllm", "trtllm"])
async def test_a_close_cut_while_its_late_health_probe_ends_still_closes_its_session(kind: str) -> None:
    """The base close (HttpEngineAdapter's, which each adapter's own close ends with) reaped the
    late probe before it took the session: until 2026-12-08 a cut there left the session open."""
    adapter: SglangAdapter | TrtllmAdapter | VllmAdapter
    if kind == "sglang":
        adapter = SglangAdapter(
            ShimConfig(engine="sglang", model="m", engine_url="http://127.0.0.1:9", kv_events="tcp://127.0.0.1:9")
        )
    elif kind == "vllm":
        adapter = VllmAdapter(ShimConfig(engine="vllm", model="m", engine_url="http://127.0.0.1:9"))
    else:
        adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m"))
    await adapter.open()
    lost: list[str] = []
    probe: asyncio.Task[Any] = asyncio.create_task(runs_on(lost, "engine call"))
    adapter._late = probe
    await _cut_close(adapter, lost)
