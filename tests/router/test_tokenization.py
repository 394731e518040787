"""Tokenisers: the built-in default, a Hugging Face tokenizer.json with its chat template, and
incremental detokenisation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from protocol.tokenizer import BuiltinTokenizer, apply_chat_template
from router.tokenization import (
    BuiltinPromptTokenizer,
    HfPromptTokenizer,
    IncrementalDetokenizer,
    TokenizerError,
    load_tokenizer,
)

VOCAB = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "user": 5, "assistant": 6, ":": 7, "|": 8}
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}" + (
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_default_is_the_builtin_tokenizer_with_chatml() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, BuiltinPromptTokenizer)
    messages = [{"role": "user", "content": "hello world"}]
    assert tok.encode_chat(messages) == BuiltinTokenizer().encode(apply_chat_template(messages))
    assert tok.decode(tok.encode("the cache")) == "the cache"


def test_builtin_rejects_a_message_without_role() -> None:
    with pytest.raises(TokenizerError, match="role"):
        BuiltinPromptTokenizer().encode_chat([{"content": "x"}])


@pytest.mark.parametrize("as_file", [False, True])
def test_hf_tokenizer_from_dir_or_file(hf_dir: Path, as_file: bool) -> None:
    tok = load_tokenizer(hf_dir / "tokenizer.json" if as_file else hf_dir)
    assert isinstance(tok, HfPromptTokenizer)
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([3, 4]) == "hello world"


def test_hf_chat_template_is_rendered_with_jinja(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids == [1, 5, 7, 3, 8, 6, 7]  # <s> user : hello | assistant :


def test_hf_without_template_refuses_chat(hf_dir: Path) -> None:
    (hf_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="chat_template"):
        load_tokenizer(hf_dir).encode_chat([{"role": "user", "content": "hello"}])


def test_bad_tokenizer_paths_raise_named_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizers JSON"):
        load_tokenizer(tmp_path)


def test_incremental_detokenizer_holds_back_split_utf8() -> None:
    tok = BuiltinPromptTokenizer()
    ids = tok.encode("caf\u00e9 hello world")  # é is two raw byte tokens
    detok = IncrementalDetokenizer(tok)
    parts = [detok.push([i]) for i in ids]
    assert "".join(parts) == "caf\u00e9 hello world"
    assert "\ufffd" not in "".join(parts)
    assert parts[ids.index(0xC3)] == ""  # the first byte of é alone emits nothing
