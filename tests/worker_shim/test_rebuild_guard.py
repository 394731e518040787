"""Rebuilds asked for unknown parents are held while rebuilding does not cure them.

An event the decoder cannot read is dropped, and its child names an unknown parent on every replay
too: before 2026-12-04 each rebuild's own replay asked for the next, at the ZMQ source's poll rate
(250 ms), each one a Cleared to every router, forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.config import EtcdSettings, NatsSettings
from tests.worker_shim.cluster import wait_for
from tests.worker_shim.test_zmq_events import StandIn
from worker_shim import EngineBatch, EngineStored, Normaliser
from worker_shim.adapters import zmq_events
from worker_shim.config import ShimConfig
from worker_shim.rebuild_guard import REBUILD_BACKOFF_MAX_S
from worker_shim.shim import WorkerShim

B = 4
HELD = "kvswitch_shim_kv_rebuilds_held_total"


def _shim(kv_events: str = "tcp://*:5557", kv_replay: str | None = None) -> WorkerShim:
    """A shim whose engine is on this host (the `*` endpoints' host), never started."""
    cfg = ShimConfig(
        engine="vllm", model="m", engine_url="http://127.0.0.1:1", kv_events=kv_events, kv_replay=kv_replay
    )
    return WorkerShim(cfg, NatsSettings(servers=["nats://127.0.0.1:1"]), EtcdSettings(endpoints=["http://127.0.0.1:1"]))


def _samples(shim: WorkerShim, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = shim.metrics_text().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def _held(shim: WorkerShim) -> float:
    return _samples(shim, HELD)[()]


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    s = StandIn("bs32", pub_binds=True)
    yield s
    s.close()


@contextlib.asynccontextmanager
async def _events(shim: WorkerShim, stand_in: StandIn) -> AsyncIterator[None]:
    """The shim's own ZMQ adapter against the stand-in, delivering to the shim's sink."""
    shim.normaliser = Normaliser(B, stats=shim.norm_stats)
    replay = asyncio.create_task(stand_in.serve_replay())
    live = asyncio.Event()
    run = asyncio.create_task(shim.adapter.run_events(shim._sink, live))
    try:
        await asyncio.wait_for(live.wait(), 5)
        await wait_for(lambda: shim.adapter._events._connections >= 1, 5, "SUB connected")  # type: ignore[attr-defined]
        await asyncio.sleep(0.2)  # ZMQ subscriptions propagate after the connection event
        yield
    finally:
        run.cancel()
        replay.cancel()
        for t in (run, replay):
            with contextlib.suppress(asyncio.CancelledError):
                await t


def _wire_stored(hash_: int, parent: int | None, tokens: object) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": [hash_],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": B,
    }


async def test_a_stored_event_the_shim_cannot_read_does_not_rebuild_at_poll_rate(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)  # no probe replay in the window
    monkeypatch.setattr(zmq_events, "QUIET_PROBE_S", 60.0)
    shim = _shim(stand_in.shim_endpoint, stand_in.replay_endpoint)
    asks: list[None] = []
    real = shim.adapter.request_rebuild

    def ask() -> None:
        asks.append(None)
        real()

    monkeypatch.setattr(shim.adapter, "request_rebuild", ask)
    unreadable = _wire_stored(1, None, 7)  # token_ids not a list: the decoder drops it
    child = _wire_stored(2, 1, [5, 6, 7, 8])
    frame = [b"kv-events", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [unreadable, child], 0])]
    with caplog.at_level(logging.WARNING):
        async with _events(shim, stand_in):
            stand_in.sent.append(frame)  # what the engine's replay holds from now on
            await stand_in.pub.send_multipart(frame)
            await wait_for(lambda: shim.norm_stats.unknown_parent >= 1, 5, "the child's unknown parent")
            await asyncio.sleep(1.5)  # six polls of the ZMQ source
    rebuilds = stand_in.replay_requests[1:]  # after the start's own replay
    # Was: a rebuild per poll, each replaying the same bytes (one Cleared to every router per poll).
    assert len(asks) == 1 and rebuilds == [0], (asks, rebuilds)
    assert shim.norm_stats.unknown_parent == 2  # the live child, then the same child replayed
    said = _errors(caplog)
    assert len(said) == 1 and "kvswitch_shim_kv_events_malformed_total" in said[0] and "held for 5s" in said[0]
    assert _held(shim) == 1.0


@pytest.mark.parametrize("root_type", ["BlockStoredV2", None], ids=["unknown-type", "no-type"])
async def test_a_root_of_an_unknown_type_or_none_is_counted_said_and_named_by_the_guard(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, root_type: str | None
) -> None:
    """Until 2026-12-07 both were dropped with no count and no word, and the guard's ERROR pointed
    at kvswitch_shim_kv_events_malformed_total, which read 0 (engine-side audit). A map without a
    type is malformed; an unknown type is counted by type and said once per type at WARNING."""
    monkeypatch.setattr(zmq_events, "SETTLE_S", 60.0)
    monkeypatch.setattr(zmq_events, "QUIET_PROBE_S", 60.0)
    shim = _shim(stand_in.shim_endpoint, stand_in.replay_endpoint)
    root = {k: v for k, v in _wire_stored(1, None, [1, 2, 3, 4]).items() if k != "type"}
    if root_type is not None:
        root["type"] = root_type
    with caplog.at_level(logging.WARNING):
        async with _events(shim, stand_in):
            for seq in range(3):
                child = _wire_stored(10 + seq, 1, [5, 6, 7, seq])
                frame = [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [root, child], 0])]
                stand_in.sent.append(frame)
                await stand_in.pub.send_multipart(frame)
            await wait_for(lambda: shim.norm_stats.unknown_parent >= 3, 5, "the children's unknown parent")
            await asyncio.sleep(0.5)
    unknown = _samples(shim, "kvswitch_shim_kv_events_unknown_type_total")
    malformed = _samples(shim, "kvswitch_shim_kv_events_malformed_total")[()]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if root_type is None:
        assert unknown == {} and malformed >= 3
        assert len([w for w in warnings if "not a string" in w]) == 1, warnings
    else:
        assert malformed == 0 and set(unknown) == {(("type", "BlockStoredV2"),)}
        assert unknown[(("type", "BlockStoredV2"),)] >= 3
        said = [w for w in warnings if "BlockStoredV2" in w]
        assert len(said) == 1 and "kvswitch_shim_kv_events_unknown_type_total" in said[0], warnings
    errors = _errors(caplog)
    assert errors and all("kvswitch_shim_kv_events_unknown_type_total" in e for e in errors), errors


# --- the guard at the shim's sink, on a clock of the test's ---------------------------------------


def _orphan(h: int = 2) -> EngineStored:
    return EngineStored(hashes=[h], parent=1, token_ids=[5, 6, 7, 8], block_size=B)


class _Sink:
    """A shim's sink on the test's clock, counting the rebuilds it asks its adapter for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        self.shim = _shim()
        self.shim.normaliser = Normaliser(B, stats=self.shim.norm_stats)
        self.shim.rebuild_guard.clock = lambda: self.now
        self.asks = 0
        monkeypatch.setattr(self.shim.adapter, "request_rebuild", self._ask)
        asyncio.run(self.shim._sink(EngineBatch(reset=True, complete=True, live=False)))

    def _ask(self) -> None:
        self.asks += 1

    def at(self, dt: float, *events: EngineStored, live: bool = True) -> int:
        """Deliver `events` dt seconds on; the rebuilds asked so far."""
        self.now += dt
        asyncio.run(self.shim._sink(EngineBatch(events=list(events), live=live)))
        return self.asks

    def rebuild(self, dt: float, *events: EngineStored) -> int:
        """The replay of a rebuild, dt seconds on: a complete reset and the engine's batches."""
        self.now += dt
        asyncio.run(self.shim._sink(EngineBatch(reset=True, complete=True, live=False)))
        return self.at(0.0, *events, live=False)


def test_rebuilds_back_off_while_the_replay_names_the_same_unknown_parent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    s = _Sink(monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert s.at(0.0, _orphan()) == 1  # a first unknown parent rebuilds at once
        assert s.rebuild(0.3, _orphan()) == 1  # its own replay did not cure it: held
        for _ in range(6):  # the source's polls, and live batches below the same parent
            assert s.at(0.25, _orphan()) == 1
        assert len(_errors(caplog)) == 1 and "held for 5s" in _errors(caplog)[0]
        assert s.at(3.3, _orphan()) == 2  # 5 s after the rebuild: another try
        assert s.rebuild(0.3, _orphan()) == 2  # not cured again: held twice as long
        assert s.at(9.0, _orphan()) == 2
        assert s.at(0.8, _orphan()) == 3
    assert [m.split("held for ")[1][:3] for m in _errors(caplog)] == ["5s ", "10s"]
    assert _held(s.shim) == 9.0


def test_a_genuine_unknown_parent_rebuilds_at_once_once_rebuilds_cure_or_things_go_quiet(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    s = _Sink(monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert s.at(0.0, _orphan()) == 1
        assert s.rebuild(0.3, _orphan()) == 1  # held: 5 s
        # Quiet for the longest backoff: a genuine gap then rebuilds at once, its replay cures it
        # (nothing is held), and another gap after the repeat window rebuilds at once too.
        assert s.at(REBUILD_BACKOFF_MAX_S, _orphan(3)) == 2
        assert s.rebuild(0.3) == 2
        assert s.at(6.0, _orphan(4)) == 3
    assert len(_errors(caplog)) == 1 and _held(s.shim) == 1.0


def test_another_unknown_parent_soon_after_a_rebuild_that_cured_the_first_rebuilds_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the same parent, unknown again after the rebuild it asked for, is one rebuilding cannot
    cure: a timing rule alone held this one and said at ERROR that the replay was at fault."""
    s = _Sink(monkeypatch)

    def root(h: int) -> EngineStored:
        return EngineStored(hashes=[h], parent=None, token_ids=[h, h, h, h], block_size=B)

    other = EngineStored(hashes=[9], parent=7, token_ids=[5, 6, 7, 8], block_size=B)
    with caplog.at_level(logging.WARNING):
        assert s.at(0.0, _orphan()) == 1  # parent 1 unknown: a rebuild
        assert s.rebuild(0.3, root(1), _orphan()) == 1  # its replay holds parent 1: cured
        assert s.at(2.7, other) == 2  # parent 7 unknown 3 s after: a rebuild of its own
        assert s.rebuild(0.3, root(1), _orphan(), root(7), other) == 2
    assert _errors(caplog) == [] and _held(s.shim) == 0.0
