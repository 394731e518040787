"""Replay fidelity against two real in-process sims: never early, arrival order kept, round-robin
over URLs, every request's prompt and output exactly as the workload says."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bench.replay import replay
from bench.trace import TokenSynth
from bench.workloads import WorkItem
from engine_sim import SimServer


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    async with SimServer(speedup=50.0, num_gpu_blocks=1024) as a, SimServer(speedup=50.0, num_gpu_blocks=1024) as b:
        yield [a, b]


def _items() -> list[WorkItem]:
    # Deliberately out of order in the list: replay sends by arrival time.
    arrivals = [0.0, 0.4, 0.1, 0.1, 0.25, 0.6]
    return [WorkItem(t, ((i, 40 + 16 * i),), 2 + i, f"w{i}") for i, t in enumerate(arrivals)]


async def test_requests_go_out_in_arrival_order_never_early_at_speed(sims: list[SimServer]) -> None:
    items = _items()
    run = await replay(items, [s.url for s in sims], speed=2.0, progress=False)
    assert [r.index for r in run.results] == list(range(len(items)))
    for item, r in zip(items, run.results, strict=True):
        assert r.ok, r.error
        assert r.due_s == pytest.approx(item.arrival_s / 2.0)
        assert r.sent_s >= r.due_s
        assert (r.prompt_tokens, r.output_tokens, r.tag) == (item.input_len, item.output_len, item.tag)
    by_send = sorted(run.results, key=lambda r: r.sent_s)
    assert [r.due_s for r in by_send] == sorted(r.due_s for r in run.results)
    # Round-robin in the order of sending, starting with the first URL.
    assert [r.url for r in by_send] == [sims[i % 2].url for i in range(len(items))]
    assert run.wall_s >= max(r.due_s for r in run.results)


async def test_the_engine_receives_the_synthesised_tokens(sims: list[SimServer]) -> None:
    item = WorkItem(0.0, ((3, 64), (4, 20)), 1, "x")
    run = await replay([item, item], [sims[0].url], speed=1.0, synth=TokenSynth(7), progress=False)
    assert all(r.ok for r in run.results)
    cached = sims[0].engine.cached_block_prefixes()
    expected = TokenSynth(7).expand(item.segments)
    assert expected[:80] in cached  # the engine cached the prompt's full blocks, token for token


async def test_replay_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one URL"):
        await replay([], [], progress=False)
    with pytest.raises(ValueError, match="--speed"):
        await replay([], ["http://127.0.0.1:1"], speed=0.0, progress=False)
