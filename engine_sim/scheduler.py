"""The synchronous core of a simulated engine: vLLM v1's scheduler over a prefix-caching block pool.

`step()` schedules one iteration, "executes" it (advances every scheduled request and samples a
token for each that has computed all it knows) and returns what happened with the modelled
duration; it never awaits. The async driver (engine_sim/runner.py) sleeps that duration, delivers
the outputs and publishes `take_events()`.

Scheduling, as vLLM v1 does it:
- one token budget per step (`max_num_batched_tokens`); running requests first, in admission order,
  each getting everything it has not computed (a decode gets 1 token, a long prompt a chunk:
  chunked prefill), then waiting requests in FIFO order while `max_num_seqs` allows;
- a waiting request first takes its longest prefix-cache hit, at most `(num_tokens - 1) // B`
  blocks, because the last token must be computed to produce logits;
- when the pool cannot hold a running request's next tokens, the most recently admitted running
  request is preempted by recompute (blocks freed, progress reset, back to the front of the
  waiting queue) until it fits; no waiting request is admitted in a step that preempted;
- remote KV (NixlConnector): a request with `do_remote_prefill` takes its local hit, allocates the
  rest of its prompt, waits in WAITING_FOR_REMOTE_KVS for the driver to finish the transfer, then
  recomputes only its last prompt token; a request with `do_remote_decode` runs to its max_tokens
  (one, as P/D proxies ask) and, where it ended on its length (not on a stop token id), its blocks stay pinned until
  `release_pin` (the decode side pulled or gave them up, or their lease ran out: engine_sim/runner.py).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine_sim.block_hash import HashChains, HashedBlock, root_hash
from engine_sim.block_pool import BlockPool
from engine_sim.request import RequestStatus, SimRequest
from engine_sim.stats import EngineStats
from protocol.hashing import BlockHasher, chain_salt
from protocol.hashing import root_hash as canonical_root
from protocol.timing import TimingModel

__all__ = ["Scheduler", "StepOutput", "StepResult"]


@dataclass(slots=True)
class StepOutput:
    """New tokens for one request from one step; `finish_reason` set on its last."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    """The prompt's cached tokens as vLLM reports them in usage (set on its first output only)."""
    num_cache_creation_tokens: int = 0
    """Prompt tokens this request wrote to the prefix cache (set on its first output only)."""
    prefill_kv_computed: int | None = None
    """vLLM 0.32's request_prefill_kv_computed_tokens for this request (set on its first output
    only): the driver observes it with the prefill time when it delivers the request's finish, so
    the two histograms count the same requests at every instant (vLLM observes both per finished
    request; a client's abort, even in the step that finishes it, counts neither)."""


@dataclass(slots=True)
class StepResult:
    duration: float = 0.0
    """Modelled seconds of H200 time for this step (before speedup)."""
    outputs: list[StepOutput] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_decode: int = 0
    num_prefill_tokens: int = 0
    transfers: list[tuple[str, int]] = field(default_factory=list)
    """(request_id, tokens to pull) for remote-KV loads that start now."""
    started: list[str] = field(default_factory=list)
    """Requests scheduled for the first time in this step (vLLM's prefill time starts here; a
    remote-KV load that only starts is not scheduled yet)."""


class Scheduler:
    """One engine. Ownership: it owns its requests, pool and pins; the driver owns time."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_gpu_blocks: int = 8192,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 32768,
        timing: TimingModel | None = None,
        emit_events: bool = True,
        engine_id: str = "sim",
        hash_seed: str | None = None,
        enable_prefix_caching: bool = True,
        kv_connector: bool = False,
        recompute_kv_load_failures: bool = False,
    ) -> None:
        self.block_size = block_size
        # A P/D engine (vLLM with --kv-transfer-config): its connector is asked about every new
        # request, so its connector stats count them all; without one, only requests that pull KV.
        self.kv_connector = kv_connector
        # vLLM's kv_load_failure_policy: "fail" (its default) ends a request whose pull failed with
        # an error; "recompute" prefills it here.
        self.recompute_kv_load_failures = recompute_kv_load_failures
        # Off (vLLM's --no-enable-prefix-caching): no block is hashed, cached or reported, no hit.
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.timing = timing or TimingModel.for_profile()
        self.engine_id = engine_id
        self.pool = BlockPool(num_gpu_blocks, block_size, emit_events=emit_events)
        self.root = root_hash(hash_seed)
        self.chains = HashChains(self.root)
        # One trie per LoRA adapter, by name and path (vLLM keys both: an adapter re-pointed at
        # another path caches afresh): an adapter's chains share no node with any other's, and
        # `HashChains.child` keeps the signature bench/virtual/engine_hash.py overrides.
        self.lora_chains: dict[tuple[str, str], HashChains] = {}
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.pins: dict[str, SimRequest] = {}
        # Decode side: the prefill engine's own prompt hits, from its kv_transfer_params, until the
        # request's first output reports them (vLLM 0.32's OutputProcessor takes them over the
        # decode engine's own cached tokens, a failed or recomputed load included).
        self.remote_cached: dict[str, int] = {}
        self.stats = EngineStats(max_model_len)
        # Filled in by the driver so kv_transfer_params can say where to pull from.
        self.remote_host = "127.0.0.1"
        self.remote_port = 0

    # --- requests in and out ---------------------------------------------------------------------

    def add_request(self, req: SimRequest) -> None:
        if req.request_id in self.requests or req.request_id in self.pins:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        req.extend_chain(self.block_size, self._chains(req))
        self.requests[req.request_id] = req
        self.waiting.append(req)
        params = req.remote_prefill or {}
        if isinstance(cached := params.get("remote_prefill_cached_tokens"), int):
            self.remote_cached[req.request_id] = cached

    def _chains(self, req: SimRequest) -> HashChains:
        """The chains `req` hashes into: the base model's, or its LoRA adapter's."""
        lora = req.lora
        if lora is None:
            return self.chains
        key = (lora.name, lora.path)
        chains = self.lora_chains.get(key)
        if chains is None:
            chains = self.lora_chains[key] = HashChains(self.root, lora)
        return chains

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Drop a request wherever it is and free its blocks (client gone, stop string, deadline)."""
        if self.release_pin(request_id):
            return True
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.remote_cached.pop(request_id, None)
        if req in self.running:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return True

    def release_pin(self, request_id: str | None, block_ids: list[list[int]] | None = None) -> bool:
        """The decode side pulled (or gave up on) a prefilled request's KV: free its blocks.
        Found by request id, or by its exact block ids (one list per KV cache group, as the params
        carry them) when the params carry no request id."""
        req = self.pins.pop(request_id, None) if request_id is not None else None
        if req is None and request_id is None and block_ids:
            rid = next((k for k, r in self.pins.items() if [[b.block_id for b in r.blocks]] == block_ids), None)
            req = self.pins.pop(rid, None) if rid is not None else None
        if req is None:
            return False
        self.pool.free(req.blocks)
        req.blocks = []
        return True

    def finish_remote_load(self, request_id: str, ok: bool) -> bool | None:
        """A remote-KV transfer ended: on success only the last prompt token remains to compute.
        On failure the request ends with finish reason "error" (vLLM's default policy: False is
        returned), or, recomputing, prefills locally: into its own cache hit, or, with none, after a
        fresh lookup (its pull's blocks freed, as vLLM's). None, changing
        nothing, when no request waits for it (aborted during the pull)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            return None
        req.status = RequestStatus.WAITING
        if ok:
            self.stats.external_kv_tokens += req.num_external_tokens
            req.num_computed_tokens = req.num_prompt_tokens - 1
            req.remote_loaded = True
            self._cache_full(req, req.num_computed_tokens)
            return True
        self.stats.failed_transfers += 1
        if not self.recompute_kv_load_failures:
            self.abort(request_id, "error")
            return False
        req.num_external_tokens = 0
        req.remote_prefill = None
        if req.num_computed_tokens == 0:
            # vLLM frees the blocks of a request left with no valid computed tokens: its retry looks
            # the cache up afresh and may hit blocks cached during the pull.
            self.pool.free(req.blocks)
            req.blocks = []
            req.num_cached_blocks = 0
        return True

    def has_waiting_work(self) -> bool:
        return bool(self.running) or any(r.status is not RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting)

    # --- prefix cache ----------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    def take_events(self) -> list[Any]:
        return self.pool.take_events()

    def publish_stats(self) -> None:
        """A step ended (or found nothing to compute): its gauges and counters become what /metrics
        shows (EngineStats.publish). The driver calls it, as only it knows when a step ends."""
        self.stats.publish(len(self.running), len(self.waiting), self.pool.usage)

    def cached_block_prefixes(self) -> list[list[int]]:
        """For every block now in the prefix cache, the token ids from the start through that
        block (duplicates appear once per physical block)."""
        return [b.hashed.prefix() for b in self.pool.cached_blocks() if b.hashed is not None]

    def cached_canonical_hashes(self) -> list[int]:
        """The canonical hash (protocol.hashing) of every block now in the prefix cache, each once:
        what a router's index should hold for this engine. A chain of a LoRA adapter or a cache_salt
        starts from `canonical_root(chain_salt(lora_name, cache_salt))`. Each chain is hashed once,
        parents first, so this costs one hash per distinct block (the prefixes above grow with the
        square)."""
        hasher = BlockHasher(self.block_size)
        memo: dict[int, int] = {}
        roots: dict[str, int] = {}

        def canonical(node: HashedBlock) -> int:
            chain: list[HashedBlock] = []
            cur: HashedBlock | None = node
            while cur is not None and id(cur) not in memo:
                chain.append(cur)
                cur = cur.parent
            if cur is not None:
                parent: int | None = memo[id(cur)]
            elif salt := chain_salt(node.lora.name if node.lora is not None else "", node.salt or ""):
                if salt not in roots:
                    roots[salt] = canonical_root(salt)
                parent = roots[salt]
            else:
                parent = None
            for block in reversed(chain):
                parent = memo[id(block)] = hasher.extend(parent, block.tokens)[0]
            return memo[id(node)]

        return sorted({canonical(b.hashed) for b in self.pool.cached_blocks() if b.hashed is not None})

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_used

    @property
    def prefill_tokens_computed(self) -> int:
        return self.stats.prefill_tokens_computed

    # --- one step --------------------------------------------------------------------------------

    def step(self) -> StepResult:
        result = StepResult()
        scheduled = self._schedule(result)
        if not scheduled:
            return result
        self._execute(scheduled, result)
        return result

    def _schedule(self, result: StepResult) -> list[tuple[SimRequest, int]]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False
        running = self.running
        pool = self.pool
        bs = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed_tokens
            n = len(req.token_ids) - c
            if n == 1 and (c < len(req.blocks) * bs or pool.num_free):
                # The common case, a decode, inlined: a new block only at a block boundary, and
                # a block to cache only when this token completes it. Same effect as _allocate.
                if c >= len(req.blocks) * bs:
                    req.blocks.extend(pool.allocate(1))
                if (c + 1) % bs == 0:
                    self._cache_full(req, c + 1)
                scheduled.append((req, 1))
                budget -= 1
                i += 1
                continue
            n = min(n, budget)
            while not self._allocate(req, n):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
        if preempted:
            return scheduled
        skipped: list[SimRequest] = []
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting[0]
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(waiting.popleft())
                continue
            if req.remote_prefill is not None and not req.remote_loaded and req.num_external_tokens == 0:
                if not self._start_remote_load(req, result):
                    break
                skipped.append(waiting.popleft())
                continue
            fresh = req.num_computed_tokens == 0
            use_cache = fresh and not req.skip_prefix_cache and self.enable_prefix_caching
            hits = self.pool.longest_hit(req.chain, (req.num_tokens - 1) // self.block_size) if use_cache else []
            hit_tokens = len(hits) * self.block_size
            n = min(req.num_tokens - req.num_computed_tokens - hit_tokens, budget)
            if not self._allocate(req, n, hits):
                break
            if fresh and req.num_preemptions == 0:
                self._count_admission(req, hit_tokens, 0, result, looked_up=use_cache)
            if req.num_preemptions == 0:  # vLLM's SCHEDULED event (a loaded remote request's too)
                result.started.append(req.request_id)
            waiting.popleft()
            running.append(req)
            req.status = RequestStatus.RUNNING
            scheduled.append((req, n))
            budget -= n
        waiting.extendleft(reversed(skipped))
        return scheduled

    def _count_admission(
        self, req: SimRequest, hit_tokens: int, external: int, result: StepResult, *, looked_up: bool
    ) -> None:
        st = self.stats
        if looked_up:  # vLLM's record_prefix_cache_stats: a request that skipped the lookup is no query
            st.prefix_cache_queries += req.num_tokens
            st.prefix_cache_hits += hit_tokens
        if self.kv_connector or external:
            st.external_prefix_cache_queries += req.num_tokens - hit_tokens
            st.external_prefix_cache_hits += external
        # vLLM counts each lookup above, but a prompt once, with its last lookup's hit: one looked up
        # again (its pull failed with no local hit) had a hit of 0 before.
        if not req.admitted:
            st.prompt_tokens += req.num_prompt_tokens
        req.admitted = True
        st.prompt_tokens_cache_hit += min(hit_tokens, req.num_prompt_tokens)
        req.num_hit_tokens = hit_tokens

    def _start_remote_load(self, req: SimRequest, result: StepResult) -> bool:
        bs = self.block_size
        use_cache = self.enable_prefix_caching and not req.skip_prefix_cache
        hits = self.pool.longest_hit(req.chain, (req.num_prompt_tokens - 1) // bs) if use_cache else []
        hit_tokens = len(hits) * bs
        if not self._allocate(req, req.num_prompt_tokens - hit_tokens, hits, cache=False):
            return False
        req.num_computed_tokens = hit_tokens
        req.num_external_tokens = req.num_prompt_tokens - hit_tokens
        self._count_admission(req, hit_tokens, req.num_external_tokens, result, looked_up=use_cache)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        result.transfers.append((req.request_id, req.num_external_tokens))
        return True

    def _allocate(self, req: SimRequest, n: int, hits: list[Any] | None = None, *, cache: bool = True) -> bool:
        """Room for `n` more tokens after `hits` (cache-hit blocks, for a request with no blocks
        yet). False, changing nothing, when the pool cannot provide it."""
        bs = self.block_size
        hits = hits or []
        total = req.num_computed_tokens + len(hits) * bs + n
        need = -(-total // bs) - len(req.blocks) - len(hits)
        if need > 0 and self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0) < need:
            return False
        if hits:
            self.pool.touch(hits)
            req.blocks.extend(hits)
            req.num_computed_tokens += len(hits) * bs
            req.num_cached_blocks = len(req.blocks)
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        if cache:
            self._cache_full(req, total)
        return True

    def _cache_full(self, req: SimRequest, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        req.extend_chain(self.block_size, self._chains(req))
        full = min(num_tokens // self.block_size, len(req.chain), len(req.blocks))
        if full > req.num_cached_blocks:
            self.pool.cache(req.blocks, req.chain, req.num_cached_blocks, full, req.lora)
            req.num_cached_blocks = full

    def _preempt(self, req: SimRequest) -> None:
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.remote_loaded = False
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _execute(self, scheduled: list[tuple[SimRequest, int]], result: StepResult) -> None:
        decode_ctx = 0
        chunks: list[tuple[int, int]] = []
        outputs = result.outputs
        st = self.stats
        num_decode = num_prefill = num_scheduled = prompt_computed = 0
        max_model_len = self.max_model_len
        for req, n in scheduled:
            before = req.num_computed_tokens
            if n == 1 and (req.output_token_ids or req.remote_loaded):
                num_decode += 1
                decode_ctx += before + 1
            else:
                chunks.append((n, before))
                num_prefill += n
            num_scheduled += n
            req.num_computed_tokens = before + n
            if before + n < len(req.token_ids):
                continue  # a prefill chunk that is not the last: nothing to sample yet
            out_ids = req.output_token_ids
            created = 0
            computed = None
            reported = 0
            if not out_ids:
                found = req.num_hit_tokens + req.num_external_tokens
                prompt_computed += max(req.num_prompt_tokens - found, 0)
                # vLLM's prompt cached tokens (usage, computed KV): its local and pulled tokens, or,
                # when its params name them, the prefill engine's hits (OutputProcessor)
                reported = self.remote_cached.pop(req.request_id, found)
                computed = max(req.num_prompt_tokens - reported, 0)
                # vLLM's PrefillStats.finalize: the prompt's cached blocks less those it found
                cached = min(req.num_cached_blocks * self.block_size, req.num_prompt_tokens)
                created = max(cached - found, 0)
            tok = req.sampler.token(len(out_ids))
            finish = None
            if req.stop_token_ids and tok in req.stop_token_ids:
                if len(out_ids) < req.min_tokens:  # masked until min_tokens: the next best token
                    tok = req.sampler.token_avoiding(len(out_ids), req.stop_token_ids)
                else:
                    finish = "stop"
            out_ids.append(tok)
            req.token_ids.append(tok)
            req.remote_loaded = False
            if finish is None and (len(out_ids) >= req.max_tokens or len(req.token_ids) >= max_model_len):
                finish = "length"
            out = StepOutput(
                req.request_id,
                [tok],
                finish,
                num_cached_tokens=reported,
                num_cache_creation_tokens=created,
                prefill_kv_computed=computed,
            )
            if finish is not None:
                self._finish(req, finish, out)
            outputs.append(out)
        result.num_decode, result.num_prefill_tokens, result.num_scheduled_tokens = (
            num_decode,
            num_prefill,
            num_scheduled,
        )
        st.prefill_tokens_computed += num_prefill
        st.generation_tokens += len(outputs)
        st.steps += 1
        if outputs:
            st.iteration_tokens.observe(prompt_computed + len(outputs))
        mean_ctx = decode_ctx / num_decode if num_decode else 0.0
        result.duration = self.timing.step(num_decode, mean_ctx, chunks)

    def prefill_kv_computed_unserved(self, req: SimRequest) -> int:
        """request_prefill_kv_computed_tokens of `req` (just added) should it end before its first
        output (a failed KV load): its prompt less the prefill engine's hits its params named, as
        vLLM 0.32 counts it (the whole prompt without them)."""
        return max(req.num_prompt_tokens - self.remote_cached.get(req.request_id, 0), 0)

    def _finish(self, req: SimRequest, reason: str, out: StepOutput) -> None:
        self.running.remove(req)
        del self.requests[req.request_id]
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.remote_decode and reason == "length":
            # NixlConnector: the blocks stay allocated for the decode engine to read. Only for a
            # request that ended on its length (request_finished: FINISHED_LENGTH_CAPPED); one that
            # stopped on its token gets no params, and its blocks go as any request's.
            self.pins[req.request_id] = req
            # vLLM 0.32's NixlConnector (nixl/pull_scheduler.py request_finished), key for key:
            # block ids one list per KV cache group (the sim's one full-attention group).
            out.kv_transfer_params = req.kv_transfer_params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[b.block_id for b in req.blocks]],
                "remote_engine_id": self.engine_id,
                "remote_request_id": req.request_id,
                "remote_host": self.remote_host,
                "remote_port": self.remote_port,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": req.num_computed_tokens,
                "remote_blocks_expiry_time": None,  # set on a decode engine's own pins only
                "transfer_mode": "pull",
                # vLLM 0.32 (Scheduler.update_from_output): this engine's own prompt hits, which the
                # decode engine reports as the prompt's cached tokens
                "remote_prefill_cached_tokens": req.num_hit_tokens + req.num_external_tokens,
            }
        else:
            self.pool.free(req.blocks)
            req.blocks = []
