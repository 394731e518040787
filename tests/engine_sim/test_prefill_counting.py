"""vllm:request_prefill_kv_computed_tokens and vllm:request_prefill_time_seconds are observed when
vLLM 0.32 observes them: as a request finishes (v1/metrics/loggers.py, per finished request), a
client's abort being no finish. Until 2026-12-05 engine_sim observed both at the first token, so
the virtual engines fed calibration a prompt's computed tokens and its cache hits (counted at
scheduling, as vLLM counts them) in the same interval, where vLLM's land seconds apart."""

from __future__ import annotations

from bench.virtual.clock import VirtualClock
from bench.virtual.engine import VirtualEngine
from engine_sim import SimServer
from engine_sim.request import SimRequest
from engine_sim.runner import MAX_LAG
from engine_sim.scheduler import Scheduler, StepOutput
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


def _outputs(s: Scheduler) -> list[StepOutput]:
    """Every output until the engine idles."""
    outs: list[StepOutput] = []
    while (result := s.step()).num_scheduled_tokens:
        outs += result.outputs
    return outs


def test_a_prompts_computed_tokens_ride_its_first_output_to_be_counted_at_its_finish() -> None:
    s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64)
    _cached_then(s, "r", max_tokens=4)
    hits = s.stats.prefix_cache_hits
    first = s.step()
    assert [o.request_id for o in first.outputs] == ["r"] and first.outputs[0].finish_reason is None
    assert s.stats.prefix_cache_hits == hits + 64  # hits: at scheduling, as vLLM records them
    assert first.outputs[0].prefill_kv_computed == 20  # its 84 tokens less the 64 it found cached
    rest = _outputs(s)
    assert [o.prefill_kv_computed for o in rest] == [None] * 3 and rest[-1].finish_reason == "length"
    # The driver observes it with the prefill time as it delivers the finish (the runner's and the
    # virtual engine's _count_prefill), so the scheduler itself observes nothing: a step computed
    # but not delivered, or a request aborted in it, never counts one histogram without the other.
    assert s.stats.prefill_kv_computed.count == 0


def test_a_failed_kv_load_counts_its_whole_prompt_at_0s_on_both_engines() -> None:
    """vLLM reports the whole prompt computed for a request that ends before any output."""
    s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64)
    req = SimRequest("d", list(range(100)), max_tokens=3, remote_prefill={"do_remote_prefill": True})
    s.add_request(req)
    assert s.prefill_kv_computed_unserved(req) == 100
    clock = VirtualClock()
    eng = VirtualEngine(clock, Scheduler(num_gpu_blocks=64, kv_connector=True), peers={})
    outs: list[tuple[str, list[int], str | None]] = []
    eng.submit(
        SimRequest("d", list(range(100)), max_tokens=3, remote_prefill={"do_remote_prefill": True}),
        lambda out, at: outs.append((out.request_id, out.new_token_ids, out.finish_reason)),
    )
    clock.run()  # its pull finds no prefill engine: the request ends with an error
    h = eng.scheduler.stats.prefill_kv_computed
    assert eng.scheduler.stats.finished["error"] == 1
    assert (eng.timing.prefill_requests, eng.timing.prefill_s, h.count, h.sum) == (1, 0.0, 1, 100)
    # Its client hears the error as the live runner's stream ends (old: never told, and kept)
    assert outs == [("d", [], "error")]
    assert not eng._requests and not eng._sinks and not eng._scheduled_at


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


def _drop(out: StepOutput, at: float) -> None:
    pass


async def test_a_client_abort_in_the_step_that_finishes_its_request_counts_neither_histogram() -> None:
    """vLLM 0.32 ignores the output of a request its client aborted (output_processor.py: "Ignore
    output for already-aborted request"): neither histogram counts it. The old scheduler counted
    the computed tokens when it computed the finishing step, so a /metrics read during that step
    saw one more than the prefill times, and an abort in it left them apart for good.

    Steps are slowed to ~0.5 s, longer than the runner's MAX_LAG, so the finishing step is always
    slept for after the first token goes out: at 5 ms a late event loop ran it back to back and
    delivered the finish before this test could abort it (seen once under CI load)."""
    assert MAX_LAG < 0.4
    async with SimServer(sim_config(speedup=1.0, slowdown=100.0)) as sim:
        st = sim.runner.scheduler.stats
        for i in range(3):
            rid = f"r{i}"
            stream = sim.runner.submit(SimRequest(rid, list(range(3000 + 100 * i, 3040 + 100 * i)), max_tokens=2))
            assert await stream.next_tokens()  # token 1 of 2: the step that finishes it is computed, not delivered
            assert rid not in sim.runner.scheduler.requests
            assert st.prefill_time.count == st.prefill_kv_computed.count == 0, rid  # old: 0 and 1 (a torn read)
            sim.runner.abort(rid)  # the client goes away
        # The runner delivers steps in order, so the aborted finishes are all past once this one ends.
        assert await sim.runner.submit(SimRequest("last", list(range(4000, 4040)), max_tokens=2)).result()
        assert (st.prefill_time.count, st.prefill_kv_computed.count) == (1, 1)  # old: (1, 4), apart for good
        # request_success_total and e2e latency count with them (old: length 4, counted when computed)
        assert (dict(st.finished), st.e2e.count) == ({"length": 1}, 1)


def test_a_virtual_abort_during_a_step_leaks_nothing_and_counts_as_the_runner_does() -> None:
    clock = VirtualClock()
    eng = VirtualEngine(clock, Scheduler(num_gpu_blocks=512), peers={})
    for i in range(5):  # aborted while its first step (its prefill and first token) runs
        rid = f"a{i}"
        eng.submit(SimRequest(rid, list(range(10000 * i, 10000 * i + 300)), max_tokens=50), _drop)
        clock.after(1e-4, eng.abort, rid)
        clock.run()
    assert not eng._last_token_at and not eng._scheduled_at and not eng._prefill  # old: 5 each left behind
    firsts: list[float] = []

    def on_output(out: StepOutput, at: float) -> None:
        if not firsts:
            firsts.append(at)
            clock.after(1e-4, eng.abort, "b")  # during the step that finishes it

    eng.submit(SimRequest("b", list(range(300)), max_tokens=2), on_output)
    clock.run()
    h = eng.scheduler.stats.prefill_kv_computed
    assert firsts and (eng.timing.prefill_requests, h.count) == (0, 0)  # old: (1, 1), at 0 s
    assert not eng._last_token_at and not eng._prefill


def _prefilled_elsewhere(d_cached: bool) -> tuple[dict[str, object], Scheduler]:
    """P serves a 400-token prompt whose first 64 tokens it holds cached; D gets its params."""
    p = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=256, engine_id="p", kv_connector=True)
    prompt = [*SHARED, *range(7000, 7336)]
    p.add_request(SimRequest("warm", [*SHARED, 1], max_tokens=1))
    _outputs(p)
    p.add_request(SimRequest("pre", prompt, max_tokens=1, remote_decode=True))
    (out,) = _outputs(p)
    assert out.kv_transfer_params is not None
    d = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=256, engine_id="d", kv_connector=True)
    if d_cached:  # D holds more of the prompt than P found: vLLM still reports P's hits
        d.add_request(SimRequest("warm", [*prompt[:128], 1], max_tokens=1))
        _outputs(d)
    d.add_request(SimRequest("dec", prompt, max_tokens=3, remote_prefill=out.kv_transfer_params))
    return out.kv_transfer_params, d


def test_a_decode_request_fed_by_a_transfer_counts_as_vllm_counts_it() -> None:
    """vLLM 0.32: the prefill side returns its own prompt hits as `remote_prefill_cached_tokens`
    (v1/core/sched/scheduler.py), which the decode side's OutputProcessor reports as the prompt's
    cached tokens (output_processor.py), so D counts prompt less P's hits computed; and D's
    prefill time starts when it schedules the request after its KV arrived, not at the pull."""
    for d_cached in (False, True):
        params, d = _prefilled_elsewhere(d_cached)
        assert params["remote_prefill_cached_tokens"] == 64  # old: no such key
        start = d.step()
        assert start.transfers == [("dec", 400 - (128 if d_cached else 0))]
        assert "dec" not in start.started  # old: its prefill time started with the pull
        assert d.finish_remote_load("dec", ok=True)
        resumed = d.step()
        assert "dec" in resumed.started
        (first,) = resumed.outputs
        assert first.prefill_kv_computed == 400 - 64  # old: 0 (the whole prompt counted as D's hits)
        assert first.num_cached_tokens == 64  # usage's cached tokens: P's hits (old: D's own, 0 or 128)


def test_a_decode_request_without_the_prefill_engines_hits_reports_its_local_and_pulled_tokens() -> None:
    """vLLM 0.32's PrefillStats: cached = local hits + tokens the connector supplied, when the
    params name no `remote_prefill_cached_tokens` (an older prefill engine)."""
    params, d = _prefilled_elsewhere(d_cached=True)
    (req,) = d.requests.values()
    req.remote_prefill = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
    d.remote_cached.clear()
    d.step()
    assert d.finish_remote_load("dec", ok=True)
    (first,) = d.step().outputs
    # 128 local and 272 pulled: the NixlConnector loads the whole prompt (no backoff for plain
    # attention) and PrefillStats counts it all cached (old: 128)
    assert (first.num_cached_tokens, first.prefill_kv_computed) == (400, 0)


async def test_a_live_failed_kv_load_counts_the_prompt_less_the_prefill_engines_hits_at_0s() -> None:
    async with SimServer(sim_config(role="decode")) as sim:
        st = sim.runner.scheduler.stats
        params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_prefill_cached_tokens": 30}
        stream = sim.runner.submit(SimRequest("d", list(range(100)), max_tokens=3, remote_prefill=params))
        assert await stream.next_tokens() == [] and stream.finish_reason == "error"  # no prefill engine to pull from
        assert (st.prefill_time.count, st.prefill_time.sum) == (1, 0.0)
        assert (st.prefill_kv_computed.count, st.prefill_kv_computed.sum) == (1, 70)  # old: (1, 100)
        assert (dict(st.finished), st.e2e.count) == ({"error": 1}, 1)  # counted as one finish (old e2e: 0)
