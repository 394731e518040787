"""KV bytes per token from a model's Hugging Face `config.json`, as vLLM sizes its KV cache.

    per token = 2 (K and V) x num_hidden_layers x num_key_value_heads x head_dim x bytes per element

`head_dim` defaults to hidden_size / num_attention_heads and `num_key_value_heads` to
num_attention_heads (no GQA). A multimodal config's `text_config` holds the language model's
numbers. MLA models (DeepSeek: `kv_lora_rank`) cache one latent per layer instead:
num_hidden_layers x (kv_lora_rank + qk_rope_head_dim) x bytes. The element type is the engine's KV
cache dtype when it is not "auto" (vLLM's `cache_dtype` label), else the model's `torch_dtype`
(`dtype` in newer configs). Anything missing or unknown gives None and says why: the field is
then not registered rather than guessed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_BYTES", "kv_bytes_per_token", "kv_bytes_per_token_of", "read_config"]

DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}


def _int(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _dtype_bytes(cfg: dict[str, Any], cache_dtype: str | None) -> tuple[int | None, str]:
    if cache_dtype and cache_dtype != "auto":
        name, source = cache_dtype, "the engine's cache_dtype"
    else:
        raw = cfg.get("torch_dtype") or cfg.get("dtype")
        name, source = (str(raw) if raw else ""), "config.json's torch_dtype"
    size = DTYPE_BYTES.get(name.removeprefix("torch."))
    if size is None:
        return None, f"{source} {name!r} is not one of {', '.join(DTYPE_BYTES)}"
    return size, ""


def kv_bytes_per_token_of(cfg: dict[str, Any], cache_dtype: str | None = None) -> tuple[int | None, str]:
    """(bytes per token, "") or (None, why) for one parsed config.json."""
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, dict):
        cfg = {**cfg, **text}
    size, why = _dtype_bytes(cfg, cache_dtype)
    if size is None:
        return None, why
    layers = _int(cfg, "num_hidden_layers")
    if layers is None:
        return None, "config.json has no num_hidden_layers"
    lora_rank = _int(cfg, "kv_lora_rank")
    if lora_rank is not None:
        rope = _int(cfg, "qk_rope_head_dim")
        if rope is None:
            return None, "config.json has kv_lora_rank (MLA) but no qk_rope_head_dim"
        return layers * (lora_rank + rope) * size, ""
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim")
    hidden = _int(cfg, "hidden_size")
    if head_dim is None and hidden is not None and heads is not None:
        head_dim = hidden // heads
    if kv_heads is None or head_dim is None:
        return None, "config.json lacks num_attention_heads / num_key_value_heads / head_dim / hidden_size"
    return 2 * layers * kv_heads * head_dim * size, ""


def read_config(model_dir: str | Path) -> tuple[dict[str, Any] | None, str]:
    """(parsed `model_dir`/config.json, "") or (None, why) when there is none or it is no JSON object."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"{path} does not exist"
    except (OSError, ValueError) as exc:
        return None, f"{path} is not readable JSON ({exc})"
    if not isinstance(cfg, dict):
        return None, f"{path} is not a JSON object"
    return cfg, ""


def kv_bytes_per_token(model_dir: str | Path, cache_dtype: str | None = None) -> tuple[int | None, str]:
    """(bytes per token, "") or (None, why) from `model_dir`/config.json."""
    cfg, why = read_config(model_dir)
    if cfg is None:
        return None, why
    return kv_bytes_per_token_of(cfg, cache_dtype)
