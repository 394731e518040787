"""Special tokens tokenizer_config.json (or special_tokens_map.json) names and tokenizer.json lacks
are added at load as transformers adds them, so the router's ids are vLLM's.

The expected ids are transformers 5.24.0's (`AutoTokenizer.from_pretrained(folder)`, then
`tokenizer(text, add_special_tokens=False)` or `apply_chat_template(chat, tokenize=True)`) for the
folders `_folder` builds, recorded on 2026-12-07 from the .venv-bench of `make bench-deps`, which a
clean clone does not have. Before the fix the router encoded each missing token as its characters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from router.tokenization import ChatOptions, TokenizerError, load_tokenizer

VOCAB = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "user": 5, "assistant": 6, "<|end|>": 7}
EOT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}{{ eos_token }}{% endfor %}"


def _folder(folder: Path, config: dict[str, Any], **files: dict[str, Any]) -> Path:
    """A word-level tokenizer.json whose added tokens are <s>, </s> and <|end|> (ids 1, 2, 7), with
    `config` as its tokenizer_config.json and `files` (special_tokens_map="...") beside it."""
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder


def _added(content: str, **flags: bool) -> dict[str, Any]:
    """An `added_tokens_decoder` entry as save_pretrained writes it."""
    fields = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {"content": content, **fields, **flags}


def test_a_pad_token_only_the_config_names_is_one_id_as_in_vllm(tmp_path: Path) -> None:
    # The silent case: no fingerprint probe writes the pad token, so a worker's fingerprint
    # matched while every prompt holding its spelling was routed on other ids.
    folder = _folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|PAD_TOKEN|>"})
    assert load_tokenizer(folder).encode("hello <|PAD_TOKEN|> world", add_special_tokens=False) == [3, 8, 4]


def test_an_eos_token_the_template_writes_after_each_turn_is_its_id_as_in_vllm(tmp_path: Path) -> None:
    # The loud case: the fingerprint differed from every vLLM worker's, and no setting could mend it.
    folder = _folder(tmp_path, {"bos_token": "<s>", "eos_token": "<|eot|>", "chat_template": EOT_TEMPLATE})
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    ids = load_tokenizer(folder).encode_chat(chat, ChatOptions(add_generation_prompt=False))
    assert ids == [5, 0, 3, 8, 6, 0, 4, 8]


@pytest.mark.parametrize(
    ("config", "files", "text", "ids"),
    [
        pytest.param(
            # the seven named ones in transformers' order (not the file's), then a model's own,
            # then extra_special_tokens: ids 8.. in that order
            {"mask_token": "<M>", "pad_token": "<P>", "bos_token": "<B>", "image_token": "<img>",
             "extra_special_tokens": ["<x2>", "<x1>", "<P>"]},
            {}, "<x1> <x2> <img> <M> <P> <B> hello", [13, 12, 11, 10, 9, 8, 3], id="order",
        ),
        pytest.param(
            # decoder entries by id, each the next id past the vocabulary whatever id the config
            # wrote, with their flags (lstrip/rstrip eat the spaces; <|end|>'s are the config's)
            {"added_tokens_decoder": {"90": _added("<|tool|>", lstrip=True, rstrip=True, special=False),
                                      "40": _added("<|y|>"), "7": _added("<|end|>", lstrip=True)},
             "pad_token": "<|tool|>", "eos_token": "</s>"},
            {}, "hello <|tool|> world <|y|>  <|end|>", [3, 9, 4, 8, 7], id="added_tokens_decoder",
        ),
        pytest.param(
            # a special token the vocabulary spells becomes an added token at its own id, so
            # splits out of a word
            {"unk_token": "hello", "additional_special_tokens": ["world"]},
            {}, "hello world helloworld", [3, 4, 3, 4], id="in_the_vocabulary",
        ),
        pytest.param(
            # no added_tokens_decoder: special_tokens_map.json's, with its flags
            {"bos_token": "<s>"},
            {"special_tokens_map": {"pad_token": _added("<pad>", rstrip=True, special=False), "eos_token": "<|eot|>"}},
            "hello <pad>   world <|eot|>", [3, 9, 4, 8], id="special_tokens_map",
        ),
        pytest.param(
            # added, and still spelled out as text under split_special_tokens
            {"pad_token": "<P>", "split_special_tokens": True}, {}, "hello <P> <s> world", [3, 0, 0, 0, 0, 0, 0, 4],
            id="split_special_tokens",
        ),
    ],
)  # fmt: skip
def test_the_special_tokens_transformers_adds_are_added_in_its_order_with_its_flags(
    tmp_path: Path, config: dict[str, Any], files: dict[str, Any], text: str, ids: list[int]
) -> None:
    folder = _folder(tmp_path, config, **files)
    assert load_tokenizer(folder).encode(text, add_special_tokens=False) == ids


@pytest.mark.parametrize(
    ("config", "files", "where"),
    [
        ({"added_tokens_decoder": {"5": "<s>"}}, {}, "tokenizer_config.json: added_tokens_decoder['5']"),
        ({"added_tokens_decoder": {"five": _added("<s>")}}, {}, "tokenizer_config.json: added_tokens_decoder['five']"),
        ({"added_tokens_decoder": ["<s>"]}, {}, "tokenizer_config.json: added_tokens_decoder"),
        ({"pad_token": 5}, {}, "tokenizer_config.json: pad_token"),
        ({"bos_token": {"content": "<s>"}}, {}, "tokenizer_config.json: bos_token"),
        ({"extra_special_tokens": "<x>"}, {}, "tokenizer_config.json: extra_special_tokens"),
        ({}, {"special_tokens_map": {"additional_special_tokens": [{"content": "<a>"}]}},
         "special_tokens_map.json: additional_special_tokens[0]"),
        ({}, {"special_tokens_map": {"extra_special_tokens": [_added("<a>")]}},
         "special_tokens_map.json: extra_special_tokens[0]"),
        # a list where transformers reads an object (until 2026-12-07 the router took it silently)
        ({}, {"special_tokens_map": ["<P>"]}, "special_tokens_map.json"),
        ({}, {"added_tokens": ["<q>"]}, "added_tokens.json"),
    ],
)  # fmt: skip
def test_an_entry_transformers_refuses_is_a_load_error_naming_it(
    tmp_path: Path, config: dict[str, Any], files: dict[str, Any], where: str
) -> None:
    folder = _folder(tmp_path, config, **files)
    with pytest.raises(TokenizerError, match="transformers refuses it too") as err:
        load_tokenizer(folder)
    assert f"{tmp_path}/{where}" == f"{err.value.what}", err.value


def test_an_added_tokens_json_id_transformers_loads_the_router_loads(tmp_path: Path) -> None:
    # transformers 5.19.0 takes any JSON number as an id (it only orders them), and gives the token
    # the next id past the vocabulary; until 2026-12-07 the router refused 9.0
    folder = _folder(tmp_path, {"bos_token": "<s>"}, added_tokens={"<q>": 9.0})
    assert load_tokenizer(folder).encode("hello <q> world", add_special_tokens=False) == [3, 8, 4]


def test_an_added_tokens_json_id_that_is_no_number_is_a_load_error_naming_its_token(tmp_path: Path) -> None:
    # transformers 5.19.0 fails ordering "9" among tokenizer.json's ids (a TypeError)
    folder = _folder(tmp_path, {"bos_token": "<s>"}, added_tokens={"<q>": "9"})
    with pytest.raises(TokenizerError, match="not a number") as err:
        load_tokenizer(folder)
    assert err.value.what == f"{tmp_path}/added_tokens.json: <q>"


def test_a_malformed_added_tokens_decoder_stops_the_router_naming_the_flag(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"added_tokens_decoder": {"5": "<s>"}})
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "router", "--tokenizer", str(folder),
         "--nats-servers", "nats://127.0.0.1:1", "--etcd-endpoints", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"kvswitch router: invalid tokenizer (--tokenizer, KVSWITCH_TOKENIZER) = '{folder}': "
        f"{folder}/tokenizer_config.json: added_tokens_decoder['5']: '<s>' is not an AddedToken's fields; "
        "transformers refuses it too"
    ], out.stderr
