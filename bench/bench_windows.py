"""What a hybrid model's sliding-window groups cost the shim, against the same model's
full-attention events alone, in the same run (worker_shim.window_endpoints).

Workload, as vLLM publishes it (docs/worker_shim.md, "Hybrid models"), at block size 16: requests
of a 1,024-token prompt, half of it a prefix shared with the previous request, then 256 output
tokens. Each prompt is one batch: the full-attention group's BlockStored of its new blocks, and
the window group's of the blocks inside its window. Each output block is one batch of one block
per group. Every block of a request is evicted from both groups four requests later, tail first
(vLLM frees a request's blocks in reverse, so its LRU evicts them so), one batch per block.
Plain: the same batches without the window group's events. Figure: microseconds of
`Normaliser.apply` per batch, hybrid over plain, for windows of 128, 1,024 and 4,096 tokens.
`--head-first` evicts each request's first block first instead: every eviction then cuts a held run
and recomputes the blocks after it, up to the window's length.

    .venv/bin/python -m bench.bench_windows [--requests 200]
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from protocol import block_hashes
from worker_shim.engine_events import FULL, WINDOW, EngineEvent, EngineRemoved, EngineStored
from worker_shim.normaliser import Normaliser

BS = 16
PROMPT = 1024
OUTPUT = 256
KEEP = 4  # requests whose blocks stay cached


def batches(requests: int, window: int, hybrid: bool, head_first: bool = False) -> list[list[EngineEvent]]:
    out: list[list[EngineEvent]] = []
    need = -(-(window - 1) // BS)
    live: deque[list[int]] = deque()
    next_token = 10_000
    shared: list[int] = []
    for _ in range(requests):
        prompt = shared + list(range(next_token, next_token + PROMPT - len(shared)))
        next_token += PROMPT
        output = list(range(next_token, next_token + OUTPUT))
        next_token += OUTPUT
        tokens = prompt + output
        engine = [h ^ 0x5A5A for h in block_hashes(tokens, BS)]  # engine hashes: content's, and opaque
        first = len(shared) // BS  # the shared blocks are cached already: stored from there on
        cut = PROMPT // BS
        parent = engine[first - 1] if first else None
        batch: list[EngineEvent] = []
        if hybrid:
            window_blocks = engine[max(first, cut - need) : cut]
            batch.append(
                EngineStored(window_blocks, parent, tokens[first * BS : cut * BS], BS, kind=WINDOW, window=window)
            )
        batch.append(EngineStored(engine[first:cut], parent, tokens[first * BS : cut * BS], BS, group=1, kind=FULL))
        out.append(batch)
        for i in range(cut, len(engine)):
            step: list[EngineEvent] = [
                EngineStored([engine[i]], engine[i - 1], tokens[i * BS : (i + 1) * BS], BS, group=1)
            ]
            if hybrid:
                step.insert(
                    0,
                    EngineStored(
                        [engine[i]], engine[i - 1], tokens[i * BS : (i + 1) * BS], BS, kind=WINDOW, window=window
                    ),
                )
            out.append(step)
        live.append(engine[first:])
        if len(live) > KEEP:
            evicted = live.popleft()
            for eh in evicted if head_first else reversed(evicted):  # vLLM frees a request's tail first
                evict: list[EngineEvent] = [EngineRemoved([eh], group=1)]
                if hybrid:
                    evict.append(EngineRemoved([eh], group=0))
                out.append(evict)
        shared = prompt[: PROMPT // 2]
    return out


def timed(events: list[list[EngineEvent]]) -> float:
    """Seconds per batch, the best of three passes over a fresh normaliser."""
    best = float("inf")
    for _ in range(3):
        norm = Normaliser(BS)
        started = time.perf_counter()
        for batch in events:
            norm.apply(batch)
        best = min(best, (time.perf_counter() - started) / len(events))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument(
        "--head-first", action="store_true", help="evict each request's first block first: the worst case"
    )
    args = parser.parse_args()
    plain = timed(batches(args.requests, 128, hybrid=False, head_first=args.head_first))
    print(f"plain (full attention only): {plain * 1e6:.1f} us per batch")
    for window in (128, 1024, 4096):
        hybrid = timed(batches(args.requests, window, hybrid=True, head_first=args.head_first))
        print(f"window {window:>5}: {hybrid * 1e6:.1f} us per batch, {hybrid / plain:.2f}x plain")


if __name__ == "__main__":
    main()
