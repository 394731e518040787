"""The synchronous core: vLLM v1 scheduling, prefix hits, preemption, remote KV, stats."""

from __future__ import annotations

from engine_sim.lora import LoraRequest
from engine_sim.request import RequestStatus, SimRequest
from engine_sim.scheduler import Scheduler, StepResult
from protocol.hashing import block_hashes, chain_salt
from protocol.vllm_events import BlockRemoved, BlockStored


def make(*, num_gpu_blocks: int = 64, max_num_batched_tokens: int = 256, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        hash_seed="0",
        block_size=16,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )


def run(s: Scheduler) -> list[StepResult]:
    steps = []
    while (r := s.step()).num_scheduled_tokens:
        steps.append(r)
    return steps


def req(rid: str, n: int, base: int = 1000, max_tokens: int = 4) -> SimRequest:
    return SimRequest(rid, list(range(base, base + n)), max_tokens=max_tokens)


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    s = make()
    s.add_request(req("a", 600, max_tokens=2))
    steps = run(s)
    assert [r.num_prefill_tokens for r in steps[:3]] == [256, 256, 88]
    assert [len(r.outputs) for r in steps] == [0, 0, 1, 1]  # first token with the last chunk
    assert steps[-1].outputs[0].finish_reason == "length"
    assert s.prefill_tokens_computed == 600 and s.num_blocks_in_use == 0


def test_decodes_batch_with_a_prefill_chunk() -> None:
    s = make(max_num_batched_tokens=100)
    s.add_request(req("a", 50, max_tokens=10))
    s.step()
    s.add_request(req("b", 500, base=5000))
    r = s.step()
    assert r.num_decode == 1 and r.num_prefill_tokens == 99
    assert r.duration > s.timing.decode(1, 51)  # the chunk's marginal cost is added


def test_max_num_seqs_caps_running() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 20, base=1000 * (i + 1)))
    s.step()
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_prefix_hit_leaves_the_last_token_to_compute() -> None:
    s = make()
    s.add_request(req("a", 64, max_tokens=1))
    run(s)
    s.add_request(req("b", 64, max_tokens=1))
    steps = run(s)
    assert steps[0].num_prefill_tokens == 16  # 3 of 4 blocks hit: (64 - 1) // 16
    assert s.stats.prefix_cache_hits == 48 and s.stats.prefix_cache_queries == 128


def test_cached_block_prefixes_match_canonical_chain() -> None:
    s = make()
    s.add_request(req("a", 40, max_tokens=10))
    run(s)
    prefixes = sorted(s.cached_block_prefixes(), key=len)
    assert [len(p) for p in prefixes] == [16, 32, 48]  # 40 prompt + 9 computed outputs: 3 full blocks
    assert prefixes[1] == list(range(1000, 1032))
    # What another package does with them: canonical hashes of each prefix's last block.
    assert len({block_hashes(p, 16)[-1] for p in prefixes}) == 3


def test_cached_canonical_hashes_are_each_cached_blocks_chain_hash_once() -> None:
    s = make(num_gpu_blocks=64)
    s.add_request(req("a", 100, base=1000))
    s.add_request(req("b", 100, base=1000))  # the same prompt: shared blocks, hashed once
    s.add_request(req("c", 70, base=5000))
    run(s)
    expected = {block_hashes(prefix, s.block_size)[-1] for prefix in s.cached_block_prefixes()}
    got = s.cached_canonical_hashes()
    assert got == sorted(expected) and len(got) == len(expected) > 0


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    s = make(num_gpu_blocks=7, max_num_batched_tokens=512)  # 6 hold KV: block 0 is the null block
    s.add_request(req("a", 40, max_tokens=30))
    s.add_request(req("b", 40, base=3000, max_tokens=30))
    steps = run(s)
    assert s.stats.preemptions >= 1
    finished = [o.request_id for r in steps for o in r.outputs if o.finish_reason]
    assert sorted(finished) == ["a", "b"]
    assert s.num_blocks_in_use == 0


def test_eviction_emits_removed_for_exactly_the_evicted_hashes() -> None:
    s = make(num_gpu_blocks=9)  # 8 hold KV
    s.add_request(req("a", 64, max_tokens=1))
    run(s)
    stored_a = [h for e in s.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    s.add_request(req("b", 112, base=9000, max_tokens=1))  # 7 of 8 blocks: evicts a's LRU ones
    run(s)
    events = s.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    survivors = {p[-1] for p in s.cached_block_prefixes() if p[0] == 1000}
    assert len(stored_a) == 4 and len(removed) == 3
    assert set(removed) < set(stored_a)
    assert removed == stored_a[::-1][:3]  # tails first
    assert survivors == {1015}  # only a's first block is still cached


def test_remote_prefill_skips_local_prefill() -> None:
    s = make()
    r = SimRequest("d", list(range(100)), max_tokens=3, remote_prefill={"do_remote_prefill": True})
    s.add_request(r)
    first = s.step()
    assert first.transfers == [("d", 100)] and first.num_scheduled_tokens == 0
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.step().num_scheduled_tokens == 0  # still waiting
    s.finish_remote_load("d", ok=True)
    steps = run(s)
    assert [st.num_decode for st in steps] == [1, 1, 1]
    assert s.prefill_tokens_computed == 0 and s.stats.external_kv_tokens == 100


def test_connector_stats_count_as_vllm_with_a_kv_connector() -> None:
    """vLLM asks its connector about each new request's tokens past the local hit; NIXL supplies a
    P/D pull's. Without a connector only a request that pulls counts."""
    for connector in (False, True):
        s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64, kv_connector=connector)
        s.add_request(req("local", 100, base=0, max_tokens=1))
        run(s)
        assert (s.stats.external_prefix_cache_queries, s.stats.external_prefix_cache_hits) == (
            100 if connector else 0,
            0,
        )
        # 6 of its 10 blocks cached here (the local request's first 96 tokens): 64 tokens pulled.
        s.add_request(SimRequest("pd", list(range(160)), max_tokens=1, remote_prefill={"do_remote_prefill": True}))
        assert s.step().transfers == [("pd", 64)]
        queries = 64 + (100 if connector else 0)
        assert (s.stats.external_prefix_cache_queries, s.stats.external_prefix_cache_hits) == (queries, 64)
        assert s.stats.prefix_cache_hits == 96


def test_remote_prefill_failure_recomputes_or_fails_by_policy() -> None:
    for recompute in (True, False):
        s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64, recompute_kv_load_failures=recompute)
        s.add_request(SimRequest("d", list(range(100)), max_tokens=1, remote_prefill={"do_remote_prefill": True}))
        s.step()
        assert s.pool.num_used > 0
        assert s.finish_remote_load("d", ok=False) is recompute
        run(s)
        assert s.stats.failed_transfers == 1
        if recompute:
            assert s.prefill_tokens_computed == 100
        else:  # vLLM's default: the request ends with an error and frees its blocks
            assert (s.prefill_tokens_computed, s.requests, s.pool.num_used) == (0, {}, 0)


def test_recompute_after_a_failed_load_with_no_hit_frees_its_blocks_and_looks_up_again() -> None:
    """vLLM 0.32 (_update_waiting_for_remote_kv): a failed pull with no valid computed tokens frees
    the request's blocks ("there may be a local cache hit on retry"), and the retry, with
    num_computed_tokens 0, looks the cache up afresh: b takes the 6 blocks a cached during the pull
    and prefills 4 tokens. vLLM records the prefix-cache (and connector) queries at each lookup,
    the prompt once, with its last lookup's hit."""
    s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64, recompute_kv_load_failures=True, kv_connector=True)
    prompt = list(range(100))
    s.add_request(SimRequest("a", prompt, max_tokens=3, remote_prefill={"do_remote_prefill": True}))
    s.add_request(SimRequest("b", prompt, max_tokens=3, remote_prefill={"do_remote_prefill": True}))
    s.step()
    assert s.pool.num_used == 14  # 7 + 7, no hit for either
    assert s.finish_remote_load("a", ok=True)  # a's 6 full blocks are cached now
    assert s.finish_remote_load("b", ok=False)  # b prefills here
    b = s.requests["b"]
    assert (b.blocks, s.pool.num_used) == ([], 7)  # b's blocks back in the pool
    a_blocks = [x.block_id for x in s.requests["a"].blocks]
    s.take_events()
    step = s.step()
    assert [x.block_id for x in b.blocks[:6]] == a_blocks[:6] and len(b.blocks) == 7
    assert (step.num_prefill_tokens, s.pool.num_used, b.num_hit_tokens) == (4, 8, 96)
    assert not [e for e in s.take_events() if isinstance(e, BlockStored)]  # nothing new to cache
    st = s.stats
    assert (st.prompt_tokens, st.prompt_tokens_cache_hit) == (200, 96)
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (300, 96)
    assert (st.external_prefix_cache_queries, st.external_prefix_cache_hits) == (204, 200)
    outs = [o for o in step.outputs if o.request_id == "b"]
    assert outs[0].num_cached_tokens == 96


def test_recompute_after_a_failed_load_with_a_local_hit_keeps_its_blocks() -> None:
    """With valid computed tokens (its local hit) vLLM keeps the request's blocks and does not look
    the cache up again: it prefills the rest of its prompt into them."""
    s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64, recompute_kv_load_failures=True)
    s.add_request(req("local", 40, base=0, max_tokens=1))
    run(s)
    s.add_request(SimRequest("d", list(range(100)), max_tokens=2, remote_prefill={"do_remote_prefill": True}))
    s.step()
    d = s.requests["d"]
    held = [x.block_id for x in d.blocks]
    assert s.finish_remote_load("d", ok=False)
    assert [x.block_id for x in d.blocks] == held and d.num_computed_tokens == 32
    step = s.step()
    assert step.num_prefill_tokens == 68 and [x.block_id for x in d.blocks] == held
    assert (s.stats.prompt_tokens, s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (140, 140, 32)


def test_recompute_after_a_failed_load_counts_the_prompt_once() -> None:
    s = Scheduler(hash_seed="0", block_size=16, num_gpu_blocks=64, recompute_kv_load_failures=True)
    s.add_request(SimRequest("d", list(range(100)), max_tokens=1, remote_prefill={"do_remote_prefill": True}))
    s.step()
    assert s.finish_remote_load("d", ok=False)
    run(s)
    st = s.stats
    # two lookups (the pull's and the retry's), one prompt
    assert (st.prompt_tokens, st.prefix_cache_queries, st.prompt_tokens_cache_hit) == (100, 200, 0)
    # no KV connector (an agg sim): only the pull's lookup asks one
    assert (st.external_prefix_cache_queries, st.external_prefix_cache_hits) == (100, 100)
    assert (s.prefill_tokens_computed, s.pool.num_used) == (100, 0)


def test_remote_decode_pins_blocks_until_released() -> None:
    s = make()
    r = SimRequest("p", list(range(100)), max_tokens=1, remote_decode=True)
    s.add_request(r)
    (step,) = run(s)
    params = step.outputs[0].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    (group,) = params["remote_block_ids"]  # one list per KV cache group, as vLLM 0.32's NixlConnector
    assert group and s.num_blocks_in_use == len(group)
    assert s.release_pin(None, params["remote_block_ids"]) is True
    assert s.num_blocks_in_use == 0 and s.release_pin("p") is False


def test_remote_decode_returns_params_only_for_a_request_that_ended_on_its_length() -> None:
    """vLLM 0.32's NixlConnector.request_finished: no params unless FINISHED_LENGTH_CAPPED. A
    prefill whose one token is a stop token id ends "stop", with none, and frees its blocks;
    min_tokens 1 masks the stop id, and the request ends on its length with them."""
    prompt = list(range(100))
    first = SimRequest("probe", prompt, max_tokens=1).sampler.token(0)
    for least, finish in ((0, "stop"), (1, "length")):
        s = make()
        stops = frozenset({first})
        s.add_request(SimRequest("p", prompt, max_tokens=1, stop_token_ids=stops, min_tokens=least, remote_decode=True))
        (step,) = run(s)
        (out,) = step.outputs
        assert out.finish_reason == finish
        assert (out.kv_transfer_params is not None) is (finish == "length")
        assert (s.num_blocks_in_use > 0) is (finish == "length") and not s.requests


def test_abort_frees_blocks() -> None:
    s = make()
    s.add_request(req("a", 300))
    s.step()
    assert s.num_blocks_in_use > 0
    assert s.abort("a") and s.num_blocks_in_use == 0 and not s.running
    assert s.abort("a") is False


def test_a_cache_salt_isolates_its_chain_as_vllm_hashes_it() -> None:
    """vLLM mixes a request's cache_salt into its first block's extra keys: requests share cached
    blocks only with the same salt, and the Stored event carries the salt on the chain's first
    block, which is how a shim learns it."""
    s = make()

    def salted(rid: str, salt: str | None) -> SimRequest:
        return SimRequest(rid, list(range(1000, 1064)), max_tokens=1, cache_salt=salt)

    s.add_request(salted("a", "tenant-1"))
    run(s)
    (stored,) = [e for e in s.take_events() if isinstance(e, BlockStored)]
    assert stored.parent_block_hash is None and stored.extra_keys == [("tenant-1",), None, None, None]
    for rid, salt, hit in (("b", "tenant-1", 48), ("c", "tenant-2", 0), ("d", None, 0), ("e", None, 48)):
        before = s.stats.prefix_cache_hits
        s.add_request(salted(rid, salt))
        run(s)
        assert s.stats.prefix_cache_hits - before == hit, rid
    tokens = list(range(1000, 1064))
    expected = {*block_hashes(tokens, 16, salt="\x00tenant-1"), *block_hashes(tokens, 16, salt="\x00tenant-2")}
    assert set(s.cached_canonical_hashes()) == expected | set(block_hashes(tokens, 16))


def test_an_adapters_chain_is_its_own_as_vllm_hashes_it() -> None:
    """vLLM puts a LoRA request's adapter name in every block's extra keys (a cache_salt follows it
    on the first block): an adapter's blocks are shared only with requests for the same adapter and
    salt, and its Stored events name the adapter, as the bs32 LoRA capture shows."""
    sql, chat = LoraRequest("sql", 1, "/a/sql"), LoraRequest("chat", 2, "/a/chat")
    tokens = list(range(1000, 1064))
    s = make()

    def stored(rid: str, lora: LoraRequest | None, salt: str | None = None) -> BlockStored:
        s.add_request(SimRequest(rid, tokens, max_tokens=1, lora=lora, cache_salt=salt))
        run(s)
        (event,) = [e for e in s.take_events() if isinstance(e, BlockStored)]
        return event

    base, adapter, salted = stored("base", None), stored("sql", sql), stored("salted", sql, "tenant-1")
    assert (base.lora_id, base.lora_name, base.extra_keys) == (None, None, [None] * 4)
    assert (adapter.lora_id, adapter.lora_name, adapter.extra_keys) == (1, "sql", [("sql",)] * 4)
    assert salted.lora_id == 1 and salted.extra_keys == [("sql", "tenant-1"), ("sql",), ("sql",), ("sql",)]
    chains = [base.block_hashes, adapter.block_hashes, salted.block_hashes]
    assert len({h for c in chains for h in c}) == 12  # same tokens, three chains, no block shared
    for rid, lora, salt, hit in (("sql-2", sql, None, 48), ("chat", chat, None, 0), ("base-2", None, None, 48),
                                 ("salted-2", sql, "tenant-1", 48), ("other-salt", sql, "tenant-2", 0)):  # fmt: skip
        before = s.stats.prefix_cache_hits
        s.add_request(SimRequest(rid, tokens, max_tokens=1, lora=lora, cache_salt=salt))
        run(s)
        assert s.stats.prefix_cache_hits - before == hit, rid
    salts = ["", chain_salt("sql"), chain_salt("sql", "tenant-1"), chain_salt("chat"), chain_salt("sql", "tenant-2")]
    assert set(s.cached_canonical_hashes()) == {h for salt in salts for h in block_hashes(tokens, 16, salt=salt)}


def test_tagged_extra_keys_keep_a_salt_named_like_an_adapter_and_a_repointed_adapter_apart() -> None:
    """vLLM 0.32 hashes tagged extra keys, ("lora", name, path) and ("cache_salt", salt): a
    cache_salt equal to an adapter's name shares none of its blocks, and an adapter re-pointed at
    another path (same name, same id: load_inplace) caches afresh; its events keep the untagged keys."""
    tokens = list(range(1000, 1064))
    first, moved = LoraRequest("A", 1, "/adapters/a"), LoraRequest("A", 1, "/adapters/a-v2")
    s = make()

    def hits(rid: str, lora: LoraRequest | None, salt: str | None = None) -> int:
        before = s.stats.prefix_cache_hits
        s.add_request(SimRequest(rid, tokens, max_tokens=1, lora=lora, cache_salt=salt))
        run(s)
        return s.stats.prefix_cache_hits - before

    assert hits("adapter", first) == 0
    (adapter,) = [e for e in s.take_events() if isinstance(e, BlockStored)]
    assert hits("salt named A", None, "A") == 0, "a salt is no adapter"
    (salted,) = [e for e in s.take_events() if isinstance(e, BlockStored)]
    assert adapter.extra_keys == [("A",)] * 4 and salted.extra_keys == [("A",), None, None, None]
    assert not set(adapter.block_hashes) & set(salted.block_hashes)
    assert hits("re-pointed", moved) == 0, "another path: other weights, no reuse"
    (repointed,) = [e for e in s.take_events() if isinstance(e, BlockStored)]
    assert (repointed.lora_id, repointed.lora_name, repointed.extra_keys) == (1, "A", [("A",)] * 4)
    assert hits("re-pointed again", moved) == 48
    assert hits("reloaded at the first path", LoraRequest("A", 2, "/adapters/a")) == 48, "the id is not hashed"
