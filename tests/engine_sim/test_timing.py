"""An isolated request's latencies end to end against the timing model (the model itself:
tests/protocol/test_timing.py)."""

from __future__ import annotations

import gc
import itertools
import time

import aiohttp
import pytest

from engine_sim import SimServer
from protocol.timing import TimingModel
from tests.engine_sim.conftest import sim_config

# Wall-clock latencies: run serially, away from the parallel suite's CPU load (see Makefile).
pytestmark = pytest.mark.timing

LLAMA = "h200:llama-3.1-8b"


async def _isolated(sim: SimServer, prompt_len: int, max_tokens: int) -> tuple[float, list[float]]:
    """Client-side TTFT and the gaps between streamed tokens."""
    body = {"prompt": list(range(1000, 1000 + prompt_len)), "max_tokens": max_tokens, "stream": True}
    arrivals: list[float] = []
    gc.collect()  # garbage left by earlier tests must not be collected inside the measured request
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(sim.url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.perf_counter())
    return arrivals[0] - t0, [b - a for a, b in itertools.pairwise(arrivals)]


@pytest.mark.parametrize(
    ("prompt_len", "speedup"), [(1024, 1.0), (4096, 1.0), (8192, 1.0), (8192, 10.0), (16384, 10.0)]
)
async def test_isolated_request_ttft_and_itl_match_profile(prompt_len: int, speedup: float) -> None:
    tm = TimingModel.for_profile(LLAMA)
    n_tokens = 12
    async with SimServer(sim_config(speedup=speedup, num_gpu_blocks=2048)) as sim:
        client_ttft, gaps = await _isolated(sim, prompt_len, n_tokens)
        st = sim.engine.stats
    want_ttft = tm.prefill(prompt_len, 0)  # the profile's number, in H200 seconds
    want_itl = tm.decode(1, prompt_len + n_tokens / 2)
    # What the engine reports (vllm:time_to_first_token_seconds, inter_token_latency), simulated seconds.
    assert st.ttft.count == 1 and abs(st.ttft.sum - want_ttft) < 0.1 * want_ttft, (st.ttft.sum, want_ttft)
    assert st.itl.count == n_tokens - 1
    assert abs(st.itl.sum / st.itl.count - want_itl) < 0.1 * want_itl, (st.itl.sum / st.itl.count, want_itl)
    # What a client sees, in wall seconds: never less than the model scaled by the speedup; more by
    # HTTP, the sim's own parsing and hashing of the prompt (~1 us per token) and, on a loaded CI
    # machine, by however long the OS deschedules the process, so the upper bound is loose.
    assert want_ttft / speedup * 0.9 < client_ttft < want_ttft / speedup * 1.1 + 0.1 + 2e-6 * prompt_len
    if speedup == 1.0:  # at 10x the loop sends tokens due within 1 ms together (runner.QUANTUM)
        median_gap = sorted(gaps)[len(gaps) // 2]
        assert abs(median_gap - want_itl) < 0.1 * want_itl + 0.001, (median_gap, want_itl)


async def test_slowdown_fault_stretches_steps() -> None:
    async with SimServer(sim_config(speedup=2.0, slowdown=3.0)) as sim:
        await _isolated(sim, 2048, 2)
        assert sim.engine.stats.ttft.sum == pytest.approx(3 * TimingModel.for_profile(LLAMA).prefill(2048), rel=0.1)
