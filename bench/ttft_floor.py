"""The TTFT floor: the best time to first token any router could give a workload's requests.

Per request, its prefill on an engine that already holds every prefix any earlier request of the
workload brought: one cache for the whole fleet that never evicts, no queue, no network hops. Only
the part of the prompt no earlier request had is computed, over the cached part as context, in the
chunks a scheduler would cut, each at the least the engines' own timing model charges for it: a
prefill step of its own, or its marginal beside other work (`TimingModel.marginal`: a chunk in a
mixed step can cost less than alone), with nothing else's time counted in its steps.

No router on any fleet of these engines beats it for a request it serves: real caches are split
across workers and evict, queues form, and hops cost time. So round robin's TTFT p90 over the
floor's p90 is the most any routing could improve on round robin at that point. It bounds the
routers' served requests only as long as they serve all of them: a router that refused the
longest prompts could report a lower p90.

A prefix is matched by segment chain (bench.workloads: equal segment ids are equal tokens), and a
matched segment counts as cached in full even where an earlier one with the same id was shorter,
so the floor errs low, never high. Cached tokens are whole blocks and leave the last prompt token
to compute, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bench.workloads import WorkItem
from protocol.timing import TimingModel

__all__ = ["ceiling_cached", "floor_p90", "ttft_floor"]


def ttft_floor(
    items: Sequence[WorkItem], model: TimingModel, *, budget: int, block_size: int, max_num_seqs: int
) -> list[float]:
    """Seconds, one per item in arrival order; `budget`, `block_size` and `max_num_seqs` are the
    engines'."""
    ordered = sorted(items, key=lambda i: i.arrival_s)
    return [
        _least_prefill(model, item.input_len - cached, cached, budget, max_num_seqs)
        for item, cached in zip(ordered, ceiling_cached(ordered, block_size), strict=True)
    ]


def ceiling_cached(items: Sequence[WorkItem], block_size: int) -> list[int]:
    """Prompt tokens per item (in the order given, which must be arrival order) that one cache for
    the whole fleet, never evicting, would hold when it arrives: the single-cache ceiling of any
    router's prefix hit rate."""
    seen: set[int] = set()
    out = []
    for item in items:
        chain, matched, prefix = 0, True, 0
        for seg_id, n in item.segments:
            chain = hash((chain, seg_id))
            if matched and chain in seen:
                prefix += n
            else:
                matched = False
                seen.add(chain)
        out.append(min(prefix // block_size * block_size, (item.input_len - 1) // block_size * block_size))
    return out


def _least_prefill(model: TimingModel, new: int, cached: int, budget: int, max_num_seqs: int) -> float:
    # The marginal is linear in the decode batch beside it, so its least is at an end of the range.
    total, done = 0.0, 0
    while done < new:
        n, c = min(budget, new - done), cached + done
        total += min(model.prefill(n, c), model.marginal(n, c, 0), model.marginal(n, c, max_num_seqs))
        done += n
    return total


def floor_p90(
    items: Sequence[WorkItem], model: TimingModel, *, budget: int, block_size: int, max_num_seqs: int
) -> float:
    floor = ttft_floor(items, model, budget=budget, block_size=block_size, max_num_seqs=max_num_seqs)
    return float(np.percentile(floor, 90))
