"""How many KV events one worker sends a router: engine_sim's scheduler, sized as vLLM sizes one
H200 serving llama-3.1-8b (block size 16), replays the shipped Mooncake trace on a virtual clock,
and every step's events are counted as the shim publishes them: one KvEventBatch per step that has
events (the shim coalesces for 5 ms; a modelled step takes 7 ms or more).

    .venv/bin/python -m bench.index_event_rate [--duration 600] [--speed 1.0]

`--speed` compresses the trace's arrivals (2.0: twice its request rate). Printed, per simulated
second: batches, hashes stored and removed, and the engine's busy fraction (its load). The event
lag bench (bench/bench_index_fleet.py) takes its per-worker rate from this.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field

from bench.trace import TokenSynth, load_trace, shipped_trace
from engine_sim.config import SimConfig
from engine_sim.request import SimRequest
from engine_sim.scheduler import Scheduler
from protocol.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored


@dataclass
class EventRate:
    sim_s: float = 0.0
    busy_s: float = 0.0
    steps: int = 0
    batches: int = 0
    stored: int = 0
    removed: int = 0
    batch_sizes: list[tuple[int, int]] = field(default_factory=list)  # (stored, removed) per batch

    def line(self) -> str:
        s = self.sim_s
        sizes = sorted(a + b for a, b in self.batch_sizes) or [0]
        return (
            f"{s:.0f} simulated s, engine busy {self.busy_s / s:.0%}: {self.batches / s:.1f} batches/s, "
            f"{self.stored / s:,.0f} hashes stored/s, {self.removed / s:,.0f} removed/s; hashes per batch "
            f"mean {statistics.fmean(sizes):.0f}, p50 {sizes[len(sizes) // 2]}, p99 {sizes[int(len(sizes) * 0.99)]}"
        )


def measure(duration_s: float, speed: float) -> EventRate:
    cfg = SimConfig()
    sched = Scheduler(
        block_size=cfg.block_size,
        num_gpu_blocks=cfg.resolved_num_gpu_blocks,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=200_000,
    )
    records = load_trace(shipped_trace(), duration_s=duration_s * speed)
    synth = TokenSynth()
    rate = EventRate()
    now, i = 0.0, 0
    while i < len(records) or sched.has_waiting_work():
        while i < len(records) and records[i].arrival_s / speed <= now:
            r = records[i]
            prompt = synth.expand(r.segments())
            sched.add_request(SimRequest(f"r{i}", prompt, max_tokens=r.output_length, arrival=now))
            i += 1
        if not sched.has_waiting_work():
            now = records[i].arrival_s / speed
            continue
        step = sched.step()
        now += step.duration
        rate.busy_s += step.duration
        rate.steps += 1
        stored = removed = cleared = 0
        for event in sched.take_events():
            if isinstance(event, BlockStored):
                stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                removed += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                cleared += 1
        if stored or removed or cleared:
            rate.batches += 1
            rate.stored += stored
            rate.removed += removed
            rate.batch_sizes.append((stored, removed))
    rate.sim_s = now
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds of the trace to replay")
    ap.add_argument("--speed", type=float, default=1.0, help="arrival rate as a multiple of the trace's")
    args = ap.parse_args()
    print(
        f"one H200 (llama-3.1-8b, {SimConfig().resolved_num_gpu_blocks} blocks of 16), Mooncake trace x{args.speed:g}"
    )
    print(measure(args.duration, args.speed).line())


if __name__ == "__main__":
    main()
