"""The tokenizer class transformers 5 builds where tokenizer_config.json names LlamaTokenizer, and
that class's own pipeline in place of tokenizer.json's (matched against transformers 5.19.0, vLLM
0.32 requiring >=5.16.1,<5.20.0).

transformers 5 builds a tokenizer class that has an `__init__` of its own (LlamaTokenizer,
Qwen2Tokenizer, GemmaTokenizer, ...) from tokenizer.json's vocabulary and merges alone, with the
class's normalizer and pre-tokenizer (`TokenizersBackend.convert_to_native_format`); only the
post-processor, padding and truncation are the file's. Qwen2's and Gemma's pipelines are their
files' as those models ship them; LlamaTokenizer's is not Llama 2's: its tokenizer.json prepends
"▁" in the normalizer, to every piece between special tokens, where LlamaTokenizer's Metaspace
pre-tokenizer prepends it to the first piece only (`legacy` false). Which class AutoTokenizer
builds for a Llama class depends on config.json's model type (`class_for`): the router rebuilds
the tokenizer as LlamaTokenizer does where that is LlamaTokenizer, so its ids are vLLM's (a byte-level
vocabulary under a Llama class gets the same rebuild there); where it is another model-specific
class (Qwen2's), the router cannot, and says so (router.tokenization).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE

__all__ = ["AS_IS", "LLAMA", "LLAMA_DEFAULTS", "TokenizerClassError", "class_for", "rebuild_as_llama"]

LLAMA = "LlamaTokenizer"
AS_IS = "TokenizersBackend"  # tokenizer.json's pipeline as saved
# LlamaTokenizer.__init__'s defaults: a special token its config does not name is this one
LLAMA_DEFAULTS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
# transformers' MODEL_IDS_TO_TOKENIZERS_BACKEND: model names whose tokenizer.json is used as is,
# whatever class their config names (matched against the name AutoTokenizer is given, lower case)
_NAMES_AS_IS = (
    "deepseek-ai/deepseek-r1-distill-llama-*",
    "deepseek-ai/deepseek-coder-*",
    "allenai/dolma2-tokenizer",
    "google/umt5-small",
    "naver-clova-ix/donut-*",
    "salesforce/blip2-opt-*",
    "salesforce/blip2-flan-t5-*",
    "salesforce/instructblip-flan-t5-*",
    "stepfun-ai/step-3.7-*",
)
# The model types whose registered tokenizer class is TokenizersBackend (or MistralCommonBackend),
# for which AutoTokenizer takes tokenizer.json as is whatever class the config names; and those it
# lists as having a wrong class on the hub, for which it builds its own registered class. Any other
# model type (llama, none, one it does not know) gets the config's Llama class. transformers 5.19.0's
# TOKENIZER_MAPPING_NAMES and MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.
_TYPES_AS_IS = frozenset(
    "EvollaModel arctic aria bigbird_pegasus camembertv2-base canary chameleon chatlm cohere_asr deepseek_ocr "
    "deepseek_ocr2 deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4 deepseek_vl deepseek_vl_hybrid deepseek_vl_v2 "
    "ernie4_5 ernie4_5_moe flex_olmo fuyu glm glm4 glm4_moe glm4_moe_lite glm4v glm4v_moe glm_image glmasr got_ocr2 "
    "gpt_bigcode granite granitemoe granitemoehybrid granitemoeshared h2ovl_chat hyperclovax hyperclovax_vlm "
    "internlm2 jamba janus kimi_k25 kimi_linear kosmos-2 llava llava_next mimo_v2_flash minicpm3 minicpmv "
    "minicpmv4_6 minicpmv4_7 minimax_m2 ministral ministral3 mistral mistral3 mixtral modernbert modernbert-decoder "
    "molmo molmo2 nemotron nvfp4 nystromformer olmo2 olmo3 olmo_hybrid opencua openvla paddleocr_vl pegasus_x "
    "persimmon phi3 phi3_v phimoe pix2struct pixtral smolvlm stablelm step3_vl step3p5 umt5 vipllava voxtral "
    "voxtral_realtime xlm-roberta-xl".split()
)
_TYPES_OWN_CLASS = {
    "hyperclovax_vision_v2": "GPT2Tokenizer",
    "qwen2": "Qwen2Tokenizer",
    "qwen3_5": "Qwen3_5Tokenizer",
    "qwen3_5_moe": "Qwen3_5Tokenizer",
    "qwen3_5_moe_text": "Qwen3_5Tokenizer",
    "qwen4_exp": "Qwen3_5Tokenizer",
}


class TokenizerClassError(ValueError):
    """A tokenizer LlamaTokenizer cannot be built from (transformers would not load it either)."""

    def __init__(self, what: str, why: str) -> None:
        self.what = what
        self.why = why
        super().__init__(f"{what}: {why}")


def class_for(name: str, config: Mapping[str, Any], folder: Path) -> str:
    """The class AutoTokenizer, given `name` (the router's --tokenizer), builds for the tokenizer in
    `folder` whose tokenizer_config.json is `config`, where that names a Llama class: LLAMA; AS_IS
    (tokenizer.json as saved) for a model type or model name transformers takes the file as is for,
    and for a config that names another class (the router's reading, checked on Qwen2's and Gemma's);
    or the model-specific class transformers builds in its place. A tokenizer with code of its own
    (`auto_map`) loads it only under --trust-remote-code; without, as here."""
    if config.get("tokenizer_class") not in (LLAMA, LLAMA + "Fast"):
        return AS_IS
    if any(fnmatch.fnmatch(name.lower(), pattern) for pattern in _NAMES_AS_IS):
        return AS_IS
    path = folder / "config.json"
    try:
        model_config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise TokenizerClassError(str(path), f"unreadable: {exc}") from exc
    model_type = model_config.get("model_type") if isinstance(model_config, dict) else None
    if model_type in _TYPES_AS_IS:
        return AS_IS
    return _TYPES_OWN_CLASS.get(model_type, LLAMA) if isinstance(model_type, str) else LLAMA


def rebuild_as_llama(file: Path, loaded: Tokenizer, config: Mapping[str, Any]) -> Tokenizer:
    """LlamaTokenizer's backend for the tokenizer.json `file` (`loaded`), whose tokenizer_config.json
    is `config`: its vocabulary and merges in a byte-fallback BPE with no unknown token, no normalizer, a Metaspace
    pre-tokenizer that prepends "▁" to the first piece (to every piece where `legacy` is true, to
    none where `add_prefix_space` is false), the file's post-processor, no added tokens (the
    caller adds them, router.special_tokens)."""
    try:
        model = json.loads(file.read_text()).get("model") or {}
    except (OSError, ValueError) as exc:
        raise TokenizerClassError(str(file), f"unreadable: {exc}") from exc
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # a Unigram's [piece, score] list, by id
        vocab = {entry[0] if isinstance(entry, list) else entry: i for i, entry in enumerate(vocab)}
    if not isinstance(vocab, dict):
        raise TokenizerClassError(str(file), "its model has no vocabulary LlamaTokenizer can be built from")
    # "a b" or ["a", "b"]; a malformed one fails in BPE below, as in transformers
    merges = cast(
        list[tuple[str, str]], [tuple(m.split(" ") if isinstance(m, str) else m) for m in model.get("merges") or []]
    )
    try:
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    except Exception as exc:  # the Rust side raises plain Exception for a bad vocabulary or merge
        raise TokenizerClassError(str(file), f"LlamaTokenizer cannot be built from its vocabulary: {exc}") from exc
    prefix = config.get("add_prefix_space")
    scheme = "never" if prefix is False else ("always" if config.get("legacy") else "first")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    tok.post_processor = loaded.post_processor
    return tok
