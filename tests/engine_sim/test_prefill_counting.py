"""vllm:request_prefill_kv_computed_tokens and vllm:request_prefill_time_seconds are observed when
vLLM 0.32 observes them: as a request finishes (v1/metrics/loggers.py, per finished request), a
client's abort being no finish. Until 2026-12-05 engine_sim observed both at the first token, so
the virtual engines fed calibration a prompt's computed tokens and its cache hits (counted at
scheduling, as vLLM counts them) in the same interval, where vLLM's land seconds apart."""

from __future__ import annotations

from engine_sim import SimServer
from engine_sim.request import SimRequest
from engine_sim.scheduler import Scheduler
from tests.engine_sim.conftest import sim_config

SHARED = list(range(2000, 2064))  # 4 blocks


def _cached_then(s: Scheduler, rid: str, max_tokens: int) -> SimRequest:
    """A request of 84 tokens whose first 64 `s` caches (another request served them first)."""
    s.add_request(SimRequest("warm", [*SHARED, 1], max_tokens=1))
    while s.step().num_scheduled_tokens:
        pass
    req = SimRequest(rid, [*SHARED, *range(5000, 5020)], max_tokens=max_tokens)
    s.add_request(req)
    return req


def _counted(s: Scheduler) -> tuple[int, float]:
    h = s.stats.prefill_kv_computed
    return h.count, h.sum


def test_a_prompts_computed_tokens_are_counted_at_its_finish_not_its_first_token() -> None:
    s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64)
    _cached_then(s, "r", max_tokens=4)
    assert _counted(s) == (1, 65)  # the warm-up request, finished
    hits = s.stats.prefix_cache_hits
    first = s.step()
    assert [o.request_id for o in first.outputs] == ["r"] and first.outputs[0].finish_reason is None
    assert s.stats.prefix_cache_hits == hits + 64  # hits: at scheduling, as vLLM records them
    assert _counted(s) == (1, 65)  # old: (2, 85), counted with the first token
    while s.step().num_scheduled_tokens:
        pass
    assert _counted(s) == (2, 65 + 20)  # at its finish: its 84 tokens less the 64 it found cached


def test_an_engine_ended_request_counts_and_a_client_abort_does_not() -> None:
    for reason, counted in (("abort", None), ("stop", 20)):
        s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64)
        _cached_then(s, "r", max_tokens=8)
        s.step()  # its first token
        assert s.abort("r", reason)
        assert _counted(s) == ((1, 65) if counted is None else (2, 65 + counted)), reason
    # A failed KV load ends the request before any output: vLLM reports its whole prompt computed.
    s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64)
    s.add_request(SimRequest("d", list(range(100)), max_tokens=3, remote_prefill={"do_remote_prefill": True}))
    s.step()
    assert s.finish_remote_load("d", ok=False) is False
    assert _counted(s) == (1, 100) and s.stats.finished["error"] == 1


async def test_the_live_engine_observes_both_histograms_as_the_request_finishes() -> None:
    async with SimServer(sim_config(speedup=1.0)) as sim:
        st = sim.runner.scheduler.stats
        for rid, end in (("done", None), ("stop", "stop"), ("gone", "abort")):
            before = (st.prefill_time.count, st.prefill_kv_computed.count)
            stream = sim.runner.submit(SimRequest(rid, list(range(3000, 3040)), max_tokens=30))
            assert await stream.next_tokens()  # its first token is out; 29 more to come
            assert (st.prefill_time.count, st.prefill_kv_computed.count) == before, rid  # old: one each
            if end is None:
                await stream.result()
            else:
                sim.runner.abort(rid, end)
            added = 0 if end == "abort" else 1
            assert (st.prefill_time.count, st.prefill_kv_computed.count) == (before[0] + added, before[1] + added)
        assert st.prefill_time.sum > 0
