"""LoRA adapters reloaded at run time as vLLM 0.32 serves them: `load_inplace` re-points a loaded
adapter, whose blocks then hash by the new path (vllm/entrypoints/openai/models/serving.py,
vllm/v1/core/kv_cache_utils.py)."""

from __future__ import annotations

import pytest

from engine_sim import SimServer
from engine_sim.block_hash import HashedBlock
from engine_sim.lora import LoraModule, LoraRequest
from tests.engine_sim.conftest import sim_config
from tests.engine_sim.test_http_api import post

TOKENS = tuple(range(7000, 7016))


@pytest.mark.parametrize(
    ("lora", "salt", "digest"),
    [
        (LoraRequest("A", 1, "/adapters/a"), None, "ed9c5f8a77b8e6e7"),
        (LoraRequest("A", 2, "/other"), None, "f4ed653c0633b4d2"),
        (None, "A", "ba6c1808b949aae1"),
    ],
)
def test_a_first_block_hashes_as_vllms_own_functions_hash_it(
    lora: LoraRequest | None, salt: str | None, digest: str
) -> None:
    """The digests vLLM 0.32 gives these blocks: its generate_block_hash_extra_keys and
    hash_block_tokens (sha256_cbor) on parent b"root", run with .venv-vllm (2026-12-03)."""
    assert HashedBlock(None, TOKENS, b"root", salt, lora).digest[-8:].hex() == digest


def cached(answer: dict[str, object]) -> object:
    usage = answer["usage"]
    assert isinstance(usage, dict)
    return usage["prompt_tokens_details"]["cached_tokens"]


async def test_load_inplace_repoints_an_adapter_which_then_caches_afresh() -> None:
    cfg = sim_config(
        model="base", enable_prompt_tokens_details=True, runtime_lora_updating=True,
        lora_modules=(LoraModule("A", "/adapters/a"),),
    )  # fmt: skip
    body = {"model": "A", "prompt": list(range(900, 1000)), "max_tokens": 1}
    async with SimServer(cfg) as sim:
        assert cached((await post(sim, "/v1/completions", body))[1]) == 0
        assert cached((await post(sim, "/v1/completions", body))[1]) == 96
        status, err, _ = await post(sim, "/v1/load_lora_adapter", {"lora_name": "A", "lora_path": "/adapters/a2"})
        assert status == 400 and err["error"]["message"] == (
            "The lora adapter 'A' has already been loaded. If you want to load the adapter in place, set "
            "'load_inplace' to True."
        )
        load = {"lora_name": "A", "lora_path": "/adapters/a2", "load_inplace": True}
        status, text, _ = await post(sim, "/v1/load_lora_adapter", load)
        assert (status, text) == (200, "Success: LoRA adapter 'A' added successfully.")
        assert sim.loras.get("A") == LoraRequest("A", 1, "/adapters/a2"), "vLLM keeps the adapter's id"
        assert cached((await post(sim, "/v1/completions", body))[1]) == 0, "the old path's KV is not reused"
        assert cached((await post(sim, "/v1/completions", body))[1]) == 96
        status, text, _ = await post(sim, "/v1/load_lora_adapter", {**load, "lora_path": "/adapters/a2"})
        assert status == 200 and cached((await post(sim, "/v1/completions", body))[1]) == 96, "same path, same KV"
        status, text, _ = await post(sim, "/v1/load_lora_adapter", {**load, "lora_name": "B"})
        assert status == 200 and sim.loras.get("B") == LoraRequest("B", 2, "/adapters/a2"), "in place: loads too"
        status, err, _ = await post(sim, "/v1/load_lora_adapter", {**load, "lora_name": "base"})
        assert (
            status == 400 and err["error"]["message"] == "The lora adapter 'base' conflicts with a served base model."
        )
        status, err, _ = await post(sim, "/v1/unload_lora_adapter", {"lora_name": ""})
        assert status == 400 and err["error"]["message"] == "'lora_name' needs to be provided to unload a LoRA adapter."
