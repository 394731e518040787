"""A leg's reader, chunk by chunk, in-process: CPU per chunk of router.leg's push and next, the
reader waiting for each chunk as it does while a worker streams (its queue empty at each read).

    .venv/bin/python bench/leg_reads.py --trees /path/to/before,/path/to/after

Run by path, not `-m`: each tree's own router.leg is measured in a child with that tree on
PYTHONPATH, the trees alternating, `--repeats` times each; the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from opentelemetry.trace import INVALID_SPAN

# Imported in the child run with each tree on PYTHONPATH, so each tree's own router.leg is measured
from protocol import GenerateRequest, ResponseChunk
from router.client_buffers import ClientBuffers
from router.leg import Leg, RoundTrip


class IdleOwner:
    """A leg's owner (router.dispatch.Dispatcher's part of it) whose connection is up, whose loop
    never stalled and which sends nothing: a leg read on its own (here, and tests/router)."""

    resumes = 0
    lost_at = None

    def __init__(self, buffer_bytes: int = 1 << 30) -> None:
        async def cut(leg: Leg) -> None:
            return None

        self.buffers = ClientBuffers(buffer_bytes, list, cut)

    def awake_for(self) -> float:
        return math.inf

    def is_connected(self) -> bool:
        return True

    async def connected(self) -> bool:
        return True

    async def answers(self) -> RoundTrip:
        return RoundTrip.PROMPT

    def back_within(self, window_s: float, since: float | None = None) -> bool:
        return False

    async def send(self, leg: Leg, request: GenerateRequest) -> None:
        return None

    async def closed(self, leg: Leg) -> None:
        return None


async def _reads(chunks: int) -> float:
    request = GenerateRequest(request_id="r", model="m", token_ids=[1])
    sent = [ResponseChunk(request_id="r", seq=i, events=[b"{}"], tokens=1) for i in range(chunks)]

    async def produce(leg: Leg) -> None:
        for chunk in sent:
            await asyncio.sleep(0)  # the reader reaches its wait first, as behind a socket read
            leg.push(chunk, 64)

    async with Leg(IdleOwner(), "1", "w", "agg", request, INVALID_SPAN, lambda prefilled: None) as leg:
        producer = asyncio.create_task(produce(leg))
        start = time.process_time()
        for _ in range(chunks):
            await leg.next(600.0, 3.0)
        spent = time.process_time() - start
        await producer
    return spent / chunks


def _child(chunks: int) -> None:
    import uvloop

    print(json.dumps({"us_per_chunk": uvloop.run(_reads(chunks)) * 1e6}))


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trees", default=".", help="comma-separated checkouts whose router.leg to measure")
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.chunks)
        return
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    runs: dict[str, list[float]] = {t: [] for t in trees}
    for repeat in range(args.repeats):
        for tree in trees if repeat % 2 == 0 else trees[::-1]:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", "--chunks", str(args.chunks)],
                env={**os.environ, "PYTHONPATH": tree}, cwd=tree, capture_output=True, text=True, check=True,
            )  # fmt: skip
            runs[tree].append(json.loads(out.stdout)["us_per_chunk"])
    result: dict[str, Any] = {t: {"runs_us": [round(x, 3) for x in r], "median_us": round(statistics.median(r), 3)}
                              for t, r in runs.items()}  # fmt: skip
    if len(trees) == 2:
        result["ratio"] = round(result[trees[1]]["median_us"] / result[trees[0]]["median_us"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
