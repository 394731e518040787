"""`chat_template_kwargs` merged with the request as vLLM 0.32 merges them (build_chat_params, then
ChatParams.with_defaults): its `tools` win over the request's, its `documents` count where the
request has none, its special tokens override the tokenizer's, null values count as unset, and
`messages` is vLLM's 400. A case with `defaults` is a server started with
`--default-chat-template-kwargs` (the router's flag of that name): under the request's own kwargs,
reasoning_effort and tools, over the special tokens. Each case's ids (or error) were recorded with
vLLM's own renderer by tests/fixtures/vllm-0.32/chat_render/record_kwargs.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.api_errors import ApiError
from router.request_parsing import parse_request, prompt_ids
from router.tokenization import HfPromptTokenizer, Tokenization
from tests.router.test_vllm_render import tokenizers_fixture

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32" / "chat_render"
CASES = [json.loads(line) for line in (FIXTURES / "kwargs_cases.jsonl").read_text().splitlines()]


tokenizers = tokenizers_fixture(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
async def test_chat_template_kwargs_render_as_vllm_renders_them(
    case: dict[str, Any], tokenizers: dict[str | None, Tokenization]
) -> None:
    expected = case["vllm_ids"]
    body = json.loads(json.dumps(case["body"]))
    tok = tokenizers[case["template"]]
    if "defaults" in case:
        tok = Tokenization(HfPromptTokenizer(tok.tokenizer.name, default_kwargs=case["defaults"]))
    if isinstance(expected, dict):
        with pytest.raises(ApiError) as err:
            await prompt_ids(tok, parse_request(body, chat=True))
        assert (err.value.code, str(err.value.message)) == (400, expected["error"])
        return
    routed, _ = await prompt_ids(tok, parse_request(body, chat=True))
    assert routed == expected


def test_the_cases_cover_each_merge_rule() -> None:
    names = {c["name"] for c in CASES}
    assert {"kwargs_bos_token", "kwargs_tools_over_top_level", "kwargs_documents", "kwargs_messages"} <= names
    differ = {c["name"]: c["vllm_ids"] for c in CASES}
    # each rule changes vLLM's ids, so the cases test something
    assert differ["kwargs_tools_over_top_level"] != differ["kwargs_tools_null"]
    assert differ["kwargs_documents"] != differ["kwargs_documents_under_top_level"]
    assert differ["kwargs_bos_token"] != differ["kwargs_bos_token_null"]
    plain = differ["kwargs_bos_token_null"]  # llama31.jinja with nothing set
    assert differ["defaults_enable_thinking"] not in (plain, differ["defaults_under_request_kwargs"])
    assert differ["defaults_request_null"] == differ["defaults_enable_thinking"]
    assert differ["defaults_bos_token"] not in (plain, differ["defaults_bos_token_under_request"])
    assert differ["defaults_tools"] != differ["defaults_tools_under_request"]
    assert differ["defaults_documents"] != differ["defaults_documents_under_request"]
