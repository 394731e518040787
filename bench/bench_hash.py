"""Canonical block hashing throughput (issue 2's benchmark).

    .venv/bin/python -m bench.bench_hash [--tokens 8192] [--seconds 2]

Tokens per second for 8k-token prompts (a Python list of ids, as the router and shim hold them) at
block sizes 16 and 64, on one core. When `ai-dynamo-runtime` is installed, Dynamo's
`compute_block_hash_for_seq` runs on the same prompts in the same process and the ratio is
printed. Targets: >= 50 M tokens/s at block size 16; at 64, >= 2x Dynamo.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from protocol.hashing import block_hashes

Hasher = Callable[[list[int], int], object]


def _rate(fn: Hasher, prompts: list[list[int]], block_size: int, seconds: float) -> float:
    """Tokens/s: best of 5 rounds, each at least seconds/5 long."""
    best = 0.0
    for _ in range(5):
        n = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 5:
            for p in prompts:
                fn(p, block_size)
            n += sum(len(p) for p in prompts)
        best = max(best, n / elapsed)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(128_000) for _ in range(args.tokens)] for _ in range(8)]
    dynamo_hash: Hasher | None = None
    try:
        from dynamo.llm import compute_block_hash_for_seq

        dynamo_hash = compute_block_hash_for_seq
    except ImportError:
        print("ai-dynamo-runtime not installed: no Dynamo baseline (pip install ai-dynamo-runtime==1.6.1)")
    print(f"prompts of {args.tokens} tokens; best of 5 rounds")
    print(f"{'block':>5} {'kvswitch Mtok/s':>16} {'dynamo Mtok/s':>14} {'ratio':>6}")
    for bs in (16, 64):
        ours = _rate(block_hashes, prompts, bs, args.seconds)
        if dynamo_hash is not None:
            theirs = _rate(dynamo_hash, prompts, bs, args.seconds)
            print(f"{bs:>5} {ours / 1e6:>16.1f} {theirs / 1e6:>14.1f} {ours / theirs:>5.2f}x")
        else:
            print(f"{bs:>5} {ours / 1e6:>16.1f} {'-':>14} {'-':>6}")


if __name__ == "__main__":
    main()
