"""Mooncake trace loading and token synthesis: equal hash ids give identical blocks, lengths exact."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from bench.trace import TOKEN_HIGH, TOKEN_LOW, TokenSynth, TraceError, TraceRecord, load_trace, shipped_trace


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(ts: float, input_length: int, hash_ids: list[int], output_length: int = 5) -> dict[str, object]:
    return {"timestamp": ts, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids}


def test_equal_hash_ids_expand_to_identical_blocks() -> None:
    synth = TokenSynth(seed=0)
    a = synth.expand(TraceRecord(0.0, 1536, 5, (1, 2, 3)).segments())
    b = synth.expand(TraceRecord(0.0, 1536, 5, (1, 2, 4)).segments())
    assert a[:1024] == b[:1024]
    assert a[1024:] != b[1024:]


def test_same_id_at_another_position_is_the_same_block() -> None:
    synth = TokenSynth(seed=0)
    a = synth.expand(TraceRecord(0.0, 1024, 5, (7, 9)).segments())
    b = synth.expand(TraceRecord(0.0, 1024, 5, (9, 7)).segments())
    assert a[:512] == b[512:] and a[512:] == b[:512]


def test_expansion_is_deterministic_across_instances_and_depends_on_seed() -> None:
    segs = TraceRecord(0.0, 700, 5, (3, 5)).segments()
    assert TokenSynth(seed=1).expand(segs) == TokenSynth(seed=1).expand(segs)
    assert TokenSynth(seed=1).expand(segs) != TokenSynth(seed=2).expand(segs)


def test_a_cut_segment_is_a_prefix_of_the_full_one_in_any_order() -> None:
    short_first = TokenSynth(seed=0)
    short = short_first.stream(42, 100).tolist()
    full = short_first.stream(42, 512).tolist()
    fresh_full = TokenSynth(seed=0).stream(42, 512).tolist()
    assert full == fresh_full
    assert short == full[:100]


def test_tokens_are_in_the_builtin_vocabulary_words() -> None:
    tokens = TokenSynth().expand([(i, 512) for i in range(20)])
    assert min(tokens) >= TOKEN_LOW and max(tokens) < TOKEN_HIGH


@pytest.mark.parametrize(
    ("input_length", "hash_ids", "scale", "max_len", "expected"),
    [
        (1000, (1, 2), 1.0, None, 1000),  # last block cut to 488
        (1024, (1, 2), 1.0, None, 1024),
        (1, (1,), 1.0, None, 1),
        (1000, (1, 2), 0.25, None, 250),  # blocks of 128
        (40160, tuple(range(79)), 1.0, 4096, 4096),
    ],
)
def test_prompt_length_is_exact(
    input_length: int, hash_ids: tuple[int, ...], scale: float, max_len: int | None, expected: int
) -> None:
    block = round(512 * scale)
    segs = TraceRecord(0.0, input_length, 5, hash_ids).segments(block, max_len)
    assert len(TokenSynth().expand(segs)) == expected
    assert all(n == block for _, n in segs[:-1])


def test_scaled_blocks_keep_the_prefix_structure() -> None:
    synth = TokenSynth()
    a = synth.expand(TraceRecord(0.0, 1536, 5, (1, 2, 3)).segments(64))
    b = synth.expand(TraceRecord(0.0, 1536, 5, (1, 2, 8)).segments(64))
    assert len(a) == 192 and a[:128] == b[:128] and a[128:] != b[128:]


def test_load_converts_ms_to_seconds_and_rebases_a_window(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_row(ts, 512, [i]) for i, ts in enumerate([0, 500, 1500, 2500, 4000])])
    assert [r.arrival_s for r in load_trace(path)] == [0.0, 0.5, 1.5, 2.5, 4.0]
    window = load_trace(path, start_s=1.0, duration_s=2.0)
    assert [(r.arrival_s, r.hash_ids) for r in window] == [(0.0, (2,)), (1.0, (3,))]
    assert [r.hash_ids for r in load_trace(path, limit=2)] == [(0,), (1,)]


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("{not json", "not a Mooncake record"),
        (json.dumps({"timestamp": 0, "input_length": 5}), "not a Mooncake record"),
        (json.dumps(_row(0, 1500, [1, 2])), "does not fit 2 blocks"),
        (json.dumps(_row(0, 100, [1, 2])), "does not fit 2 blocks"),
        (json.dumps(_row(0, 100, [])), "hash_ids is empty"),
        (json.dumps(_row(0, 100, [1], output_length=0)), "output_length 0"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, row: str, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_row(0, 10, [0])) + "\n" + row + "\n")
    with pytest.raises(TraceError, match=reason) as info:
        load_trace(path)
    assert info.value.line == 2 and str(path) in str(info.value)


def test_timestamps_going_back_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_row(1000, 10, [0]), _row(500, 10, [1])])
    with pytest.raises(TraceError, match="back in time"):
        load_trace(path)


def test_shipped_trace_loads_whole_and_fits_its_blocks() -> None:
    records = load_trace(shipped_trace())
    assert len(records) == 3993
    assert records[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(records))
    assert all(sum(n for _, n in r.segments()) == r.input_length for r in records)
