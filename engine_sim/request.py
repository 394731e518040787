"""One request inside the simulated engine: its tokens, blocks, hash chain and progress."""

from __future__ import annotations

import enum
from typing import Any

from engine_sim.block_hash import HashChains, HashedBlock
from engine_sim.block_pool import Block
from engine_sim.lora import LoraRequest
from engine_sim.sampler import Sampler

__all__ = ["RequestStatus", "SimRequest"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class SimRequest:
    """Progress is `num_computed_tokens` out of `num_tokens` (prompt plus output so far); a new
    token is sampled whenever everything known has been computed. `chain` holds the hash of every
    full block of known tokens; `blocks[:num_cached_blocks]` are marked cached in the pool.

    `choice` tells apart the `n` samples of one prompt; `min_tokens` keeps stop token ids from being
    emitted before that many tokens; `skip_prefix_cache` (vLLM sets it for prompt logprobs) makes
    the request compute its whole prompt. `lora`, the adapter the request named, picks the
    HashChains its blocks hash into (the scheduler's, per adapter); `cache_salt` starts its chain.
    `admitted`: its prompt is counted in prompt_tokens (once, however often it is looked up)."""

    __slots__ = (
        "admitted",
        "arrival",
        "blocks",
        "cache_salt",
        "chain",
        "finish_reason",
        "kv_transfer_params",
        "lora",
        "max_tokens",
        "min_tokens",
        "num_cached_blocks",
        "num_computed_tokens",
        "num_external_tokens",
        "num_hit_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "remote_decode",
        "remote_loaded",
        "remote_prefill",
        "request_id",
        "sampler",
        "skip_prefix_cache",
        "status",
        "stop_token_ids",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        seed: int | None = None,
        choice: int = 0,
        min_tokens: int = 0,
        skip_prefix_cache: bool = False,
        remote_decode: bool = False,
        remote_prefill: dict[str, Any] | None = None,
        arrival: float = 0.0,
        cache_salt: str | None = None,
        lora: LoraRequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.min_tokens = min_tokens
        self.skip_prefix_cache = skip_prefix_cache
        self.sampler = Sampler(prompt_token_ids, seed, choice)
        self.remote_decode = remote_decode
        self.remote_prefill = remote_prefill
        self.remote_loaded = False
        self.arrival = arrival
        self.cache_salt = cache_salt
        self.lora = lora
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.blocks: list[Block] = []
        self.chain: list[HashedBlock] = []
        self.num_cached_blocks = 0
        self.num_hit_tokens = 0
        self.num_external_tokens = 0
        self.num_preemptions = 0
        self.admitted = False
        self.finish_reason: str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def extend_chain(self, block_size: int, chains: HashChains) -> None:
        """Hash every newly full block of known tokens (once each) into `chains` (its adapter's)."""
        chain = self.chain
        toks = self.token_ids
        while (len(chain) + 1) * block_size <= len(toks):
            start = len(chain) * block_size
            parent = chain[-1] if chain else None
            chain.append(chains.child(parent, tuple(toks[start : start + block_size]), self.cache_salt))
