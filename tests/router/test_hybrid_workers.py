"""A hybrid model's worker (sliding-window and full-attention layers) is credited with the prefix
vLLM would reuse: the matched prefix cut back to a hit end its shim published."""

from __future__ import annotations

import json

import pytest

from protocol.vllm_events import END_SEQ, decode_replay_reply
from tests.protocol.vllm_captures import FIXTURES
from tests.router.test_planner import Fleet, winfo
from worker_shim.adapters.vllm_events import decode_payload
from worker_shim.normaliser import Normaliser

BS = 32


def _published_before(batches: int) -> set[int]:
    """What a shim had published after the first `batches` of the captured hybrid replay."""
    norm = Normaliser(BS)
    lines = (FIXTURES / "bs32" / "hybrid_replay_from_0.jsonl").read_text().splitlines()[1:]
    for line in lines[:batches]:
        _, seq, payload = decode_replay_reply([bytes.fromhex(h) for h in json.loads(line)["frames_hex"]])
        assert seq != END_SEQ
        norm.apply(decode_payload(payload))
    return norm.canonical_hashes()


def test_each_captured_request_is_credited_with_what_vllm_reused() -> None:
    requests = json.loads((FIXTURES / "bs32" / "hybrid_requests.json").read_text())
    got, plain = [], []
    for r in requests:
        f = Fleet(winfo("hybrid", block_size=BS, sliding_window=64), winfo("plain", block_size=BS))
        keys = _published_before(r["batches_before"])
        f.index.store("hybrid", keys)
        f.index.store("plain", keys)
        ctx = f.ctx(r["prompt"])
        f.planner.refresh(ctx)
        by_worker = {c.worker: ctx.cached_tokens(c) for c in ctx.decode_pool}
        got.append(by_worker["hybrid"])
        plain.append(by_worker["plain"])
    assert got == [r["cached_tokens"] for r in requests] == [0, 288, 0, 192, 192]
    assert plain == [0, 288, 192, 192, 256]  # the same keys read as one full-attention cache


def test_a_hybrid_worker_with_nothing_published_at_its_window_gets_no_credit() -> None:
    f = Fleet(winfo("hybrid", block_size=BS, sliding_window=64))
    prompt = list(range(100, 400))
    ctx = f.ctx(prompt)
    f.index.store("hybrid", ctx.hashes)  # the full-attention blocks only
    f.planner.refresh(ctx)
    assert ctx.cached_tokens(ctx.decode_pool[0]) == 0


@pytest.mark.parametrize(("window", "continues", "diverges"), [(64, 288, 0), (0, 288, 192)])
def test_a_prompt_routed_to_a_hybrid_worker_is_pending_up_to_where_it_ends(
    window: int, continues: int, diverges: int
) -> None:
    f = Fleet(winfo("w", block_size=BS, sliding_window=window))
    prompt = list(range(100, 400))  # 9 full blocks; no KV event has come for it yet
    assert f.planner.take(f.ctx(prompt, "r0")) is not None
    credit = []
    for tokens in (
        prompt + list(range(1000, 1100)),  # a next turn: the whole prompt is its prefix
        prompt[:200] + list(range(2000, 2100)),  # leaves it after 6 blocks
    ):
        ctx = f.ctx(tokens, "r1")
        f.planner.refresh(ctx)
        credit.append(ctx.cached_tokens(ctx.decode_pool[0]))
    assert credit == [continues, diverges]


def test_a_block_aligned_prompt_is_pending_where_vllm_caches_its_window() -> None:
    # vLLM 0.32 caches the window before a prompt's last token (replay_boundaries): for 288 tokens,
    # blocks 6 and 7, so a resend and a longer sibling both reuse 8 blocks, neither 0 nor 9.
    f = Fleet(winfo("w", block_size=BS, sliding_window=64))
    prompt = list(range(100, 388))  # 9 full blocks and no more; no KV event has come for it yet
    assert f.planner.take(f.ctx(prompt, "r0")) is not None
    credit = []
    for tokens in (prompt, prompt + list(range(1000, 1040))):
        ctx = f.ctx(tokens, "r1")
        f.planner.refresh(ctx)
        credit.append(ctx.cached_tokens(ctx.decode_pool[0]))
    assert credit == [256, 256]


def test_an_empty_prompt_books_no_window_end() -> None:
    """Before: (0 - 1) // B is -1, and the ledger read hashes[-2] of an empty list (IndexError, a 500)."""
    f = Fleet(winfo("w", block_size=32, sliding_window=64))
    assert f.planner.take(f.ctx([], "r0")) is not None
