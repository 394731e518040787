"""The built-in tokenizer exported for Hugging Face tools (aiperf): the export encodes and decodes
exactly as protocol.tokenizer does, and it is laid out as a hub cache entry."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from bench.hf_tokenizer import HUB_NAME, tokenizer_json, write_hub_cache
from protocol.tokenizer import BuiltinTokenizer

BUILTIN = BuiltinTokenizer()
EXPORTED = Tokenizer.from_str(json.dumps(tokenizer_json()))

_WORDS = ["the", "cache", "prefix", "therefore", "ka", "kabe", "hello", "_x", "9", "é", "日本", "<|im_start|>"]
_SEPARATORS = [" ", "  ", "\n", "\t", ".", ",", "<|eos|>"]
_text = st.lists(
    st.one_of(st.sampled_from(_WORDS), st.sampled_from(_SEPARATORS), st.text(max_size=4)), max_size=40
).map("".join)


@settings(max_examples=300, deadline=None)
@given(_text)
def test_the_export_encodes_any_text_exactly_as_the_builtin(text: str) -> None:
    assert EXPORTED.encode(text, add_special_tokens=False).ids == BUILTIN.encode(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 127), st.integers(256, BUILTIN.vocab_size - 1)), max_size=64))
def test_the_export_decodes_ids_that_spell_valid_utf8_exactly_as_the_builtin(ids: list[int]) -> None:
    assert EXPORTED.decode(ids, skip_special_tokens=False) == BUILTIN.decode(ids, skip_special=False)


def test_laid_out_as_a_hub_cache_entry_whose_main_ref_names_the_snapshot(tmp_path: Path) -> None:
    snapshot = write_hub_cache(tmp_path)
    repo = tmp_path / "hub" / ("models--" + HUB_NAME.replace("/", "--"))
    assert snapshot.parent == repo / "snapshots"
    assert (repo / "refs" / "main").read_text() == snapshot.name
    assert {p.name for p in snapshot.iterdir()} == {"tokenizer.json", "tokenizer_config.json", "config.json"}
    loaded = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    assert loaded.encode(" the cache", add_special_tokens=False).ids == BUILTIN.encode(" the cache")
    assert write_hub_cache(tmp_path) == snapshot  # same content, same revision
