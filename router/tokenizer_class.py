"""The tokenizer class transformers 5 builds for a tokenizer's files, and that class's own pipeline in
place of tokenizer.json's where the router can build it (matched against transformers 5.19.0, vLLM
0.32 requiring >=5.16.1,<5.20.0).

transformers 5 builds a tokenizer class that has an `__init__` of its own (LlamaTokenizer,
Qwen2Tokenizer, GemmaTokenizer, GPT2Tokenizer, ...) from tokenizer.json's vocabulary and merges
alone, with the class's normalizer and pre-tokenizer (`TokenizersBackend.convert_to_native_format`);
only the post-processor, padding and truncation are the file's. That pipeline need not be the
file's: Llama 2's tokenizer.json prepends "▁" in the normalizer, to every piece between special
tokens, where LlamaTokenizer's and CodeLlamaTokenizer's Metaspace pre-tokenizer prepends it to the
first piece only. Which class AutoTokenizer builds depends on the class tokenizer_config.json names
and on config.json's model type (`class_for`). The router rebuilds the tokenizer as the class
does for the classes in REBUILT, so its ids are vLLM's whatever the file's pipeline; for any other
class with a pipeline of its own (OWN_PIPELINE) it cannot, and says so (router.tokenization).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

__all__ = [
    "AS_IS",
    "OWN_PIPELINE",
    "REBUILT",
    "Rebuild",
    "TokenizerClassError",
    "bos_post_processor",
    "class_for",
    "rebuild",
]

AS_IS = "TokenizersBackend"  # tokenizer.json's pipeline as saved
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
# model type (llama, none, one it does not know) gets the class the config names. transformers 5.19.0's
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


# The classes transformers 5.19.0 builds with a pipeline of their own, "Fast" left off: an `__init__`
# of their own (or inherited from one that is not TokenizersBackend's) over tokenizer.json's
# vocabulary, or a Python tokenizer read from vocabulary files of its own. A class named that is
# none of these, nor in REBUILT (TokenizersBackend, PreTrainedTokenizerFast, ParakeetTokenizer, a
# name transformers does not know), is built from tokenizer.json as saved.
OWN_PIPELINE = frozenset(
    "AlbertTokenizer BartTokenizer BarthezTokenizer BartphoTokenizer BertJapaneseTokenizer BertTokenizer "
    "BertweetTokenizer BigBirdTokenizer BioGptTokenizer BlenderbotSmallTokenizer BlenderbotTokenizer ByT5Tokenizer "
    "CLIPTokenizer CTRLTokenizer CamembertTokenizer CanineTokenizer ClvpTokenizer CodeLlamaTokenizer CohereTokenizer "
    "CpmAntTokenizer CpmTokenizer DPRQuestionEncoderTokenizer DebertaTokenizer DebertaV2Tokenizer DiaTokenizer "
    "EsmTokenizer EsmcTokenizer FNetTokenizer FSMTTokenizer FlaubertTokenizer FunnelTokenizer GPT2Tokenizer "
    "GPTNeoXJapaneseTokenizer GPTNeoXTokenizer GemmaTokenizer HerbertTokenizer LEDTokenizer LasrTokenizer "
    "LayoutLMv2Tokenizer LayoutLMv3Tokenizer LayoutXLMTokenizer LlamaTokenizer LukeTokenizer LxmertTokenizer "
    "MBart50Tokenizer MBartTokenizer MPNetTokenizer MarkupLMTokenizer MgpstrTokenizer MobileBertTokenizer "
    "MvpTokenizer MyT5Tokenizer NllbTokenizer NougatTokenizer OpenAIGPTTokenizer PLBartTokenizer PegasusTokenizer "
    "PerceiverTokenizer PhobertTokenizer ProphetNetTokenizer Qwen2Tokenizer Qwen3_5Tokenizer RagTokenizer "
    "ReformerTokenizer RemBertTokenizer RoCBertTokenizer RoFormerTokenizer RobertaTokenizer SeamlessM4TTokenizer "
    "Siglip2Tokenizer SplinterTokenizer T5Tokenizer TapasTokenizer UdopTokenizer VideoPrismTokenizer VitsTokenizer "
    "Wav2Vec2CTCTokenizer Wav2Vec2PhonemeCTCTokenizer WhisperTokenizer XGLMTokenizer XLMRobertaTokenizer "
    "XLMTokenizer XLNetTokenizer".split()
)
# Qwen2Tokenizer's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

Vocab = dict[str, int]
Merges = list[tuple[str, str]]


class TokenizerClassError(ValueError):
    """A tokenizer its class cannot be built from (transformers would not load it either)."""

    def __init__(self, what: str, why: str) -> None:
        self.what = what
        self.why = why
        super().__init__(f"{what}: {why}")


def _llama(vocab: Vocab, merges: Merges, config: Mapping[str, Any], specials: Mapping[str, str]) -> Tokenizer:
    # byte-fallback BPE with no unknown token; "▁" before the first piece (before every piece where
    # `legacy` is true, before none where `add_prefix_space` is false), no normalizer
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = config.get("add_prefix_space")
    scheme = "never" if prefix is False else ("always" if config.get("legacy") else "first")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    return tok


def _code_llama(vocab: Vocab, merges: Merges, config: Mapping[str, Any], specials: Mapping[str, str]) -> Tokenizer:
    # LlamaTokenizer's, with its unk token in the BPE and `legacy` not read ("None" for a null one,
    # as CodeLlamaTokenizer's str(unk_token) spells it)
    unk = str(specials.get("unk_token"))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None, unk_token=unk))
    scheme = "never" if config.get("add_prefix_space") is False else "first"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    return tok


def _qwen2(vocab: Vocab, merges: Merges, config: Mapping[str, Any], specials: Mapping[str, str]) -> Tokenizer:
    bpe = BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
              end_of_word_suffix="", fuse_unk=False, byte_fallback=False)  # fmt: skip
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=config.get("add_prefix_space") is True, use_regex=False),
        ]
    )
    return tok


def _gemma(vocab: Vocab, merges: Merges, config: Mapping[str, Any], specials: Mapping[str, str]) -> Tokenizer:
    unk = str(specials.get("unk_token"))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, dropout=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.normalizer = normalizers.Replace(" ", "▁")
    return tok


@dataclass(frozen=True, slots=True)
class Rebuild:
    """A class whose `__init__` the router follows: its pipeline over a vocabulary and merges
    (`build`, given tokenizer_config.json and the special tokens' spellings as the class reads
    them), its defaults for the special tokens the files do not mention, and the named tokens its
    `__init__` makes the extra special tokens where the config lists none."""

    build: Callable[[Vocab, Merges, Mapping[str, Any], Mapping[str, str]], Tokenizer]
    defaults: Mapping[str, str]
    extras: tuple[str, ...] = ()
    # its `__init__` passes add_bos_token itself, so transformers replaces the file's post-processor
    # with "bos $A" (`bos_post_processor`) once the special tokens are added
    bos_only: bool = False


_INFILL = ("prefix_token", "middle_token", "suffix_token", "eot_token", "fill_token")
# transformers 5.19.0's __init__ of each class, its defaults in its order
REBUILT: Mapping[str, Rebuild] = {
    "LlamaTokenizer": Rebuild(_llama, {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}),
    "CodeLlamaTokenizer": Rebuild(
        _code_llama,
        {
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "prefix_token": "▁<PRE>",
            "middle_token": "▁<MID>",
            "suffix_token": "▁<SUF>",
            "eot_token": "▁<EOT>",
            "fill_token": "<FILL_ME>",
        },
        _INFILL,
        bos_only=True,
    ),
    "Qwen2Tokenizer": Rebuild(
        _qwen2, {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    ),
    "GemmaTokenizer": Rebuild(
        _gemma,
        {
            "unk_token": "<unk>",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "mask_token": "<mask>",
        },
    ),
}


def class_for(name: str, config: Mapping[str, Any], folder: Path) -> str:
    """The class AutoTokenizer, given `name` (the router's --tokenizer), builds for the tokenizer in
    `folder` whose tokenizer_config.json is `config` ("Fast" left off): AS_IS (tokenizer.json as
    saved) where the config names no class, for a model name or model type transformers takes the
    file as is for, and for a class with no pipeline of its own; else the class the config names,
    or the model-specific class transformers builds in its place for config.json's model type. A
    tokenizer with code of its own (`auto_map`) loads it only under --trust-remote-code; without, as
    here."""
    named = config.get("tokenizer_class")
    if not isinstance(named, str):
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
    built = _TYPES_OWN_CLASS.get(model_type, named) if isinstance(model_type, str) else named
    built = built.removesuffix("Fast")
    return built if built in REBUILT or built in OWN_PIPELINE else AS_IS


def rebuild(
    built: str, file: Path, loaded: Tokenizer, config: Mapping[str, Any], specials: Mapping[str, str]
) -> Tokenizer:
    """The backend class `built` (one of REBUILT) makes of the tokenizer.json `file` (`loaded`), whose
    tokenizer_config.json is `config` and whose special tokens are spelled `specials`: its vocabulary
    and merges under the class's pipeline, the file's post-processor, no added tokens (the caller
    adds them, router.special_tokens)."""
    try:
        model = json.loads(file.read_text()).get("model") or {}
    except (OSError, ValueError) as exc:
        raise TokenizerClassError(str(file), f"unreadable: {exc}") from exc
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # a Unigram's [piece, score] list, by id
        vocab = {entry[0] if isinstance(entry, list) else entry: i for i, entry in enumerate(vocab)}
    if not isinstance(vocab, dict):
        raise TokenizerClassError(str(file), f"its model has no vocabulary {built} can be built from")
    # "a b" or ["a", "b"]; a malformed one fails in BPE below, as in transformers
    merges = cast(Merges, [tuple(m.split(" ") if isinstance(m, str) else m) for m in model.get("merges") or []])
    try:
        tok = REBUILT[built].build(vocab, merges, config, specials)
    except Exception as exc:  # the Rust side raises plain Exception for a bad vocabulary or merge
        raise TokenizerClassError(str(file), f"{built} cannot be built from its vocabulary: {exc}") from exc
    tok.post_processor = loaded.post_processor
    return tok


def bos_post_processor(tok: Tokenizer, bos: str | None) -> processors.TemplateProcessing:
    """TokenizersBackend.update_post_processor with add_bos_token true and add_eos_token false (the
    flags tokenizer_config.json gives are dropped where there is a tokenizer.json): the bos token
    before the text, nothing where there is no bos token. `tok` has its special tokens added."""
    if bos is None:
        return processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    bos_id = tok.token_to_id(bos)
    if bos_id is None:  # read_special_tokens adds every named token the tokenizer lacks
        raise TokenizerClassError(bos, "the bos token is not in the tokenizer it names")
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
