from __future__ import annotations

import pytest

from protocol import subjects


def test_subjects_follow_design() -> None:
    assert subjects.kv("ns", "ab12") == "ns.kv.ab12"
    assert subjects.kv_all("ns") == "ns.kv.*"
    assert subjects.kvstate("ns", "ab12") == "ns.kvstate.ab12"
    assert subjects.load("ns", "ab12") == "ns.load.ab12"
    assert subjects.gen("ns", "prefill", "ab12") == "ns.gen.prefill.ab12"
    assert subjects.cancel("ns", "ab12") == "ns.cancel.ab12"
    assert subjects.sync("ns") == "ns.router.sync"


def test_keys_follow_design() -> None:
    assert subjects.worker_key("ns", "ab12") == "/ns/workers/ab12"
    assert subjects.worker_from_key("ns", "/ns/workers/ab12") == "ab12"
    assert subjects.router_key("ns", "r1") == "/ns/routers/r1"
    assert subjects.config_key("ns") == "/ns/config/router"


@pytest.mark.parametrize("bad", ["a.b", "a*", "a b", "", ">", "kvswitch\n", "a\tb"])
def test_tokens_that_would_break_a_subject_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="must match"):
        subjects.kv("ns", bad)
    with pytest.raises(ValueError, match="namespace"):
        subjects.validate_namespace(bad)


def test_worker_from_key_rejects_foreign_prefix() -> None:
    with pytest.raises(ValueError, match="is not under"):
        subjects.worker_from_key("ns", "/other/workers/ab")
