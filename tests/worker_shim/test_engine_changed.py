"""What the shim takes for an engine changed on reconnection is judged against what its session
found: an SGLang serving --model under another name (allowed, with a WARNING) or a /v1/models left
unread where that is allowed ended every session whose event socket reconnected before its first
batch, and the worker registered anew under a new id (final read of 2026-12-07)."""

from __future__ import annotations

import pytest

from protocol.config import EtcdSettings, NatsSettings
from worker_shim.adapters.base import EngineLimits, ModelCard
from worker_shim.config import ShimConfig
from worker_shim.shim import WorkerShim


async def _changed(
    monkeypatch: pytest.MonkeyPatch, found: dict[str, ModelCard] | None, now: dict[str, ModelCard] | None
) -> str | None:
    cfg = ShimConfig(engine="sglang", model="m", engine_url="http://127.0.0.1:1", kv_events="tcp://127.0.0.1:2")
    shim = WorkerShim(cfg, NatsSettings(servers=["nats://127.0.0.1:1"]), EtcdSettings(endpoints=["http://127.0.0.1:1"]))
    listings = [found, now]

    async def served_models() -> dict[str, ModelCard] | None:
        return listings.pop(0)

    async def engine_limits() -> object:
        return shim._reported

    monkeypatch.setattr(shim.adapter, "served_models", served_models)
    monkeypatch.setattr(shim, "_engine_limits", engine_limits)
    shim.limits = EngineLimits(max_model_len=await shim._served_model_len())
    return await shim._engine_changed()


async def test_an_engine_that_lists_other_names_as_it_did_has_not_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    other = {"served-name": ModelCard(max_model_len=4096)}
    assert await _changed(monkeypatch, other, other) is None


async def test_an_engine_whose_models_stay_unread_has_not_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert await _changed(monkeypatch, None, None) is None


async def test_an_engine_that_stops_listing_the_model_has_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = {"m": ModelCard(max_model_len=4096)}
    assert await _changed(monkeypatch, listed, {"served-name": ModelCard()}) == "it no longer lists --model m"
    assert await _changed(monkeypatch, listed, None) == "its /v1/models could not be read again at http://127.0.0.1:1"
    assert await _changed(monkeypatch, listed, {"m": ModelCard(max_model_len=8192)}) == (
        "--model's max_model_len went from 4096 to 8192"
    )
