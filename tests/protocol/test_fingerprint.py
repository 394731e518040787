"""protocol.fingerprint: one hash over every probe's ids, a refused probe told apart from any ids,
and probe bodies as vLLM's /tokenize takes them."""

from __future__ import annotations

import json

import pytest

from protocol.fingerprint import PROBES, ChatProbe, TextProbe, builtin_fingerprint, fingerprint


def test_each_probe_and_a_refusal_count() -> None:
    base: list[list[int] | None] = [[1, 2]] * len(PROBES)
    fp = fingerprint(base)
    for i in range(len(PROBES)):
        refused = list(base)
        refused[i] = None
        empty = list(base)
        empty[i] = []
        assert len({fp, fingerprint(refused), fingerprint(empty)}) == 3
    with pytest.raises(ValueError, match="probe results"):
        fingerprint(base[:-1])


def test_the_probes_cover_what_routing_hashes() -> None:
    chats = [p for p in PROBES if isinstance(p, ChatProbe)]
    texts = [p for p in PROBES if isinstance(p, TextProbe)]
    assert {t.add_special_tokens for t in texts} == {True, False}
    assert {c.add_generation_prompt for c in chats} == {True, False}
    roles = {m["role"] for c in chats for m in c.messages}
    assert {"system", "user", "assistant", "tool"} <= roles
    assert any(c.tools for c in chats)
    assert any("tool_calls" in m for c in chats for m in c.messages)


def test_probe_bodies_are_tokenize_requests() -> None:
    for probe in PROBES:
        body = json.loads(json.dumps(probe.body()))
        if isinstance(probe, TextProbe):
            assert body == {"prompt": probe.prompt, "add_special_tokens": probe.add_special_tokens}
        else:
            assert set(body) <= {"messages", "add_generation_prompt", "tools"}
            assert body["messages"] == list(probe.messages)


def test_the_builtin_fingerprint_is_stable() -> None:
    # Deployed engine_sim fleets advertise this value: changing it (a probe, the built-in
    # vocabulary) needs a coordinated upgrade of routers and shims.
    assert builtin_fingerprint() == "tok-c6d1cbd52c9a5ac6"
