"""A watched prefix is read in pages at one revision: more than gRPC's 4 MiB receive limit of values
under it (each within etcd's 1.5 MiB) stalled the watch for good, its read failing every 0.5 s with a
multi-line WARNING each time (audit of 2026-12-07, etcd 3.4). A value too large for a read even alone
is left out naming its key, and a read that keeps failing is said once and held in a ReadHealth."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from etcd3aio import Etcd3Client
from etcd3aio.kv import KVService

from discovery import Discovery, Snapshot
from discovery.watch import watch_prefix
from protocol.config import EtcdSettings
from tests.router.polling import until

BIG = 1_400_000  # under etcd's 1.5 MiB request limit; three are over gRPC's 4 MiB


@pytest.fixture
async def disc(etcd_url: str, ns: str) -> AsyncIterator[Discovery]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        yield d
        assert d.client.kv is not None
        await d.client.kv.delete(f"/{ns}/", f"/{ns}0", timeout=5.0)  # the shared etcd keeps no megabytes


async def test_more_than_a_read_takes_under_a_prefix_is_read_in_pages(disc: Discovery) -> None:
    prefix = f"/{disc.ns}/big/"
    values = {f"big{i}": bytes([65 + i]) * BIG for i in range(3)} | {"small": b"x"}
    for name, value in values.items():
        await disc.put_raw(prefix + name, value)
    watch = disc.watch_raw(prefix)
    snapshot = await asyncio.wait_for(anext(watch), 10)
    await watch.aclose()
    assert isinstance(snapshot, Snapshot)
    assert snapshot.items == values and not snapshot.skipped


async def test_a_value_too_large_for_a_read_alone_is_skipped_naming_its_key(disc: Discovery, etcd_url: str) -> None:
    prefix = f"/{disc.ns}/big/"
    await disc.put_raw(prefix + "a", b"a")
    await disc.put_raw(prefix + "huge", b"h" * BIG)
    await disc.put_raw(prefix + "z", b"z")
    client = Etcd3Client()  # a receive limit of 1 MB, as a client whose limit etcd's exceeds
    client._manager.target = "ipv4:" + etcd_url.removeprefix("http://")
    client._manager.grpc_options.append(("grpc.max_receive_message_length", 1_000_000))
    await client.connect()
    try:
        watch = watch_prefix(client, prefix, lambda raw: raw, log_skipped=False)
        snapshot = await asyncio.wait_for(anext(watch), 10)
        await watch.aclose()
    finally:
        await client.close()
    assert isinstance(snapshot, Snapshot)
    assert snapshot.items == {"a": b"a", "z": b"z"}
    assert list(snapshot.skipped) == ["huge"] and "too large for one read" in snapshot.skipped["huge"]


async def test_a_failing_read_is_said_once_in_one_line_and_held_until_it_works(
    disc: Discovery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from discovery.watch import ReadHealth  # here: the module's other tests run on older code too

    prefix = f"/{disc.ns}/flaky/"
    tries = 0
    get = KVService.get

    async def failing(self: KVService, key: Any, *args: Any, **kw: Any) -> Any:
        nonlocal tries
        if key in (prefix, prefix.encode()) and tries < 4:
            tries += 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="boom"
            )
        return await get(self, key, *args, **kw)

    monkeypatch.setattr(KVService, "get", failing)
    health = ReadHealth(after_s=0.05)
    caplog.set_level(logging.INFO, logger="discovery.watch")
    watch = watch_prefix(disc.client, prefix, lambda raw: raw, retry_s=0.05, health=health)
    first = asyncio.ensure_future(anext(watch))
    await until(lambda: tries >= 2, what="two failed reads")
    assert health.why == "UNAVAILABLE: boom"
    await until(lambda: health.trouble() is not None, what="the failure named")
    assert "has failed for" in (health.trouble() or "") and "UNAVAILABLE: boom" in (health.trouble() or "")
    assert isinstance(await asyncio.wait_for(first, 10), Snapshot)
    await watch.aclose()
    said = [r.getMessage() for r in caplog.records if prefix in r.getMessage()]
    assert tries == 4 and len(said) == 2, said  # once when it fails, once when it works again
    assert said[0] == f"watch {prefix}: reading it failed (UNAVAILABLE: boom); retrying, said again once it works"
    assert "works again" in said[1] and health.trouble() is None and health.since is None
