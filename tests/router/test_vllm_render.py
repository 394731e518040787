"""The router's prompt ids against vLLM 0.32's own renderer: for each case the ids vLLM computes
(recorded by tests/vllm/record_chat_render.py over make_model.py's tokenizer) are the ids the router
routes on. Cases: truncation with and without a side, a lax echo, a chat truncation, a null
content beside tool calls, a developer message under templates with and without that role, tool
call arguments as a JSON string, a tool with no description, reasoning_effort."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.request_parsing import parse_request, prompt_ids
from router.tokenization import Tokenization, load_tokenizer
from tests.vllm.make_model import build_tokenizer

CASES_FILE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32" / "chat_render" / "cases.jsonl"
CASES = [json.loads(line) for line in CASES_FILE.read_text().splitlines()]


def build_tokenizers(templates: set[str | None], tmp: pytest.TempPathFactory) -> dict[str | None, Tokenization]:
    """make_model.py's tokenizer (None) and one copy per chat template of chat_render/."""
    base = tmp.mktemp("tiny-llama")
    build_tokenizer(base)
    out: dict[str | None, Tokenization] = {None: Tokenization(load_tokenizer(base))}
    for template in (t for t in templates if t is not None):
        folder = tmp.mktemp(Path(template).stem)
        (folder / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
        config = json.loads((base / "tokenizer_config.json").read_text())
        config["chat_template"] = (CASES_FILE.parent / template).read_text()
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        out[template] = Tokenization(load_tokenizer(folder))
    return out


def tokenizers_fixture(cases: list[dict[str, Any]]) -> Any:
    """A module fixture: build_tokenizers for the templates `cases` name, closed after the module."""

    @pytest.fixture(scope="module")
    def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str | None, Tokenization]]:
        out = build_tokenizers({c["template"] for c in cases}, tmp_path_factory)
        yield out
        for tok in out.values():
            tok.close()

    return tokenizers


tokenizers = tokenizers_fixture(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
async def test_the_router_routes_on_the_ids_vllm_computes(
    case: dict[str, Any], tokenizers: dict[str | None, Tokenization]
) -> None:
    parsed = parse_request(json.loads(json.dumps(case["body"])), chat=case["kind"] == "chat")
    routed, prompts = await prompt_ids(tokenizers[case["template"]], parsed)
    assert (routed if case["kind"] == "chat" else prompts) == case["vllm_ids"]
