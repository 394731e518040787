"""The one timing model (protocol/timing.py) against the H200 profiles, and its compositions."""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protocol.errors import VariableError
from protocol.timing import (
    DEFAULT_PROFILE,
    MAX_SPEEDUP,
    MIN_SPEEDUP,
    TimingModel,
    fit_marginal,
    load_profile,
    mixed_marginals,
    profile_names,
    speed_profile,
)

ROOT = Path(__file__).parents[2]
PROFILE = json.loads((ROOT / "protocol" / "profiles" / "h200.json").read_text())
LLAMA = "h200:llama-3.1-8b"
QWEN = "h200:qwen2.5-32b"


def _model(name: str) -> dict:  # type: ignore[type-arg]
    return next(m for m in PROFILE["models"] if m["model"] == name)


def test_known_profiles() -> None:
    assert {LLAMA, QWEN} <= set(profile_names())
    assert DEFAULT_PROFILE == LLAMA


def test_the_profiles_exist_once() -> None:
    tables = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("*/**/h200*.json") if ".venv" not in p.parts)
    assert tables == ["protocol/profiles/h200.json", "protocol/profiles/h200_mixed.json"]


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen2.5-32b"])
def test_measured_points_are_reproduced_exactly(model: str) -> None:
    tm = TimingModel.for_profile(f"h200:{model}")
    for pt in _model(model)["prefill"]:
        assert tm.prefill(pt["new_tokens"], pt["cached_tokens"]) == pytest.approx(pt["seconds"], rel=1e-9)
        assert tm.step(0, 0, [(pt["new_tokens"], pt["cached_tokens"])]) == pytest.approx(pt["seconds"], rel=1e-9)
    for pt in _model(model)["decode"]:
        assert tm.decode(pt["batch"], pt["context_tokens"]) == pytest.approx(pt["seconds"], rel=1e-9)
        assert tm.step(pt["batch"], pt["context_tokens"], []) == pytest.approx(pt["seconds"], rel=1e-9)


def test_interpolation_is_monotone_between_points() -> None:
    tm = TimingModel.for_profile(LLAMA)
    assert tm.prefill(1024) < tm.prefill(1500) < tm.prefill(2048)
    assert tm.prefill(2048, 0) < tm.prefill(2048, 2048) < tm.prefill(2048, 4096)
    assert tm.decode(64, 1024) < tm.decode(64, 2000) < tm.decode(64, 4096)
    assert tm.decode(32, 1024) < tm.decode(48, 1024) < tm.decode(64, 1024)
    assert tm.prefill(65536) > tm.prefill(32768)  # extrapolates past the table


def test_zero_work_costs_nothing() -> None:
    tm = TimingModel.for_profile(LLAMA)
    assert tm.prefill(0) == tm.decode(0, 100) == tm.marginal(0, 100, 8) == tm.step(0, 0, []) == 0.0
    assert tm.prefill_time(0, 0, budget=8192) == tm.stall(0, 0, 8, budget=8192) == 0.0


def test_transfer_time_is_bytes_over_bandwidth() -> None:
    assert TimingModel.for_profile(LLAMA).transfer(1000, 50.0) == pytest.approx(1000 * 131072 / 50e9)
    assert TimingModel.for_profile(QWEN).transfer(1000, 50.0) == pytest.approx(1000 * 262144 / 50e9)


def test_marginal_fit_is_the_least_squares_solution() -> None:
    rows = np.array(mixed_marginals(), dtype=float)
    batch, n, c, y = rows[:, 0], rows[:, 2], rows[:, 3], rows[:, 4]
    want = np.linalg.lstsq(np.c_[n, n * (c + n / 2), batch * n], y, rcond=None)[0]
    fit = fit_marginal()
    assert [fit.a, fit.b, fit.e] == pytest.approx(list(want), rel=1e-9)


def test_mixed_marginal_fit_error_is_bounded() -> None:
    """The fitted marginal cost of a prefill chunk beside a decode batch, against h200_mixed.json."""
    fit = fit_marginal()
    rows = mixed_marginals()
    errors = [abs(fit(n, c, b) - m) for b, _, n, c, m in rows]
    assert len(rows) == 48
    assert sum(errors) / len(errors) < 0.0025  # mean absolute error < 2.5 ms
    assert max(errors) < 0.012
    # Chunks of 2048 tokens (what a busy engine schedules) are within 15% everywhere; smaller ones
    # carry the eager profile's noise (protocol/timing.py's docstring states the error).
    big = [(fit(n, c, b), m) for b, _, n, c, m in rows if n >= 2048]
    assert all(abs(p - m) / m < 0.15 for p, m in big)


def test_mixed_step_costs_decode_plus_marginal() -> None:
    tm = TimingModel.for_profile(LLAMA)
    alone = tm.decode(64, 1024)
    mixed = tm.step(64, 1024, [(1024, 0)])
    assert mixed == pytest.approx(alone + tm.marginal(1024, 0, 64))
    assert 0.015 < mixed - alone < 0.025  # h200_mixed.json measured +19.2 ms for this shape


def test_other_models_scale_the_marginal_by_their_prefill_ratio() -> None:
    llama, qwen = TimingModel.for_profile(LLAMA), TimingModel.for_profile(QWEN)
    ratio = qwen.prefill(2048, 1024) / llama.prefill(2048, 1024)
    assert qwen.marginal(2048, 1024, 32) == pytest.approx(llama.marginal(2048, 1024, 32) * ratio)


def test_prefill_time_is_the_scheduler_chunks_summed() -> None:
    tm = TimingModel.for_profile(LLAMA)
    # Alone: one prefill step per chunk of the budget.
    assert tm.prefill_time(20000, 0, budget=8192) == pytest.approx(
        tm.prefill(8192, 0) + tm.prefill(8192, 8192) + tm.prefill(3616, 16384)
    )
    # Beside 100 decodes at context 1000 the prompt gets 8092 tokens a step, and the decodes grow.
    want = tm.step(100, 1000, [(8092, 0)]) + tm.step(100, 1001, [(1908, 8092)])
    assert tm.prefill_time(10000, 0, budget=8192, decode_batch=100, decode_context=1000) == pytest.approx(want)
    assert tm.stall(10000, 0, 100, budget=8192) == pytest.approx(
        tm.marginal(8092, 0, 100) + tm.marginal(1908, 8092, 100)
    )
    assert tm.stall(10000, 0, 0, budget=8192) == 0.0  # nobody to stall
    assert tm.prefill_time(10, 0, budget=64, decode_batch=64) == math.inf  # no room beside the decodes


@pytest.mark.parametrize("factor", [0.5, 1.25])
def test_scaled_model_multiplies_every_coefficient(factor: float) -> None:
    tm = TimingModel.for_profile(LLAMA)
    wrong = tm.scaled(factor)
    assert wrong.prefill(3000, 500) == pytest.approx(factor * tm.prefill(3000, 500))
    assert wrong.decode(48, 3000) == pytest.approx(factor * tm.decode(48, 3000))
    assert wrong.marginal(512, 4096, 32) == pytest.approx(factor * tm.marginal(512, 4096, 32))
    assert wrong.step(8, 100, [(64, 0)]) == pytest.approx(factor * tm.step(8, 100, [(64, 0)]))
    assert wrong.transfer(1000, 25.0) == pytest.approx(factor * tm.transfer(1000, 25.0))
    assert wrong.prefill_time(9000, 0, budget=2048, decode_batch=4, decode_context=300) == pytest.approx(
        factor * tm.prefill_time(9000, 0, budget=2048, decode_batch=4, decode_context=300)
    )
    assert wrong.scaled(2.0).decode(1, 100) == pytest.approx(2 * factor * tm.decode(1, 100))
    assert tm.scale == 1.0 and TimingModel.for_profile(LLAMA).scale == 1.0  # the shared model is untouched


def test_scale_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        TimingModel.for_profile(LLAMA).scaled(0.0)


@pytest.mark.parametrize(("speedup", "name"), [(10.0, f"{LLAMA}@10x"), (2.5, f"{LLAMA}@2.5x"), (1 / 3, None)])
def test_a_profile_at_a_speedup_divides_every_time_by_it(speedup: float, name: str | None) -> None:
    """What a sim at --speedup S runs, and what `kvswitch up` registers for its shim: the routers
    read it S times as fast as the profile."""
    tm = TimingModel.for_profile(LLAMA)
    named = speed_profile(LLAMA, speedup)
    assert name is None or named == name
    fast = TimingModel.for_profile(named)
    assert fast.prefill(3000, 500) == pytest.approx(tm.prefill(3000, 500) / speedup)
    assert fast.decode(48, 3000) == pytest.approx(tm.decode(48, 3000) / speedup)
    assert fast.transfer(1000, 25.0) == pytest.approx(tm.transfer(1000, 25.0) / speedup)
    assert fast.prefill_time(9000, 0, budget=2048, decode_batch=4, decode_context=300) == pytest.approx(
        tm.prefill_time(9000, 0, budget=2048, decode_batch=4, decode_context=300) / speedup
    )
    assert fast.profile == tm.profile and tm.scale == 1.0


def test_a_profile_at_speed_1_is_the_profile_and_bad_speeds_are_refused() -> None:
    assert speed_profile(LLAMA, 1.0) == LLAMA
    for speedup in (0.0, -2.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"a profile's speed-up must be a number in 0\.001\.\.1000000"):
            speed_profile(LLAMA, speedup)
    with pytest.raises(ValueError, match=r"'h200:llama-3.1-8b@0x': the speed-up after '@' must be a number in"):
        TimingModel.for_profile(LLAMA + "@0x")
    # Not `@`, a plain decimal number and `x`: no speed-up, so no such profile, and how one is written
    for bad in ("@10", "@x", "@-1x", "@infx", "@nanx", "@tenx"):
        with pytest.raises(ValueError, match=r"unknown timing profile .*a speed-up ends the name once: @\{S\}x"):
            TimingModel.for_profile(LLAMA + bad)
    with pytest.raises(ValueError, match="unknown timing profile 'h200:no-such-model'"):
        TimingModel.for_profile("h200:no-such-model@10x")


@pytest.mark.parametrize("speedup", [1e-320, 1e-4, 0.000999, 1000000.5, 1e300])
def test_a_speedup_past_its_bounds_is_refused(speedup: float) -> None:
    """Review of 3a2a9c4: `@1e-320x` passed (1 / S is inf: every time infinite, and a router divided
    a backlog by a prefill rate of 0.0), as did `kvswitch up --speedup 1e-320`."""
    with pytest.raises(ValueError, match=r"a profile's speed-up must be a number in 0\.001\.\.1000000 .*, got "):
        speed_profile(LLAMA, speedup)
    written = f"{LLAMA}@{format(Decimal(repr(speedup)), 'f')}x"  # as a hand would write it: no exponent
    with pytest.raises(ValueError, match=r"the speed-up after '@' must be a number in 0\.001\.\.1000000"):
        TimingModel.for_profile(written)


@pytest.mark.parametrize(("speedup", "name"), [(MIN_SPEEDUP, f"{LLAMA}@0.001x"), (MAX_SPEEDUP, f"{LLAMA}@1000000x")])
def test_a_speedup_at_its_bounds_is_a_profile(speedup: float, name: str) -> None:
    """1e6 was written `@1e+06x`, which no longer reads as a speed-up."""
    assert speed_profile(LLAMA, speedup) == name
    tm, fast = TimingModel.for_profile(LLAMA), TimingModel.for_profile(name)
    assert fast.decode(48, 3000) == pytest.approx(tm.decode(48, 3000) / speedup)
    assert math.isfinite(fast.prefill(3000, 500)) and fast.prefill(3000, 500) > 0


@pytest.mark.parametrize(
    "bad", ["@10x@2x", "@ 10x", "@10 x", "@1_0x", "@1e1x", "@+10x", "@10.x", "@.5x", "@10X", "@\u0661\u0660x"]
)
def test_a_speedup_is_one_plain_decimal_number(bad: str) -> None:
    """Review of 3a2a9c4: float() read each of these (`@10x@2x` as 20x, a speed-up per `@`); only
    ASCII digits with at most one `.`, once, at the end, are a speed-up now."""
    with pytest.raises(ValueError, match=r"unknown timing profile .*a speed-up ends the name once"):
        TimingModel.for_profile(LLAMA + bad)


def test_a_table_or_model_with_an_at_sign_is_a_profile_at_any_speed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of 3a2a9c4: `profile_names` listed `lab@h200:llama-3.1-8b` and `load_profile` loaded it,
    but its `@` was read as a speed-up, refused (`after '@' give the engine's speed-up`) by every
    shim's check and router, and `kvswitch up --profile` of it was refused."""
    (tmp_path / "lab@h200.json").write_text(json.dumps({"models": [{**_model("llama-3.1-8b"), "model": "m@v2"}]}))
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    name = "lab@h200:m@v2"
    assert name in profile_names()
    llama, mine = TimingModel.for_profile(LLAMA), TimingModel.for_profile(name)
    assert mine.profile.name == name and mine.prefill(3000, 500) == pytest.approx(llama.prefill(3000, 500))
    fast = TimingModel.for_profile(speed_profile(name, 4.0))
    assert speed_profile(name, 4.0) == f"{name}@4x" and fast.profile.name == name
    assert fast.decode(48, 3000) == pytest.approx(llama.decode(48, 3000) / 4)


def test_unknown_profile_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown timing profile 'a100:x'; known: h200:llama-3.1-8b"):
        load_profile("a100:x")
    with pytest.raises(ValueError, match="unknown timing profile"):
        TimingModel.for_profile("h200:no-such-model")


def test_operator_tables_come_from_kvswitch_profile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    twice = {**_model("llama-3.1-8b"), "model": "my-8b"}
    for key in ("prefill", "decode"):
        twice[key] = [{**p, "seconds": 2 * p["seconds"]} for p in twice[key]]
    (tmp_path / "a100.json").write_text(json.dumps({"models": [twice]}))
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    assert "a100:my-8b" in profile_names()
    mine, llama = TimingModel(load_profile.__wrapped__("a100:my-8b")), TimingModel.for_profile(LLAMA)
    assert mine.prefill(2048, 0) == pytest.approx(2 * llama.prefill(2048, 0))
    assert mine.decode(16, 2048) == pytest.approx(2 * llama.decode(16, 2048))
    # No a100_mixed.json: the reference fit, scaled by the prefill ratio (2x here).
    assert mine.marginal(1024, 0, 64) == pytest.approx(2 * llama.marginal(1024, 0, 64))


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_profile_dir_that_is_no_directory_is_refused(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit 2026-12-07: it was skipped, so an operator's own h200.json gave way to the built-in
    table of that name without a word."""
    given = tmp_path / kind
    if kind == "file":
        given.write_text("{}")
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(given))
    for read in (profile_names, lambda: load_profile.__wrapped__(LLAMA)):
        with pytest.raises(VariableError) as err:
            read()
        assert str(err.value).startswith(f"KVSWITCH_PROFILE_DIR = '{given}' names no directory"), err.value
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", "")  # empty is unset, as before
    assert LLAMA in profile_names()


# --- operators' tables that are malformed (KVSWITCH_PROFILE_DIR) --------------------------------


def _table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, content: object) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    return path


def _broken(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    model = copy.deepcopy({**_model("llama-3.1-8b"), "model": "m"})
    change(model)
    return model


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda m: m.pop("decode"), "missing `decode`"),
        (lambda m: m.pop("kv_bytes_per_token_bf16"), "missing `kv_bytes_per_token_bf16`"),
        (lambda m: m.update(kv_bytes_per_token_bf16="128k"), "`kv_bytes_per_token_bf16` must be an integer"),
        (lambda m: m.update(params=[8]), "`params` must be an integer"),
        (lambda m: m.update(prefill=[]), "`prefill` must be a non-empty list"),
        (lambda m: m.update(decode={"batch": 1}), "`decode` must be a non-empty list"),
        (lambda m: m.update(decode=[1, 2]), "`decode[0]` is not an object"),
        (lambda m: m["decode"][3].pop("seconds"), "`decode[3]`: missing `seconds`"),
        (lambda m: m["prefill"][0].update(seconds="fast"), "`prefill[0]`: `seconds` must be a finite number"),
        (lambda m: m["prefill"][0].update(seconds=float("nan")), "`prefill[0]`: `seconds` must be a finite number"),
        (lambda m: m["prefill"][1].update(new_tokens=-16), "`prefill[1]`: `new_tokens` must be an integer >= 0"),
        (lambda m: m["decode"].append(dict(m["decode"][0])), "`decode[36]` repeats batch 1, context_tokens 256"),
        # review of 2026-12-06: these loaded, then divided by zero in the sims and the routers' admission
        (lambda m: m.update(kv_bytes_per_token_bf16=0), "`kv_bytes_per_token_bf16` must be an integer >= 1, got 0"),
        (
            lambda m: m.update(
                prefill=[p for p in m["prefill"] if p["cached_tokens"] != 16384 or p["new_tokens"] == 1024]
            ),
            "`prefill` has one point at cached_tokens 16384 (new_tokens 1024); "
            "each cached_tokens needs >= 2 new_tokens values",
        ),
        (
            lambda m: m.update(decode=[p for p in m["decode"] if p["context_tokens"] != 256 or p["batch"] == 1]),
            "`decode` has one point at context_tokens 256 (batch 1); each context_tokens needs >= 2 batch values",
        ),
    ],
)
def test_a_malformed_operator_table_is_a_value_error_naming_the_file_and_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Callable[[dict[str, Any]], object], words: str
) -> None:
    """Audit 2026-12-04: a table without `decode` raised KeyError from load_profile, past the
    router's `except ValueError`, and every request planned for the model failed with a 500."""
    path = _table(tmp_path, monkeypatch, "mygpu.json", {"models": [_broken(change)]})
    assert "mygpu:m" in profile_names()  # the name is known: what is wrong is in the table
    with pytest.raises(ValueError) as err:
        load_profile.__wrapped__("mygpu:m")
    assert f"timing table {path}, model 'm': {words}" in str(err.value)


def test_counts_written_as_whole_floats_are_those_integers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`8.03e9` or `256.0` is how many tools write a count: the loader took it before it checked
    the table, and the check refused the whole table (review of the table checks)."""

    def floats(m: dict[str, Any]) -> None:
        m.update(kv_bytes_per_token_bf16=float(m["kv_bytes_per_token_bf16"]), params=8.03e9)
        for p in m["decode"]:
            p.update(batch=float(p["batch"]), context_tokens=float(p["context_tokens"]))

    _table(tmp_path, monkeypatch, "mygpu.json", {"models": [_broken(floats)]})
    loaded, llama = load_profile.__wrapped__("mygpu:m"), load_profile.__wrapped__(LLAMA)
    assert loaded.params == 8_030_000_000 and isinstance(loaded.params, int)
    assert loaded.kv_bytes_per_token == llama.kv_bytes_per_token and loaded.decode == llama.decode
    _table(tmp_path, monkeypatch, "mygpu.json", {"models": [_broken(lambda m: m["decode"][0].update(batch=1.5))]})
    with pytest.raises(ValueError, match=r"`batch` must be an integer >= 0, got 1\.5"):
        load_profile.__wrapped__("mygpu:m")


@pytest.mark.parametrize("content", ["[1, 2]", '{"models": 3}', '{"models": [1]}', "{not json", '"x"', "\xff"])
def test_a_json_file_that_is_no_table_names_no_profile_and_loading_it_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    """A `[1, 2]` notes.json beside the tables raised AttributeError from profile_names()."""
    path = _table(tmp_path, monkeypatch, "notes.json", content)
    names = profile_names()
    assert {LLAMA, QWEN} <= set(names) and not [n for n in names if n.startswith("notes:")]
    with pytest.raises(ValueError, match=f"timing table {path}: "):
        load_profile.__wrapped__("notes:x")
    with pytest.raises(ValueError, match="unknown timing profile 'other:x'"):
        load_profile.__wrapped__("other:x")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ([1], "not a JSON object"),
        ({"model": "m", "steps": 3}, "not a JSON object with a `steps` list"),
        ({"model": "m", "steps": [{"batch": 1}]}, "`steps[0]`: missing `context_tokens`"),
        (
            {
                "model": "m",
                "steps": [
                    {"batch": 1, "context_tokens": 8, "chunk_tokens": 0, "cached_tokens": 0, "seconds": 0.01},
                    {"batch": 1, "context_tokens": 8, "chunk_tokens": 16, "cached_tokens": 0, "seconds": 0.02},
                ],
            },
            "too few distinct steps",
        ),
    ],
)
def test_a_malformed_mixed_table_is_a_value_error_for_the_timing_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: object, words: str
) -> None:
    """The router builds a TimingModel (which reads `{table}_mixed.json`) and takes only ValueError."""
    _table(tmp_path, monkeypatch, "mygpu.json", {"models": [_broken(lambda m: None)]})
    path = _table(tmp_path, monkeypatch, "mygpu_mixed.json", content)
    with pytest.raises(ValueError, match=re.escape(f"timing table {path}")) as err:
        TimingModel(load_profile.__wrapped__("mygpu:m"))
    assert words in str(err.value)


def test_an_unknown_model_at_a_well_written_speedup_gets_no_hint_on_writing_one() -> None:
    """The hint is for a speed-up written wrong; a right one on an unknown model pointed the
    operator at the part of the name that was right (final read of 432f06f)."""
    with pytest.raises(ValueError) as known:
        TimingModel.for_profile("h200:nope@10x")
    assert "unknown timing profile 'h200:nope'" in str(known.value) and "ends the name once" not in str(known.value)
    with pytest.raises(ValueError, match="ends the name once"):
        TimingModel.for_profile("h200:llama-3.1-8b@10")
