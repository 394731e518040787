from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from discovery import ConfigWatcher, Discovery, put_config
from protocol.config import EtcdSettings, RouterSettings


async def _next(it: AsyncIterator[RouterSettings]) -> RouterSettings:
    return await asyncio.wait_for(anext(it), 10)


async def test_valid_change_applies_and_invalid_change_keeps_previous(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        watcher = ConfigWatcher(d, base_cli={"eff_isl_threshold": 1000}, base_file={})
        it = aiter(watcher)
        start = await _next(it)
        assert start.conditional.eff_isl_threshold == 1000

        await put_config(d, {"eff_isl_threshold": 512, "conditional_disagg": True})
        changed = await _next(it)
        assert changed.conditional.eff_isl_threshold == 512 and changed.conditional.conditional_disagg

        await put_config(d, {"eff_isl_ratio_threshold": 3.0})
        await put_config(d, {"conditional_disagg_policy": "nope"})
        await put_config(d, {"eff_isl_threshold": 256})
        after = await _next(it)  # only the valid one yields
        assert after.conditional.eff_isl_threshold == 256
        assert after.conditional.eff_isl_ratio_threshold == 0.7
        assert watcher.rejected == 2
        assert "conditional_disagg_policy" in watcher.last_error

        await d.delete(f"/{ns}/config/router")
        back = await _next(it)
        assert back.conditional.eff_isl_threshold == 1000 and not back.conditional.conditional_disagg


async def test_invalid_config_at_start_keeps_the_base(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        await d.put_raw(f"/{ns}/config/router", b"[1, 2]")
        watcher = ConfigWatcher(d, base_cli={}, base_file={})
        first = await _next(aiter(watcher))
        assert first == RouterSettings().validate()
        assert watcher.rejected == 1 and "JSON object" in watcher.last_error
