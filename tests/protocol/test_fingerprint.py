"""protocol.fingerprint: one hash over every probe's ids, a refused probe told apart from any ids,
and probe bodies as vLLM's /tokenize takes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.fingerprint import PROBES, ChatProbe, TextProbe, builtin_fingerprint, fingerprint, legacy_fingerprint


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


# What shims before the 2026-12-04 probe set advertised over vLLM's ids for these tokenizers, computed
# by that code (`git show 29f5c69^:protocol/fingerprint.py`, fingerprint(text_ids, chat_ids)): the
# llama31 variants that differ only in a tool call's layout or an added token shared one.
LEGACY = {
    "own": "tok-8cdffb188e1b4617",
    "llama31": "tok-c613de59c2625531",
    "llama31_tool_call_arguments": "tok-c613de59c2625531",
    "llama31_added_token": "tok-c613de59c2625531",
    "gemma": "tok-57897494182b1882",
    "named_templates": "tok-a00efce1a000b330",
}
_RECORDED_IDS = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32" / "fingerprint" / "probes.json"


@pytest.mark.parametrize("name", list(LEGACY))
def test_the_legacy_fingerprint_is_what_shims_of_the_old_probe_set_advertised(name: str) -> None:
    ids = json.loads(_RECORDED_IDS.read_text())[name]["ids"]
    assert legacy_fingerprint(ids) == LEGACY[name] != fingerprint(ids)


def test_the_legacy_fingerprint_of_a_tokenizer_without_a_chat_template_leaves_the_chat_out() -> None:
    ids = json.loads(_RECORDED_IDS.read_text())["own"]["ids"]
    refused = [ids[0], ids[1], None, None, None, None]
    assert legacy_fingerprint(refused) == "tok-686de4a4e7689f09"  # the old code's, chat_ids None
    assert legacy_fingerprint([*ids[:5], None]) == LEGACY["own"]  # the new probes count for nothing
    with pytest.raises(ValueError, match="probe results"):
        legacy_fingerprint(ids[:-1])
