"""The router's tokenizer fingerprint against vLLM 0.32's: for each tokenizer of
tests/router/fingerprint_variants.py the router's ids for every probe are the ids vLLM's /tokenize
computes for the probe's body (recorded by tests/fixtures/vllm-0.32/fingerprint/record.py), so a
router and a shim over the same files agree. Tokenizers that differ only in a tool call's layout,
an added special token, or a special token read from special_tokens_map.json get fingerprints of
their own; the same files from another path keep theirs."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol import WorkerInfo
from protocol.config import RouterSettings
from protocol.fingerprint import PROBES, legacy_fingerprint
from router.block_index import BlockIndex
from router.load_view import LoadView
from router.planner import standalone_planner
from router.tokenization import (
    ChatOptions,
    HfPromptTokenizer,
    PromptTokenizer,
    TokenizerError,
    load_tokenizer,
    probe_ids,
    tokenizer_fingerprint,
    tokenizer_fingerprints,
)
from tests.router.fingerprint_variants import VARIANTS, build_variant

RECORDED_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32" / "fingerprint"
RECORDED: dict[str, Any] = json.loads((RECORDED_DIR / "probes.json").read_text())


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("variants")
    yield {name: build_variant(name, root / name) for name in VARIANTS}


def _tok(folders: dict[str, Path], name: str) -> PromptTokenizer:
    return load_tokenizer(folders[name])


WITH_DEFAULTS: dict[str, Any] = json.loads((RECORDED_DIR / "probes_server_defaults.json").read_text())


@pytest.mark.parametrize("name", list(WITH_DEFAULTS))
def test_the_engines_default_chat_template_kwargs_are_in_the_fingerprint(folders: dict[str, Path], name: str) -> None:
    # vLLM's /tokenize renders with the server's --default-chat-template-kwargs: a router given the
    # same (its flag of that name) gets the shim's fingerprint, and one without them does not
    case = WITH_DEFAULTS[name]
    tok = load_tokenizer(folders[case["variant"]], default_kwargs=case["defaults"])
    assert [probe_ids(tok, p) for p in PROBES] == case["ids"]
    assert tokenizer_fingerprint(tok) == case["fingerprint"] != RECORDED[case["variant"]]["fingerprint"]


def test_every_variant_was_recorded_with_the_current_probes() -> None:
    assert set(RECORDED) == set(VARIANTS)
    assert all(len(r["ids"]) == len(PROBES) for r in RECORDED.values())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_routers_probe_ids_are_vllms(folders: dict[str, Path], name: str) -> None:
    tok = _tok(folders, name)
    assert [probe_ids(tok, p) for p in PROBES] == RECORDED[name]["ids"]
    assert tokenizer_fingerprint(tok) == RECORDED[name]["fingerprint"]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("llama31", "llama31_tool_call_arguments"),  # differ only in how an assistant tool call is written
        ("llama31", "llama31_added_token"),  # one added special token
        ("own", "eos_in_map_only"),
    ],
)
def test_tokenizers_that_tokenize_differently_get_different_fingerprints(
    folders: dict[str, Path], a: str, b: str
) -> None:
    assert tokenizer_fingerprint(_tok(folders, a)) != tokenizer_fingerprint(_tok(folders, b))


def test_the_same_files_from_another_path_keep_their_fingerprint(folders: dict[str, Path], tmp_path: Path) -> None:
    copy = shutil.copytree(folders["llama31_added_token"], tmp_path / "elsewhere" / "snapshot")
    mine = tokenizer_fingerprint(_tok(folders, "llama31_added_token"))
    assert tokenizer_fingerprint(load_tokenizer(copy)) == mine
    assert tokenizer_fingerprint(load_tokenizer(copy / "tokenizer.json")) == mine


def test_an_eos_token_only_in_special_tokens_map_closes_assistant_turns(folders: dict[str, Path]) -> None:
    tok = _tok(folders, "eos_in_map_only")
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    eos = tok.encode("</s>", add_special_tokens=False)
    assert len(eos) == 1
    assert eos[0] in tok.encode_chat(chat)


def test_special_tokens_map_overrides_the_config_as_transformers_does(folders: dict[str, Path]) -> None:
    # the config says <|end|>, special_tokens_map.json <s>: transformers (so vLLM) renders <s>
    tok = _tok(folders, "map_overrides_config")
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.encode("<s>", add_special_tokens=False)[0]
    assert RECORDED["map_overrides_config"]["ids"] == RECORDED["own"]["ids"]


def test_named_templates_saved_as_files_are_the_configs_own(folders: dict[str, Path], tmp_path: Path) -> None:
    # transformers' save_pretrained writes named templates as chat_template.jinja (default) and
    # additional_chat_templates/NAME.jinja, none in the config: the router read only the first
    saved = tmp_path / "saved"
    shutil.copytree(folders["named_templates"], saved)
    config = json.loads((saved / "tokenizer_config.json").read_text())
    templates = {t["name"]: t["template"] for t in config.pop("chat_template")}
    (saved / "tokenizer_config.json").write_text(json.dumps(config))
    (saved / "chat_template.jinja").write_text(templates.pop("default"))
    (saved / "additional_chat_templates").mkdir()
    for name, template in templates.items():
        (saved / "additional_chat_templates" / f"{name}.jinja").write_text(template)
    # the fingerprint vLLM computes for this tokenizer, whichever layout it was saved in
    assert tokenizer_fingerprint(load_tokenizer(saved)) == RECORDED["named_templates"]["fingerprint"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    rendered = HfPromptTokenizer(saved).render_chat([{"role": "user", "content": "hi"}], ChatOptions(tools=[tool]))
    assert rendered.startswith("[TOOLS][{")


def test_named_templates_are_picked_as_transformers_picks_them(folders: dict[str, Path]) -> None:
    # `tool_use` for a request with tools, `default` without; a trusted request may name one
    tok = HfPromptTokenizer(folders["named_templates"])
    chat = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert tok.render_chat(chat) == "<user>hi"
    assert tok.render_chat(chat, ChatOptions(tools=[tool])).startswith("[TOOLS][{")
    assert tok.render_chat(chat, ChatOptions(chat_template="tool_use")) == "[TOOLS]null<user>hi"
    assert tok.render_chat(chat, ChatOptions(chat_template="default", tools=[tool])) == "<user>hi"


def test_the_router_fingerprints_with_the_default_kwargs_it_is_given(folders: dict[str, Path]) -> None:
    from router.service import RouterConfig, RouterService

    case = WITH_DEFAULTS["llama31_no_thinking"]
    config = RouterConfig(tokenizer=str(folders[case["variant"]]), default_chat_template_kwargs=case["defaults"])
    assert RouterService(config).fingerprints.mine == case["fingerprint"]


def test_named_templates_without_a_default_are_named_when_a_chat_needs_one(tmp_path: Path) -> None:
    # transformers refuses such a chat naming the templates there are; the router said the
    # tokenizer had no template at all
    folder = build_variant("own", tmp_path / "named")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "t"}, {"name": "rag", "template": "r"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"named chat templates \(rag, tool_use\) and none is `default`"):
        HfPromptTokenizer(folder).render_chat([{"role": "user", "content": "hi"}])


def test_a_shim_of_the_old_probe_set_is_refused_text_and_told_to_upgrade_not_to_change_the_tokenizer(
    folders: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    # A rolling upgrade: the router probes with the 2026-12-04 set, a worker's shim still with the
    # old one (what it advertises: tests/protocol/test_fingerprint.py's LEGACY, the old code's).
    from router.service import RouterConfig, RouterService

    router = RouterService(RouterConfig(tokenizer=str(folders["llama31"])))
    watch = router.fingerprints
    mine, legacy = tokenizer_fingerprints(_tok(folders, "llama31"))
    assert watch.mine == mine and legacy == "tok-c613de59c2625531" != mine
    assert router.fingerprint_days.is_legacy(legacy) and not router.fingerprint_days.accepts(legacy)

    def info(worker: str, tokenizer: str) -> WorkerInfo:
        return WorkerInfo(worker=worker, model="m", role="agg", engine="vllm", block_size=16, tokenizer=tokenizer)

    with caplog.at_level(logging.ERROR, logger="router.tokenization"):
        # Same files, old shim; and another tokenizer the old probes could not tell apart: both refused,
        # never taken for a match on the weaker check.
        watch.check(info("old", "tok-c613de59c2625531"))
        watch.check(info("added", legacy_fingerprint(RECORDED["llama31_added_token"]["ids"])))
        watch.check(info("gemma", legacy_fingerprint(RECORDED["gemma"]["ids"])))  # differs under either set
    why = {r["worker"]: r["why"] for r in watch.report()["text_refused"]}
    assert set(why) == {"old", "added", "gemma"}
    for worker in ("old", "added"):
        assert why[worker].startswith(f"the shim of worker {worker} predates the 2026-12-04 tokenizer probe set")
        assert f"upgrade the shim of worker {worker}" in why[worker] and "--tokenizer" not in why[worker]
    assert "give the router the tokenizer" in why["gemma"] and "predates" not in why["gemma"]
    assert len([r for r in caplog.records if "predates the 2026-12-04" in r.getMessage()]) == 2

    watch.check(info("old", watch.mine))  # its shim upgraded: it registers again with the new fingerprint
    assert "old" not in {r["worker"] for r in watch.report()["text_refused"]}

    # The planner's words (/debug/route, a text request's 503, /ready) say the same.
    stale = [info("old", legacy), info("added", legacy)]
    planner = standalone_planner(
        RouterSettings(),
        lambda: stale,
        index=BlockIndex(),
        view=LoadView(),
        tokenizer=watch.mine,
        legacy_tokenizer=legacy,
    )
    assert planner.text_refusals() == [planner.text_refusal("m", stale)]
    refusal = planner.text_refusal("m", stale)
    assert "the shims of workers old, added predate the 2026-12-04" in refusal and "--tokenizer" not in refusal
    assert planner._tokenizer_why(stale[0]).startswith("the shim of worker old predates")
