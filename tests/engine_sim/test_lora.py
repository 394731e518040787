"""LoRA adapters' settings: `--lora-modules` values and the adapters they make (engine_sim/lora.py)."""

from __future__ import annotations

import pytest

from engine_sim import SimConfig, SimConfigError
from engine_sim.lora import LoraModule, LoraRequest, lora_requests


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sql=/adapters/sql", LoraModule("sql", "/adapters/sql")),
        ('{"name": "sql", "path": "/adapters/sql"}', LoraModule("sql", "/adapters/sql")),
        ('{"name": "sql", "path": "p", "base_model_name": "m"}', LoraModule("sql", "p", "m")),
    ],
)
def test_a_module_is_name_equals_path_or_vllms_json(text: str, expected: LoraModule) -> None:
    assert LoraModule.parse(text) == expected


@pytest.mark.parametrize("text", ["sql", '{"name": "sql"}', '{"name": "sql", "path": "p", "rank": 8}'])
def test_a_malformed_module_names_the_flag(text: str) -> None:
    with pytest.raises(SimConfigError, match="--lora-modules"):
        LoraModule.parse(text)


def test_adapters_get_vllms_int_ids_in_the_order_given() -> None:
    loras = lora_requests([LoraModule("b", "/b"), LoraModule("a", "/a")], ("base",))
    assert list(loras.values()) == [LoraRequest("b", 1, "/b"), LoraRequest("a", 2, "/a")]


@pytest.mark.parametrize(
    ("modules", "needle"),
    [
        ([LoraModule("sim-llama", "/p")], "served model"),
        ([LoraModule("a", "/p"), LoraModule("a", "/q")], "twice"),
        ([LoraModule("", "/p")], "a name and a path"),
        ([LoraModule("a", "")], "a name and a path"),
    ],
)
def test_config_refuses_a_bad_adapter_naming_the_flag(modules: list[LoraModule], needle: str) -> None:
    with pytest.raises(SimConfigError, match="--lora-modules") as exc:
        SimConfig(lora_modules=tuple(modules)).validate()
    assert needle in str(exc.value)
