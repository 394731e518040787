from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

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


async def test_only_the_exact_key_counts_not_a_key_that_starts_with_it(etcd_url: str, ns: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        watcher = ConfigWatcher(d, base_cli={}, base_file={})
        it = aiter(watcher)
        await _next(it)
        await put_config(d, {"eff_isl_threshold": 512})
        assert (await _next(it)).conditional.eff_isl_threshold == 512
        await d.put_raw(f"/{ns}/config/router-canary", b'{"eff_isl_threshold": 7}')
        await d.delete(f"/{ns}/config/router-canary")
        await put_config(d, {"eff_isl_threshold": 256})
        after = await _next(it)  # the canary's put and delete yielded nothing
        assert after.conditional.eff_isl_threshold == 256 and watcher.rejected == 0


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b'{"overlap_weight": NaN}', "overlap_weight"),
        (b'{"temperature": Infinity}', "temperature"),
        (b'{"eff_isl_ratio_threshold": -Infinity}', "eff_isl_ratio_threshold"),
        (b'{"eff_isl_treshold": 100}', "eff_isl_treshold"),  # a typo must not pass for applied
        # Nested too deep for json.loads, and for the checks: RecursionError, no ValueError.
        (b'{"eff_isl_threshold": ' + b"[" * 5000 + b"]" * 5000 + b"}", "recursion"),
        (b'{"eff_isl_threshold": ' + b"[" * 900 + b"]" * 900 + b"}", "recursion"),
    ],
)
async def test_nan_infinity_and_unknown_keys_are_refused(etcd_url: str, ns: str, raw: bytes, named: str) -> None:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        watcher = ConfigWatcher(d, base_cli={}, base_file={})
        it = aiter(watcher)
        await _next(it)
        await d.put_raw(f"/{ns}/config/router", raw)
        await put_config(d, {"eff_isl_threshold": 300})
        assert (await _next(it)).conditional.eff_isl_threshold == 300
        assert watcher.rejected == 1 and named in watcher.last_error
        assert watcher.current.overlap_weight == 4.0 and watcher.current.temperature == 0.0


async def test_large_sibling_keys_are_never_read(etcd_url: str, ns: str) -> None:
    """The key was watched as a prefix: three 1.4 MB `router-canary-N` keys made its read larger than
    gRPC's 4 MiB, and a router never read its config (audit of 2026-12-07)."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        canaries = [f"/{ns}/config/router-canary-{i}" for i in range(3)]
        for key in canaries:
            await d.put_raw(key, b"x" * 1_400_000)
        try:
            await put_config(d, {"eff_isl_threshold": 512})
            watcher = ConfigWatcher(d, base_cli={}, base_file={})
            it = aiter(watcher)
            assert (await _next(it)).conditional.eff_isl_threshold == 512
            await d.put_raw(f"/{ns}/config/router", b'{"eff_isl_threshold": NaN}')
            await put_config(d, {"eff_isl_threshold": 256})
            assert (await _next(it)).conditional.eff_isl_threshold == 256
            assert watcher.rejected == 1 and watcher.reading.trouble() is None
        finally:
            for key in canaries:
                await d.delete(key)
