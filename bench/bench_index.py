"""Prefix index micro-benchmark: ingest (blocks/s), memory per entry and find_matches latency, at
32, 256 and 1,000 workers (issue 5's index benchmark, issue 12's targets; figures in
docs/router_index.md).

    .venv/bin/python -m bench.bench_index [--blocks 262144] [--queries 200] [--rounds 5] [--workers 32 256 1000]
                                          [--spin] [--memory] [--fleet]

`--memory` adds the fleet-scale memory run (bench/bench_index_memory.py: 1,000 workers x 16 k
blocks, RSS per entry) and `--fleet` the 1,000-worker bootstrap and event-lag run over NATS
(bench/bench_index_fleet.py), each with its defaults; run those modules for their options.

Workload: every worker stores sequences of 64 blocks, about `--blocks` in all; half of them start
with one of 16 shared 8-block "system prompts". Ingest is timed four ways: our BlockIndex.store on
decoded hash lists (index only); our full wire path (msgpack KvEventBatch decode +
BlockIndex.apply, hashes packed as shims send them: protocol.packed); the same with hash lists
(`lists`: the wire format before packing, for the before/after in one run); the packed wire path
on the pure-Python core (`py`: the index before router._blockindex, and its fallback); and, when
`ai-dynamo-runtime` is installed, Dynamo's RadixTree.apply_event on the JSON event bytes its
Python API takes, in the same process. The ratio compares the two wire paths (bytes in, index
updated). find_matches is timed on 64-block prompts of four kinds: `unique` (one worker holds all
of it), `shared` (a shared system prompt, then one worker's tail; many workers match 8 blocks),
`diverge` (a shared system prompt, then a new question nobody holds) and `miss` (nobody holds
it). `ours` is BlockIndex.match, the lazy per-worker answer routing reads (as Dynamo's time
excludes converting its OverlapScores); `dict` is find_matches, which names every matching worker;
`py` is match on the pure-Python core.
Rounds alternate ours and Dynamo's so both see the same machine noise; medians are printed.
Dynamo's RadixTree hands each call to a runtime thread: on an otherwise idle box waking that thread
costs it ~50 us per call, on a busy one ~10 us. `--spin` keeps one other CPU busy (a spinning
process) so Dynamo is measured at its best, as on a loaded router host.
`B/entry` is the native index's own `bytes_per_entry` after the ingest (its `memory_bytes()` per
(worker, block)). `CPU` is the ratio of CPU time instead of wall time (Dynamo's: every thread of
the process, its runtime's included): on a machine other work keeps busy, wall time also counts
the waits for a CPU, and this ratio is the steadier one.
Targets: ingest >= 2 M blocks/s and >= 5x Dynamo (issue 12; was 3x); find_matches <= 10 us at
1,000 workers and <= 0.5x Dynamo's latency.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import bench_index_fleet, bench_index_memory
from protocol import pack_batch
from protocol.messages import KvEventBatch, Stored, decode_msg, encode_msg
from router.block_index import NATIVE, BlockIndex

SEQ_BLOCKS = 64
PREFIX_BLOCKS = 8
N_PREFIXES = 16


@dataclass
class Workload:
    workers: int
    seqs: list[tuple[int, list[int]]]  # (worker, hashes), in ingest order
    queries: dict[str, list[list[int]]]


def make_workload(workers: int, total_blocks: int, n_queries: int, rng: random.Random) -> Workload:
    prefixes = [[rng.getrandbits(64) for _ in range(PREFIX_BLOCKS)] for _ in range(N_PREFIXES)]
    per_worker = max(1, total_blocks // (workers * SEQ_BLOCKS))
    seqs: list[tuple[int, list[int]]] = []
    unique: list[list[int]] = []
    shared: list[list[int]] = []
    for w in range(workers):
        for _ in range(per_worker):
            if rng.random() < 0.5:
                seq = rng.choice(prefixes) + [rng.getrandbits(64) for _ in range(SEQ_BLOCKS - PREFIX_BLOCKS)]
                shared.append(seq)
            else:
                seq = [rng.getrandbits(64) for _ in range(SEQ_BLOCKS)]
                unique.append(seq)
            seqs.append((w, seq))
    rng.shuffle(seqs)
    miss = [[rng.getrandbits(64) for _ in range(SEQ_BLOCKS)] for _ in range(n_queries)]
    queries = {
        "unique": rng.sample(unique, min(n_queries, len(unique))),
        "shared": rng.sample(shared, min(n_queries, len(shared))),
        "diverge": [rng.choice(prefixes) + q[PREFIX_BLOCKS:] for q in miss],
        "miss": miss,
    }
    # A router hashes each prompt afresh: its hashes are new int objects, not the stored keys.
    queries = {
        kind: [[int.from_bytes(h.to_bytes(8, "little"), "little") for h in q] for q in qs]
        for kind, qs in queries.items()
    }
    return Workload(workers, seqs, queries)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# --- ours ------------------------------------------------------------------------------------------


def ingest_index_only(wl: Workload, native: bool) -> tuple[float, BlockIndex]:
    """Seconds to store every sequence into a fresh index, and that index."""
    names = [f"{w:x}" for w in range(wl.workers)]
    idx = BlockIndex(native=native)
    start = time.perf_counter()
    for w, seq in wl.seqs:
        idx.store(names[w], seq)
    return time.perf_counter() - start, idx


def wire_payloads(wl: Workload, *, packed: bool = True) -> list[bytes]:
    """Each batch's payload as a shim publishes it: hashes packed, or as a list of ints (what shims
    sent before protocol.packed)."""
    batches = (
        KvEventBatch(worker=f"{w:x}", epoch=1, seq=i + 1, ts=0.0, events=[Stored(hashes=seq)])
        for i, (w, seq) in enumerate(wl.seqs)
    )
    return [encode_msg(pack_batch(b) if packed else b) for b in batches]


def ingest_wire(payloads: list[bytes], native: bool) -> tuple[float, float]:
    """Seconds, wall and CPU, to decode every payload and apply it to a fresh index."""
    idx = BlockIndex(native=native)
    start, cpu = time.perf_counter(), time.process_time()
    for data in payloads:
        batch = decode_msg(data, KvEventBatch)
        idx.apply(batch.worker, batch.events)
    return time.perf_counter() - start, time.process_time() - cpu


def match_us(find: Callable[[list[int]], object], queries: list[list[int]]) -> float:
    """Mean microseconds per call over the query set, for at least 0.2 s."""
    n = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < 0.2:
        for q in queries:
            find(q)
        n += len(queries)
    return elapsed / n * 1e6


# --- Dynamo --------------------------------------------------------------------------------------


def _spin() -> None:
    while True:
        pass


def dynamo_tree() -> Callable[[], Any] | None:
    try:
        from dynamo._core import RadixTree
    except ImportError:
        return None
    tree: Callable[[], Any] = RadixTree
    return tree


def dynamo_events(wl: Workload) -> list[tuple[int, bytes]]:
    return [
        (
            w,
            json.dumps(
                {
                    "event_id": i,
                    "data": {
                        "stored": {"parent_hash": None, "blocks": [{"block_hash": h, "tokens_hash": h} for h in seq]}
                    },
                }
            ).encode(),
        )
        for i, (w, seq) in enumerate(wl.seqs)
    ]


def dynamo_ingest(make: Callable[[], Any], events: list[tuple[int, bytes]]) -> tuple[float, float, Any]:
    """Seconds, wall and CPU (every thread of this process: its runtime's too), to apply every event
    to a fresh RadixTree (apply_event is synchronous), and the tree."""
    tree = make()
    start, cpu = time.perf_counter(), time.process_time()
    for w, data in events:
        tree.apply_event(w, data)
    return time.perf_counter() - start, time.process_time() - cpu, tree


# --- report --------------------------------------------------------------------------------------


def run_workers(workers: int, args: argparse.Namespace, make_tree: Callable[[], Any] | None) -> tuple[str, list[str]]:
    """One worker count: ingest and match rounds, ours and Dynamo's interleaved so both see the same
    machine noise; medians over rounds, and the median of per-round ratios."""
    wl = make_workload(workers, args.blocks, args.queries, random.Random(workers))
    blocks = len(wl.seqs) * SEQ_BLOCKS
    payloads = wire_payloads(wl)
    list_payloads = wire_payloads(wl, packed=False)
    events = dynamo_events(wl) if make_tree is not None else []
    index_s: list[float] = []
    wire_s: list[float] = []
    lists_s: list[float] = []
    py_s: list[float] = []
    dyn_s: list[float] = []
    cpu_ratios: list[float] = []
    idx, py_idx, tree = BlockIndex(), BlockIndex(native=False), None
    for _ in range(args.rounds):
        elapsed, idx = ingest_index_only(wl, NATIVE)
        index_s.append(elapsed)
        elapsed, wire_cpu = ingest_wire(payloads, NATIVE)
        wire_s.append(elapsed)
        lists_s.append(ingest_wire(list_payloads, NATIVE)[0])
        _, py_idx = ingest_index_only(wl, False)
        py_s.append(ingest_wire(payloads, False)[0])
        if make_tree is not None:
            elapsed, dyn_cpu, tree = dynamo_ingest(make_tree, events)
            dyn_s.append(elapsed)
            cpu_ratios.append(dyn_cpu / wire_cpu)
    line = f"{workers:>7} {blocks / _median(index_s) / 1e6:>7.2f} {blocks / _median(wire_s) / 1e6:>7.2f}"
    line += f" {blocks / _median(lists_s) / 1e6:>7.2f}"
    line += f" {blocks / _median(py_s) / 1e6:>7.2f} {idx.bytes_per_entry:>7.1f}"
    if dyn_s:
        ratios = [d / w for w, d in zip(wire_s, dyn_s, strict=True)]
        line += f" {blocks / _median(dyn_s) / 1e6:>7.2f} {_median(ratios):>11.2f}x {_median(cpu_ratios):>7.2f}x"
    rows = []
    for kind, qs in wl.queries.items():
        ours_us: list[float] = []
        dict_us: list[float] = []
        py_us: list[float] = []
        theirs_us: list[float] = []
        for _ in range(args.rounds):
            ours_us.append(match_us(idx.match, qs))
            dict_us.append(match_us(idx.find_matches, qs))
            py_us.append(match_us(py_idx.match, qs))
            if tree is not None:
                theirs_us.append(match_us(tree.find_matches, qs))
        hits = sum(len(idx.match(q)) for q in qs) / len(qs)
        row = f"{workers:>7} {kind:>7} {hits:>9.1f} {_median(ours_us):>8.2f} {_median(dict_us):>8.2f}"
        row += f" {_median(py_us):>8.2f}"
        if theirs_us:
            ratio = _median([o / t for o, t in zip(ours_us, theirs_us, strict=True)])
            row += f" {_median(theirs_us):>8.2f} {ratio:>11.2f}x"
        rows.append(row)
    return line, rows


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", type=int, default=262_144, help="blocks stored in all, per worker count")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[32, 256, 1000])
    ap.add_argument("--spin", action="store_true", help="keep one other CPU busy (Dynamo's best case)")
    ap.add_argument("--memory", action="store_true", help="then the 1,000 x 16 k memory run")
    ap.add_argument("--fleet", action="store_true", help="then the 1,000-worker bootstrap and lag run over NATS")
    args = ap.parse_args()
    spinner = multiprocessing.Process(target=_spin, daemon=True) if args.spin else None
    if spinner is not None:
        spinner.start()
    try:
        report(args)
    finally:
        if spinner is not None:
            spinner.terminate()
            spinner.join()
    if args.memory:
        print()
        bench_index_memory.main([])
    if args.fleet:
        print()
        bench_index_fleet.main([])


def report(args: argparse.Namespace) -> None:
    make_tree = dynamo_tree()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}  python {platform.python_version()}  {os.cpu_count()} CPUs  "
        f"{platform.processor() or platform.machine()}"
    )
    print(f"core: {'C (router._blockindex)' if NATIVE else 'pure Python: router._blockindex not built'}", end="")
    print("; one other CPU kept busy (--spin)" if args.spin else "")
    if make_tree is None:
        print("ai-dynamo-runtime not installed: no Dynamo baseline (pip install ai-dynamo-runtime==1.6.1)")
    print(f"~{args.blocks} blocks per run, sequences of {SEQ_BLOCKS}; medians of {args.rounds} interleaved rounds\n")
    print(
        "ingest, M blocks/s:  index = BlockIndex.store; wire = msgpack decode + apply (hashes packed, as"
        " shims send them); lists = wire with hash lists; py = wire on the Python core; dynamo = apply_event(json)"
    )
    print(
        f"{'workers':>7} {'index':>7} {'wire':>7} {'lists':>7} {'py':>7} {'B/entry':>7} {'dynamo':>7}"
        f" {'wire/dynamo':>12} {'CPU':>8}"
    )
    matches: list[str] = []
    for workers in args.workers:
        line, rows = run_workers(workers, args, make_tree)
        print(line, flush=True)
        matches.extend(rows)
    print("\nfind_matches of 64 blocks, us per call (lower is better):")
    print(
        f"{'workers':>7} {'prompt':>7} {'matched':>9} {'ours':>8} {'dict':>8} {'py':>8} {'dynamo':>8}"
        f" {'ours/dynamo':>12}"
    )
    print("\n".join(matches))


if __name__ == "__main__":
    main()
