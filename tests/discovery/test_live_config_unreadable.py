"""A live config value too large to read is refused, the last settings kept: the watch reads it as
absent and says why (`Snapshot.skipped`, `Deleted.why`), and until a review of 2026-12-08 the
watcher took it for the key deleted, the router back on its base settings and nothing counted."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncGenerator
from typing import cast

from discovery import ConfigWatcher, Deleted, Discovery, Put, Snapshot, WatchEvent
from discovery.watch import ReadHealth

TOO_LARGE = "its value is too large for one read (RESOURCE_EXHAUSTED: received message larger than max)"


def _fed(events: asyncio.Queue[WatchEvent[bytes]]) -> Discovery:
    """A Discovery whose watch of the config key yields `events`."""

    async def watch_key(key: str, health: ReadHealth | None = None) -> AsyncGenerator[WatchEvent[bytes], None]:
        while True:
            yield await events.get()

    return cast(Discovery, types.SimpleNamespace(ns="ns", watch_key=watch_key))


async def test_a_value_too_large_to_read_is_refused_keeping_the_last_settings() -> None:
    events: asyncio.Queue[WatchEvent[bytes]] = asyncio.Queue()
    watcher = ConfigWatcher(_fed(events), base_cli={"eff_isl_threshold": 1000}, base_file={})
    it = aiter(watcher)
    events.put_nowait(Snapshot({"": b'{"eff_isl_threshold": 512}'}, 1))
    assert (await asyncio.wait_for(anext(it), 5)).conditional.eff_isl_threshold == 512

    events.put_nowait(Snapshot({}, 2, skipped={"": TOO_LARGE}))  # a watch made again, the value grown
    kept = await asyncio.wait_for(anext(it), 5)
    assert kept.conditional.eff_isl_threshold == 512
    assert watcher.rejected == 1 and watcher.refused_now and "too large" in watcher.last_error

    # Defensive: watch_key's parser takes any bytes and a value too large breaks the stream (a
    # re-read, a Snapshot as above), so no Deleted with why comes from it; one made by hand here.
    events.put_nowait(Deleted("", 3, why=TOO_LARGE))
    events.put_nowait(Put("", b'{"eff_isl_threshold": 256}', 4))
    assert (await asyncio.wait_for(anext(it), 5)).conditional.eff_isl_threshold == 256, "the base came back"
    assert watcher.rejected == 2 and not watcher.refused_now

    events.put_nowait(Deleted("", 5))  # deleted: back to the settings the process started with
    assert (await asyncio.wait_for(anext(it), 5)).conditional.eff_isl_threshold == 1000


async def test_a_value_too_large_to_read_at_start_is_refused() -> None:
    events: asyncio.Queue[WatchEvent[bytes]] = asyncio.Queue()
    watcher = ConfigWatcher(_fed(events), base_cli={"eff_isl_threshold": 1000}, base_file={})
    events.put_nowait(Snapshot({}, 1, skipped={"": TOO_LARGE}))
    first = await asyncio.wait_for(anext(aiter(watcher)), 5)
    assert first.conditional.eff_isl_threshold == 1000
    assert watcher.rejected == 1 and watcher.refused_now and watcher.last_error == TOO_LARGE
