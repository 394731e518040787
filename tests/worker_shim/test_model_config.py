"""KV bytes per token from config.json, and the shim registering it (or None, never a guess)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from discovery import Discovery, Snapshot
from engine_sim.server import SimServer
from protocol import ConfigError, WorkerInfo
from protocol.config import EtcdSettings
from tests.worker_shim.cluster import shim_for, sim_config
from worker_shim import ShimConfig
from worker_shim.model_config import kv_bytes_per_token, kv_bytes_per_token_of

# The tiny Llama of tests/fixtures/vllm-0.32 (its README): hidden 128, 2 layers, 4 heads, 2 KV heads.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "torch_dtype": "bfloat16",
    "vocab_size": 4096,
}


def test_the_fixtures_tiny_llama_has_512_bytes_per_token(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert kv_bytes_per_token(tmp_path) == (512, "")
    # The captured engine agrees: kv_cache_memory_bytes 1310720 / kv_cache_size_tokens 2560.
    assert 1310720 // 2560 == 512


@pytest.mark.parametrize(
    ("cfg", "cache_dtype", "expected"),
    [
        ({**TINY_LLAMA, "head_dim": 64}, None, 1024),
        (TINY_LLAMA, "fp8", 256),
        (TINY_LLAMA, "auto", 512),
        ({**TINY_LLAMA, "torch_dtype": "float32"}, None, 1024),
        ({k: v for k, v in TINY_LLAMA.items() if k != "num_key_value_heads"}, None, 1024),
        ({"text_config": {**TINY_LLAMA}, "torch_dtype": "bfloat16"}, None, 512),
        (
            {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"},
            None,
            70272,
        ),
    ],
    ids=["head_dim", "fp8-cache", "auto-cache", "fp32", "no-gqa", "text_config", "mla"],
)
def test_kv_bytes_per_token_follows_the_config(cfg: dict[str, Any], cache_dtype: str | None, expected: int) -> None:
    assert kv_bytes_per_token_of(cfg, cache_dtype) == (expected, "")


@pytest.mark.parametrize(
    ("cfg", "why"),
    [
        ({k: v for k, v in TINY_LLAMA.items() if k != "torch_dtype"}, "torch_dtype"),
        ({**TINY_LLAMA, "torch_dtype": "int4"}, "int4"),
        ({k: v for k, v in TINY_LLAMA.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
        ({k: v for k, v in TINY_LLAMA.items() if k != "hidden_size"}, "head_dim"),
    ],
)
def test_an_incomplete_config_gives_none_and_says_why(cfg: dict[str, Any], why: str) -> None:
    value, reason = kv_bytes_per_token_of(cfg)
    assert value is None and why in reason


def test_a_missing_config_json_says_so(tmp_path: Path) -> None:
    value, reason = kv_bytes_per_token(tmp_path)
    assert value is None and "config.json does not exist" in reason


async def registered(etcd_url: str, ns: str) -> WorkerInfo:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        async for ev in d.watch_workers():
            assert isinstance(ev, Snapshot) and len(ev.items) == 1
            return next(iter(ev.items.values()))
    raise AssertionError("no snapshot")


async def test_the_shim_registers_kv_bytes_from_model_path_and_never_from_the_profile(
    ns: str, nats_url: str, etcd_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    async with SimServer(sim_config()) as sim:
        async with shim_for(sim, ns, nats_url, etcd_url, model_path=str(tmp_path)) as shim:
            await shim.registered.wait()
            info = await registered(etcd_url, ns)
            assert info.kv_bytes_per_token == 512 and info.timing_profile is None
        caplog.set_level(logging.INFO, logger="worker_shim")
        async with shim_for(sim, ns, nats_url, etcd_url, timing_profile="h200:llama-3.1-8b") as shim:
            await shim.registered.wait()
            info = await registered(etcd_url, ns)
            # The profile names the latency table only; its KV size is not this model's.
            assert info.kv_bytes_per_token is None and info.timing_profile == "h200:llama-3.1-8b"
            assert info.max_num_batched_tokens is None
        said = caplog.text
        assert "--model-path" in said and "max_num_batched_tokens" in said and "--max-num-batched-tokens" in said


def test_a_model_path_that_is_no_directory_is_refused_at_start(tmp_path: Path) -> None:
    """Given and wrong (a typo, a volume not mounted) was one WARNING after registering a worker
    without its KV size."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    ShimConfig(model="m", kv_events="tcp://*:1", model_path=str(tmp_path)).validate()
    for wrong in (tmp_path / "nope", tmp_path / "config.json"):
        if wrong.name == "config.json":
            wrong.write_text("{}")
        with pytest.raises(ConfigError) as err:
            ShimConfig(model="m", kv_events="tcp://*:1", model_path=str(wrong)).validate()
        assert err.value.setting == "model_path" and "--kv-bytes-per-token" in str(err.value)


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (None, "config.json does not exist"),
        ("not json", "config.json is not readable JSON"),
        ([], "config.json is not a JSON object"),
    ],
)
def test_a_model_path_without_a_config_is_refused_at_start(config: object, said: str, tmp_path: Path) -> None:
    """Config review of 2026-12-07, finding 5: a directory without a config.json (or with one that
    is no JSON object: no model's) passed the start, and the worker registered with no KV size
    (routers priced its transfers at their default profile's), said in one WARNING later."""
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", kv_events="tcp://*:1", model_path=str(tmp_path)).validate()
    assert err.value.setting == "model_path" and said in str(err.value), err.value
    assert "--kv-bytes-per-token" in str(err.value)


def test_an_empty_model_path_is_refused_not_read_as_unset() -> None:
    """'' passed Path('').is_dir() (the working directory) and the shim then read it as unset."""
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", kv_events="tcp://*:1", model_path="").validate()
    assert err.value.setting == "model_path" and "must not be empty" in str(err.value), err.value


def test_a_model_path_config_without_a_dtype_leaves_it_to_the_engine(tmp_path: Path) -> None:
    """The element size may be the engine's cache dtype (fp8), known only once the shim asks it."""
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in TINY_LLAMA.items() if k != "torch_dtype"}))
    assert ShimConfig(model="m", kv_events="tcp://*:1", model_path=str(tmp_path)).validate().model_path


# Real models' config.json (trimmed) whose KV numbers kv_bytes_per_token_of cannot work out.
# llava-hf/llava-1.5-7b-hf: text_config leaves num_hidden_layers and the heads to LlamaConfig's defaults.
LLAVA_1_5 = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "text_config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float16"},
    "torch_dtype": "float16",
    "vision_config": {"hidden_size": 1024, "model_type": "clip_vision_model", "num_hidden_layers": 24},
}
# google/gemma-3-4b-it: text_config leaves the head counts and head_dim to Gemma3TextConfig's defaults.
GEMMA_3 = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "model_type": "gemma3_text", "num_hidden_layers": 34},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "num_hidden_layers": 27},
}
# THUDM/glm-4-9b-chat: its own names (num_layers, multi_query_group_num, kv_channels).
GLM_4 = {
    "architectures": ["ChatGLMModel"],
    "model_type": "chatglm",
    "num_layers": 40,
    "num_attention_heads": 32,
    "multi_query_group_num": 2,
    "kv_channels": 128,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
UNWORKABLE = [
    (LLAVA_1_5, "config.json has no num_hidden_layers"),
    (GEMMA_3, "config.json lacks num_attention_heads"),
    (GLM_4, "config.json has no num_hidden_layers"),
    ({**TINY_LLAMA, "num_hidden_layers": 0}, "config.json has no num_hidden_layers"),
    ({"num_hidden_layers": 2, "kv_lora_rank": 512, "torch_dtype": "bf16"}, "(MLA) but no qk_rope_head_dim"),
]


@pytest.mark.parametrize(("config", "why"), UNWORKABLE, ids=["llava-1.5", "gemma-3", "glm-4", "zero-layers", "mla"])
def test_a_model_path_whose_kv_size_cannot_be_worked_out_is_accepted_at_start(
    config: dict[str, Any], why: str, tmp_path: Path
) -> None:
    """Review of fb2b841, finding 1: these real models' folders were refused at start, where until
    then the worker served them and registered without its KV size, said in one WARNING."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ShimConfig(model="m", kv_events="tcp://*:1", model_path=str(tmp_path)).validate().model_path
    value, reason = kv_bytes_per_token(tmp_path)
    assert value is None and why in reason, reason


async def test_a_model_whose_kv_size_cannot_be_worked_out_is_served_with_one_warning(
    ns: str, nats_url: str, etcd_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAVA_1_5))
    caplog.set_level(logging.WARNING, logger="worker_shim")
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url, model_path=str(tmp_path)) as shim:
        await shim.registered.wait()
        assert (await registered(etcd_url, ns)).kv_bytes_per_token is None
    said = [r.getMessage() for r in caplog.records if "kv_bytes_per_token not registered" in r.getMessage()]
    assert len(said) == 1 and "no num_hidden_layers" in said[0], said
