"""The planner end to end, synchronously: filters, choice, booking, admission, pending prefixes."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from protocol import block_hashes
from protocol.messages import ENDPOINT_DETOKENIZE, ENDPOINT_TOKENIZE, LoadReport, Role, Stored, WorkerInfo
from router.admission import Admission
from router.block_index import BlockIndex
from router.disagg import RoutePlan
from router.eligibility import Exclusion, WorkerStatus
from router.load_view import LoadView
from router.planner import PlanError, Planner, standalone_planner
from router.policies import Outcome, Path
from router.request_context import RequestShape
from tests.router.builders import settings

BLOCK = 16
MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def winfo(name: str, role: Role = "decode", **kw: object) -> WorkerInfo:
    fields: dict[str, object] = {
        "model": MODEL, "engine": "vllm", "block_size": BLOCK, "kv_total_blocks": 10_000,
        "max_num_batched_tokens": 8192, "timing_profile": "h200:llama-3.1-8b", "tokenizer": "builtin",
    }  # fmt: skip
    fields.update(kw)
    return WorkerInfo(worker=name, role=role, **fields)  # type: ignore[arg-type]


class Fleet:
    def __init__(
        self,
        *infos: WorkerInfo,
        sync: dict[str, tuple[str, str]] | None = None,
        unrouted: Sequence[WorkerStatus] = (),
        **flat: object,
    ) -> None:
        self.clock = Clock()
        self.infos = list(infos)
        self.index = BlockIndex()
        self.view = LoadView(clock=self.clock)
        self.sync = sync if sync is not None else {}
        self.planner: Planner = standalone_planner(
            settings(**flat),
            lambda: self.infos,
            index=self.index,
            view=self.view,
            clock=self.clock,
            rng=random.Random(0),
            sync_state=self.sync.get,
            tokenizer="builtin",
            unrouted=lambda model: unrouted,
        )
        for i in infos:
            self.report(i.worker)
        self.clock.now += 0.001  # bookings come after the reports (a report as new covers them)

    def report(self, worker: str, **load: Any) -> None:
        self.view.update(LoadReport(worker=worker, ts=self.clock(), kv_total_blocks=10_000, period_s=0.5, **load))

    def ctx(self, tokens: list[int], request_id: str = "r", *, text: bool = False):  # type: ignore[no-untyped-def]
        return self.planner.context(request_id, MODEL, tokens, text=text)


def test_excluded_workers_are_left_out_with_their_reason_and_the_rest_route() -> None:
    f = Fleet(winfo("d1"), winfo("d2"), sync={"d1": ("repairing", "gap: seq 9 after 7")})
    plan = f.planner.take(f.ctx(list(range(64))))
    assert plan is not None and plan.decode.worker == "d2"
    (excluded,) = plan.ctx.excluded
    assert excluded["worker"] == "d1" and excluded["excluded"] == "repairing" and "gap" in excluded["why"]


def test_no_routable_decode_worker_is_a_503_naming_each_reason() -> None:
    f = Fleet(winfo("d1"), sync={"d1": ("bootstrapping", "waiting for the shim's first full state")})
    with pytest.raises(PlanError) as err:
        f.planner.take(f.ctx(list(range(64))))
    assert err.value.code == 503 and "d1: bootstrapping (waiting for the shim's first full state)" in err.value.message


def test_a_503_names_eight_workers_and_counts_the_rest_by_reason() -> None:
    down = {f"d{i:02d}": ("bootstrapping", "waiting") for i in range(12)}
    down.update({f"d{i:02d}": ("repairing", "gap") for i in range(12, 20)})
    f = Fleet(*[winfo(w) for w in down], sync=down)
    with pytest.raises(PlanError) as err:
        f.planner.take(f.ctx(list(range(64))))
    message = err.value.message
    assert "d07: bootstrapping (waiting)" in message and "d08" not in message
    assert message.endswith("; and 12 more (bootstrapping: 4, repairing: 8)")


def test_a_block_size_tie_hashes_the_prompt_at_the_size_of_the_workers_that_route() -> None:
    # One worker of each size: the greater sets the model's size (router.fleet_vote), whichever
    # registered first (until 2026-12-07 the first did, as this router saw them), and the prompt
    # must be hashed at that size or its prefix never matches the routable worker.
    f = Fleet(winfo("d1", block_size=16))
    f.clock.now += 1.0
    f.infos.append(winfo("d2", block_size=32))
    f.planner.eligibility.added("d2")
    f.report("d1")
    f.report("d2")
    ctx = f.ctx(list(range(64)))
    plan = f.planner.take(ctx)
    assert plan is not None and plan.decode.worker == "d2"
    assert ctx.block_size == 32 and len(ctx.hashes) == 2


def test_a_503_for_want_of_a_decode_worker_names_those_the_registry_does_not_route() -> None:
    # A decode worker left out for its max_model_len is registered: "none is registered" was false
    # and hid the fix (until 2026-12-07).
    why = "max_model_len 32768, but model m is served with 16384, the length most of its decode and agg workers"
    odd = WorkerStatus("d1", MODEL, "decode", Exclusion.CONTEXT_CONFLICT, why, True)
    f = Fleet(winfo("p1", "prefill"), unrouted=[odd, WorkerStatus("p2", MODEL, "prefill", odd.exclusion, why, True)])
    with pytest.raises(PlanError) as err:
        f.planner.take(f.ctx(list(range(64))))
    assert (
        err.value.message
        == f"no decode or agg worker of model m can take the request now: d1: context_conflict ({why})"
    )
    alone = Fleet(unrouted=[odd])  # no worker of the model routed at all
    with pytest.raises(PlanError) as err:
        alone.ctx(list(range(64)))
    assert err.value.message == f"no worker of model m can take the request now: d1: context_conflict ({why})"


def test_a_prefill_worker_left_out_is_no_reason_for_want_of_a_decode_worker() -> None:
    # It said "can take the request now: " and named none.
    f = Fleet(winfo("p1", "prefill"), winfo("p2", "prefill"), sync={"p1": ("repairing", "gap")})
    with pytest.raises(PlanError) as err:
        f.planner.take(f.ctx(list(range(64))))
    assert err.value.message == "no decode or agg worker is registered for model m"


def test_unknown_model_is_a_503() -> None:
    f = Fleet(winfo("d1"))
    with pytest.raises(PlanError, match="no worker is registered for model other"):
        f.planner.context("r", "other", [1, 2, 3])


def test_a_lora_adapters_request_runs_only_where_the_adapter_is_served() -> None:
    f = Fleet(winfo("d1"), winfo("d2", adapters=["sql"]), winfo("p1", "prefill"),
              winfo("p2", "prefill", adapters=["sql", "chat"]), disagg="always")  # fmt: skip
    for i in range(4):
        plan = f.planner.take(f.planner.context(f"r{i}", "sql", list(range(i * 64, i * 64 + 64))))
        assert plan is not None and plan.ctx.model == "sql"
        assert [c.worker for c in plan.ctx.decode_pool] == ["d2"]
        assert [c.worker for c in plan.ctx.prefill_pool] == ["p2"]
    with pytest.raises(PlanError, match="no decode or agg worker is registered for model chat"):
        f.planner.take(f.planner.context("r", "chat", list(range(64))))
    plan = f.planner.take(f.ctx(list(range(64))))  # the model itself: every worker of it
    assert plan is not None and {c.worker for c in plan.ctx.decode_pool} == {"d1", "d2"}


def test_a_lora_adapters_prefix_is_its_own_chain() -> None:
    """vLLM keys every block of an adapter's request by the adapter's name: the same tokens on the
    model, on another adapter or with a cache_salt share no block with it."""
    f = Fleet(winfo("d1", adapters=["sql", "chat"]), winfo("d2", adapters=["sql", "chat"]))
    prompt = list(range(512))
    f.index.apply("d2", [Stored(hashes=block_hashes(prompt, BLOCK, salt="sql"))])
    ctx = f.planner.context("r", "sql", prompt)
    assert ctx.hashes == block_hashes(prompt, BLOCK, salt="sql") != block_hashes(prompt, BLOCK)
    plan = f.planner.take(ctx)
    assert plan is not None and plan.decode.worker == "d2" and plan.decode.overlap_blocks == 32
    salted = f.planner.context("r", "sql", prompt, shape=RequestShape(cache_salt="t1")).hashes
    assert salted == block_hashes(prompt, BLOCK, salt="sql\x00t1")
    for name in ("chat", MODEL):
        other = f.planner.take(f.planner.context(f"r-{name}", name, prompt))
        assert other is not None and max(c.overlap_blocks for c in other.ctx.decode_pool) == 0, name


def test_an_adapters_request_is_hashed_at_its_models_block_size_and_never_moves_it() -> None:
    """The block-size vote is the model's: a request naming an adapter (or an alias) runs on part of
    the model's workers, and a vote of theirs, settled as the model's standing size, gave every later
    tie of the model's own requests to the adapter's side: a and b, at the size the model was served
    with, left out as `block_size` (until 2026-12-07)."""
    f = Fleet(winfo("a", adapters=["lora"]), winfo("b"))
    assert f.ctx(list(range(64))).block_size == 16  # served at 16
    f.clock.now += 1.0
    f.infos += [winfo("c", block_size=32, adapters=["lora"]), winfo("d", block_size=32, adapters=["lora"])]
    for w in ("a", "b", "c", "d"):
        f.planner.eligibility.added(w)
        f.report(w)
    assert f.ctx(list(range(64))).block_size == 16  # two against two: the tie goes to the standing 16
    ctx = f.planner.context("r-lora", "lora", list(range(64)))
    plan = f.planner.take(ctx)
    assert ctx.block_size == 16 and plan is not None and [c.worker for c in ctx.decode_pool] == ["a"]
    assert {e["worker"]: e["excluded"] for e in ctx.excluded} == {"c": "block_size", "d": "block_size"}
    ctx = f.ctx(list(range(64)), "r2")
    plan = f.planner.take(ctx)
    assert ctx.block_size == 16 and plan is not None and {c.worker for c in ctx.decode_pool} == {"a", "b"}
    assert {e["worker"]: e["excluded"] for e in ctx.excluded} == {"c": "block_size", "d": "block_size"}


def test_a_utility_call_never_moves_its_models_block_size() -> None:
    """/tokenize goes to the workers whose engine serves it, part of the model's fleet: their vote,
    settled as the model's standing size, gave the model's next tie to their side (until 2026-12-07)."""
    f = Fleet(winfo("a"), winfo("b", engine="sglang"))
    assert f.ctx(list(range(64))).block_size == 16
    f.clock.now += 1.0
    f.infos += [winfo("c", block_size=32), winfo("d", block_size=32)]
    for w in ("a", "b", "c", "d"):
        f.planner.eligibility.added(w)
        f.report(w)
    assert f.ctx(list(range(64))).block_size == 16
    assert [i.worker for i in f.planner.utility_workers(MODEL, ENDPOINT_TOKENIZE)] == ["a", "c", "d"]
    assert f.ctx(list(range(64))).block_size == 16


def test_a_name_that_is_a_model_and_an_adapter_names_the_model() -> None:
    f = Fleet(winfo("d1"), winfo("q1", model="base-2", adapters=[MODEL]))
    ctx = f.ctx(list(range(64)))
    plan = f.planner.take(ctx)
    assert plan is not None and [c.worker for c in ctx.decode_pool] == ["d1"]
    assert ctx.hashes == block_hashes(list(range(64)), BLOCK)


def test_text_prompts_go_only_to_workers_sharing_the_routers_tokenizer() -> None:
    f = Fleet(winfo("d1", tokenizer="tok-aaaaaaaaaaaaaaaa"), winfo("d2"))
    for i in range(4):
        plan = f.planner.take(f.ctx(list(range(i, i + 64)), f"r{i}", text=True))
        assert plan is not None and plan.decode.worker == "d2"
    only_other = Fleet(winfo("d1", tokenizer="tok-aaaaaaaaaaaaaaaa"))
    with pytest.raises(PlanError, match="tokenizer"):
        only_other.planner.take(only_other.ctx([1, 2, 3], text=True))
    assert only_other.planner.take(only_other.ctx([1, 2, 3])) is not None  # token ids need no tokenizer


def test_a_silent_worker_leaves_and_returns_with_its_next_report() -> None:
    f = Fleet(winfo("d1"), winfo("d2"))
    f.clock.now += 2.0  # 4 periods of 0.5 s without a word from either ...
    f.report("d2")  # ... but d2 speaks
    plans = [f.planner.take(f.ctx(list(range(i, i + 64)), f"r{i}")) for i in range(5)]
    assert {p.decode.worker for p in plans if p is not None} == {"d2"}
    f.report("d1")
    assert "d1" in {c.worker for c in (f.planner.take(f.ctx([9] * 64, "x")) or plans[0]).ctx.decode_pool}  # type: ignore[union-attr]


def test_a_booking_is_seen_by_the_next_request_at_once() -> None:
    f = Fleet(winfo("d1"), winfo("d2"))
    first = f.planner.take(f.ctx(list(range(4096)), "r1"))
    assert first is not None
    loads = {c.worker: c for c in f.planner.take(f.ctx(list(range(5000, 9096)), "r2")).ctx.decode_pool}  # type: ignore[union-attr]
    assert loads[first.decode.worker].queued_prefill_tokens == 4096
    assert loads[first.decode.worker].active_blocks == 4096 // BLOCK


def test_least_loaded_counts_the_requests_routed_since_each_workers_last_report() -> None:
    """A burst between two reports: each request sees the ones routed before it, so the requests even
    out, instead of all landing on the worker that reported the fewest."""
    f = Fleet(winfo("d1"), winfo("d2"), routing="least_loaded")
    f.report("d1", running=2, kv_used_blocks=4000)  # fewer requests, longer ones
    f.report("d2", running=4, kv_used_blocks=100)
    f.clock.now += 0.001
    chosen: Counter[str] = Counter()
    for i in range(6):
        plan = f.planner.take(f.ctx(list(range(i * 64, i * 64 + 64)), f"r{i}"))
        assert plan is not None
        f.planner.ledger.prefill_done(plan.key)  # running now, and in no report yet
        chosen[plan.decode.worker] += 1
    assert (2 + chosen["d1"], 4 + chosen["d2"]) == (6, 6), chosen
    f.report("d1", running=6, kv_used_blocks=4100)
    f.report("d2", running=6, kv_used_blocks=150)
    plan = f.planner.take(f.ctx(list(range(64)), "next"))
    assert plan is not None
    assert [c.booked_requests for c in plan.ctx.decode_pool] == [0, 0]  # the reports count them now


def _follow_ups(f: Fleet, n: int) -> Counter[str]:
    """`n` requests on one new 4,096-token prefix, each prefilled (first token seen) before the next
    arrives, and no KV event yet: only the pending prefixes know where the prefix went."""
    shared = list(range(100_000, 100_000 + 4096))
    chosen: Counter[str] = Counter()
    for i in range(n):
        plan = f.planner.take(f.ctx([*shared, *range(i * 100, i * 100 + 64)], f"r{i}"))
        assert plan is not None
        f.planner.ledger.prefill_done(plan.key)
        chosen[plan.decode.worker] += 1
    return chosen


def test_follow_ups_on_one_new_prefix_stick_to_one_worker() -> None:
    chosen = _follow_ups(Fleet(*(winfo(f"d{i}") for i in range(4))), 8)
    assert len(chosen) == 1, chosen


def test_without_pending_prefixes_the_same_follow_ups_spread() -> None:
    chosen = _follow_ups(Fleet(*(winfo(f"d{i}") for i in range(4)), pending_ttl_s=0.0), 8)
    assert len(chosen) == 4, chosen


def test_workers_without_prefix_caching_get_no_pending_credit_so_the_follow_ups_spread() -> None:
    """An engine without prefix caching will hold no prefix routed to it: sticking to it would only
    pile the prefix's requests on one worker."""
    chosen = _follow_ups(Fleet(*(winfo(f"d{i}", prefix_caching=False) for i in range(4))), 8)
    assert len(chosen) == 4, chosen


def test_an_unconfirmed_pending_prefix_expires() -> None:
    f = Fleet(winfo("d1"), winfo("d2"), pending_ttl_s=5.0)
    prompt = list(range(2048))
    f.planner.take(f.ctx(prompt, "r1"))
    assert max(c.overlap_blocks for c in f.planner.take(f.ctx(prompt, "r2")).ctx.decode_pool) == 128  # type: ignore[union-attr]
    f.clock.now += 5.0
    for w in ("d1", "d2"):
        f.report(w)
    assert max(c.overlap_blocks for c in f.planner.take(f.ctx(prompt, "r3")).ctx.decode_pool) == 0  # type: ignore[union-attr]


def test_a_remote_requests_prefix_is_credited_on_its_decode_worker_from_the_booking() -> None:
    # a decision (docs/decisions.md): a prediction of what d holds when the next request runs there;
    # crediting it only from d's first token cost more goodput than it saved
    f = Fleet(winfo("d1"), winfo("d2"), winfo("p1", "prefill"), disagg="always")
    prompt = list(range(8192))
    a = f.planner.take(f.ctx(prompt, "a"))
    assert a is not None and a.path is Path.REMOTE
    b = f.planner.take(f.ctx(prompt, "b"))
    assert b is not None and b.decode.worker == a.decode.worker and b.decode.overlap_blocks == 512


def test_a_remote_prefill_that_falls_back_leaves_its_prefix_pending_on_the_decode_worker() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), disagg="always")
    prompt = list(range(4096))
    a = f.planner.take(f.ctx(prompt, "a"))
    assert a is not None and a.path is Path.REMOTE
    f.planner.ledger.rebook_bypass(a.key, a)  # d1 prefills it itself now
    b = f.planner.take(f.ctx(prompt, "b"))
    assert b is not None and b.decode.overlap_blocks == 256


def _held(plan: RoutePlan | None) -> dict[str, int]:
    """Per candidate, decode and prefill, the prompt's blocks the planner saw cached or pending there."""
    assert plan is not None
    return {c.worker: c.overlap_blocks for c in [*plan.ctx.decode_pool, *plan.ctx.prefill_pool]}


def test_a_remote_attempt_that_ends_before_its_prefill_leaves_its_prefix_pending_nowhere() -> None:
    """The client left during the remote prefill (or both legs failed): neither worker cached the
    prompt, and its retry, planned at once, must not be told they did."""
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), disagg="always")
    prompt = list(range(4096))
    a = f.planner.take(f.ctx(prompt, "a"))
    assert a is not None and a.path is Path.REMOTE
    f.planner.ledger.free(a.key)
    assert _held(f.planner.take(f.ctx(prompt, "b"))) == {"d1": 0, "p1": 0}


def test_a_fallback_withdraws_the_prefill_workers_prefix_and_a_served_attempt_keeps_the_decode_workers() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), disagg="always")
    prompt = list(range(4096))
    a = f.planner.take(f.ctx(prompt, "a"))
    assert a is not None and a.path is Path.REMOTE
    f.planner.ledger.rebook_bypass(a.key, a)  # the prefill leg failed: d1 prefills it itself
    f.planner.ledger.free(a.key, served=True)  # its whole answer came, no first token read before
    assert _held(f.planner.take(f.ctx(prompt, "b"))) == {"d1": 256, "p1": 0}


def test_a_remote_prefill_done_keeps_the_prefill_workers_prefix_when_the_decode_leg_fails() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), disagg="always")
    prompt = list(range(4096))
    a = f.planner.take(f.ctx(prompt, "a"))
    assert a is not None and a.path is Path.REMOTE
    f.planner.ledger.prefill_done(a.key, "p1")  # p1 returned its transfer: its events will confirm
    f.planner.ledger.free(a.key)  # the decode leg failed before its first token
    assert _held(f.planner.take(f.ctx(prompt, "b"))) == {"d1": 0, "p1": 256}


def test_a_failed_attempt_leaves_the_prefix_another_request_in_flight_booked_there() -> None:
    f = Fleet(winfo("d1"))
    prompt = list(range(4096))
    a = f.planner.take(f.ctx(prompt, "a"))
    b = f.planner.take(f.ctx(prompt, "b"))
    assert a is not None and b is not None
    f.planner.ledger.free(b.key)  # b's client left; a still prefills the prompt on d1
    assert _held(f.planner.take(f.ctx(prompt, "c"))) == {"d1": 256}


def test_the_index_overlap_counts_like_a_pending_one() -> None:
    f = Fleet(winfo("d1"), winfo("d2"))
    prompt = list(range(2048))
    f.index.apply("d2", [Stored(hashes=block_hashes(prompt, BLOCK))])
    plan = f.planner.take(f.ctx(prompt))
    assert plan is not None and plan.decode.worker == "d2" and plan.decode.overlap_blocks == 128


def test_no_room_on_any_decode_worker_returns_none() -> None:
    # h200 llama-8b prefills ~8k tokens in well under a second: 200k queued is several seconds
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True)
    f.report("d1", prefill_tokens_queued=200_000)
    assert f.planner.take(f.ctx(list(range(64)))) is None  # a prefill worker with room does not help
    f.report("d1", prefill_tokens_queued=0)
    assert f.planner.take(f.ctx(list(range(64)))) is not None


async def test_a_request_only_a_full_decode_worker_serves_holds_up_no_other_request() -> None:
    # s1 and sp1, an SGLang P/D pair with room, cannot serve n=2; only d1 (vLLM, full) could. The
    # n=2 request is refused at once: waiting at the head of the model's line (2026-12-08,
    # reverted) kept every request the pair could serve waiting behind it, to a 429.
    f = Fleet(winfo("s1", engine="sglang", local_prefill=False), winfo("sp1", "prefill", engine="sglang"), winfo("d1"))
    f.report("d1", prefill_tokens_queued=200_000)
    adm = Admission(max_wait_s=lambda: 5.0, max_queue=lambda: None, on_abandon=lambda plan: None)
    wide = f.planner.context("a", MODEL, list(range(64)), shape=RequestShape(sequences=2))
    with pytest.raises(PlanError) as caught:
        await asyncio.wait_for(adm.admit(wide, f.planner.take), 0.1)
    assert caught.value.code == 503 and adm.depth == 0
    plan = await asyncio.wait_for(adm.admit(f.ctx(list(range(64, 128)), "b"), f.planner.take), 0.1)
    assert (plan.decode.worker, plan.path) == ("s1", Path.REMOTE)


@pytest.mark.parametrize("sglang_prefill", [False, True], ids=["no_sglang_prefill", "n2"])
def test_a_503_for_want_of_room_on_the_workers_that_could_serve_it_says_so_as_debug_route_does(
    sglang_prefill: bool,
) -> None:
    # s1 (SGLang, no local prefill) has room but cannot serve the request: no SGLang prefill worker
    # is up, or one is (sp1) and the request is n=2, which no transfer handle serves. d1 (vLLM,
    # prefills locally) could, but is full. The 503 said none could serve it, and /debug/route that
    # it waits for d1 (until 2026-12-08).
    prefill = [winfo("sp1", "prefill", engine="sglang")] if sglang_prefill else []
    f = Fleet(winfo("s1", engine="sglang", local_prefill=False), *prefill, winfo("d1"))
    f.report("d1", prefill_tokens_queued=200_000)
    shape = RequestShape(sequences=2 if sglang_prefill else 1)
    with pytest.raises(PlanError) as taken:
        f.planner.take(f.planner.context("r", MODEL, list(range(64)), shape=shape))
    with pytest.raises(PlanError) as explained:
        f.planner.explain(f.planner.context("dbg", MODEL, list(range(64)), shape=shape))
    assert taken.value.code == explained.value.code == 503 and taken.value.transient
    assert (
        taken.value.message
        == explained.value.message
        == (
            "no worker of model m can take the request now: the decode workers that could serve it are full "
            "(those with room cannot prefill locally and no prefill worker of their engine can serve it); "
            "it may be retried"
        )
    )
    assert f.view.bookings("s1") == f.view.bookings("d1") == 0
    f.report("d1", prefill_tokens_queued=0)
    plan = f.planner.take(f.planner.context("r2", MODEL, list(range(64)), shape=shape))
    assert plan is not None and plan.decode.worker == "d1"


def test_a_full_decode_worker_with_a_prefill_worker_of_its_engine_could_serve_it_too() -> None:
    # t1 cannot prefill locally either, but a prefill worker of its engine (tp1) would prefill for it
    f = Fleet(
        winfo("s1", engine="sglang", local_prefill=False),
        winfo("t1", engine="trtllm", local_prefill=False),
        winfo("tp1", "prefill", engine="trtllm"),
    )
    f.report("t1", prefill_tokens_queued=200_000)
    with pytest.raises(PlanError) as caught:
        f.planner.take(f.ctx(list(range(64))))
    assert "could serve it are full" in caught.value.message
    wide = f.planner.context("r", MODEL, list(range(64)), shape=RequestShape(sequences=2))
    with pytest.raises(PlanError) as caught:  # no transfer handle serves n=2: t1 could not serve it
        f.planner.take(wide)
    assert "full" not in caught.value.message


def test_a_request_no_worker_would_serve_even_with_room_is_a_503() -> None:
    # s1 has room, s2 is full; neither prefills locally and no SGLang prefill worker is up
    f = Fleet(winfo("s1", engine="sglang", local_prefill=False), winfo("s2", engine="sglang", local_prefill=False))
    f.report("s2", prefill_tokens_queued=200_000)
    with pytest.raises(PlanError) as caught:
        f.planner.take(f.ctx(list(range(64))))
    assert caught.value.code == 503 and "cannot prefill locally" in caught.value.message
    assert "full" not in caught.value.message  # waiting for s2 frees nothing that serves it
    with pytest.raises(PlanError) as explained:
        f.planner.explain(f.ctx(list(range(64)), "dbg"))
    assert explained.value.message == caught.value.message


def test_a_request_no_candidate_is_planned_while_it_waits_is_shown_waiting() -> None:
    # s1 is full, cannot prefill locally, and no SGLang prefill worker is up: take() leaves the
    # request to wait (a worker may come), while /debug/route answered a 503 (until 2026-12-08)
    f = Fleet(winfo("s1", engine="sglang", local_prefill=False))
    f.report("s1", prefill_tokens_queued=200_000)
    assert f.planner.take(f.ctx(list(range(64)), "r1")) is None
    info = f.planner.explain(f.ctx(list(range(64)), "dbg"))
    assert (info["admissible"], info["waits"]) == (False, True)
    assert (info["decode_worker"], info["prefill_worker"], info["path"], info["outcome"]) == (None,) * 4
    assert info["decode_candidates"] == info["prefill_candidates"] == []
    assert f.view.bookings("s1") == 0
    # with a prefill worker of its engine, s1 would serve it once it has room: the plan over it is shown
    f.infos.append(winfo("sp1", "prefill", engine="sglang"))
    f.planner.eligibility.added("sp1")
    f.report("sp1")
    assert f.planner.take(f.ctx(list(range(64)), "r2")) is None
    info = f.planner.explain(f.ctx(list(range(64)), "dbg2"))
    assert (info["admissible"], info["waits"], info["decode_worker"]) == (False, True, "s1")


def test_a_request_the_room_rule_keeps_off_every_decode_worker_is_shown_waiting() -> None:
    # s1 has room to decode, but slo_aware refuses a local prefill of this n=2 request there: take()
    # leaves it to wait, and /debug/route answered a 503 (until 2026-12-08)
    f = Fleet(winfo("s1", engine="sglang", local_prefill=False), winfo("sp1", "prefill", engine="sglang"))
    f.planner.configure(settings(conditional_disagg=True, conditional_disagg_policy="slo_aware"))
    f.report("s1", running=60)
    shape = RequestShape(sequences=2)
    assert f.planner.take(f.planner.context("r", MODEL, list(range(8000)), shape=shape)) is None
    info = f.planner.explain(f.planner.context("dbg", MODEL, list(range(8000)), shape=shape))
    assert (info["admissible"], info["waits"], info["decode_worker"]) == (True, True, None)
    assert [(e["worker"], e["excluded"]) for e in info["excluded"]] == [("s1", "room")]


def test_a_request_waits_for_a_soft_excluded_worker_that_would_serve_it() -> None:
    # a1 is briefly unhealthy, so refresh() leaves it out while s1 (full, cannot prefill locally, no
    # SGLang prefill worker) is routable: the request waits for room, and a1 back serves it. It was
    # refused at once (a 503 saying no worker could serve it) on 2026-12-08, reverted
    f = Fleet(winfo("a1", role="agg"), winfo("s1", engine="sglang", local_prefill=False))
    f.view.update(LoadReport(worker="a1", ts=f.clock(), period_s=0.5, healthy=False))
    f.report("s1", prefill_tokens_queued=200_000)
    assert f.planner.take(f.ctx(list(range(64)), "r1")) is None
    info = f.planner.explain(f.ctx(list(range(64)), "dbg"))
    assert (info["admissible"], info["waits"], info["decode_worker"]) == (False, True, None)
    f.clock.now += 0.5
    f.report("a1")
    f.report("s1", prefill_tokens_queued=200_000)
    plan = f.planner.take(f.ctx(list(range(64)), "r1"))
    assert plan is not None and (plan.decode.worker, plan.outcome) == ("a1", Outcome.AGGREGATED)


@pytest.mark.parametrize(
    ("prefill", "shape"),
    [(winfo("p1", "prefill"), RequestShape()), (winfo("p1", "prefill", engine="sglang"), RequestShape(sequences=2))],
    ids=["vllm_prefill", "sglang_prefill_n2"],
)
def test_a_request_waits_for_a_prefill_worker_to_take_its_spill(prefill: WorkerInfo, shape: RequestShape) -> None:
    # s1 (full) cannot serve it, but with spill_to_prefill on p1 serves the whole request once it has
    # room: it waits for that. It was refused at once on 2026-12-08, reverted
    f = Fleet(
        winfo("s1", engine="sglang", local_prefill=False),
        prefill,
        conditional_disagg=True,
        conditional_disagg_policy="slo_aware",
        spill_to_prefill=True,
    )
    f.report("s1", prefill_tokens_queued=200_000)
    f.report("p1", prefill_tokens_queued=200_000)
    assert f.planner.take(f.planner.context("r1", MODEL, list(range(64)), shape=shape)) is None
    info = f.planner.explain(f.planner.context("dbg", MODEL, list(range(64)), shape=shape))
    assert (info["admissible"], info["waits"], info["decode_worker"]) == (False, True, None)
    f.clock.now += 0.5
    f.report("s1", prefill_tokens_queued=200_000)
    f.report("p1")
    plan = f.planner.take(f.planner.context("r1", MODEL, list(range(64)), shape=shape))
    assert plan is not None and (plan.decode.worker, plan.outcome) == ("p1", Outcome.SPILLED_TO_PREFILL)


@pytest.mark.parametrize(
    "shape",
    [RequestShape(sequences=2), RequestShape(prompt_logprobs=True), RequestShape(beam_search=True)],
    ids=["n2", "prompt_logprobs", "beam_search"],
)
@pytest.mark.parametrize("disagg", ["conditional", "never"])
def test_a_request_no_transfer_handle_serves_is_not_sent_remote_through_a_full_prefill_worker(
    shape: RequestShape, disagg: str
) -> None:
    # s1 cannot prefill locally and sp1, its engine's only prefill worker, is full: the planned
    # prefill_pool_full bypass (or, under disagg=never, the aggregated plan) went remote on sp1
    # (remote_no_local_prefill) before the shape was looked at, though no transfer handle serves
    # such a request (until 2026-12-08)
    f = Fleet(
        winfo("s1", engine="sglang", local_prefill=False), winfo("sp1", "prefill", engine="sglang"), disagg=disagg
    )
    f.report("sp1", prefill_tokens_queued=200_000)
    with pytest.raises(PlanError) as taken:
        f.planner.take(f.planner.context("r", MODEL, list(range(64)), shape=shape))
    with pytest.raises(PlanError) as explained:
        f.planner.explain(f.planner.context("dbg", MODEL, list(range(64)), shape=shape))
    assert taken.value.code == 503 and "cannot prefill locally" in taken.value.message
    assert explained.value.message == taken.value.message
    assert f.view.bookings("s1") == f.view.bookings("sp1") == 0
    plain = f.planner.take(f.ctx(list(range(64)), "plain"))  # one a handle serves still goes remote on sp1
    assert plain is not None and plain.prefill is not None
    assert (plain.prefill.worker, plain.outcome) == ("sp1", Outcome.REMOTE_NO_LOCAL_PREFILL)


def test_with_every_prefill_worker_full_the_decode_worker_prefills() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), disagg="always")
    f.report("p1", prefill_tokens_queued=200_000)
    plan = f.planner.take(f.ctx(list(range(64))))
    assert plan is not None and plan.prefill is None
    assert (plan.path, plan.outcome) == (Path.BYPASS, Outcome.PREFILL_POOL_FULL)
    f.report("p1", prefill_tokens_queued=0)
    plan = f.planner.take(f.ctx(list(range(64)), "r2"))
    assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.REMOTE_PREFILL)


def test_a_prefill_worker_whose_pulls_failed_is_left_out_of_the_pair_and_with_none_left_d_prefills() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), winfo("p2", "prefill"), disagg="always")
    prompt = list(range(8192))
    plan = f.planner.take(f.ctx(prompt))
    assert plan is not None and plan.prefill is not None and plan.path is Path.REMOTE
    first, other = plan.prefill.worker, ({"p1", "p2"} - {plan.prefill.worker}).pop()
    f.planner.ledger.free(plan.key)
    transfers = f.planner.disagg.transfers
    transfers.failed("d1", first)
    plan = f.planner.take(f.ctx(prompt, "r2"))
    assert plan is not None and plan.prefill is not None
    assert (plan.path, plan.prefill.worker) == (Path.REMOTE, other)  # disaggregation goes on
    f.planner.ledger.free(plan.key)
    transfers.failed("d1", other)
    plan = f.planner.take(f.ctx(prompt, "r3"))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.BYPASS_TRANSFER_FAILING)


@pytest.mark.parametrize("flat", [{"disagg": "always"}, {"conditional_disagg": True}])
def test_a_decode_worker_whose_pull_failed_prefills_its_requests_until_the_cooldown_ends(flat: dict[str, Any]) -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), **flat)
    prompt = list(range(8192))  # long and uncached: every policy sends it to the prefill worker
    plan = f.planner.take(f.ctx(prompt))
    assert plan is not None and plan.path is Path.REMOTE
    f.planner.ledger.free(plan.key)
    transfers = f.planner.disagg.transfers
    transfers.failed("d1", "p1")
    plan = f.planner.take(f.ctx(prompt, "r2"))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.BYPASS_TRANSFER_FAILING)
    assert plan.decode.worker == "d1" and "failed to load KV from every prefill worker" in plan.reason
    f.planner.ledger.free(plan.key)
    f.clock.now += transfers.cooldown_s
    for w in ("d1", "p1"):
        f.report(w)
    f.planner.explain(f.ctx(prompt, "dry"))  # /debug/route takes no probe
    plan = f.planner.take(f.ctx(prompt, "r3"))
    assert plan is not None and plan.path is Path.REMOTE  # the probe
    plan = f.planner.take(f.ctx(prompt, "r4"))  # while it is out, the others keep prefilling on d1
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.BYPASS_TRANSFER_FAILING)
    f.planner.ledger.free(plan.key)
    transfers.succeeded("d1", "p1")
    plan = f.planner.take(f.ctx(list(range(10_000, 18_192)), "r5"))  # uncached: r3 and r4 made prompt d1's
    assert plan is not None and plan.path is Path.REMOTE


def test_slo_aware_offers_a_decode_worker_only_while_its_running_requests_keep_their_tpot() -> None:
    # h200 llama-8b at the policy's starting context (4,096 + 128 / 2): a step of 101 sequences
    # takes 28.7 ms, over the 20 ms budget (0.8 x 25 ms); one of 41 takes 14.1 ms
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="slo_aware")
    f.report("d1", running=100)
    assert f.planner.take(f.ctx(list(range(64)))) is None
    f.report("d1", running=40)
    plan = f.planner.take(f.ctx(list(range(64))))
    assert plan is not None and plan.decode.worker == "d1"


def test_slo_aware_with_the_prefill_pool_full_prefills_locally_only_within_the_tpot_budget() -> None:
    # d1 runs 40 (a step: 14.1 ms); prefilling 16,384 new tokens beside them adds 4.6 ms per output
    # token (128), 30,000 add 11.4 ms: 18.7 ms fits the 20 ms budget, 25.5 ms does not
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="slo_aware")
    f.report("d1", running=40)
    f.report("p1", prefill_tokens_queued=200_000)
    assert f.planner.take(f.ctx(list(range(30_000)))) is None
    plan = f.planner.take(f.ctx(list(range(16_384)), "r2"))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.PREFILL_POOL_FULL)


def test_slo_aware_judges_a_request_of_several_sequences_by_its_local_prefill() -> None:
    # as above: d1 runs 40; 30,000 new tokens prefilled beside them break the TPOT budget, so a
    # batch of that size waits where a single prompt goes to the (idle) prefill worker
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="slo_aware")
    f.report("d1", running=40)
    batch = f.planner.context("b", MODEL, list(range(30_000)), shape=RequestShape(sequences=2))
    assert f.planner.take(batch) is None
    why = f.planner.explain(f.planner.context("b2", MODEL, list(range(30_000)), shape=RequestShape(sequences=2)))
    assert any("no transfer handle can serve the request" in e["why"] for e in why["excluded"]), why
    plan = f.planner.take(f.ctx(list(range(30_000)), "one"))
    assert plan is not None and plan.path is Path.REMOTE
    plan = f.planner.take(f.planner.context("small", MODEL, list(range(1_000)), shape=RequestShape(sequences=2)))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.BYPASS_SEQUENCES)


def _spill_fleet() -> Fleet:
    return Fleet(
        winfo("d1"),
        winfo("p1", "prefill"),
        conditional_disagg=True,
        conditional_disagg_policy="slo_aware",
        spill_to_prefill=True,
    )


def test_with_spill_on_a_prefill_worker_serves_the_request_while_no_decode_worker_has_room() -> None:
    f = _spill_fleet()
    f.report("d1", running=100)  # a 28.7 ms step: no room (test above)
    plan = f.planner.take(f.ctx(list(range(64))))
    assert plan is not None and plan.decode.worker == "p1" and plan.prefill is None
    assert (plan.path, plan.outcome) == (Path.AGG, Outcome.SPILLED_TO_PREFILL)
    assert f.planner.disagg.counts[Outcome.SPILLED_TO_PREFILL] == 1
    load = f.view.load("p1")
    assert load.prefill_tokens_queued == 64 and load.active_blocks == 4  # booked there, as an agg request


def test_spill_needs_room_on_the_prefill_worker_too() -> None:
    f = _spill_fleet()
    f.report("d1", running=100)
    f.report("p1", running=100)  # its own TPOT rule
    assert f.planner.take(f.ctx(list(range(64)))) is None
    f.report("p1", prefill_tokens_queued=200_000)  # its backlog
    assert f.planner.take(f.ctx(list(range(64)))) is None
    f.report("p1")
    plan = f.planner.take(f.ctx(list(range(64))))
    assert plan is not None and plan.outcome is Outcome.SPILLED_TO_PREFILL


def test_while_a_decode_worker_has_room_nothing_spills() -> None:
    f = _spill_fleet()
    f.report("d1", running=40)
    plan = f.planner.take(f.ctx(list(range(64))))
    assert plan is not None and plan.decode.worker == "d1" and plan.outcome is not Outcome.SPILLED_TO_PREFILL


def test_spill_is_refused_unless_the_policy_decides() -> None:
    with pytest.raises(ValueError, match=r"spill_to_prefill \(--spill-to-prefill.*needs disagg=conditional"):
        settings(disagg="always", spill_to_prefill=True)
    with pytest.raises(ValueError, match="conditional_disagg=off"):
        settings(spill_to_prefill=True)


def test_the_fixed_modes_ignore_the_slo_aware_room_rule() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), disagg="always", conditional_disagg_policy="slo_aware")
    f.report("d1", running=100)
    plan = f.planner.take(f.ctx(list(range(64))))
    assert plan is not None and plan.outcome is Outcome.REMOTE_PREFILL


def test_queue_threshold_replaces_the_slo_rule_when_set() -> None:
    f = Fleet(winfo("d1"), queue_threshold=1.0)
    f.report("d1", prefill_tokens_queued=8193)
    assert f.planner.take(f.ctx(list(range(64)))) is None
    f.report("d1", prefill_tokens_queued=8192)
    assert f.planner.take(f.ctx(list(range(64)))) is not None


def test_a_retry_avoids_the_workers_tried_and_books_a_new_attempt() -> None:
    f = Fleet(winfo("d1"), winfo("d2"))
    ctx = f.ctx(list(range(256)))
    first = f.planner.take(ctx)
    assert first is not None and first.key == "r#1"
    again = f.planner.plan_again(ctx, frozenset({first.decode.worker}))
    assert again is not None and again.key == "r#2" and again.decode.worker != first.decode.worker
    assert f.planner.plan_again(ctx, frozenset({"d1", "d2"})) is None
    f.planner.finished(ctx)
    assert f.planner.take(f.ctx(list(range(256)))).key == "r#1"  # type: ignore[union-attr]


def test_explain_books_and_counts_nothing() -> None:
    f = Fleet(winfo("d1"), winfo("d2"), sync={"d2": ("repairing", "digest")})
    before = dict(f.planner.disagg.counts)
    info = f.planner.explain(f.ctx(list(range(64))))
    assert info["decode_worker"] == "d1" and info["excluded"][0]["worker"] == "d2" and info["admissible"]
    assert f.view.bookings("d1") == 0 and dict(f.planner.disagg.counts) == before


def test_explain_leaves_out_a_worker_without_room_as_take_does_and_says_why() -> None:
    """d1 holds the whole 64 k-token prompt but has ~1.2 s of prefill queued (past half the 2 s TTFT
    SLO): over every candidate it is the cheapest (its queue costs less than d2's prefill), but it
    has no room, so the request goes to d2, and the dry run must say so rather than show d1."""
    f = Fleet(winfo("d1"), winfo("d2"))
    prompt = list(range(65_536))
    f.index.store("d1", f.ctx(prompt).hashes)
    f.report("d1", prefill_tokens_queued=40_000)
    info = f.planner.explain(f.ctx(prompt))
    assert (info["decode_worker"], info["admissible"], info["waits"]) == ("d2", True, False)
    (room,) = info["excluded"]
    assert room["worker"] == "d1" and room["excluded"] == "room"
    assert "predicted prefill backlog 1.2" in room["why"] and "over half the TTFT SLO (1 s)" in room["why"]
    plan = f.planner.take(f.ctx(prompt, "r2"))
    assert plan is not None and plan.decode.worker == "d2" and plan.ctx.excluded == []


def test_explain_names_the_policy_room_rule_and_says_when_a_request_would_wait() -> None:
    f = Fleet(winfo("d1"), winfo("d2"), winfo("p1", "prefill"), conditional_disagg=True)
    f.planner.configure(settings(conditional_disagg=True, conditional_disagg_policy="slo_aware"))
    f.report("d1", running=100)  # its running requests are at their TPOT budget
    info = f.planner.explain(f.ctx(list(range(64))))
    assert info["decode_worker"] == "d2" and not info["waits"]
    (room,) = info["excluded"]
    assert room["worker"] == "d1" and "slo_aware policy's room rule" in room["why"]
    f.report("d2", running=100)
    info = f.planner.explain(f.ctx(list(range(64))))
    assert (info["admissible"], info["waits"]) == (False, True)
    assert f.planner.take(f.ctx(list(range(64)), "r2")) is None


def test_prefix_reach_tells_room_and_choice_losses_apart() -> None:
    f = Fleet(winfo("d1"), winfo("d2"))
    prompt = list(range(65_536))
    hashes = f.ctx(prompt).hashes
    f.index.store("d1", hashes)
    f.report("d1", prefill_tokens_queued=40_000)  # past half the TTFT SLO: no room
    plan = f.planner.take(f.ctx(prompt, "r1"))
    assert plan is not None and plan.decode.worker == "d2"
    held = len(hashes) * BLOCK
    assert f.planner.reach.as_dict() == {"prompt": 65_536, "held": held, "with_room": 0, "chosen": 0}
    f.report("d1")  # d1's queue drained: it has room, and its prefix wins
    plan = f.planner.take(f.ctx(prompt + [7] * 16, "r2"))
    assert plan is not None and plan.decode.worker == "d1"
    assert f.planner.reach.as_dict() == {
        "prompt": 2 * 65_536 + 16,
        "held": 2 * held,
        "with_room": held,
        "chosen": held,
    }
    f.report("d1", prefill_tokens_queued=40_000)
    f.report("d2", prefill_tokens_queued=40_000)
    assert f.planner.take(f.ctx(prompt, "r3")) is None  # it waits: nothing routed, nothing counted
    assert f.planner.reach.prompt == 2 * 65_536 + 16


def test_an_unhealthy_worker_is_left_out_only_while_a_healthy_one_remains() -> None:
    f = Fleet(winfo("d1"), winfo("d2"))
    f.view.update(LoadReport(worker="d1", ts=f.clock(), period_s=0.5, healthy=False))
    plan = f.planner.take(f.ctx(list(range(64)), "r1"))
    assert plan is not None and plan.decode.worker == "d2"
    assert [e["excluded"] for e in plan.ctx.excluded] == ["engine_unhealthy"]
    f.view.update(LoadReport(worker="d2", ts=f.clock(), period_s=0.5, healthy=False))
    plan = f.planner.take(f.ctx(list(range(64)), "r2"))  # a whole fleet too busy to answer its probes
    assert plan is not None and {c.worker for c in plan.ctx.decode_pool} == {"d1", "d2"}


def test_explain_shows_the_spill_a_request_would_get_and_books_nothing() -> None:
    f = _spill_fleet()
    f.report("d1", running=100)
    info = f.planner.explain(f.ctx(list(range(64))))
    assert (info["admissible"], info["outcome"], info["decode_worker"], info["path"]) == (
        False,
        "spilled_to_prefill",
        "p1",
        "agg",
    )
    assert f.view.bookings("p1") == 0 and not f.planner.disagg.counts


def test_explain_keeps_the_room_exclusions_of_a_request_that_would_wait() -> None:
    # Room for one more decode on d1, but the prefill worker is full and a local prefill of this
    # prompt would break d1's running requests' TPOT: the request waits, and says why.
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True)
    f.planner.configure(settings(conditional_disagg=True, conditional_disagg_policy="slo_aware"))
    f.report("p1", prefill_tokens_queued=1_000_000)
    f.report("d1", running=60)
    info = f.planner.explain(f.ctx(list(range(8000))))
    assert (info["admissible"], info["waits"]) == (True, True)
    why = {e["worker"]: e["why"] for e in info["excluded"]}
    assert "over half the TTFT SLO" in why["p1"] and "refuses a local prefill here" in why["d1"]


def test_utility_calls_go_to_every_worker_that_can_answer_prefill_last() -> None:
    """/tokenize needs an engine, not a synced index: a bootstrapping worker answers, a silent one
    cannot."""
    f = Fleet(winfo("p1", "prefill"), winfo("d1"), winfo("d2"), winfo("a1", "agg"), winfo("other", model="x"),
              sync={"d2": ("bootstrapping", "waiting for the shim's first full state")})  # fmt: skip
    assert [i.worker for i in f.planner.utility_workers(MODEL, ENDPOINT_TOKENIZE)] == ["d1", "d2", "a1", "p1"]
    f.clock.now += 2.0  # four load-report periods without a word ...
    f.report("d2")
    f.report("p1")  # ... but from these two
    assert [i.worker for i in f.planner.utility_workers(MODEL, ENDPOINT_TOKENIZE)] == ["d2", "p1"]


@pytest.mark.parametrize("endpoint", [ENDPOINT_TOKENIZE, ENDPOINT_DETOKENIZE])
def test_utility_calls_go_only_to_workers_whose_engine_serves_the_route(endpoint: str) -> None:
    """SGLang and TensorRT-LLM serve no /tokenize: until 2026-12-07 every Nth call went to such a
    worker first, its shim's 404 handed on as a failure (a WARNING per episode)."""
    f = Fleet(winfo("s1", engine="sglang"), winfo("v1"), winfo("t1", "agg", engine="trtllm"), winfo("v2", "prefill"))
    assert [i.worker for i in f.planner.utility_workers(MODEL, endpoint)] == ["v1", "v2"]


def test_a_model_no_engine_of_which_serves_the_route_is_a_404_naming_why() -> None:
    """A model served by SGLang and TensorRT-LLM workers alone: no worker to wait for, so a 404 at
    once, as its shims answered it (until 2026-12-07 after a leg to each, logged per call)."""
    f = Fleet(winfo("s1", engine="sglang"), winfo("t1", engine="trtllm"), winfo("v1", model="other"))
    with pytest.raises(PlanError) as err:
        f.planner.utility_workers(MODEL, ENDPOINT_TOKENIZE)
    assert (err.value.code, err.value.transient) == (404, False)
    assert err.value.message == (
        f"no worker of model {MODEL} serves /tokenize: its engines (sglang, trtllm) have no such route; "
        "send it for a model that vllm engines serve"
    )
    # a model none serves at all stays the caller's 503 (its workers may register)
    assert f.planner.utility_workers("none", ENDPOINT_TOKENIZE) == []


def test_a_model_of_an_engine_this_router_does_not_know_is_a_404_that_says_so() -> None:
    """An engine no shim of this build runs (a newer shim's) is left out, as one without the route;
    the 404 said its engines "have no such route", a guess of this router's."""
    f = Fleet(winfo("n1", engine="llamacpp"), winfo("v1", model="other"))
    with pytest.raises(PlanError) as err:
        f.planner.utility_workers(MODEL, ENDPOINT_TOKENIZE)
    assert (err.value.code, err.value.transient) == (404, False)
    assert err.value.message == (
        f"no worker of model {MODEL} serves /tokenize: this router knows no utility routes for engine llamacpp "
        "(a shim newer than the router?); send it for a model that vllm engines serve"
    )
    f = Fleet(winfo("n1", engine="llamacpp"), winfo("m1", engine="mlx"), winfo("s1", engine="sglang"))
    with pytest.raises(PlanError) as err:
        f.planner.utility_workers(MODEL, ENDPOINT_DETOKENIZE)
    assert err.value.message == (
        f"no worker of model {MODEL} serves /detokenize: its engines (sglang) have no such route, and this router "
        "knows no utility routes for engines llamacpp, mlx (shims newer than the router?); send it for a model "
        "that vllm engines serve"
    )
    # beside a vLLM worker, the one of an unknown engine is left out: the vLLM one answers
    f = Fleet(winfo("n1", engine="llamacpp"), winfo("v1"))
    assert [i.worker for i in f.planner.utility_workers(MODEL, ENDPOINT_TOKENIZE)] == ["v1"]


@pytest.mark.parametrize("mark", ["mark_unreachable", "mark_malformed"])
def test_utility_calls_skip_a_worker_at_the_losing_block_size_that_cannot_answer(mark: str) -> None:
    """A utility call takes no block-size vote: a worker at the size that lost it shows its own
    exclusion, not `block_size`. Until 2026-12-07 (8bb0874) the call voted, c read as `block_size`,
    which leaves a worker's engine fit to tokenize, and /tokenize could go to the unreachable c."""
    f = Fleet(winfo("a"), winfo("b"), winfo("c", block_size=32))
    getattr(f.planner.eligibility, mark)("c", "its leg failed")
    assert [i.worker for i in f.planner.utility_workers(MODEL, ENDPOINT_TOKENIZE)] == ["a", "b"]
    assert f.ctx(list(range(64))).block_size == 16  # the model's size, which c does not share


def test_utility_calls_skip_a_worker_in_its_malformed_reply_cooldown() -> None:
    """Routing leaves a worker out for a while after a malformed reply; /tokenize did not, so every
    Nth call went to it first, a failed leg and a warning each (review1 D1)."""
    f = Fleet(winfo("d1"), winfo("d2"))
    f.planner.eligibility.mark_malformed("d1", "it sent a malformed reply: bad chunk")
    assert [i.worker for i in f.planner.utility_workers(MODEL, ENDPOINT_TOKENIZE)] == ["d2"]
