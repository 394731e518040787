"""Tokenizer folders for the fingerprint tests: make_model.py's tiny tokenizer under several chat
templates, and variants that tokenize differently where the old probes did not look. Built the
same way by tests/fixtures/vllm-0.32/fingerprint/record.py (vLLM's ids) and by the tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.vllm.make_model import build_tokenizer

RENDER_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32" / "chat_render"
# A Llama-2/Mistral-style template: `eos_token` closes each assistant turn.
EOS_AFTER_ASSISTANT = (
    "{% for m in messages %}{% if m.role == 'assistant' %}[A] {{ m.content }}{{ eos_token }}"
    "{% else %}[{{ m.role }}] {{ m.content }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}[A]{% endif %}"
)


def _edit_config(folder: Path, edit: Callable[[dict[str, object]], None]) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    edit(config)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _template(name: str) -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        source = (RENDER_FIXTURES / name).read_text()
        _edit_config(folder, lambda c: c.__setitem__("chat_template", source))

    return build


def _tool_call_arguments(folder: Path) -> None:
    """llama31 writing a tool call's arguments under another key: only tool calls differ."""
    source = (RENDER_FIXTURES / "llama31.jinja").read_text().replace('"parameters": ', '"arguments": ')
    _edit_config(folder, lambda c: c.__setitem__("chat_template", source))


def _added_token(folder: Path) -> None:
    """llama31 plus one added special token, as a fine-tune adds one."""
    from tokenizers import AddedToken, Tokenizer

    _template("llama31.jinja")(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|tool|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))


def _eos_in_map_only(folder: Path) -> None:
    """`eos_token` only in special_tokens_map.json, written after assistant turns."""

    def edit(config: dict[str, object]) -> None:
        config.pop("eos_token")
        config["chat_template"] = EOS_AFTER_ASSISTANT

    _edit_config(folder, edit)


def _map_overrides_config(folder: Path) -> None:
    """special_tokens_map.json's `bos_token` differs from the config's: transformers takes the map's."""
    _edit_config(folder, lambda c: c.__setitem__("bos_token", "<|end|>"))


def _named_templates(folder: Path) -> None:
    """transformers' named templates (Hermes-2-Pro, Command-R): `tool_use` renders requests with tools."""
    templates = [
        {"name": "default", "template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"},
        {
            "name": "tool_use",
            "template": "[TOOLS]{{ tools | tojson }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
        },
    ]
    _edit_config(folder, lambda c: c.__setitem__("chat_template", templates))


def _model_specific_tokens(folder: Path) -> None:
    """A model's own special tokens in the template (and in its vocabulary, as models ship them):
    `image_token` only in special_tokens_map.json, `boi_token` an AddedToken dict in the config."""
    from tokenizers import AddedToken, Tokenizer

    def edit(config: dict[str, object]) -> None:
        config["chat_template"] = (
            "[{{ image_token }}|{{ boi_token }}]{% for m in messages %}{{ m.content }}{% endfor %}"
        )
        config["boi_token"] = {
            "__type": "AddedToken",
            "content": "<boi>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    _edit_config(folder, edit)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", special=True), AddedToken("<boi>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    mapped = json.loads((folder / "special_tokens_map.json").read_text())
    (folder / "special_tokens_map.json").write_text(json.dumps({**mapped, "image_token": "<image>"}))


def _split_special_tokens(folder: Path) -> None:
    """`split_special_tokens`: special tokens' spellings in a text are plain text."""
    _edit_config(folder, lambda c: c.__setitem__("split_special_tokens", True))


VARIANTS: dict[str, Callable[[Path], None]] = {
    "own": lambda folder: None,
    "llama31": _template("llama31.jinja"),
    "gemma": _template("gemma.jinja"),
    "parts": _template("parts.jinja"),
    "macro_trim": _template("macro_trim.jinja"),
    "llama31_tool_call_arguments": _tool_call_arguments,
    "llama31_added_token": _added_token,
    "eos_in_map_only": _eos_in_map_only,
    "map_overrides_config": _map_overrides_config,
    "named_templates": _named_templates,
    "model_specific_tokens": _model_specific_tokens,
    "split_special_tokens": _split_special_tokens,
}


def build_variant(name: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    VARIANTS[name](folder)
    return folder
