"""router.content_format against vLLM 0.32's own detection: each template's `vllm` format in
content_formats.json is what `vllm.renderers.hf._detect_content_format(template, default="string")`
returned for it, run with `.venv-vllm/bin/python` on 2026-12-03."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from router.content_format import detect_content_format
from router.tokenization import ChatOptions, HfPromptTokenizer, TokenizerError, _environment
from tests.vllm.make_model import build_tokenizer

FORMATS = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32" / "chat_render" / "content_formats.json"
VLLM_DETECTED = json.loads(FORMATS.read_text())


@pytest.mark.parametrize("case", VLLM_DETECTED, ids=[c["name"] for c in VLLM_DETECTED])
def test_the_format_is_the_one_vllm_detects(case: dict[str, str]) -> None:
    assert detect_content_format(_environment(), case["template"]) == case["vllm"]


PARTS = (
    "{% for m in messages %}[{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}]{% endfor %}"
)


@pytest.fixture(scope="module")
def parts_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("parts")
    build_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": PARTS}))
    return folder


@pytest.mark.parametrize(("flag", "rendered"), [("auto", "[ab]"), ("openai", "[ab]"), ("string", "[a\nb]")])
def test_the_flag_overrides_the_detection(parts_tokenizer: Path, flag: str, rendered: str) -> None:
    # vLLM's --chat-template-content-format: the router takes the engines' setting.
    tok = HfPromptTokenizer(parts_tokenizer, flag)
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.render_chat(messages, ChatOptions(add_generation_prompt=False)) == rendered


def test_an_unknown_format_is_refused_naming_the_values(parts_tokenizer: Path) -> None:
    with pytest.raises(TokenizerError, match="chat_template_content_format: one of auto, string, openai"):
        HfPromptTokenizer(parts_tokenizer, "parts")


async def test_a_template_whose_aliases_form_a_cycle_is_read_in_finite_time() -> None:
    # vLLM's own walk re-queues the cycle forever (so there is no verdict of its to record): with
    # --trust-request-chat-template one client's template held a tokenizer thread for good.
    cycle = (
        "{% set x = messages %}{% set messages = x %}"
        "{% for m in x %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}"
    )
    found = await asyncio.wait_for(asyncio.to_thread(detect_content_format, _environment(), cycle), 5)
    assert found == "openai"


def test_continuing_a_final_message_that_is_not_text_is_the_requests_error(parts_tokenizer: Path) -> None:
    tok = HfPromptTokenizer(parts_tokenizer, "string")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": {"x": 1}}]
    with pytest.raises(TokenizerError, match="continue_final_message"):
        tok.render_chat(messages, ChatOptions(add_generation_prompt=False, continue_final_message=True))
