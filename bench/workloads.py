"""Workloads: what a replay sends, and when. Every workload is a list of `WorkItem`s sorted by
arrival; a prompt is kept as segments (see bench/trace.py) and expanded to token ids only when it is
sent, since a whole Mooncake trace expanded at once would need gigabytes.

- `from_trace`: one item per trace record, its arrival time and lengths as recorded.
- `shared_prefix`: `groups` system prompts, each followed by `prompts_per_group` distinct questions;
  Poisson arrivals at `rate` req/s, groups interleaved at random.
- `multi_turn`: sessions of `turns` turns over one shared system prompt; turn t's prompt is the whole
  conversation so far (earlier questions and answers) plus a new question. Sessions start as a
  Poisson process at `session_rate`; turn t arrives `turn_gap_s * t` after its session starts (fixed
  times, as in the Mooncake trace, rather than waiting for the previous answer). The earlier answers
  in the prompt are synthetic tokens, not what the engine generated, so a follow-up turn can hit the
  cache on the earlier prompt but not on the generated answer blocks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.trace import MOONCAKE_BLOCK_TOKENS, Segment, TraceRecord

__all__ = ["WorkItem", "from_trace", "multi_turn", "shared_prefix"]


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request: when it is due (seconds from the start, before `--speed`), its prompt, how many
    tokens to generate, and a tag naming where it came from (`trace:17`, `group2`, `s3/t1`)."""

    arrival_s: float
    segments: tuple[Segment, ...]
    output_len: int
    tag: str

    @property
    def input_len(self) -> int:
        return sum(n for _, n in self.segments)


def from_trace(
    records: Sequence[TraceRecord], *, scale_tokens: float = 1.0, max_input_len: int | None = None
) -> list[WorkItem]:
    """Items for trace records. `scale_tokens` F expands each 512-token hash block to round(512·F)
    tokens (prefix structure kept, prompts F times as long); `max_input_len` caps prompt length."""
    if not 0 < scale_tokens < math.inf:  # NaN fails too
        raise ValueError(f"--scale-tokens must be > 0 and finite, got {scale_tokens:g}")
    if max_input_len is not None and max_input_len < 1:
        raise ValueError(f"--max-input-len must be >= 1, got {max_input_len}")
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * scale_tokens))
    return [
        WorkItem(r.arrival_s, tuple(r.segments(block, max_input_len)), r.output_length, f"trace:{i}")
        for i, r in enumerate(records)
    ]


def _poisson(rng: random.Random, rate: float, n: int) -> list[float]:
    if not rate > 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def shared_prefix(
    *, groups: int, prompts_per_group: int, system_len: int, question_len: int, output_len: int, rate: float, seed: int
) -> list[WorkItem]:
    _positive(
        groups=groups,
        prompts_per_group=prompts_per_group,
        system_len=system_len,
        question_len=question_len,
        output_len=output_len,
    )
    rng = random.Random(seed)
    order = [(g, i) for g in range(groups) for i in range(prompts_per_group)]
    rng.shuffle(order)
    arrivals = _poisson(rng, rate, len(order))
    items = []
    for t, (g, i) in zip(arrivals, order, strict=True):
        question_id = groups + g * prompts_per_group + i  # system prompts take ids 0..groups-1
        items.append(WorkItem(t, ((g, system_len), (question_id, question_len)), output_len, f"group{g}"))
    return items


def multi_turn(
    *,
    sessions: int,
    turns: int,
    system_len: int,
    user_len: int,
    answer_len: int,
    session_rate: float,
    turn_gap_s: float,
    seed: int,
) -> list[WorkItem]:
    _positive(sessions=sessions, turns=turns, system_len=system_len, user_len=user_len, answer_len=answer_len)
    if turn_gap_s < 0:
        raise ValueError(f"turn gap must be >= 0 s, got {turn_gap_s}")
    starts = _poisson(random.Random(seed), session_rate, sessions)
    items = []
    next_id = 1  # id 0 is the shared system prompt
    for s, start in enumerate(starts):
        history: list[Segment] = [(0, system_len)]
        for t in range(turns):
            question = (next_id, user_len)
            answer = (next_id + 1, answer_len)
            next_id += 2
            items.append(WorkItem(start + t * turn_gap_s, (*history, question), answer_len, f"s{s}/t{t}"))
            history += [question, answer]
    items.sort(key=lambda item: item.arrival_s)
    return items
