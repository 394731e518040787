"""Builds, offline, a tiny random hybrid model for `make test-vllm`: Gemma 2's architecture (one
sliding-window layer of 64 tokens, one full-attention layer; hidden 128, 4 heads, 2 KV heads,
head 32, bf16, no logit soft-capping, which vLLM's CPU attention lacks) with the tiny Llama's
tokenizer, so vLLM runs two KV cache groups and publishes each one's events.

Runs in the vLLM venv after make_model.py:
    .venv-vllm/bin/python tests/vllm/make_hybrid.py OUT_DIR TINY_LLAMA_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

SLIDING_WINDOW = 64


def main() -> int:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    out, tokenizer = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer / name, out / name)
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        max_position_embeddings=2048,
        sliding_window=SLIDING_WINDOW,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        torch_dtype="bfloat16",
    )
    Gemma2ForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    print(f"tiny hybrid Gemma 2 written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
