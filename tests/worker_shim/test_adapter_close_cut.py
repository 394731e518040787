"""An engine adapter's close cancelled again while it waits on its own tasks (the SGLang adapter's
prefill requests, the TensorRT-LLM adapter's /metrics read): cancel_and_wait passes the cut on and
raises it once they ended, and `super().close()` after it was skipped, the HTTP session left
open. It now runs though the wait was cut (runtime.StopSteps),
and the cut is raised after it."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.lost_cancellation import cut_while_it_waits, runs_on
from worker_shim.adapters.sglang import SglangAdapter
from worker_shim.adapters.trtllm import TrtllmAdapter
from worker_shim.config import ShimConfig


async def _cut_close(adapter: SglangAdapter | TrtllmAdapter, lost: list[str]) -> None:
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
