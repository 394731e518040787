"""WorkerRegistry against a real etcd: workers appear and vanish with their leased keys."""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import pytest

from discovery import Deleted, Discovery, Lease, Put, Snapshot, WatchEvent
from protocol import WorkerInfo, subjects
from protocol.config import EtcdSettings
from router.lifecycle import PartStatus
from router.served_names import clash_message, shadow_message
from router.worker_registry import ContextConflict, WorkerRegistry, context_message
from tests.router.oracles import model_contexts, resolve_names, shadowed
from tests.router.polling import until


def info(worker: str, model: str = "m", role: str = "decode", block_size: int = 16, **kw: object) -> WorkerInfo:
    return WorkerInfo(worker=worker, model=model, role=role, engine="sim", block_size=block_size, **kw)  # type: ignore[arg-type]


@dataclass
class Calls:
    added: list[WorkerInfo] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def on_add(self, i: WorkerInfo) -> None:
        self.added.append(i)

    def on_remove(self, worker: str) -> None:
        self.removed.append(worker)


@pytest.fixture
async def disc(etcd_url: str, ns: str) -> AsyncIterator[Discovery]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        yield d


async def register(disc: Discovery, **kw: object) -> Lease:
    return await disc.register_worker(lambda wid: info(wid, **kw), ttl=5)  # type: ignore[arg-type]


@pytest.fixture
async def registry(disc: Discovery) -> AsyncIterator[tuple[WorkerRegistry, Calls]]:
    calls = Calls()
    reg = WorkerRegistry(disc, calls.on_add, calls.on_remove)
    yield reg, calls
    await reg.stop()


async def test_workers_present_at_start_come_in_the_first_snapshot(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls]
) -> None:
    reg, calls = registry
    a = await register(disc)
    b = await register(disc, role="prefill")
    await reg.start()
    assert await reg.wait_ready(10.0)
    assert sorted(i.worker for i in calls.added) == sorted([a.hex_id, b.hex_id])
    assert [i.worker for i in reg.workers(role="prefill")] == [b.hex_id]
    assert reg.get(a.hex_id) == info(a.hex_id)


async def test_new_changed_and_deleted_workers_drive_the_callbacks(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls]
) -> None:
    reg, calls = registry
    await reg.start()
    assert await reg.wait_ready(10.0)
    lease = await register(disc)
    w = lease.hex_id
    await until(lambda: reg.get(w) is not None)
    assert calls.added == [info(w)]
    assert reg.workers() == [info(w)]  # the sorted list every request reads follows each change
    await disc.update_worker(lease, info(w, kv_total_blocks=900))
    await until(lambda: len(calls.added) == 2)
    assert reg.get(w) == info(w, kv_total_blocks=900)
    assert reg.workers() == [info(w, kv_total_blocks=900)]
    await disc.update_worker(lease, info(w, kv_total_blocks=900))  # same record again: no callback
    await disc.release(lease)
    await until(lambda: reg.get(w) is None)
    assert calls.removed == [w]
    assert reg.workers() == []
    assert len(calls.added) == 2


async def test_a_name_whose_worker_left_is_gone_until_a_worker_serves_it_again(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls]
) -> None:
    """departed (a 503 to retry, not a 404, for 10 min) after the last worker serving the name left,
    until one registers serving it again."""
    reg, _ = registry
    await reg.start()
    assert await reg.wait_ready(10.0)
    lease = await register(disc, adapters=["sql"])
    await until(lambda: reg.get(lease.hex_id) is not None)
    assert "sql" not in reg.departed()
    await disc.release(lease)
    await until(lambda: reg.get(lease.hex_id) is None)
    left = reg.departed()
    assert left["sql"].model == "m" and left["m"].model == "m", left
    back = await register(disc, adapters=["sql"])
    await until(lambda: reg.get(back.hex_id) is not None)
    assert "sql" not in reg.departed() and "m" not in reg.departed()


async def test_a_name_other_workers_still_serve_is_not_departed_and_unloaded_from_them_is_gone(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls]
) -> None:
    """A worker leaving with a name others still serve records no departure for it: the adapter
    unloaded from the one left later is unknown (vLLM's 404), not a 503 for 10 min on every
    replica; the last worker's departure records only what it still served."""
    reg, _ = registry
    await reg.start()
    assert await reg.wait_ready(10.0)
    one = await register(disc, adapters=["chat"])
    two = await register(disc, adapters=["chat"], aliases=["m-alias"])
    await until(lambda: reg.get(one.hex_id) is not None and reg.get(two.hex_id) is not None)
    await disc.release(one)
    await until(lambda: reg.get(one.hex_id) is None)
    assert dict(reg.departed()) == {}
    await disc.update_worker(two, info(two.hex_id, aliases=["m-alias"]))  # chat unloaded
    await until(lambda: reg.get(two.hex_id) == info(two.hex_id, aliases=["m-alias"]))
    assert dict(reg.departed()) == {}
    await disc.release(two)
    await until(lambda: reg.get(two.hex_id) is None)
    assert sorted(reg.departed()) == ["m", "m-alias"], reg.departed()


async def test_filters_by_model_and_role(disc: Discovery, registry: tuple[WorkerRegistry, Calls]) -> None:
    reg, _ = registry
    d1 = await register(disc, model="llama", role="decode")
    p1 = await register(disc, model="llama", role="prefill")
    q1 = await register(disc, model="qwen", role="agg")
    await reg.start()
    assert await reg.wait_ready(10.0)
    assert reg.models() == ["llama", "qwen"]
    assert [i.worker for i in reg.workers(model="llama")] == sorted([d1.hex_id, p1.hex_id])
    assert [i.worker for i in reg.workers(model="llama", role="decode")] == [d1.hex_id]
    assert [i.worker for i in reg.workers(role="agg")] == [q1.hex_id]
    assert reg.workers(model="nope") == []


async def test_a_models_max_model_len_is_its_workers_and_none_unless_all_say(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls]
) -> None:
    reg, _ = registry
    await register(disc, model="llama", max_model_len=4096)
    await register(disc, model="llama", role="prefill", max_model_len=4096)
    await register(disc, model="qwen", max_model_len=32768)
    await register(disc, model="qwen")  # says nothing
    await reg.start()
    assert await reg.wait_ready(10.0)
    assert [reg.max_model_len(m) for m in ("llama", "qwen", "nope")] == [4096, None, None]
    assert reg.context_conflicts == {} and len(reg.workers()) == 4


async def test_workers_of_another_max_model_len_than_most_of_their_models_are_left_out_and_reported(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls], caplog: pytest.LogCaptureFixture
) -> None:
    # Before, the least length served the model: one worker registering 64 cut every prompt a
    # client truncated to the context (truncate_prompt_tokens -1) to 63 tokens on its 32k peers.
    reg, _ = registry
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    big = [await register(disc, model="llama", max_model_len=32768) for _ in range(2)]
    small = await register(disc, model="llama", max_model_len=64, adapters=["sql"])
    silent = await register(disc, model="llama")  # says nothing: not counted, routed
    tie = [await register(disc, model="qwen", max_model_len=n) for n in (2048, 4096)]
    await reg.start()
    assert await reg.wait_ready(10.0)
    assert [i.worker for i in reg.workers(model="llama")] == sorted([*(b.hex_id for b in big), silent.hex_id])
    # a tie: the length of the worker registered first (its key's create_revision, router.fleet_vote)
    assert [i.worker for i in reg.workers(model="qwen")] == [tie[0].hex_id]
    assert reg.get(small.hex_id) is not None and reg.adapters() == {}  # registered, not routed
    assert [reg.max_model_len(m) for m in ("llama", "qwen")] == [None, 2048]
    assert reg.context_conflicts == {
        "llama": ContextConflict(32768, {64: [small.hex_id], 32768: sorted(b.hex_id for b in big)}),
        "qwen": ContextConflict(2048, {2048: [tie[0].hex_id], 4096: [tie[1].hex_id]}),
    }
    errors = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(errors) == 2 and "served with 32768" in errors[0] and f"64 on {small.hex_id}" in errors[0]


async def test_block_size_disagreement_is_reported_until_resolved(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls], caplog: pytest.LogCaptureFixture
) -> None:
    reg, _ = registry
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    await register(disc, model="llama", block_size=16)
    await register(disc, model="qwen", block_size=32)
    await reg.start()
    assert await reg.wait_ready(10.0)
    assert reg.block_size_conflicts == {}
    odd = await register(disc, model="llama", block_size=32)
    await until(lambda: reg.block_size_conflicts == {"llama": {16, 32}})
    assert any("disagree on block size" in r.getMessage() and odd.hex_id in r.getMessage() for r in caplog.records)
    await disc.release(odd)
    await until(lambda: reg.block_size_conflicts == {})


async def test_a_failing_callback_does_not_stop_the_watch(disc: Discovery) -> None:
    removed: list[str] = []

    def boom(_: WorkerInfo) -> None:
        raise RuntimeError("callback bug")

    reg = WorkerRegistry(disc, boom, removed.append)
    await reg.start()
    try:
        assert await reg.wait_ready(10.0)
        lease = await register(disc)
        await until(lambda: reg.get(lease.hex_id) is not None)
        await disc.release(lease)
        await until(lambda: removed == [lease.hex_id])
    finally:
        await reg.stop()


async def test_stop_is_idempotent_and_stops_the_callbacks(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls]
) -> None:
    reg, calls = registry
    await reg.start()
    assert await reg.wait_ready(10.0)
    await reg.stop()
    await reg.stop()
    assert reg.status is PartStatus.STOPPED
    lease = await register(disc)
    sentinel = await register(disc)
    await disc.release(sentinel)
    assert calls.added == [] and calls.removed == []
    assert reg.get(lease.hex_id) is None


async def test_wait_ready_times_out_before_start(registry: tuple[WorkerRegistry, Calls]) -> None:
    reg, _ = registry
    assert not await reg.wait_ready(0.05)


async def test_lora_adapters_are_listed_with_their_model_and_limited_by_the_workers_serving_them(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls]
) -> None:
    reg, _ = registry
    await register(disc, model="llama", max_model_len=8192, adapters=["sql", "chat"])
    await register(disc, model="llama", role="prefill", max_model_len=8192, adapters=["sql"])
    await register(disc, model="llama", role="prefill")  # says nothing
    await register(disc, model="qwen", max_model_len=2048, adapters=["llama"])  # a model's name stays the model's
    await reg.start()
    assert await reg.wait_ready(10.0)
    assert reg.adapters() == {"chat": "llama", "sql": "llama"}
    assert [reg.max_model_len(m) for m in ("sql", "chat", "llama")] == [8192, 8192, None]


async def test_a_name_is_listed_once_an_alias_and_an_adapter_of_it_clash(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls]
) -> None:
    reg, _ = registry
    a = await register(disc, model="llama", adapters=["chat", "sql"])
    b = await register(disc, model="qwen", aliases=["chat"])
    await reg.start()
    assert await reg.wait_ready(10.0)
    assert reg.aliases() == {"chat": "qwen"} and reg.adapters() == {"sql": "llama"}  # before: chat in both
    assert reg.name_clashes == {"chat": {"llama": [a.hex_id], "qwen": [b.hex_id]}}


async def test_a_models_own_name_wins_over_another_models_alias_and_the_alias_is_reported(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls], caplog: pytest.LogCaptureFixture
) -> None:
    # Before, one qwen worker aliasing `llama` made `llama` a clash: every request for it a 503.
    reg, _ = registry
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    a = await register(disc, model="llama")
    q = await register(disc, model="qwen", aliases=["llama", "chat", "qwen"])
    await reg.start()
    assert await reg.wait_ready(10.0)
    assert reg.name_clashes == {}
    assert reg.shadowed_aliases == {"llama": {"qwen": [q.hex_id]}}
    assert [i.aliases for i in reg.workers(model="qwen")] == [["chat", "qwen"]]  # not routed for llama
    assert reg.get(q.hex_id).aliases == ["llama", "chat", "qwen"]  # type: ignore[union-attr]  # as registered
    assert reg.aliases() == {"chat": "qwen"} and [i.worker for i in reg.workers(model="llama")] == [a.hex_id]
    errors = [r.getMessage() for r in caplog.records if "`llama`" in r.getMessage()]
    assert len(errors) == 1 and q.hex_id in errors[0], errors


def test_a_rolling_change_of_the_fleet_says_each_conflict_once_not_per_worker(
    disc: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, a conflict's workers were part of what was compared: every worker that joined the
    # minority logged it again, 999 ERRORs (2 MB) at 1,000 workers (log-volume audit, 2026-12-06).
    caplog.set_level(logging.WARNING, logger="router.worker_registry")
    reg = WorkerRegistry(disc, lambda _: None, lambda _: None)
    ids = [f"w{i:02d}" for i in range(20)]
    reg.apply(Snapshot(items={w: info(w, max_model_len=4096) for w in ids}, revision=1))
    for revision, w in enumerate(ids[:10], 2):  # half the fleet, one at a time, to a shorter length
        reg.apply(Put(w, info(w, max_model_len=2048), revision))
    assert reg.context_conflicts == {"m": ContextConflict(4096, {2048: ids[:10], 4096: ids[10:]})}  # every worker
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "served with 4096" in errors[0] and "2048 on w00" in errors[0], errors
    caplog.clear()
    reg.apply(Put(ids[10], info(ids[10], max_model_len=2048), 20))  # most register 2048 now: it is served
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "served with 2048" in errors[0], errors

    caplog.clear()
    reg.apply(Snapshot(items={w: info(w) for w in ids}, revision=30))
    for revision, w in enumerate(ids[:10], 31):  # half the fleet to model m2, serving `m` as an alias
        reg.apply(Put(w, info(w, model="m2", aliases=["m"]), revision))
    assert reg.shadowed_aliases == {"m": {"m2": ids[:10]}}
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "`m`" in errors[0], errors


def test_a_third_length_joining_a_context_conflict_is_said_though_the_served_one_stays(
    disc: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    # A context conflict's substance is the lengths at odds and the one served: a worker at a
    # third length is left out too, and the line said before did not name it.
    caplog.set_level(logging.WARNING, logger="router.worker_registry")
    reg = WorkerRegistry(disc, lambda _: None, lambda _: None)
    ids = [f"w{i:02d}" for i in range(6)]
    reg.apply(Snapshot(items={w: info(w, max_model_len=2048 if w == "w00" else 4096) for w in ids}, revision=1))
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "served with 4096" in errors[0], errors
    caplog.clear()
    reg.apply(Put("w01", info("w01", max_model_len=8192), 2))
    assert reg.context_conflicts == {"m": ContextConflict(4096, {2048: ["w00"], 4096: ids[2:], 8192: ["w01"]})}
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "served with 4096" in errors[0] and "8192 on w01" in errors[0], errors
    caplog.clear()
    reg.apply(Put("w02", info("w02", max_model_len=8192), 3))  # another worker at a length said: no news
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []


def test_a_block_size_conflict_names_eight_workers_per_size_and_counts_the_rest(
    disc: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, every worker id: a line of 9,206 characters at 1,000 workers (log-volume audit, 2026-12-06).
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    reg = WorkerRegistry(disc, lambda _: None, lambda _: None)
    items = {f"a{i:02d}": info(f"a{i:02d}") for i in range(20)}
    items |= {f"b{i:02d}": info(f"b{i:02d}", block_size=32) for i in range(20)}
    reg.apply(Snapshot(items=items, revision=1))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "16 on a00, a01, a02, a03, a04, a05, a06, a07 and 12 more" in line, line
    assert "32 on b00, b01, b02, b03, b04, b05, b06, b07 and 12 more" in line, line
    assert "a08" not in line and "b19" not in line
    assert reg.block_size_conflicts == {"m": {16, 32}}


class Counted(WorkerInfo):
    """A worker record that counts the reads of its fields, by anyone."""

    reads: ClassVar[list[int]] = [0]

    def __getattribute__(self, name: str) -> Any:
        Counted.reads[0] += 1
        return super().__getattribute__(name)


def reads_registering_one_at_a_time(disc: Discovery, n: int) -> int:
    reg = WorkerRegistry(disc, lambda _: None, lambda _: None)
    reg.apply(Snapshot(items={}, revision=1))
    Counted.reads[0] = 0
    for i in range(n):
        w = f"w{i:04d}"
        record = Counted(worker=w, model="llama", role="decode", engine="sim", block_size=16, max_model_len=8192,
                         aliases=["chat"], adapters=["sql"])  # fmt: skip
        reg.apply(Put(w, record, revision=i + 2))  # each worker's shim puts its own key
    assert len(reg.workers()) == n and reg.name_clashes == {} and reg.block_size_conflicts == {}
    return Counted.reads[0]


async def test_a_put_costs_the_same_however_many_workers_are_registered(disc: Discovery) -> None:
    # Before, every watch event ran three checks over the whole fleet and sorted it again: 1,000
    # workers registering one by one cost the router 1.9-2.4 s of CPU (scale audit of 2026-12-06).
    one, two = (reads_registering_one_at_a_time(disc, n) for n in (100, 200))
    assert two < 2.5 * one, (one, two)  # twice the puts, twice the work: 4 times, were it quadratic


async def test_the_names_a_request_resolves_by_are_read_once_per_change(disc: Discovery) -> None:
    # Every request resolves its model's name by models(), aliases() and adapters(): each was a
    # pass over the fleet's records, three per request.
    reg = WorkerRegistry(disc, lambda _: None, lambda _: None)
    reg.apply(Snapshot(items={}, revision=1))
    for i in range(50):
        w = f"w{i:04d}"
        reg.apply(Put(w, Counted(worker=w, model="llama", role="decode", engine="sim", block_size=16,
                                 aliases=["chat"], adapters=["sql"]), revision=i + 2))  # fmt: skip
    assert (reg.models(), reg.aliases(), reg.adapters()) == (["llama"], {"chat": "llama"}, {"sql": "llama"})
    Counted.reads[0] = 0
    for _ in range(10):
        reg.models(), reg.aliases(), reg.adapters()
    assert Counted.reads[0] == 0
    reg.apply(Put("q", WorkerInfo(worker="q", model="qwen", role="decode", engine="sim", block_size=16,
                                  aliases=["chat2"]), revision=100))  # fmt: skip
    assert (reg.models(), reg.aliases()["chat2"]) == (["llama", "qwen"], "qwen")


def whole_fleet(raw: dict[str, WorkerInfo], standing: dict[str, int]) -> tuple[list[WorkerInfo], dict[str, Any]]:
    """What the registry routes and reports for `raw` (worker -> record), from scratch but for each
    model's `standing` length (model_contexts): the definitions (the module's docstring) the
    registry keeps up to date one record at a time."""
    infos = [i for _, i in sorted(raw.items())]
    models, contexts = {i.model for i in infos}, model_contexts(infos, standing)
    routed = [
        msgspec.structs.replace(i, aliases=[n for n in i.aliases if n not in models or n == i.model])
        for i in infos
        if i.max_model_len in (None, contexts[i.model])
    ]
    sizes: dict[str, set[int]] = {}
    lengths: dict[str, dict[int, list[str]]] = {}
    for i in infos:
        sizes.setdefault(i.model, set()).add(i.block_size)
        if i.max_model_len is not None:
            lengths.setdefault(i.model, {}).setdefault(i.max_model_len, []).append(i.worker)
    return routed, {
        "block_size_conflicts": {m: s for m, s in sizes.items() if len(s) > 1},
        "shadowed_aliases": shadowed(infos),
        "name_clashes": {n: by for n, by in resolve_names(routed).items() if len(by) > 1},
        "context_conflicts": {
            m: ContextConflict(contexts[m] or 0, dict(sorted(by.items()))) for m, by in lengths.items() if len(by) > 1
        },
    }


def substance(attr: str, conflict: Any) -> object:
    """What a reported conflict is, which a change of must be said again: a name's models (shadows,
    clashes); a model's lengths at odds and the one it is served with (model_contexts). Which
    workers take part is not."""
    if attr == "context_conflicts":
        return set(conflict.workers), conflict.served
    return set(conflict)


def said(before: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str]]:
    """The log lines due from `before` to `now` (whole_fleet's reports): (level, a text in it). A
    conflict is said when it begins and when its substance changes (`substance`), and its end."""
    out: list[tuple[str, str]] = []
    if now["block_size_conflicts"] != before["block_size_conflicts"]:  # every conflict again
        out += [("ERROR", f"model {m} disagree on block size") for m in sorted(now["block_size_conflicts"])]
    out += [
        ("WARNING", f"model {m} agree")
        for m in sorted(before["block_size_conflicts"].keys() - now["block_size_conflicts"].keys())
    ]
    messages: dict[str, Callable[[str, Any], str]] = {
        "shadowed_aliases": shadow_message,
        "name_clashes": clash_message,
        "context_conflicts": context_message,
    }
    for attr, message in messages.items():
        was, seen = before[attr], now[attr]
        out += [
            ("ERROR", message(k, v))
            for k, v in sorted(seen.items())
            if k not in was or substance(attr, was[k]) != substance(attr, v)
        ]
        out += [("WARNING", f" {k} ") for k in sorted(was.keys() - seen.keys())]
    return out


def random_event(rng: random.Random, revision: int) -> WatchEvent[WorkerInfo]:
    def record(w: str) -> WorkerInfo:
        return info(
            w if rng.random() > 0.03 else "w9",  # now and then a record naming another worker: refused
            model=rng.choice(["llama", "qwen", "mist"]),
            role=rng.choice(["decode", "agg", "prefill", "prefill"]),  # prefill workers vote on nothing
            block_size=rng.choice([16, 16, 16, 32]),
            max_model_len=rng.choice([None, 4096, 4096, 8192, 2048]),  # three lengths: a conflict of several
            aliases=rng.sample(["llama", "qwen", "chat", "code"], rng.choice([0, 0, 1, 2])),
            adapters=rng.sample(["llama", "chat", "sql"], rng.choice([0, 0, 1, 2])),
        )

    w = f"w{rng.randrange(8)}"
    roll = rng.random()
    if roll < 0.05:
        ws = {f"w{i}" for i in range(8) if rng.random() < 0.5}
        return Snapshot(items={w: record(w) for w in ws}, revision=revision, skipped={"w8": "not JSON"})
    if roll < 0.25:
        return Deleted(w, revision, why="not JSON" if roll < 0.08 else "")
    return Put(w, record(w), revision)


async def test_what_each_event_changes_is_what_the_whole_fleet_says(
    disc: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    # The registry keeps its reports one record at a time; after every event they, the workers
    # routed and the lines logged are those of the whole-fleet definitions.
    caplog.set_level(logging.WARNING, logger="router.worker_registry")
    for seed in range(40):
        rng = random.Random(seed)
        reg = WorkerRegistry(disc, lambda _: None, lambda _: None)
        raw: dict[str, WorkerInfo] = {}
        standing: dict[str, int] = {}  # each model's length as last decided: a tie goes to it
        before = whole_fleet(raw, standing)[1]
        for revision in range(1, 80):
            event = random_event(rng, revision)
            match event:
                case Snapshot(items=items):
                    raw = {w: i for w, i in items.items() if i.worker == w}
                case Put(name=w, value=i) if i.worker == w:
                    raw[w] = i
                case Put(name=w) | Deleted(name=w):
                    raw.pop(w, None)
            caplog.clear()
            reg.apply(event)
            routed, now = whole_fleet(raw, standing)
            assert reg.workers() == routed, (seed, revision)
            # the rest, each named with the context it misses, for the views to list as excluded
            contexts = model_contexts(list(raw.values()), standing)
            unrouted = [(i, f"{i.max_model_len}, but model {i.model} is served with {contexts[i.model]},")
                        for _, i in sorted(raw.items()) if i.worker not in {r.worker for r in routed}]  # fmt: skip
            got = reg.unrouted()
            assert [i for i, _ in got] == [i for i, _ in unrouted], (seed, revision)
            assert all(text in why for (_, why), (_, text) in zip(got, unrouted, strict=True)), (seed, revision)
            models = sorted({i.model for i in routed})  # kept between events: each must renew them
            aliases = {n: i.model for i in routed for n in i.aliases if n not in models}
            adapters = {n: i.model for i in routed for n in i.adapters if n not in {*models, *aliases}}
            assert (reg.models(), reg.aliases(), reg.adapters()) == (models, aliases, adapters), (seed, revision)
            assert {attr: getattr(reg, attr) for attr in now} == now, (seed, revision)
            lines = [(r.levelname, r.getMessage()) for r in caplog.records if "ignored" not in r.getMessage()]
            due = said(before, now)
            assert len(lines) == len(due) and all(
                level == want and text in line for (level, line), (want, text) in zip(lines, due, strict=True)
            ), (seed, revision, lines, due)
            before = now


async def test_a_worker_key_put_again_without_a_lease_is_refused_once(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls], caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's key re-put with no lease outlives its shim: every router listed the dead worker for
    good (audit of 2026-12-07). DESIGN.md: a worker exists exactly as long as its lease."""
    reg, calls = registry
    kept, stray = await register(disc), await register(disc)
    await disc.put_raw(f"/{disc.ns}/workers/{stray.hex_id}", msgspec.json.encode(info(stray.hex_id)))
    with caplog.at_level(logging.ERROR):
        await reg.start()
        assert await reg.wait_ready(10.0)
        assert [i.worker for i in reg.workers()] == [kept.hex_id]  # in the first snapshot: refused
        [refused] = reg.refusing()
        assert refused.name == stray.hex_id and "no lease" in refused.why
        await disc.put_raw(f"/{disc.ns}/workers/{kept.hex_id}", msgspec.json.encode(info(kept.hex_id)))
        await until(lambda: not reg.workers())  # as a change: refused too
        assert kept.hex_id in calls.removed
        await disc.put_raw(f"/{disc.ns}/workers/{kept.hex_id}", msgspec.json.encode(info(kept.hex_id)))
        await disc.update_worker(kept, info(kept.hex_id, role="prefill"))  # under its lease again: routed
        await until(lambda: [i.worker for i in reg.workers()] == [kept.hex_id])
    said = [r.getMessage() for r in caplog.records if "no lease" in r.getMessage()]
    assert len(said) == 2 and stray.hex_id in said[0] and kept.hex_id in said[1], said  # once per key
    assert [r.name for r in reg.refusing()] == [stray.hex_id]


async def test_a_key_whose_bad_value_keeps_changing_is_said_once_a_window_with_its_changes(
    disc: Discovery, registry: tuple[WorkerRegistry, Calls], caplog: pytest.LogCaptureFixture
) -> None:
    """logonce audit of 2026-12-07, finding 5: a repeat was skipped only when its problem was the
    same, so 1,000 puts cycling four bad values on one key were 999 ERRORs."""
    reg, _ = registry
    reg._records.window_s = 3600.0  # every put within one window, however slow the machine
    await reg.start()
    assert await reg.wait_ready(10.0)
    key = subjects.workers_prefix(disc.ns) + "bad1"
    values = [b"not json", b'{"hello":1}', b'{"v":1,"worker":"x","model":"m"}', b"[]"]
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    try:
        for i in range(200):
            await disc.put_raw(key, values[i % len(values)])
        await until(lambda: reg.refused == 200, what="every put read")  # each counted
        assert [r.name for r in reg.refusing()] == ["bad1"]
        await reg.stop()  # says the change its window still holds
    finally:
        await disc.delete(key)
    said = [r.getMessage() for r in caplog.records if "'bad1'" in r.getMessage()]
    assert said == [
        "worker record under key 'bad1' ignored: malformed WorkerInfo: JSON is malformed: invalid character (byte 4)",
        "worker record under key 'bad1' ignored: malformed WorkerInfo: Expected `object`, got `array` (changes of "
        "its reason since it was last said: 199)",
    ], said
