"""Benchmark: many simulated engines in one process under a shared-prefix load.

    .venv/bin/python bench/bench_engine_sim.py --engines 32 --speedup 10 --duration 20

Each engine gets Poisson arrivals (rate given in simulated requests per second, so the load an
engine sees is the same at any speedup) of prompts made of one of a few shared "system prompts"
plus a unique suffix. Requests go straight into each engine's runner (the in-process API), so what
is measured is the simulator (scheduler, step loop, event encoding and publishing), not HTTP.

Printed:
- generated tokens per wall second, and per simulated second (what the modelled H200s produce);
- step-loop CPU: the CPU the step loops spent (scheduling, "execution", delivery, event encoding
  and ZMQ sends), as a fraction of the run's wall time (the share of one core the fleet needs to
  keep up), of the simulated time elapsed (wall x speedup), and of the engines' simulated busy
  time. Target: under 20% for 32 engines at 10x;
- per-step CPU in microseconds, steps per second, and lag resets (times an engine fell more than
  MAX_LAG behind its modelled clock: 0 means the fleet sustained real time);
- the prefix cache hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_sim import KVEventsConfig, SimConfig, SimFleet, SimServer
from engine_sim.request import SimRequest
from runtime import tune_gc


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", type=int, default=32)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--duration", type=float, default=20.0, help="wall seconds of load")
    p.add_argument("--rate", type=float, default=2.0, help="requests per simulated second per engine")
    p.add_argument("--prefixes", type=int, default=8, help="distinct shared system prompts")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-events", action="store_true", help="do not publish KV events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--default-gc", action="store_true", help="keep Python's default GC thresholds")
    return p.parse_args()


async def client(sim: SimServer, args: argparse.Namespace, rng: random.Random, stop_at: float, done: list[int]) -> None:
    loop = asyncio.get_running_loop()
    prefixes = [list(range(1000 + i * 10_000, 1000 + i * 10_000 + args.prefix_len)) for i in range(args.prefixes)]
    inflight: set[asyncio.Task[None]] = set()
    n = 0

    async def one(req: SimRequest) -> None:
        stream = sim.runner.submit(req)
        await stream.result()
        done[0] += 1

    while loop.time() < stop_at:
        await asyncio.sleep(rng.expovariate(args.rate * args.speedup))
        suffix = [rng.randrange(300, 30000) for _ in range(args.suffix_len)]
        req = SimRequest(f"{id(sim)}-{n}", rng.choice(prefixes) + suffix, max_tokens=args.output_len)
        n += 1
        t = asyncio.create_task(one(req))
        inflight.add(t)
        t.add_done_callback(inflight.discard)
    for t in list(inflight):
        t.cancel()


async def main(args: argparse.Namespace) -> None:
    events = KVEventsConfig(enable_kv_cache_events=not args.no_events, endpoint="tcp://*:0")
    cfg = SimConfig(speedup=args.speedup, kv_events=events, num_gpu_blocks=16384)
    async with SimFleet(cfg, args.engines) as fleet:
        if not args.default_gc:
            tune_gc()
        loop = asyncio.get_running_loop()
        done = [0]
        rng = random.Random(args.seed)
        t0, cpu0 = loop.time(), time.process_time()
        stop_at = t0 + args.duration
        await asyncio.gather(*(client(s, args, random.Random(rng.random()), stop_at, done) for s in fleet.servers))
        wall = loop.time() - t0
        proc_cpu = time.process_time() - cpu0
        runners = [s.runner for s in fleet.servers]
        engines = [s.engine for s in fleet.servers]
        step_cpu = sum(r.cpu_s for r in runners)
        steps = sum(e.stats.steps for e in engines)
        busy_sim = sum(r.sim_s for r in runners)
        lag = sum(r.lag_resets for r in runners)
        queries = sum(e.stats.prefix_cache_queries for e in engines)
        hits = sum(e.stats.prefix_cache_hits for e in engines)
        gen = sum(e.stats.generation_tokens for e in engines)
        print(f"engines={args.engines} speedup={args.speedup:g} wall={wall:.1f}s rate={args.rate}/sim-s/engine")
        print(f"generated tokens: {gen} ({gen / wall:,.0f}/wall-s, {gen / (wall * args.speedup):,.0f}/simulated-s)")
        print(f"requests completed: {done[0]}")
        print(
            f"steps: {steps} ({steps / wall:,.0f}/s), engine busy {busy_sim / (args.engines * wall * args.speedup):.0%}"
        )
        per_step = 1e6 * step_cpu / max(1, steps)
        print(f"step-loop CPU: {step_cpu:.2f}s = {step_cpu / wall:.1%} of wall time; {per_step:.0f} us/step")
        sim_elapsed = wall * args.speedup
        print(
            f"step-loop CPU per simulated second: {step_cpu / sim_elapsed:.2%} of the simulated time elapsed "
            f"({sim_elapsed:.0f}s), {step_cpu / max(busy_sim, 1e-9):.2%} of the engines' simulated busy time"
        )
        print(f"process CPU (incl. load generator): {proc_cpu / wall:.1%} of wall time")
        print(f"lag resets: {lag}")
        print(f"prefix cache hit rate: {hits / max(1, queries):.1%}")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(parse()))
