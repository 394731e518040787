"""Router benchmarks (docs/router.md, "Figures").

1. Routing decision latency: tokenise + hash + index match + select + policy, in-process, for
   2k- and 8k-token text prompts against an index of `--workers` workers, each holding prefixes;
   and for a 4k-token id prompt, from the request body's bytes (JSON, validation) to the plan;
   then `take_ids_4096`: the request path's planning of those ids (admission's room rule,
   selection, policy, booking; calibrating), bookings freed after each. `--workers 1000` is the
   fleet size the index is sized for (docs/router.md, "Planning at 1,000 workers").
2. Router overhead: streaming TTFT through a router replica minus TTFT sent straight to the same
   simulated engines, p50 and p99, at open-loop rates (default 50, 200, 500 req/s). The cluster
   (nats, etcd, sims with their shims, one router) runs in subprocesses, so the router does not
   share this process's CPU; both sides are measured in the same run. Every process runs uvloop,
   as `kvswitch` services do.

3. Registrations: a fleet of N workers registering one at a time (each shim puts its own etcd
   key), fed in-process to the router's worker registry as single Put events: CPU for all N, per
   put, and per put against the smallest fleet (1.0 where a put costs the same however many are
   registered); `with_reads` reads `workers()` after each put too, as a request per put would.

4. Prefill room: slo_aware's `slo_prefill_fit` rule (router.policies.PrefillRoom) asked of every
   prefill worker past the backlog bound, on each request: Planner.take of one long uncached prompt
   with `--prefill` prefill workers all 40 k tokens queued (past the 1 s bound, within the fit),
   beside 4 decode workers, with the rule on (0.8) and off (0); a fresh request each time, so the
   rule's per-request memo starts empty.

5. Pending prefixes: one prompt's bookkeeping in router.pending_prefixes, on a worker already
   holding 400 other claims' entries (102,400): booking, settling and confirming `--blocks` blocks
   (a request served), and booking and withdrawing them (an attempt that failed before its
   prefill); timeit, the best of 9 runs of 2,000.

6. Replica snapshots (router.replica_sync, docs/router.md "Lost releases"): `--routers` replicas
   each with `--bookings` live bookings on 16 workers; what one replica's snapshot costs its sender
   to take and encode, and a peer to read, each part (the loop's longest hold) and whole, every
   booking held as stated (the steady case); and a request's book + prefill_done + free in a load
   view holding them all (the hot path beside them). In-process, through ReplicaSync's own
   `_snapshot` and `_on_payload`, no NATS; medians of 9 (a part's, of every part of 7 reads).

7. Streamed requests' router CPU: `--requests` completions of `--isl` token ids and `--osl` tokens,
   `--concurrency` at a time (closed loop), through a router started from each of `--trees` in
   turn (alternating, `--repeats` each) in front of the same two agg sims and shims; the router's
   CPU (utime + stime from /proc) per answered request and per streamed chunk, a warm-up of one
   request per lane first. `--py-spy` records each router's raw stacks (native frames, 250 Hz;
   bench.flame.Recording: a flame graph beside them) and `--cprofile` runs it under cProfile, both
   into the tree's bench/out/ (figures not to quote).

    .venv/bin/python -m bench.bench_router decision
    .venv/bin/python -m bench.bench_router overhead --rates 50,200,500 --seconds 5
    .venv/bin/python -m bench.bench_router registrations --sizes 250,500,1000
    .venv/bin/python -m bench.bench_router prefill-room --prefill 16 --isl 128000
    .venv/bin/python -m bench.bench_router pending --blocks 256
    .venv/bin/python -m bench.bench_router snapshots --routers 2,4,8 --bookings 5000
    .venv/bin/python -m bench.bench_router stream-cpu --trees /before,/after --speedup 1 --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
import timeit
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import uvloop

from discovery import Discovery, Put, Snapshot
from kvswitch.flags import FlagParser
from protocol import LoadReport, WorkerInfo, block_hashes
from protocol.config import EtcdSettings, RouterSettings, resolve
from protocol.timing import check_speedup
from protocol.tokenizer import BuiltinTokenizer
from router.block_index import BlockIndex
from router.calibration import Calibration
from router.load_view import LoadView
from router.pending_prefixes import PendingPrefixes
from router.planner import standalone_planner
from router.replica_sync import ReplicaSync
from router.request_parsing import parse_request
from router.tokenization import BuiltinPromptTokenizer
from router.worker_registry import WorkerRegistry

BLOCK = 16


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _text(n_tokens: int, rng: random.Random) -> str:
    words = "the cache prefix request router worker decode prefill latency memory block".split()
    tok = BuiltinTokenizer()
    out: list[str] = []
    while len(tok.encode(" ".join(out))) < n_tokens:
        out.extend(rng.choice(words) for _ in range(64))
    return " ".join(out)


def bench_decision(workers: int, iterations: int, policy: str) -> dict[str, Any]:
    rng = random.Random(0)
    tokenizer = BuiltinPromptTokenizer()
    index, view = BlockIndex(), LoadView()
    infos = [
        WorkerInfo(worker=f"w{i:04x}", model="m", role="prefill" if i % 4 == 0 else "decode", engine="vllm",
                   block_size=BLOCK, kv_total_blocks=100_000, max_num_batched_tokens=8192,
                   timing_profile="h200:llama-3.1-8b")
        for i in range(workers)
    ]  # fmt: skip
    loads = [
        LoadReport(worker=info.worker, ts=0.0, running=rng.randint(0, 30), kv_used_blocks=rng.randint(0, 50_000),
                   kv_total_blocks=100_000, prefill_tokens_queued=rng.randint(0, 9000))
        for info in infos
    ]  # fmt: skip

    def report() -> None:
        # Workers fall silent after three report periods; building 8 k-token prompts takes longer.
        for load in loads:
            view.update(msgspec.structs.replace(load, ts=time.time()))

    settings = resolve(RouterSettings, cli={"conditional_disagg": True, "conditional_disagg_policy": policy,
                                            "queue_threshold": 1.0}, env={})  # fmt: skip
    planner = standalone_planner(settings, lambda: infos, index=index, view=view)
    out: dict[str, Any] = {"workers": workers, "policy": policy}

    def request_ids(body: bytes) -> list[int]:
        # the front door's work on a token-id prompt: JSON and validation (router.http_api)
        prompt = parse_request(msgspec.json.decode(body), chat=False).prompts[0]
        assert isinstance(prompt, list)
        return prompt

    cases: list[tuple[str, list[Any], Callable[[Any], list[int]]]] = []
    for isl in (2048, 8192):
        cases.append((f"isl_{isl}", [_text(isl, rng) for _ in range(8)], tokenizer.encode))
    bodies = [
        msgspec.json.encode({"model": "m", "prompt": [rng.randrange(32000) for _ in range(4096)], "max_tokens": 16})
        for _ in range(8)
    ]
    cases.append(("ids_4096", bodies, request_ids))
    for name, prompts, prepare in cases:
        for prompt in prompts:  # each prompt's first half cached on a few workers
            ids = prepare(prompt)
            half = block_hashes(ids[: len(ids) // 2], BLOCK)
            for info in rng.sample(infos, 3):
                index.store(info.worker, half)
        times: list[float] = []
        reported = 0.0
        for n in range(iterations):
            if time.monotonic() - reported > 0.5:
                report()
                reported = time.monotonic()
            start = time.perf_counter()
            ids = prepare(prompts[n % len(prompts)])
            ctx = planner.context(f"r{n}", "m", ids)
            planner.refresh(ctx)
            plan = planner.disagg.plan(ctx)
            times.append(time.perf_counter() - start)
            assert plan is not None
        out[name] = {
            "tokens": len(prepare(prompts[0])),
            "p50_ms": round(_pct(times, 0.5) * 1e3, 3),
            "p99_ms": round(_pct(times, 0.99) * 1e3, 3),
        }
    # The request path's whole planning of those id prompts: admission's room rule over every
    # candidate, selection, the policy and the booking, with calibration on as a router runs it.
    booked = standalone_planner(settings, lambda: infos, index=index, view=view, calibration=Calibration())
    id_prompts = [request_ids(body) for body in bodies]
    times = []
    for n in range(iterations):
        if time.monotonic() - reported > 0.5:
            report()
            reported = time.monotonic()
        start = time.perf_counter()
        ctx = booked.context(f"t{n}", "m", id_prompts[n % len(id_prompts)])
        plan = booked.take(ctx)
        times.append(time.perf_counter() - start)
        assert plan is not None
        booked.ledger.free(plan.key)
        booked.finished(ctx)
    out["take_ids_4096"] = {"p50_ms": round(_pct(times, 0.5) * 1e3, 3), "p99_ms": round(_pct(times, 0.99) * 1e3, 3)}
    return out


async def _ttft(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float | None:
    body = {"model": "sim-llama", "prompt": prompt, "max_tokens": 2, "stream": True}
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return None
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"text":""' not in line:
                    ttft = time.perf_counter() - start
                    await resp.read()
                    return ttft
    except aiohttp.ClientError:
        return None
    return None


async def _phase(urls: list[str], rate: float, seconds: float) -> tuple[list[float], int]:
    rng = random.Random(1)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = []
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds:
            prompt = [rng.randrange(300, 30000) for _ in range(128)]
            tasks.append(asyncio.create_task(_ttft(session, urls[n % len(urls)], prompt)))
            n += 1
            await asyncio.sleep(max(0.0, n / rate - (time.perf_counter() - start)))
        results = await asyncio.gather(*tasks)
    ok = [r for r in results if r is not None]
    return ok, len(results) - len(ok)


def _scrape(router_url: str) -> dict[str, float]:
    """The router's own sums and counts: TTFT as it sees it (dispatch to the first token back from
    the shim) and routing time, so a phase's delta splits the overhead into router and upstream."""
    import urllib.request

    with urllib.request.urlopen(router_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for metric in ("kvswitch_router_upstream_ttft_seconds", "kvswitch_router_route_seconds"):
            if name.startswith(metric + "_sum") or name.startswith(metric + "_count"):
                key = metric + name[len(metric) :].split("{")[0]
                out[key] = out.get(key, 0.0) + float(value)
    return out


def _mean_ms(before: dict[str, float], after: dict[str, float], metric: str) -> float:
    n = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
    return round((after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0)) / max(n, 1.0) * 1e3, 3)


def _wait_workers(router_url: str, n: int, timeout: float = 60.0) -> None:
    """/ready answers once the registry has its first snapshot; the shims may register later."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(router_url + "/ready", timeout=2) as resp:
                if json.loads(resp.read()).get("workers", 0) >= n:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"router {router_url} did not see {n} workers in {timeout:.0f}s")


async def _serve_workers(nats_url: str, etcd_url: str, ns: str, agg: int, speedup: float) -> None:
    """Child process: `agg` simulated engines with their shims, until SIGTERM; prints sim URLs."""
    import signal

    from engine_sim.config import SimConfig
    from engine_sim.server import SimServer
    from protocol.config import EtcdSettings, NatsSettings
    from worker_shim import ShimConfig, WorkerShim

    parts: list[Any] = []
    for _ in range(agg):
        sim = SimServer(SimConfig(speedup=speedup, block_size=BLOCK, role="agg"))
        await sim.start()
        assert sim.events_endpoint is not None
        shim = WorkerShim(
            ShimConfig(engine="vllm", engine_url=sim.url, role="agg", model=sim.config.model,
                       kv_events=sim.events_endpoint, kv_events_mode="connect", kv_replay=sim.replay_endpoint,
                       namespace=ns),
            NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url]),
        )  # fmt: skip
        await shim.start()
        await asyncio.wait_for(shim.registered.wait(), 30)
        parts += [shim, sim]
    print(json.dumps([p.url for p in parts if isinstance(p, SimServer)]), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for part in parts:
        await part.stop()


def bench_overhead(rates: list[float], seconds: float, agg: int, speedup: float) -> dict[str, Any]:
    import subprocess
    import sys

    from kvswitch.servers import EtcdServer, NatsServer, free_port

    ns = "b" + uuid.uuid4().hex[:8]
    with NatsServer() as nats_srv, EtcdServer() as etcd_srv:
        conn = [nats_srv.url, etcd_srv.url, ns]
        argv = [sys.executable, "-m", "bench.bench_router", "workers", *conn, "--agg", str(agg)]
        workers = subprocess.Popen([*argv, "--speedup", str(speedup)], stdout=subprocess.PIPE)
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "kvswitch", "router", "--http-host", "127.0.0.1", "--http-port", str(port),
             "--nats-servers", nats_srv.url, "--etcd-endpoints", etcd_srv.url, "--namespace", ns, "--disagg", "never"],
            env={**__import__("os").environ, "KVSWITCH_LOG_LEVEL": "warning"},
        )  # fmt: skip
        try:
            assert workers.stdout is not None
            sim_urls = json.loads(workers.stdout.readline())
            router_url = f"http://127.0.0.1:{port}"
            _wait_workers(router_url, agg)
            out: dict[str, Any] = {"agg_sims": agg, "speedup": speedup, "seconds": seconds, "rates": {}}
            for rate in rates:
                direct, direct_err = uvloop.run(_phase(sim_urls, rate, seconds))
                before = _scrape(router_url)
                routed, routed_err = uvloop.run(_phase([router_url], rate, seconds))
                after = _scrape(router_url)
                row = {
                    "direct_p50_ms": round(statistics.median(direct) * 1e3, 3),
                    "direct_p99_ms": round(_pct(direct, 0.99) * 1e3, 3),
                    "router_p50_ms": round(statistics.median(routed) * 1e3, 3),
                    "router_p99_ms": round(_pct(routed, 0.99) * 1e3, 3),
                    "errors": direct_err + routed_err,
                    "requests": len(direct) + len(routed),
                }
                row["overhead_p50_ms"] = round(row["router_p50_ms"] - row["direct_p50_ms"], 3)
                row["overhead_p99_ms"] = round(row["router_p99_ms"] - row["direct_p99_ms"], 3)
                # Means, to split the overhead: `upstream` is what the router waits for (NATS, shim,
                # engine), the rest of the client's TTFT is the router's own work and queueing.
                row["router_mean_ms"] = round(statistics.mean(routed) * 1e3, 3)
                row["upstream_mean_ms"] = _mean_ms(before, after, "kvswitch_router_upstream_ttft_seconds")
                row["route_mean_ms"] = _mean_ms(before, after, "kvswitch_router_route_seconds")
                row["router_own_mean_ms"] = round(row["router_mean_ms"] - row["upstream_mean_ms"], 3)
                out["rates"][str(int(rate))] = row
                print(json.dumps({str(int(rate)): row}), flush=True)
            return out
        finally:
            for proc in (router, workers):
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


async def _stream(session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int) -> int:
    """One streamed completion read to its end: the chunks that carried text (0 on a failure)."""
    body = {"model": "sim-llama", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    chunks = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return 0
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"text":""' not in line:
                    chunks += 1
    except aiohttp.ClientError:
        return 0
    return chunks


async def _closed_loop(url: str, concurrency: int, requests: int, isl: int, osl: int, seed: int) -> tuple[int, int]:
    """`requests` streamed completions, `concurrency` at a time; (requests answered, text chunks)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(300, 30000) for _ in range(isl)] for _ in range(requests)]
    todo = iter(prompts)
    done = [0, 0]

    async def lane(session: aiohttp.ClientSession) -> None:
        for prompt in todo:
            chunks = await _stream(session, url, prompt, osl)
            done[0] += chunks > 0
            done[1] += chunks

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(lane(session) for _ in range(concurrency)))
    return done[0], done[1]


def bench_stream_cpu(
    trees: list[str], concurrency: int, requests: int, isl: int, osl: int, repeats: int, speedup: float,
    py_spy: str | None, cprofile: bool,
) -> dict[str, Any]:  # fmt: skip
    """The router's CPU per streamed request and per chunk, a router from each tree in turn."""
    import contextlib
    import os
    import subprocess
    import sys

    from bench.cpu import read_cpu_ticks
    from bench.flame import Recording
    from bench.overhead import reset_prefix_caches
    from kvswitch.servers import EtcdServer, NatsServer, free_port

    hz = os.sysconf("SC_CLK_TCK")
    ns = "b" + uuid.uuid4().hex[:8]
    out: dict[str, Any] = {"concurrency": concurrency, "requests": requests, "isl": isl, "osl": osl, "runs": []}
    with NatsServer() as nats_srv, EtcdServer() as etcd_srv:
        conn = [nats_srv.url, etcd_srv.url, ns]
        argv = [sys.executable, "-m", "bench.bench_router", "workers", *conn, "--agg", "2", "--speedup", str(speedup)]
        workers = subprocess.Popen(argv, stdout=subprocess.PIPE)
        try:
            assert workers.stdout is not None
            sims = json.loads(workers.stdout.readline())
            phases = 0
            for repeat in range(repeats):
                # alternate the order, so neither tree always runs first on a warming box
                for tree in trees if repeat % 2 == 0 else trees[::-1]:
                    # every phase cold, with prompts of its own: a phase that found the one
                    # before it's prompts cached skipped their prefills
                    reset_prefix_caches(sims)
                    phases += 1
                    port = free_port()
                    name = f"{Path(tree).name}-r{repeat}"
                    stats = Path(tree) / f"bench/out/stream-cpu-{name}.pstats"
                    stats.parent.mkdir(parents=True, exist_ok=True)
                    profiled = ["-m", "cProfile", "-o", str(stats)] if cprofile else []
                    router = subprocess.Popen(
                        [sys.executable, *profiled, "-m", "kvswitch", "router", "--http-host", "127.0.0.1",
                         "--http-port", str(port), "--nats-servers", nats_srv.url, "--etcd-endpoints", etcd_srv.url,
                         "--namespace", ns, "--disagg", "never"],
                        cwd=tree, env={**os.environ, "PYTHONPATH": tree, "KVSWITCH_LOG_LEVEL": "warning"},
                    )  # fmt: skip
                    try:
                        url = f"http://127.0.0.1:{port}"
                        _wait_workers(url, 2)
                        uvloop.run(_closed_loop(url, concurrency, concurrency, isl, osl, -phases))  # warm-up
                        with contextlib.ExitStack() as stack:
                            if py_spy is not None:  # stacks in <stats>.txt, a flame graph in <stats>.svg
                                stack.enter_context(Recording(py_spy, router.pid, stats, rate=250))
                                time.sleep(1.0)
                            ticks, start = read_cpu_ticks(router.pid), time.perf_counter()
                            answered, chunks = uvloop.run(_closed_loop(url, concurrency, requests, isl, osl, phases))
                            cpu_s = (read_cpu_ticks(router.pid) - ticks) / hz
                            wall_s = time.perf_counter() - start  # not py-spy's writing its files
                        row = {
                            "tree": tree, "repeat": repeat, "answered": answered, "chunks": chunks,
                            "wall_s": round(wall_s, 2), "router_cpu_s": round(cpu_s, 3),
                            "us_per_request": round(cpu_s / max(answered, 1) * 1e6),
                            "us_per_chunk": round(cpu_s / max(chunks, 1) * 1e6, 1),
                        }  # fmt: skip
                        out["runs"].append(row)
                        print(json.dumps(row), flush=True)
                    finally:
                        router.terminate()
                        router.wait(20)
        finally:
            workers.terminate()
            workers.wait(20)
    for tree in trees:
        per = [r["us_per_request"] for r in out["runs"] if r["tree"] == tree]
        out[tree] = {"us_per_request_median": statistics.median(per)}
    return out


def bench_registrations(sizes: list[int], repeats: int) -> dict[str, Any]:
    disc = Discovery(EtcdSettings(), "bench")  # never connected: the events are fed to the registry here

    def cpu(infos: list[WorkerInfo], read: bool) -> float:
        reg = WorkerRegistry(disc, lambda _: None, lambda _: None)
        reg.apply(Snapshot(items={}, revision=1))
        t0 = time.process_time()
        for revision, info in enumerate(infos, 2):
            reg.apply(Put(info.worker, info, revision))
            if read:
                reg.workers()
        return time.process_time() - t0

    out: dict[str, Any] = {}
    for read in (False, True):
        runs: dict[str, Any] = {}
        for n in sizes:
            infos = [  # the scale audit's fleet (docs/router.md, "2026-12-06, the rest of a replica at 1,000 workers")
                WorkerInfo(worker=f"w{i:04d}", model="m", role="prefill" if i % 4 == 0 else "decode", engine="vllm",
                           block_size=BLOCK, kv_total_blocks=100_000, max_num_batched_tokens=8192,
                           timing_profile="h200:llama-3.1-8b", epoch=1, max_model_len=32768)
                for i in range(n)
            ]  # fmt: skip
            best = min(cpu(infos, read) for _ in range(repeats))
            runs[str(n)] = {"cpu_s": round(best, 4), "us_per_put": round(best / n * 1e6, 2)}
        smallest = runs[str(sizes[0])]["us_per_put"]
        for run in runs.values():
            run["per_put_vs_smallest"] = round(run["us_per_put"] / smallest, 2)
        out["with_reads" if read else "puts"] = runs
    return out


def bench_prefill_room(prefill: int, isl: int, iterations: int) -> dict[str, Any]:
    infos = [
        WorkerInfo(worker=f"{'p' if i < prefill else 'd'}{i}", model="m", role="prefill" if i < prefill else "decode",
                   engine="vllm", block_size=BLOCK, kv_total_blocks=100_000, max_num_batched_tokens=8192,
                   timing_profile="h200:llama-3.1-8b")
        for i in range(prefill + 4)
    ]  # fmt: skip
    prompt = list(range(isl))
    out: dict[str, Any] = {"prefill_workers": prefill, "isl": isl}
    for fit in (0.8, 0.0):
        view = LoadView()
        for info in infos:
            queued = 40_000 if info.role == "prefill" else 0
            view.update(LoadReport(worker=info.worker, ts=time.time(), kv_total_blocks=100_000,
                                   prefill_tokens_queued=queued))  # fmt: skip
        settings = resolve(RouterSettings, cli={"conditional_disagg": True, "conditional_disagg_policy": "slo_aware",
                                                "slo_prefill_fit": fit}, env={})  # fmt: skip
        planner = standalone_planner(settings, lambda: infos, index=BlockIndex(), view=view)
        times: list[float] = []
        for n in range(iterations):
            ctx = planner.context(f"r{n}", "m", prompt)  # the prompt's hashing is not the rule's
            start = time.perf_counter()
            plan = planner.take(ctx)
            times.append(time.perf_counter() - start)
            assert plan is not None
            planner.ledger.free(plan.key)
            planner.finished(ctx)
        out[f"take_fit_{fit:g}"] = {
            "p50_us": round(_pct(times, 0.5) * 1e6, 1),
            "p99_us": round(_pct(times, 0.99) * 1e6, 1),
        }
    return out


def bench_pending(blocks: int) -> dict[str, Any]:
    rng = random.Random(0)
    prompt = [rng.getrandbits(63) for _ in range(blocks)]
    others = [[rng.getrandbits(63) for _ in range(256)] for _ in range(400)]
    pending = PendingPrefixes(20.0, lambda: 1000.0)
    for hashes in others:
        claim = pending.add("w0", hashes)
        assert claim is not None
        pending.settle(claim)

    def served() -> None:
        claim = pending.add("w0", prompt)
        assert claim is not None
        pending.settle(claim)
        pending.confirm("w0", prompt)

    def failed() -> None:
        claim = pending.add("w0", prompt)
        assert claim is not None
        pending.withdraw(claim)

    def best_us(fn: Callable[[], None]) -> float:
        return round(min(timeit.repeat(fn, number=2000, repeat=9)) / 2000 * 1e6, 1)

    return {"blocks": blocks, "add_settle_confirm_us": best_us(served), "add_withdraw_us": best_us(failed)}


class _NoNats:
    """What ReplicaSync reads of its NATS connection to size a snapshot's parts: the default limit."""

    max_payload = 1 << 20


def bench_snapshots(routers: list[int], bookings: int) -> dict[str, Any]:
    workers = [f"worker-{i}" for i in range(16)]
    out: list[dict[str, Any]] = []
    for n in routers:
        ids = {f"r{r}": [f"cmpl-{uuid.uuid4().hex}#0" for _ in range(bookings)] for r in range(n)}
        sender, reader = (ReplicaSync(_NoNats(), "bench", me, LoadView()) for me in ("r0", "r1"))  # type: ignore[arg-type]
        for sync in (sender, reader):
            for w in workers:
                sync.view.update(LoadReport(worker=w, ts=time.time(), kv_total_blocks=100_000))
            for router, requests in ids.items():
                for i, request in enumerate(requests):
                    mine = router == sync.router_id
                    sync.view.book(request, workers[i % 16], 1500, 100, router=None if mine else router)
        taken = []
        for _ in range(9):
            start = time.perf_counter()
            payloads = sender._snapshot()[1]
            taken.append(time.perf_counter() - start)
        for payload in payloads:  # the first read: what it adds is no heal, and it is not timed
            reader._on_payload(payload)
        parts: list[float] = []
        whole: list[float] = []
        for _ in range(7):
            for payload in payloads:
                start = time.perf_counter()
                reader._on_payload(payload)
                parts.append(time.perf_counter() - start)
            whole.append(sum(parts[-len(payloads) :]))
        assert sum(reader.stats.healed.values()) == 0, reader.stats.healed
        out.append({
            "routers": n, "bookings_each": bookings, "messages": len(payloads),
            "kb": round(sum(map(len, payloads)) / 1000),
            "send_take_encode_ms": round(statistics.median(taken) * 1e3, 2),
            "read_part_p50_ms": round(statistics.median(parts) * 1e3, 2),
            "read_part_max_ms": round(max(parts) * 1e3, 2),
            "read_whole_ms": round(statistics.median(whole) * 1e3, 2),
            "read_us_per_booking": round(statistics.median(whole) / bookings * 1e6, 2),
            "book_free_us": _book_free_us(reader.view),
        })  # fmt: skip
    return {"fleets": out}


def _book_free_us(view: LoadView) -> float:
    """One request's book + prefill_done + free in `view`: the best of 9 runs of 2,000."""
    keys = (f"bench-{n}#0" for n in itertools.count())

    def request() -> None:
        key = next(keys)
        view.book(key, "worker-0", 1500, 100)
        view.prefill_done(key)
        view.free(key)

    return round(min(timeit.repeat(request, number=2000, repeat=9)) / 2000 * 1e6, 2)


def main() -> None:
    # Refusals in one line, `bench_router.py decision: WHY`, as every kvswitch command's.
    parser = FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    d = sub.add_parser("decision")
    d.add_argument("--workers", type=int, default=32, help="at least 4 (every fourth is a prefill worker)")
    d.add_argument("--iterations", type=int, default=2000)
    d.add_argument("--policy", default="isl_bounding")
    o = sub.add_parser("overhead")
    o.add_argument("--rates", default="50,200,500")
    o.add_argument("--seconds", type=float, default=5.0)
    o.add_argument("--agg", type=int, default=2)
    o.add_argument("--speedup", type=float, default=1000.0)
    sc = sub.add_parser("stream-cpu", help="the router's CPU per streamed request, routers from each tree in turn")
    sc.add_argument("--trees", default=".", help="comma-separated checkouts to run the router from")
    sc.add_argument("--concurrency", type=int, default=64)
    sc.add_argument("--requests", type=int, default=1024)
    sc.add_argument("--isl", type=int, default=1024)
    sc.add_argument("--osl", type=int, default=64)
    sc.add_argument("--repeats", type=int, default=2)
    sc.add_argument("--speedup", type=float, default=1.0)
    sc.add_argument("--py-spy", default=None, help="py-spy executable: each router's stacks, flame graph in bench/out/")
    sc.add_argument("--cprofile", action="store_true", help="run each router under cProfile: stats in bench/out/")
    r = sub.add_parser("registrations")
    r.add_argument("--sizes", default="250,500,1000", help="fleet sizes, the smallest first")
    r.add_argument("--repeats", type=int, default=3, help="runs per size; the least CPU counts")
    pr = sub.add_parser("prefill-room")
    pr.add_argument("--prefill", type=int, default=16, help="prefill workers, all past the backlog bound")
    pr.add_argument("--isl", type=int, default=128_000)
    pr.add_argument("--iterations", type=int, default=300)
    pe = sub.add_parser("pending")
    pe.add_argument("--blocks", type=int, default=256)
    sn = sub.add_parser("snapshots")
    sn.add_argument("--routers", default="2,4,8", help="fleet sizes: replicas, each with --bookings live")
    sn.add_argument("--bookings", type=int, default=5000)
    w = sub.add_parser("workers", help="(internal) sims and shims for the overhead benchmark")
    w.add_argument("nats")
    w.add_argument("etcd")
    w.add_argument("ns")
    w.add_argument("--agg", type=int, default=2)
    w.add_argument("--speedup", type=float, default=1000.0)
    args = parser.parse_args()
    chosen = sub.choices[args.benchmark]
    if (speedup := getattr(args, "speedup", None)) is not None:  # its sims run at it, as `kvswitch up`'s
        try:
            check_speedup(speedup, "--speedup")
        except ValueError as exc:
            chosen.error(str(exc))
    if args.benchmark == "decision" and args.workers < 4:
        chosen.error(f"--workers {args.workers}: at least 4, so that three workers hold each prompt's prefix")
    if args.benchmark == "workers":
        uvloop.run(_serve_workers(args.nats, args.etcd, args.ns, args.agg, args.speedup))
        return
    if args.benchmark == "decision":
        result = bench_decision(args.workers, args.iterations, args.policy)
    elif args.benchmark == "prefill-room":
        result = bench_prefill_room(args.prefill, args.isl, args.iterations)
    elif args.benchmark == "pending":
        result = bench_pending(args.blocks)
    elif args.benchmark == "snapshots":
        result = bench_snapshots([int(n) for n in args.routers.split(",")], args.bookings)
    elif args.benchmark == "stream-cpu":
        trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
        result = bench_stream_cpu(
            trees,
            args.concurrency,
            args.requests,
            args.isl,
            args.osl,
            args.repeats,
            args.speedup,
            args.py_spy,
            args.cprofile,
        )
    elif args.benchmark == "registrations":
        result = bench_registrations([int(n) for n in args.sizes.split(",")], args.repeats)
    else:
        result = bench_overhead([float(r) for r in args.rates.split(",")], args.seconds, args.agg, args.speedup)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
