"""Prefix index at fleet scale: memory per (worker, block), build time, and what match and clear
cost in an index of 1,000 workers x 16 k blocks (issue 12; figures in docs/router_index.md).

    .venv/bin/python -m bench.bench_index_memory [--workers 1000] [--blocks 16384]
                                                 [--sharing low high] [--python]

Each sharing (bench/index_fleet_workload.py) runs in a fresh process: it notes its resident set
(VmRSS) with the modules loaded, stores every worker's blocks in 64-block batches (as events
arrive), then reports the RSS it gained, its peak (VmHWM, which includes the table's last doubling,
when old and new tables coexist), and what the index itself reports (`memory_bytes()`). Target:
<= 2 GB of RSS for 1,000 x 16,384, i.e. <= 125 B per (worker, block).

`match` is timed on 64-block prompts: a worker's own blocks (`own`) and a prompt nobody holds
(`miss`); `clear` and `worker_hashes` on one worker of the full index (O(its blocks)).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from typing import Any

from bench.index_fleet_workload import SHARINGS, FleetWorkload

BATCH = 64
TARGET_BYTES_PER_ENTRY = 125


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _timed_us(calls: list[Any], fn: Any) -> float:
    start = time.perf_counter()
    for arg in calls:
        fn(arg)
    return (time.perf_counter() - start) / len(calls) * 1e6


def measure(workers: int, blocks: int, sharing: str, native: bool) -> dict[str, Any]:
    """Build the index in this process and report on it (run it in a fresh process)."""
    from router.block_index import BlockIndex

    wl = FleetWorkload(workers, blocks, sharing)
    idx = BlockIndex(native=native)
    base_kb = _status_kb("VmRSS")
    build = 0.0
    for w in range(workers):
        hashes = wl.hashes(w).tolist()
        name = wl.name(w)
        start = time.perf_counter()
        for i in range(0, len(hashes), BATCH):
            idx.store(name, hashes[i : i + BATCH])
        build += time.perf_counter() - start
    rss = (_status_kb("VmRSS") - base_kb) * 1024
    peak = (_status_kb("VmHWM") - base_kb) * 1024
    entries, distinct, reported = idx.entries, len(idx), idx.memory_bytes()
    own = [wl.hashes(w)[-BATCH:].tolist() for w in range(0, workers, max(1, workers // 200))]
    miss = [wl.fresh(w, 0, BATCH).tolist() for w in range(200)]
    match_own = statistics.median(_timed_us(own, idx.match) for _ in range(5))
    match_miss = statistics.median(_timed_us(miss, idx.match) for _ in range(5))
    name = wl.name(workers // 2)
    start = time.perf_counter()
    held = idx.worker_hashes(name)
    list_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    idx.clear(name)
    clear_ms = (time.perf_counter() - start) * 1e3
    if len(held) != blocks or idx.entries != entries - blocks:
        raise RuntimeError(f"worker {name}: listed {len(held)} of {blocks} blocks; clear left {idx.entries}")
    return {
        "sharing": sharing,
        "core": "C" if idx.native else "Python",
        "entries": entries,
        "distinct": distinct,
        "rss": rss,
        "peak": peak,
        "reported": reported,
        "build_s": build,
        "match_own_us": match_own,
        "match_miss_us": match_miss,
        "clear_ms": clear_ms,
        "list_ms": list_ms,
    }


def _child(conn: Any, args: tuple[int, int, str, bool]) -> None:
    conn.send(json.dumps(measure(*args)))
    conn.close()


def run(workers: int, blocks: int, sharings: list[str], native: bool) -> list[dict[str, Any]]:
    """One fresh process per sharing, so each starts from the same RSS."""
    ctx = multiprocessing.get_context("spawn")
    out = []
    for sharing in sharings:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(child, (workers, blocks, sharing, native)))
        proc.start()
        child.close()
        result = json.loads(parent.recv())
        proc.join()
        out.append(result)
    return out


def verdict(row: dict[str, Any]) -> str:
    """The row's RSS per entry against TARGET_BYTES_PER_ENTRY, and its peak's (a table doubling)."""
    per_entry, peak = row["rss"] / row["entries"], row["peak"] / row["entries"]
    met = "met" if per_entry <= TARGET_BYTES_PER_ENTRY else "missed"
    return (
        f"{row['sharing']} sharing, {row['core']} core: {per_entry:.1f} B of RSS per entry (peak {peak:.1f}), "
        f"target <= {TARGET_BYTES_PER_ENTRY} B: {met}"
        + (f" ({TARGET_BYTES_PER_ENTRY / per_entry:.2f}x margin)" if per_entry > 0 else "")
    )


def report(rows: list[dict[str, Any]], workers: int, blocks: int) -> None:
    budget = workers * blocks * TARGET_BYTES_PER_ENTRY
    print(
        f"{workers} workers x {blocks} blocks = {workers * blocks:,} (worker, block) entries; "
        f"target <= {TARGET_BYTES_PER_ENTRY} B of RSS per entry ({budget / 1e9:.2f} GB in all)"
    )
    print(
        f"{'sharing':>7} {'core':>6} {'distinct':>11} {'holders':>7} {'RSS MB':>7} {'B/entry':>7} {'peak MB':>7}"
        f" {'index MB':>8} {'B/entry':>7} {'build s':>7} {'M/s':>5} {'own us':>6} {'miss us':>7}"
        f" {'clear ms':>8} {'list ms':>7}"
    )
    for r in rows:
        print(
            f"{r['sharing']:>7} {r['core']:>6} {r['distinct']:>11,} {r['entries'] / r['distinct']:>7.2f}"
            f" {r['rss'] / 2**20:>7.0f} {r['rss'] / r['entries']:>7.1f} {r['peak'] / 2**20:>7.0f}"
            f" {r['reported'] / 2**20:>8.0f} {r['reported'] / r['entries']:>7.1f} {r['build_s']:>7.1f}"
            f" {r['entries'] / r['build_s'] / 1e6:>5.1f} {r['match_own_us']:>6.2f} {r['match_miss_us']:>7.2f}"
            f" {r['clear_ms']:>8.1f} {r['list_ms']:>7.1f}"
        )
    for r in rows:
        print(verdict(r))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=16_384, help="blocks per worker")
    ap.add_argument("--sharing", nargs="+", choices=SHARINGS, default=list(SHARINGS))
    ap.add_argument("--python", action="store_true", help="the pure-Python core instead of the C one")
    args = ap.parse_args(argv)
    report(run(args.workers, args.blocks, args.sharing, not args.python), args.workers, args.blocks)


if __name__ == "__main__":
    main()
