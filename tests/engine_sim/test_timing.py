"""The timing model against the H200 profiles, and an isolated request's latencies end to end."""

from __future__ import annotations

import gc
import itertools
import time

import aiohttp
import pytest

from engine_sim import SimServer, TimingModel, load_profile
from engine_sim.timing import fit_marginal, mixed_marginals
from tests.engine_sim.conftest import sim_config

# Wall-clock latencies: run serially, away from the parallel suite's CPU load (see Makefile).
pytestmark = pytest.mark.timing

LLAMA = "h200:llama-3.1-8b"


@pytest.mark.parametrize("profile", [LLAMA, "h200:qwen2.5-32b"])
def test_model_reproduces_every_profile_point(profile: str) -> None:
    tm, prof = TimingModel.for_profile(profile), load_profile(profile)
    for n, c, secs in prof.prefill:
        assert tm.prefill(n, c) == pytest.approx(secs, rel=1e-9)
        assert tm.step(0, 0, [(n, c)]) == pytest.approx(secs, rel=1e-9)
    for b, ctx, secs in prof.decode:
        assert tm.decode(b, ctx) == pytest.approx(secs, rel=1e-9)
        assert tm.step(b, ctx, []) == pytest.approx(secs, rel=1e-9)


def test_interpolation_is_monotone_between_points() -> None:
    tm = TimingModel.for_profile(LLAMA)
    assert tm.prefill(1024, 0) < tm.prefill(1536, 0) < tm.prefill(2048, 0)
    assert tm.prefill(2048, 0) < tm.prefill(2048, 2048) < tm.prefill(2048, 4096)
    assert tm.decode(32, 1024) < tm.decode(48, 1024) < tm.decode(64, 1024)
    assert tm.prefill(65536, 0) > tm.prefill(32768, 0)  # extrapolates past the table


def test_mixed_marginal_fit_error_is_bounded() -> None:
    """The fitted marginal cost of a prefill chunk beside a decode batch, against h200_mixed.json."""
    fit = fit_marginal()
    rows = mixed_marginals()
    errors = [abs(fit(n, c, b) - m) for b, _, n, c, m in rows]
    assert len(rows) == 48
    assert sum(errors) / len(errors) < 0.0025  # mean absolute error < 2.5 ms
    assert max(errors) < 0.012
    # Chunks of 2048 tokens (what a busy engine schedules) are within 15% everywhere; smaller ones
    # carry the eager profile's noise (docs/engine_sim.md lists every point).
    big = [(fit(n, c, b), m) for b, _, n, c, m in rows if n >= 2048]
    assert all(abs(p - m) / m < 0.15 for p, m in big)


def test_mixed_step_costs_decode_plus_marginal() -> None:
    tm = TimingModel.for_profile(LLAMA)
    alone = tm.decode(64, 1024)
    mixed = tm.step(64, 1024, [(1024, 0)])
    assert mixed == pytest.approx(alone + tm.marginal(1024, 0, 64))
    assert 0.015 < mixed - alone < 0.025  # h200_mixed.json measured +19.2 ms for this shape


def test_transfer_time_is_bytes_over_bandwidth() -> None:
    tm = TimingModel.for_profile(LLAMA)
    assert tm.transfer(1000, 50.0) == pytest.approx(1000 * 131072 / 50e9)


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
