"""A tokenizer whose class transformers 5 builds with a pipeline of its own is built as transformers 5
builds it: from tokenizer.json's vocabulary and merges with that class's pipeline (LlamaTokenizer,
CodeLlamaTokenizer, Qwen2Tokenizer, GemmaTokenizer), where the class the config names and
config.json's model type lead AutoTokenizer to it; any other such class is said at startup
(router.tokenizer_class).

The expected ids are transformers 5.19.0's (the newest vLLM 0.32 allows: `AutoTokenizer
.from_pretrained(folder)`, then `tokenizer(text, add_special_tokens=...)`), for the folders
`_llama2` builds, recorded on 2026-12-07 from a separate environment with transformers 5.19.0,
which a clean clone does not have (the CodeLlama, Qwen2 and Gemma ones and INFILL's the same day,
later). Before the fix the router read tokenizer.json's pipeline as saved: Llama 2's normalizer
prepends "▁" to every piece between special tokens, LlamaTokenizer's Metaspace to the first only;
a config naming CodeLlamaTokenizer, Qwen2Tokenizer or GemmaTokenizer was read as saved with no
word, its infill tokens not added; one naming any other class of its own pipeline (GPT2Tokenizer)
was read as saved with no word.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, processors

from protocol.messages import WorkerInfo
from router.tokenization import FingerprintWatch, load_tokenizer, tokenizer_fingerprint

_PIECES = ["<unk>", "<s>", "</s>", "▁", "h", "e", "l", "o", "w", "r", "d", "[", "]", "I", "N", "S", "T", "/"]
_MERGES = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"), ("▁w", "o"),
           ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d"), ("h", "e"), ("he", "ll"), ("hell", "o")]  # fmt: skip
TEXTS = ["hello world", "<s>hello</s>world", "hello <s> world", "[INST] hello [/INST]", "<unk>hello"]


def _added(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}  # fmt: skip


def _llama2(folder: Path, model_type: str | None = "llama", unk: bool = True, **config: Any) -> Path:
    """A Llama 2 tokenizer.json as its conversion from SentencePiece saved it (a normalizer that
    prepends "▁" and spells spaces "▁", no pre-tokenizer, byte fallback), with tokenizer_config.json
    naming LlamaTokenizer (and `config`) and config.json `model_type` (none for None). `unk` false:
    the vocabulary's id 0 is "<x>", and the config names no unk token."""
    pieces = _PIECES if unk else ["<x>", *_PIECES[1:]]
    vocab = {p: i for i, p in enumerate(pieces)}
    for left, right in _MERGES:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES, unk_token=pieces[0], fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(p, normalized=False, special=True) for p in pieces[:3]])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    names = {"bos_token": "<s>", "eos_token": "</s>"} | ({"unk_token": "<unk>"} if unk else {})
    decoder = {str(i): _added(p) for i, p in enumerate(pieces[:3])}
    tokenizer_config = {"tokenizer_class": "LlamaTokenizer", "added_tokens_decoder": decoder, **names, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def _ids(folder: Path | str) -> list[list[int]]:
    tok = load_tokenizer(folder)
    return [tok.encode(text, add_special_tokens=special) for text in TEXTS for special in (False, True)]


# transformers 5.19.0's ids for TEXTS, each without and with special tokens
LLAMA = [[22, 27], [1, 22, 27], [1, 30, 2, 8, 7, 9, 6, 10], [1, 1, 30, 2, 8, 7, 9, 6, 10], [22, 3, 1, 27],
         [1, 22, 3, 1, 27], [3, 11, 13, 14, 15, 16, 12, 22, 3, 11, 17, 13, 14, 15, 16, 12],
         [1, 3, 11, 13, 14, 15, 16, 12, 22, 3, 11, 17, 13, 14, 15, 16, 12], [0, 30], [1, 0, 30]]  # fmt: skip
AS_SAVED = [[22, 27], [1, 22, 27], [1, 22, 2, 27], [1, 1, 22, 2, 27], [22, 3, 1, 3, 27], [1, 22, 3, 1, 3, 27],
            [3, 11, 13, 14, 15, 16, 12, 22, 3, 11, 17, 13, 14, 15, 16, 12],
            [1, 3, 11, 13, 14, 15, 16, 12, 22, 3, 11, 17, 13, 14, 15, 16, 12], [0, 22], [1, 0, 22]]  # fmt: skip
# LlamaTokenizer's and CodeLlamaTokenizer's with `add_prefix_space` false; GemmaTokenizer's
NO_PREFIX = [[30, 27], [1, 30, 27], [1, 30, 2, 8, 7, 9, 6, 10], [1, 1, 30, 2, 8, 7, 9, 6, 10], [30, 3, 1, 27],
             [1, 30, 3, 1, 27], [11, 13, 14, 15, 16, 12, 22, 3, 11, 17, 13, 14, 15, 16, 12],
             [1, 11, 13, 14, 15, 16, 12, 22, 3, 11, 17, 13, 14, 15, 16, 12], [0, 30], [1, 0, 30]]  # fmt: skip
# Qwen2Tokenizer's byte-level pipeline over the Llama vocabulary
QWEN2 = [[30, 8, 7, 9, 6, 10], [1, 30, 8, 7, 9, 6, 10], [1, 30, 2, 8, 7, 9, 6, 10], [1, 1, 30, 2, 8, 7, 9, 6, 10],
         [30, 1, 8, 7, 9, 6, 10], [1, 30, 1, 8, 7, 9, 6, 10], [11, 13, 14, 15, 16, 12, 30, 11, 17, 13, 14, 15, 16, 12],
         [1, 11, 13, 14, 15, 16, 12, 30, 11, 17, 13, 14, 15, 16, 12], [0, 30], [1, 0, 30]]  # fmt: skip
CODE_LLAMA: dict[str, Any] = {"tokenizer_class": "CodeLlamaTokenizer"}


@pytest.mark.parametrize(
    ("model_type", "config", "ids"),
    [
        pytest.param("llama", {}, LLAMA, id="llama"),
        pytest.param(None, {}, LLAMA, id="no_config_json"),
        # a model type transformers 5.19 registers no tokenizer class for gets the config's
        pytest.param("acme_custom", {}, LLAMA, id="unknown_model_type"),
        # "▁" before every piece, as the file's normalizer, but not before one that begins with a space
        pytest.param("llama", {"legacy": True}, [
            [22, 27], [1, 22, 27], [1, 22, 2, 27], [1, 1, 22, 2, 27], [22, 3, 1, 27], [1, 22, 3, 1, 27], *LLAMA[6:8],
            [0, 22], [1, 0, 22]], id="legacy"),
        pytest.param("llama", {"add_prefix_space": False}, NO_PREFIX, id="no_prefix_space"),
        # transformers takes tokenizer.json as saved for Mistral's model type
        pytest.param("mistral", {}, AS_SAVED, id="mistral"),
        # CodeLlamaTokenizer: LlamaTokenizer's pipeline, `legacy` not read
        pytest.param("llama", CODE_LLAMA, LLAMA, id="code_llama"),
        pytest.param("llama", CODE_LLAMA | {"legacy": True}, LLAMA, id="code_llama_legacy"),
        pytest.param(None, {"tokenizer_class": "CodeLlamaTokenizerFast", "add_prefix_space": False}, NO_PREFIX,
                     id="code_llama_fast_no_prefix_space"),
        pytest.param("mistral", CODE_LLAMA, AS_SAVED, id="code_llama_mistral"),
        # model type qwen2: transformers builds Qwen2Tokenizer whatever the config names
        pytest.param("qwen2", {}, QWEN2, id="qwen2_model_type"),
        pytest.param("qwen2", {"tokenizer_class": "Qwen2TokenizerFast"}, QWEN2, id="qwen2"),
        pytest.param("gemma", {"tokenizer_class": "GemmaTokenizer"}, NO_PREFIX, id="gemma"),
    ],
)  # fmt: skip
def test_a_class_with_a_pipeline_of_its_own_is_built_as_transformers_builds_it(
    tmp_path: Path, model_type: str | None, config: dict[str, Any], ids: list[list[int]]
) -> None:
    assert _ids(_llama2(tmp_path, model_type, **config)) == ids


def test_llamas_own_unk_token_is_added_where_the_config_names_none(tmp_path: Path) -> None:
    # LlamaTokenizer's default "<unk>", past the vocabulary (id 31), as transformers adds it
    tok = load_tokenizer(_llama2(tmp_path, unk=False))
    assert tok.encode("<unk>hello", add_special_tokens=False) == [31, 30]


def test_code_llamas_infill_tokens_are_added_as_special_tokens(tmp_path: Path) -> None:
    # ▁<PRE> ▁<MID> ▁<SUF> ▁<EOT> <FILL_ME> past the vocabulary (31-35), as CodeLlamaTokenizer adds them
    tok = load_tokenizer(_llama2(tmp_path, **CODE_LLAMA))
    assert tok.encode("▁<PRE> hello ▁<SUF>world▁<MID>▁<EOT>", add_special_tokens=False) == [
        31, 22, 3, 33, 8, 7, 9, 6, 10, 32, 34]  # fmt: skip


def test_a_model_id_transformers_takes_as_saved_is_read_as_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MODEL_IDS_TO_TOKENIZERS_BACKEND, matched against the name given, as transformers matches it
    monkeypatch.chdir(tmp_path)
    _llama2(tmp_path / "deepseek-ai" / "DeepSeek-R1-Distill-Llama-8B")
    assert _ids("deepseek-ai/DeepSeek-R1-Distill-Llama-8B") == AS_SAVED


def test_a_class_the_router_cannot_build_is_said_at_startup_and_to_each_refused_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # model type qwen3_5: transformers 5.19 builds Qwen3_5Tokenizer over the Llama vocabulary
    folder = _llama2(tmp_path, "qwen3_5")
    with caplog.at_level(logging.WARNING, logger="router.tokenization"):
        tok = load_tokenizer(folder)
    assert tok.caveat is not None
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [tok.caveat]
    for part in ("names LlamaTokenizer", "Qwen3_5Tokenizer", str(folder / "config.json"), "ids may differ",
                 "refused text prompts by fingerprint", "token-id prompts still route", "save_pretrained"):  # fmt: skip
        assert part in tok.caveat, part
    watch = FingerprintWatch(tokenizer_fingerprint(tok), caveat=tok.caveat)
    watch.check(WorkerInfo(worker="w1", model="m", role="agg", engine="vllm", block_size=16, tokenizer="other"))
    why = watch.report()["text_refused"][0]["why"]
    assert tok.caveat in why
    assert "give the router the tokenizer" not in why


def test_a_named_class_of_its_own_pipeline_the_router_cannot_build_is_said_at_startup(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # GPT2Tokenizer: transformers 5.19 builds its byte-level pipeline over the vocabulary (QWEN2's
    # ids here, where the router's are the file's)
    folder = _llama2(tmp_path, "gpt2", tokenizer_class="GPT2TokenizerFast")
    with caplog.at_level(logging.WARNING, logger="router.tokenization"):
        tok = load_tokenizer(folder)
    assert tok.caveat is not None
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [tok.caveat]
    for part in ("names GPT2TokenizerFast, which transformers 5", "own pipeline", "ids may differ", "save_pretrained"):
        assert part in tok.caveat, part
    assert str(folder / "config.json") not in tok.caveat
