"""/metrics: vLLM's names, types and labels, and values that follow the workload."""

from __future__ import annotations

import re

import aiohttp

from engine_sim import SimServer
from engine_sim.request import SimRequest
from engine_sim.runner import MAX_LAG
from tests.engine_sim.conftest import sim_config
from tests.protocol.vllm_captures import CAPTURES, fixture_lines, fixture_path
from tests.router.polling import until

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$")


def parse(text: str) -> dict[str, dict[str, float]]:
    """name -> {label string -> value}."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return out


def label_keys(series: dict[str, float]) -> set[tuple[str, ...]]:
    return {tuple(sorted(re.findall(r"(\w+)=", k))) for k in series}


def types(text: str) -> dict[str, str]:
    return {p[2]: p[3] for p in (line.split() for line in text.splitlines() if line.startswith("# TYPE"))}


async def scrape(sim: SimServer) -> str:
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


def one(samples: dict[str, dict[str, float]], name: str) -> float:
    (value,) = samples[name].values()
    return value


async def test_metric_names_types_and_labels_match_vllm(sim: SimServer) -> None:
    captured = fixture_path("metrics_after.txt").read_text()
    ours = await scrape(sim)
    cap_types, our_types = types(captured), types(ours)
    wanted = [
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:cache_config_info", "vllm:prefix_cache_queries_created",
        "vllm:iteration_tokens_total", "vllm:request_prefill_time_seconds", "vllm:request_prefill_kv_computed_tokens",
        "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
        "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_cached_by_source_total",
    ]  # fmt: skip
    for name in wanted:
        assert our_types.get(name) == cap_types[name], name
    cap, mine = parse(captured), parse(ours)
    for name in ("vllm:num_requests_running", "vllm:prefix_cache_hits_total", "vllm:request_success_total"):
        assert label_keys(mine[name]) == label_keys(cap[name]), name
    for name in ("vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_by_source_total"):
        assert set(mine[name]) == {k.replace("tiny-llama", "sim-llama") for k in cap[name]}, name
    for histogram in ("time_to_first_token_seconds", "iteration_tokens_total", "request_prefill_time_seconds"):
        name = f"vllm:{histogram}_bucket"
        assert set(mine[name]) == {k.replace("tiny-llama", "sim-llama") for k in cap[name]}, name
    (info,) = mine["vllm:cache_config_info"]
    assert f'num_gpu_blocks="{sim.config.num_gpu_blocks}"' in info and 'block_size="16"' in info


async def test_shared_prefix_workload_reports_hit_counts(sim: SimServer) -> None:
    shared = list(range(2000, 2064))  # 4 blocks
    async with aiohttp.ClientSession() as s:
        for i in range(3):
            body = {"prompt": shared + list(range(5000 + 100 * i, 5000 + 100 * i + 20)), "max_tokens": 2}
            async with s.post(sim.url + "/v1/completions", json=body) as r:
                assert r.status == 200
    m = parse(await scrape(sim))
    assert one(m, "vllm:prefix_cache_queries_total") == 3 * 84
    assert one(m, "vllm:prefix_cache_hits_total") == 2 * 64  # the 2nd and 3rd hit the 4 shared blocks
    assert one(m, "vllm:prompt_tokens_total") == 3 * 84
    assert one(m, "vllm:prompt_tokens_cached_total") == 2 * 64
    by_source = {
        k.split('source="')[1].rstrip('"}'): v for k, v in m["vllm:prompt_tokens_cached_by_source_total"].items()
    }
    assert by_source == {"device": 2 * 64, "host": 0, "p2p": 0, "disk": 0, "external_unspecified": 0}
    # An agg sim is an engine without a KV connector: nothing asked of one.
    assert one(m, "vllm:external_prefix_cache_queries_total") == one(m, "vllm:external_prefix_cache_hits_total") == 0
    assert one(m, "vllm:generation_tokens_total") == 6
    assert m["vllm:request_success_total"]['{engine="0",finished_reason="length",model_name="sim-llama"}'] == 3
    assert one(m, "vllm:time_to_first_token_seconds_count") == 3
    assert one(m, "vllm:inter_token_latency_seconds_count") == 3
    # As vLLM 0.32 counts them (the fixture's iteration-token sum is computed prompt + generated
    # tokens): one prefill step and one decode step per request, all six sampling a token.
    computed = 3 * 84 - 2 * 64
    assert one(m, "vllm:request_prefill_kv_computed_tokens_sum") == computed
    assert one(m, "vllm:request_prefill_kv_computed_tokens_count") == 3
    assert one(m, "vllm:iteration_tokens_total_sum") == computed + 6
    assert one(m, "vllm:iteration_tokens_total_count") == 6
    assert one(m, "vllm:request_prefill_time_seconds_count") == 3
    assert 0 < one(m, "vllm:request_prefill_time_seconds_sum") <= one(m, "vllm:time_to_first_token_seconds_sum")
    assert one(m, "vllm:num_requests_running") == 0 and one(m, "vllm:kv_cache_usage_perc") == 0.0


async def test_preemptions_and_usage_are_reported() -> None:
    async with SimServer(sim_config(num_gpu_blocks=7, max_num_batched_tokens=512)) as sim:
        async with aiohttp.ClientSession() as s:

            async def go(base: int) -> None:
                body = {"prompt": list(range(base, base + 40)), "max_tokens": 30}
                async with s.post(sim.url + "/v1/completions", json=body) as r:
                    assert r.status == 200

            import asyncio

            await asyncio.gather(go(1000), go(3000))
        m = parse(await scrape(sim))
    assert one(m, "vllm:num_preemptions_total") >= 1


async def test_the_step_series_move_when_a_step_ends_as_vllms_do() -> None:
    """vLLM 0.32 records its gauges and per-step counters with a step's outputs, after the step ran
    (scheduler.py make_stats, loggers.py record): a scrape during a step shows the step before.
    Until 2026-12-05 engine_sim counted a step when it computed it and read its gauges live, so a
    scrape in the middle of a long step already held its tokens and showed a request that was
    still running as gone; the routers' calibration read engines differently from vLLM's (the
    engine_metrics audit: k_d 12-45% apart). Steps of 0.5-0.7 s here, so each scrape is mid-step."""
    async with SimServer(sim_config(speedup=1.0, slowdown=100.0)) as sim:
        st = sim.runner.scheduler.stats
        keys = ("vllm:num_requests_running", "vllm:generation_tokens_total", "vllm:iteration_tokens_total_count",
                "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total")  # fmt: skip

        async def shown() -> tuple[float, ...]:
            m = parse(await scrape(sim))
            return tuple(one(m, k) for k in keys)

        async def computed(steps: int) -> None:  # the runner computed the step and sleeps its modelled time
            await until(lambda: st.steps >= steps, what=f"step {steps} computed")

        assert MAX_LAG < 0.5
        stream = sim.runner.submit(SimRequest("r", list(range(3000, 3040)), max_tokens=2))
        await computed(1)
        assert await shown() == (0, 0, 0, 0, 0)  # old: (1, 1, 1, 40, 40)
        assert await stream.next_tokens()
        assert await shown() == (1, 1, 1, 40, 40)
        await computed(2)  # its last step: the request left the scheduler's running list
        assert await shown() == (1, 1, 1, 40, 40)  # old: (0, 2, 2, 40, 40)
        await stream.result()
        assert await shown() == (0, 2, 2, 40, 40)


async def test_an_engine_with_nothing_to_compute_shows_its_state_now() -> None:
    """vLLM 0.32 steps on while it holds any request, and an empty step sends its stats too: a
    request waiting for its KV pull shows as waiting, and once its client leaves, as gone (review
    of b18df07: the sim published only after steps that computed, so it showed 0 during the pull
    and kept showing 1 after the abort)."""
    stale = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "x",
             "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}  # fmt: skip
    async with SimServer(sim_config(role="decode", speedup=1.0, kv_transfer_gbps=0.001)) as sim:
        sim.runner.submit(SimRequest("b", list(range(3000, 3300)), max_tokens=2, remote_prefill=stale))

        async def waiting() -> float:
            return one(parse(await scrape(sim)), "vllm:num_requests_waiting")

        await until(lambda: bool(sim.engine.waiting), what="the pull to start")
        assert await waiting() == 1  # old: 0 until a step computed something
        sim.runner.abort("b")
        for _ in range(100):
            if await waiting() == 0:
                break
        assert await waiting() == 0  # old: 1 for good


async def test_metrics_content_type_is_the_one_vllm_sent(sim: SimServer) -> None:
    """The captures' GET /metrics Content-Type (vLLM's route is prometheus_fastapi_instrumentator's,
    which ignores Accept), with no Accept and with Prometheus's scrape Accept header. The sim's
    followed its own prometheus_client's CONTENT_TYPE_LATEST, which need not be vLLM's."""
    sent = {
        entry["resp_headers"]["content-type"]
        for variant in CAPTURES
        for entry in fixture_lines("requests_log.jsonl", variant)
        if entry.get("path") == "/metrics" and entry.get("status") == 200
    }
    assert len(sent) == 1, sent
    scrape_accept = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Accept": scrape_accept}):
            async with s.get(sim.url + "/metrics", headers=headers) as r:
                assert r.status == 200 and {r.headers["Content-Type"]} == sent, headers
