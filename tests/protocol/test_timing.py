from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.timing import load_profile, profile_names

PROFILE = json.loads((Path(__file__).parents[2] / "protocol" / "profiles" / "h200.json").read_text())


def _model(name: str) -> dict:  # type: ignore[type-arg]
    return next(m for m in PROFILE["models"] if m["model"] == name)


def test_known_profiles() -> None:
    assert {"h200:llama-3.1-8b", "h200:qwen2.5-32b"} <= set(profile_names())


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen2.5-32b"])
def test_measured_points_are_reproduced_exactly(model: str) -> None:
    p = load_profile(f"h200:{model}")
    for pt in _model(model)["prefill"]:
        assert p.prefill_s(pt["new_tokens"], pt["cached_tokens"]) == pytest.approx(pt["seconds"], rel=1e-9)
    for pt in _model(model)["decode"]:
        assert p.decode_s(pt["batch"], pt["context_tokens"]) == pytest.approx(pt["seconds"], rel=1e-9)


def test_interpolation_lies_between_neighbours() -> None:
    p = load_profile("h200:llama-3.1-8b")
    assert p.prefill_s(1024) < p.prefill_s(1500) < p.prefill_s(2048)
    assert p.decode_s(64, 1024) < p.decode_s(64, 2000) < p.decode_s(64, 4096)


def test_zero_work_costs_nothing_and_transfer_scales() -> None:
    p = load_profile("h200:llama-3.1-8b")
    assert p.prefill_s(0) == 0.0 and p.decode_s(0, 100) == 0.0
    assert p.transfer_s(1000, 50.0) == pytest.approx(1000 * 131072 / 50e9)
    assert p.decode_stall_s(2048) > p.decode_stall_s(256) > 0


def test_unknown_profile_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown timing profile 'a100:x'; known: h200:llama-3.1-8b"):
        load_profile("a100:x")
