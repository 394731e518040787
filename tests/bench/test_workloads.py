"""Workloads: trace items keep arrivals and lengths; shared-prefix groups and multi-turn sessions
share exactly the prefixes they should."""

from __future__ import annotations

import itertools

import pytest

from bench.trace import TokenSynth, TraceRecord
from bench.workloads import from_trace, multi_turn, shared_prefix


def test_trace_items_keep_arrival_times_and_output_lengths() -> None:
    records = [TraceRecord(0.0, 600, 7, (1, 2)), TraceRecord(1.25, 512, 3, (1,))]
    items = from_trace(records)
    assert [(i.arrival_s, i.output_len, i.input_len) for i in items] == [(0.0, 7, 600), (1.25, 3, 512)]
    assert [i.tag for i in items] == ["trace:0", "trace:1"]


@pytest.mark.parametrize(("scale", "max_len"), [(0.0, None), (-1.0, None), (1.0, 0)])
def test_trace_item_options_are_checked(scale: float, max_len: int | None) -> None:
    with pytest.raises(ValueError, match="must be"):
        from_trace([TraceRecord(0.0, 600, 7, (1, 2))], scale_tokens=scale, max_input_len=max_len)


def test_shared_prefix_groups_share_only_their_system_prompt() -> None:
    items = shared_prefix(groups=3, prompts_per_group=4, system_len=64, question_len=16, output_len=8, rate=10, seed=1)
    assert len(items) == 12
    assert [i.arrival_s for i in items] == sorted(i.arrival_s for i in items)
    synth = TokenSynth()
    prompts: dict[str, list[list[int]]] = {}
    for item in items:
        prompts.setdefault(item.tag, []).append(synth.expand(item.segments))
        assert item.input_len == 80 and item.output_len == 8
    assert sorted(prompts) == ["group0", "group1", "group2"]
    for group in prompts.values():
        assert len({tuple(p[:64]) for p in group}) == 1
        assert len({tuple(p[64:]) for p in group}) == 4
    assert len({tuple(g[0][:64]) for g in prompts.values()}) == 3


def test_shared_prefix_is_reproducible_from_its_seed() -> None:
    def make(seed: int) -> list[float]:
        kw = {"groups": 2, "prompts_per_group": 5, "system_len": 8, "question_len": 8, "output_len": 1, "rate": 5.0}
        return [i.arrival_s for i in shared_prefix(**kw, seed=seed)]  # type: ignore[arg-type]

    assert make(3) == make(3)
    assert make(3) != make(4)


def test_multi_turn_prompts_extend_the_previous_turn() -> None:
    items = multi_turn(
        sessions=2, turns=3, system_len=32, user_len=8, answer_len=4, session_rate=1.0, turn_gap_s=2.0, seed=0
    )
    assert len(items) == 6
    synth = TokenSynth()
    for s in range(2):
        turns = sorted((i for i in items if i.tag.startswith(f"s{s}/")), key=lambda i: i.tag)
        assert [i.input_len for i in turns] == [40, 52, 64]
        assert turns[1].arrival_s - turns[0].arrival_s == pytest.approx(2.0)
        prompts = [synth.expand(i.segments) for i in turns]
        for earlier, later in itertools.pairwise(prompts):
            assert later[: len(earlier)] == earlier
    first_turns = [synth.expand(i.segments) for i in items if i.tag.endswith("/t0")]
    assert first_turns[0][:32] == first_turns[1][:32] and first_turns[0][32:] != first_turns[1][32:]


@pytest.mark.parametrize("field", ["groups", "prompts_per_group", "system_len", "question_len", "output_len"])
def test_shared_prefix_sizes_must_be_positive(field: str) -> None:
    kw = {"groups": 1, "prompts_per_group": 1, "system_len": 1, "question_len": 1, "output_len": 1}
    kw[field] = 0
    with pytest.raises(ValueError, match=field):
        shared_prefix(**kw, rate=1.0, seed=0)


def test_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rate must be > 0"):
        shared_prefix(groups=1, prompts_per_group=1, system_len=1, question_len=1, output_len=1, rate=0.0, seed=0)
