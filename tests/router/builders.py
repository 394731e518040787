"""Builders with defaults for routing unit tests: workers, candidates and request contexts."""

from __future__ import annotations

from protocol import WorkerInfo
from protocol.config import ConditionalDisaggConfig, RouterSettings
from protocol.messages import Role
from router.request_context import Candidate, RequestContext

BLOCK = 16


def worker(
    name: str = "d1",
    role: Role = "decode",
    *,
    model: str = "m",
    kv_total_blocks: int | None = 1000,
    max_num_batched_tokens: int | None = 2048,
    timing_profile: str | None = "h200:llama-3.1-8b",
) -> WorkerInfo:
    return WorkerInfo(
        worker=name,
        model=model,
        role=role,
        engine="vllm",
        block_size=BLOCK,
        kv_total_blocks=kv_total_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        timing_profile=timing_profile,
    )


def cand(name: str = "d1", role: Role = "decode", *, overlap: int = 0, **load: int | str | None) -> Candidate:
    info_keys = {"kv_total_blocks", "max_num_batched_tokens", "timing_profile"}
    info = worker(name, role, **{k: v for k, v in load.items() if k in info_keys})  # type: ignore[arg-type]
    c = Candidate(info=info, overlap_blocks=overlap, kv_total_blocks=info.kv_total_blocks)
    for key, value in load.items():
        if key not in info_keys:
            setattr(c, key, value)
    return c


def ctx(
    isl: int,
    decode: list[Candidate] | None = None,
    prefill: list[Candidate] | None = None,
    *,
    request_id: str = "r1",
) -> RequestContext:
    tokens = list(range(isl))
    return RequestContext(
        request_id=request_id,
        model="m",
        token_ids=tokens,
        block_size=BLOCK,
        hashes=[],
        decode_pool=decode if decode is not None else [cand()],
        prefill_pool=prefill if prefill is not None else [cand("p1", "prefill")],
    )


def settings(**flat: object) -> RouterSettings:
    """RouterSettings from flat flag names (conditional ones included), validated."""
    cond_names = {f for f in ConditionalDisaggConfig.__struct_fields__}
    cond = {k: v for k, v in flat.items() if k in cond_names}
    top = {k: v for k, v in flat.items() if k not in cond_names}
    return RouterSettings(conditional=ConditionalDisaggConfig(**cond), **top).validate()  # type: ignore[arg-type]
