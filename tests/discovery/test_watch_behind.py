"""A watch created on a member a few ms behind the one its read asked: etcd's created answer carries
that member's revision, below the read's. Until a review of 2026-12-08 the watch took it for etcd's
data replaced and broke, re-read and yielded a second Snapshot (20 of 150 watches on 3 members
under puts); now a linearizable read confirms first, and only a revision still below breaks it.
The lag is made here by lowering the created answer's revision, as a member behind would send it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from etcd3aio import EtcdError

import discovery.watch as watch_module
from discovery import Discovery, Put, Snapshot
from protocol.config import EtcdSettings


def _first_created_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first stream's created answer comes from a member one revision behind the read."""
    real = watch_module._stream
    streams = []

    async def behind(*args: Any) -> AsyncGenerator[Any, None]:
        streams.append(args)
        async for wr in real(*args):
            if wr.created and len(streams) == 1:
                wr.header.revision -= 1
            yield wr

    monkeypatch.setattr(watch_module, "_stream", behind)


async def test_a_watch_created_on_a_member_behind_carries_on(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="discovery.watch")
    _first_created_behind(monkeypatch)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        await d.put_raw(f"/{ns}/w/a", b"1")
        watch = d.watch_raw(f"/{ns}/w/")
        assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
        following = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.2)  # the created answer has come
        await d.put_raw(f"/{ns}/w/b", b"2")
        event = await asyncio.wait_for(following, 5)
        assert isinstance(event, Put) and event.name == "b", f"the watch was made again: {event}"
        await watch.aclose()
    assert "made again" not in caplog.text


async def test_a_watch_created_where_etcds_revision_went_back_reads_anew(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The confirming read below the first read's revision too: etcd's data was replaced."""
    caplog.set_level(logging.INFO, logger="discovery.watch")
    _first_created_behind(monkeypatch)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        await d.put_raw(f"/{ns}/w/a", b"1")
        assert d.client.kv is not None
        real_get = d.client.kv.get
        counts: list[Any] = []

        async def went_back(*args: Any, **kwargs: Any) -> Any:
            resp = await real_get(*args, **kwargs)
            if kwargs.get("count_only") and not counts:
                counts.append(resp)
                resp.header.revision -= 1
            return resp

        monkeypatch.setattr(d.client.kv, "get", went_back)
        watch = d.watch_raw(f"/{ns}/w/")
        assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
        again = await asyncio.wait_for(anext(watch), 5)
        assert isinstance(again, Snapshot) and set(again.items) == {"a"}
        assert counts, "no confirming read"
        await watch.aclose()
    assert f"watch /{ns}/w/: made again; re-reading" in caplog.text


@pytest.mark.parametrize(
    ("error", "said", "waits"),
    [
        (TimeoutError, "went unanswered (5 tries, 2.25 s)", [0.25, 0.25, 0.25, 0.5, 1.0]),
        (EtcdError, "failed (EtcdError: refused)", [0.25]),
    ],
)
async def test_a_confirming_read_that_fails_reads_anew_at_once_in_short_waits(
    etcd_url: str,
    ns: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    error: type[Exception],
    said: str,
    waits: list[float],
) -> None:
    """The confirming read on a hung member: until a review of 2026-12-08 it waited 5 s, the watch
    passing nothing on, then slept 0.5 s and re-read in 5 s waits, why unsaid; now it tries short
    waits (SILENT_S in all at most), says why it failed, and re-reads at once in short waits."""
    caplog.set_level(logging.INFO, logger="discovery.watch")
    _first_created_behind(monkeypatch)
    prefix = f"/{ns}/w/"
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        await d.put_raw(f"{prefix}a", b"1")
        assert d.client.kv is not None
        real_get = d.client.kv.get
        counts: list[float] = []
        pages: list[float] = []

        async def failing(key: bytes, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("count_only"):
                counts.append(kwargs["timeout"])
                raise error("refused")  # a timeout: its wait spent unanswered
            if key == prefix.encode():
                pages.append(kwargs["timeout"])
            return await real_get(key, *args, **kwargs)

        monkeypatch.setattr(d.client.kv, "get", failing)
        watch = watch_module.watch_prefix(d.client, prefix, lambda raw: raw, retry_s=60)
        assert isinstance(await asyncio.wait_for(anext(watch), 5), Snapshot)
        again = await asyncio.wait_for(anext(watch), 10)  # not after retry_s
        assert isinstance(again, Snapshot) and set(again.items) == {"a"}
        await watch.aclose()
    assert counts == waits, "the confirming read's waits"
    assert pages == [5.0, 0.25], "the re-read's first wait: short after the confirming read failed"
    assert (
        f"watch {prefix}: made again, as the read confirming etcd's revision {said}; re-reading at once" in caplog.text
    )
