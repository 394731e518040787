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
    assert subjects.router_key("ns", "r1") == "/ns/routers/r1"
    assert subjects.config_key("ns") == "/ns/config/router"


@pytest.mark.parametrize("bad", ["a.b", "a*", "a b", "", ">", "kvswitch\n", "a\tb"])
def test_tokens_that_would_break_a_subject_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="must match"):
        subjects.kv("ns", bad)
    with pytest.raises(ValueError, match="namespace"):
        subjects.validate_namespace(bad)


def test_a_key_is_named_by_what_follows_its_prefix() -> None:
    worker, router = subjects.worker_key("ns", "ab12").encode(), subjects.router_key("ns", "ab12").encode()
    assert subjects.name_from_key(subjects.workers_prefix("ns"), worker) == "ab12"
    assert subjects.name_from_key(subjects.routers_prefix("ns"), router) == "ab12"


@pytest.mark.parametrize(
    ("key", "name"),
    [
        (b"/ns/workers/ab\xff", "ab\\xff"),  # not UTF-8: escaped
        (b"/other/workers/ab", "/other/workers/ab"),  # not under the prefix: named whole
        (b"/ns/workers/a.b", "a.b"),
    ],
)
def test_a_key_no_id_has_is_named_for_the_consumer_to_refuse_never_raised_on(key: bytes, name: str) -> None:
    """One bad key raised out of a watch would end it, and with it every consumer's view of etcd."""
    got = subjects.name_from_key(subjects.workers_prefix("ns"), key)
    assert got == name
    with pytest.raises(ValueError, match="must match"):
        subjects.worker_key("ns", got)  # no id has it
