"""A live `null` clears an Optional router setting whichever layer (flag, environment, file) set it."""

from __future__ import annotations

import types
from typing import cast

import pytest

from discovery import ConfigWatcher, Discovery

NO_DISCOVERY = cast(Discovery, types.SimpleNamespace(ns="ns"))  # _apply reads no key, names it in its refusals


@pytest.mark.parametrize(
    ("cli", "env", "file"),
    [
        ({"decode_busy_threshold": 0.9}, {}, {}),
        ({}, {"KVSWITCH_DECODE_BUSY_THRESHOLD": "0.9"}, {}),
        ({}, {}, {"decode_busy_threshold": 0.9}),
        ({}, {}, {"conditional": {"decode_busy_threshold": 0.9}}),
    ],
)
def test_a_live_null_turns_the_decode_guard_off_whichever_layer_set_it(
    monkeypatch: pytest.MonkeyPatch, cli: dict[str, object], env: dict[str, str], file: dict[str, object]
) -> None:
    monkeypatch.delenv("KVSWITCH_DECODE_BUSY_THRESHOLD", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    w = ConfigWatcher(NO_DISCOVERY, cli, file)
    assert w.current.conditional.decode_busy_threshold == 0.9
    assert w._apply(b'{"decode_busy_threshold": null}')
    assert w.current.conditional.decode_busy_threshold is None and w.rejected == 0
    assert w._apply(None)  # the key deleted: back to what the process started with
    assert w.current.conditional.decode_busy_threshold == 0.9


def test_a_live_null_makes_prefill_busy_threshold_inherit_queue_threshold_again() -> None:
    file = {"conditional_disagg_policy": "prefill_load", "prefill_busy_threshold": 2.0, "queue_threshold": 1.0}
    w = ConfigWatcher(NO_DISCOVERY, {}, file)
    assert w._apply(b'{"prefill_busy_threshold": null}')
    assert w.current.conditional.effective_prefill_busy_threshold == 1.0


def test_a_live_null_for_a_setting_that_cannot_be_unset_is_refused_and_says_why() -> None:
    w = ConfigWatcher(NO_DISCOVERY, {}, {"eff_isl_threshold": 100})
    assert not w._apply(b'{"eff_isl_threshold": null}')
    assert w.rejected == 1 and "eff_isl_threshold" in w.last_error
    assert w.current.conditional.eff_isl_threshold == 100
