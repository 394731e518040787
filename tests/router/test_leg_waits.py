"""A leg's reader waits under one timer kept armed across its waits (router.leg): a timer armed
for an earlier, shorter wait must not end a later one early, and silence still ends the leg."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.trace import INVALID_SPAN

from bench.leg_reads import IdleOwner
from protocol import GenerateRequest, ResponseChunk
from router.leg import Leg, LegError


def _leg() -> Leg:
    request = GenerateRequest(request_id="r", model="m", token_ids=[1, 2, 3])
    return Leg(IdleOwner(1 << 20), "1", "w", "agg", request, INVALID_SPAN, lambda prefilled: None)


def _chunk(seq: int, final: bool = False) -> ResponseChunk:
    return ResponseChunk(request_id="r", seq=seq, events=[b"{}"], tokens=1, final=final)


async def test_a_longer_wait_outlasts_the_timer_armed_for_a_shorter_one() -> None:
    loop = asyncio.get_running_loop()
    async with _leg() as leg:
        # The first wait arms the timer for 0.1 s; its chunk comes at 0.02 s.
        loop.call_later(0.02, leg.push, _chunk(0))
        assert (await leg.next(10.0, 0.1)).seq == 0
        # The next wait may last 1 s: its chunk at 0.3 s, past the first timer, still reaches it.
        loop.call_later(0.3, leg.push, _chunk(1, final=True))
        assert (await leg.next(10.0, 1.0)).seq == 1


async def test_silence_after_chunks_still_ends_the_leg() -> None:
    loop = asyncio.get_running_loop()
    async with _leg() as leg:
        for seq in range(3):
            loop.call_later(0.01, leg.push, _chunk(seq))
            assert (await leg.next(10.0, 0.2)).seq == seq
        start = loop.time()
        with pytest.raises(LegError) as raised:
            await leg.next(10.0, 0.2)
        assert raised.value.kind == "worker_silent"
        assert loop.time() - start >= 0.15  # its own window, not one cut short by an older timer


async def test_a_wait_shorter_than_the_armed_timer_ends_on_time() -> None:
    loop = asyncio.get_running_loop()
    async with _leg() as leg:
        loop.call_later(0.01, leg.push, _chunk(0))
        assert (await leg.next(10.0, 5.0)).seq == 0  # the timer is armed for 5 s
        with pytest.raises(LegError) as raised:
            await asyncio.wait_for(leg.next(10.0, 0.1), 2.0)  # a 0.1 s window re-arms it sooner
        assert raised.value.kind == "worker_silent"
