"""The TensorRT-LLM adapter against payloads written from trtllm-serve's formats (fixtures README)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvswitch.servers import free_port
from protocol import BlockHasher, ConfigError, SamplingParams, block_hashes
from protocol.config import EtcdSettings, NatsSettings
from protocol.hashing import chain_salt, root_hash
from tests.worker_shim.cluster import collector
from tests.worker_shim.test_wrong_engine import fake_engine
from worker_shim import EngineLoad, Normaliser, ShimConfig, ShimStatus, WorkerShim
from worker_shim.adapters import trtllm
from worker_shim.adapters.base import EngineError, LegRequest
from worker_shim.adapters.trtllm import TrtllmAdapter, disagg_body, limits_from_stats, load_from_stats
from worker_shim.adapters.trtllm_events import TrtllmEventTracker
from worker_shim.engine_events import EngineBatch

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "trtllm"


def load(name: str) -> Any:
    return json.loads((FIX / name).read_text())


def test_events_normalise_through_the_parent_chain() -> None:
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    batch = tracker.fold(load("kv_cache_events_poll1.json"))
    assert batch.reset and batch.complete  # `created` at event 0: a fresh engine, nothing missed
    norm.reset(exact=batch.complete)
    norm.apply(batch.events)
    chain = block_hashes(list(range(1, 13)), 4)
    assert norm.canonical_hashes() == {chain[0], chain[1], *block_hashes(list(range(100, 104)), 4)}
    assert tracker.ignored == 1  # the `updated` event


def test_an_event_id_gap_resets_as_incomplete() -> None:
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    norm.apply(tracker.fold(load("kv_cache_events_poll1.json")).events)
    batch = tracker.fold(load("kv_cache_events_poll2_gap.json"))
    assert batch.reset and not batch.complete and tracker.gaps == 1
    norm.reset(exact=batch.complete)
    norm.apply(batch.events)
    assert norm.canonical_hashes() == set(block_hashes([7, 7, 7, 7], 4))


def test_event_ids_going_back_mean_a_restart() -> None:
    tracker = TrtllmEventTracker()
    tracker.fold(load("kv_cache_events_poll1.json"))
    again = tracker.fold([e for e in load("kv_cache_events_poll1.json") if e["data"]["type"] != "created"])
    assert not again.events and tracker.restarts == 1 and tracker.next_run  # the new run's: the next fold's


def test_a_restart_ends_the_fold_and_the_new_run_folds_next_from_a_complete_reset() -> None:
    """The engine hands each event over once: the new run's events in the poll that shows the
    restart are kept for the next fold (the adapter's next session), which starts complete at
    `created` event 0 and is counted once. Until 2026-12-08 they went into the batch of the session
    the restart ended, dropped: the next session's state stayed partial, their children orphaned."""
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    tracker.fold(load("kv_cache_events_poll1.json"))
    last_of_old_run = stored(6, None, (300, [9, 9, 9, 9]))
    again = tracker.fold([last_of_old_run, *load("kv_cache_events_poll1.json")])
    assert (tracker.restarts, tracker.went_back, tracker.last_id) == (1, (6, 0), None)
    assert not again.reset and len(again.events) == 1  # the old run's, up to the restart
    assert tracker.next_run == load("kv_cache_events_poll1.json")
    new, child = folded(tracker, norm, tracker.next_run, [stored(6, 162, (164, [13, 14, 15, 16]))])
    assert new.reset and new.complete and not child.reset and norm.exact
    chain = block_hashes([*range(1, 9), 13, 14, 15, 16], 4)  # the child of a block the new run's first poll stored
    assert norm.canonical_hashes() == {*chain, *block_hashes(list(range(100, 104)), 4)}
    assert (tracker.restarts, tracker.gaps, tracker.ignored, norm.stats.unknown_parent) == (1, 0, 2, 0)


@pytest.mark.parametrize("start", ["created", "stored"])
def test_ids_going_back_right_after_a_held_over_run_reset_complete_only_from_created_0(start: str) -> None:
    """After a restart's held-over events (`after_held`), ids going back are the engine now at the
    URL starting: a reset (complete only from its created event 0) with no `next_run`, so the
    session goes on. Until 2026-12-08 a restart, whose events the adapter held over again; later
    that day it was counted nowhere, though the stream showed a restart: now in `restarts`."""
    tracker = TrtllmEventTracker()
    tracker.fold(load("kv_cache_events_poll1.json"))
    run3 = (
        [CREATED, stored(1, None, (31, [4, 4, 4, 4]))] if start == "created" else [stored(3, None, (31, [4, 4, 4, 4]))]
    )
    batch = tracker.fold(run3, after_held=True)
    assert batch.reset and batch.complete is (start == "created") and len(batch.events) == 1
    assert (tracker.restarts, tracker.next_run, tracker.last_id) == (1, [], 1 if start == "created" else 3)


def _tok(ids: list[int]) -> list[dict[str, int | str]]:
    return [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]


def stored(eid: int, parent: int | str | None, *blocks: tuple[Any, list[int]]) -> dict[str, Any]:
    data = {
        "type": "stored",
        "parent_hash": parent,
        "blocks": [{"block_hash": h, "tokens": _tok(t)} for h, t in blocks],
    }
    return {"event_id": eid, "data": data, "window_size": 4096}


def removed(eid: int, *hashes: Any) -> dict[str, Any]:
    return {"event_id": eid, "data": {"type": "removed", "block_hashes": list(hashes)}, "window_size": 4096}


CREATED = {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [512, 0]}, "window_size": 4096}


def folded(tracker: TrtllmEventTracker, norm: Normaliser, *polls: Any) -> list[EngineBatch]:
    out = []
    for poll in polls:
        batch = tracker.fold(poll)
        if batch.reset:
            norm.reset(exact=batch.complete)
        norm.apply(batch.events)
        out.append(batch)
    return out


def test_v2_hex_digest_hashes_are_opaque_keys() -> None:
    """KV cache manager V2 (`hash_algo` v2_sha256) names blocks by hex digests: every poll was
    refused ("stored_block needs block_hash and tokens"), and a digest parent read as the root."""
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    (batch,) = folded(tracker, norm, load("kv_cache_events_v2.json"))
    assert batch.reset and batch.complete and (tracker.malformed, tracker.gaps, tracker.ignored) == (0, 0, 1)
    chain = block_hashes(list(range(1, 13)), 4)
    salted = BlockHasher(4, chain_salt("", "tenant-A"))(list(range(1, 9)))
    assert norm.canonical_hashes() == {chain[0], chain[1], *salted}  # "a1f2" (block 3) was removed
    folded(tracker, norm, [stored(5, "a1f1", ("a1f3", [20, 21, 22, 23]))])  # a digest parent, a poll later
    assert norm.holds(block_hashes([*range(1, 9), 20, 21, 22, 23], 4)[-1])


def test_a_digest_and_an_integer_never_name_one_block() -> None:
    """A digest "abcd" read as hex (43981) or as bytes (0x61626364) is still not that integer hash."""
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    as_int, as_str = block_hashes([1, 1, 1, 1], 4)[0], block_hashes([2, 2, 2, 2], 4)[0]
    folded(
        tracker,
        norm,
        [CREATED, stored(1, None, (43981, [1, 1, 1, 1])), stored(2, None, (0x61626364, [3, 3, 3, 3]))],
        [stored(3, None, ("abcd", [2, 2, 2, 2])), removed(4, "abcd")],
    )
    assert norm.holds(as_int) and not norm.holds(as_str) and len(norm) == 2


def test_a_salted_chain_is_credited_to_the_routers_salted_prompt() -> None:
    """TensorRT-LLM puts the request's cache_salt on each stored block; the router hashes a prompt
    with that cache_salt from root chain_salt(adapter, cache_salt) (router/planner.py), so the shim
    must publish that chain, not the unsalted one."""
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    prompt = list(range(30, 38))
    salted = [
        {"block_hash": 700 + i, "tokens": _tok(prompt[4 * i : 4 * i + 4]), "cache_salt": "tenant-A"} for i in (0, 1)
    ]
    poll = [CREATED, {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": salted}}]
    folded(tracker, norm, poll)
    router = BlockHasher(4, chain_salt("", "tenant-A"))(prompt)  # as router/planner.py hashes it
    assert norm.canonical_hashes() == set(router)
    assert not norm.holds(block_hashes(prompt, 4)[0])  # another tenant's prompt does not hit


def test_a_lora_tasks_chain_is_credited_to_no_base_model_prompt() -> None:
    """TensorRT-LLM caches a LoRA task's blocks apart (each stored block carries its `lora_id`); the
    shim folded them unsalted, so routers credited base-model prompts of the same tokens with them."""
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    prompt = list(range(30, 38))
    blocks = [{"block_hash": 900 + i, "tokens": _tok(prompt[4 * i : 4 * i + 4]), "lora_id": 7} for i in (0, 1)]
    folded(tracker, norm, [CREATED, {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": blocks}}])
    assert len(norm) == 2 and not norm.holds(block_hashes(prompt, 4)[0])
    assert norm.canonical_hashes() == set(block_hashes(prompt, 4, parent=root_hash("7")))


def test_blocks_holding_media_go_apart_from_their_text_prefix() -> None:
    """Blocks with `mm_keys` (an image's placeholder tokens, as trtllm-serve stores them): routers
    hash prompts by token ids alone, so two requests with the same placeholders and different
    images were one canonical chain, and its text prefix before them must still be credited."""
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    text, image, after = [1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 7, 8]

    def request(eid: int, base: int, media: str) -> dict[str, Any]:
        blocks = [
            {"block_hash": base, "tokens": _tok(text), "mm_keys": []},
            {
                "block_hash": base + 1,
                "tokens": _tok(image),
                "mm_keys": [{"type": "mm_key", "hash": media, "start_offset": 0}],
            },
            {"block_hash": base + 2, "tokens": _tok(after), "mm_keys": []},
        ]
        return {"event_id": eid, "data": {"type": "stored", "parent_hash": None, "blocks": blocks}, "window_size": 4096}

    folded(tracker, norm, [CREATED, request(1, 100, "aa" * 32), request(2, 200, "bb" * 32)])
    plain = block_hashes(text + image + after, 4)
    assert norm.holds(plain[0])  # the text prefix, credited as a prompt's
    assert not norm.holds(plain[1]) and not norm.holds(plain[2])  # no prompt of token ids holds an image
    assert len(norm) == 5  # the shared text block, and each image's two blocks apart
    assert tracker.malformed == 0


def _image_then_child(image: list[Any], mm_keys: list[Any]) -> list[Any]:
    """A text block and an image's block in one stored event, and a block stored under the image
    in the next (`image`: its tokens, whose first is the item's as the engine writes it)."""
    first = [
        {"block_hash": 100, "tokens": _tok([5, 6, 7, 8]), "mm_keys": []},
        {"block_hash": 101, "tokens": _tok(image), "mm_keys": mm_keys},
    ]
    child = {"block_hash": 102, "tokens": _tok([9, 9, 9, 9]), "mm_keys": []}
    return [
        CREATED,
        {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": first}, "window_size": 4096},
        {"event_id": 2, "data": {"type": "stored", "parent_hash": 101, "blocks": [child]}, "window_size": 4096},
    ]


def test_a_v2_media_digest_token_keeps_the_chain_after_the_image_as_v1s_placeholder_does() -> None:
    """KV cache manager V2 writes a media item's first token as its content digest (a hex string):
    that block and the rest of its event were dropped as malformed, the child stored under it was
    orphaned, and only the text before the first image was indexed."""
    digest = bytes(range(32)).hex()
    mm_keys = [{"type": "mm_key", "hash": digest, "uuid": "9dc26f865941d289", "start_offset": 0}]
    outcomes = []
    for first_token in (32000, digest):  # V1's placeholder id, V2's digest
        tracker, norm = TrtllmEventTracker(), Normaliser(4)
        (batch,) = folded(tracker, norm, _image_then_child([1, first_token, 32001, 32002], mm_keys))
        held = (len(norm), norm.holds(block_hashes([5, 6, 7, 8], 4)[0]), norm.stats.unknown_parent)
        folded(tracker, norm, [removed(3, 102)])  # the child was indexed under its engine hash
        outcomes.append((tracker.malformed, *held, len(norm), [getattr(e, "media", None) for e in batch.events]))
    assert outcomes[0] == outcomes[1] == (0, 3, True, 0, 2, ["", digest, ""])


def test_a_string_token_id_outside_a_media_block_stays_malformed() -> None:
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    events = _image_then_child([1, "ab" * 32, 2, 3], [])
    folded(tracker, norm, events)
    assert tracker.malformed == 1 and len(norm) == 0 and norm.stats.unknown_parent == 1  # the child orphaned


def test_a_malformed_event_is_dropped_alone_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """It used to drop the whole poll (its valid events too) with a reset and a WARNING per poll;
    an entry `{}` (the serializer's answer for a missing event) did the same."""
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    bad = stored(2, None, (None, [5, 5, 5, 5]))
    with caplog.at_level(logging.WARNING, logger="worker_shim.adapters.trtllm_events"):
        first, second = folded(
            tracker,
            norm,
            [CREATED, stored(1, None, (11, [1, 1, 1, 1])), bad, {}, stored(3, None, (13, [3, 3, 3, 3]))],
            [{**bad, "event_id": 4}, "junk", {"event_id": 5, "data": None}, stored(6, 13, (14, [4, 4, 4, 4]))],
        )
    assert first.reset and first.complete and not second.reset
    assert norm.canonical_hashes() == {
        block_hashes([1] * 4, 4)[0],
        *block_hashes([3, 3, 3, 3, 4, 4, 4, 4], 4),
    }
    # Events 2, 4 and 5 were read as far as their ids: no gap.
    assert (tracker.malformed, tracker.ignored, tracker.gaps, tracker.restarts) == (4, 1, 0, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and sum("neither a 64-bit integer" in w for w in warnings) == 1


@pytest.mark.parametrize("answer", [b"<html>502 Bad Gateway</html>", b'{"detail": "not a list"}'], ids=["html", "dict"])
async def test_a_poll_answer_that_is_no_json_list_is_a_counted_gap_not_the_sessions_end(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, answer: bytes
) -> None:
    """A proxy's error page answered 200 between good polls: the events the engine drained for it
    are lost. Until 2026-12-07 an answer of no JSON ended the event stream (the session, and the
    worker re-registered under a new id, counted nowhere), and one of JSON that was no list waited
    for the next event's id to show the gap. Now: counted as malformed, said once, the state reset
    incomplete at once, and the next event's jump past the lost ids is no second reset."""
    monkeypatch.setattr(trtllm, "POLL_S", 0.001)
    good = json.dumps([CREATED, stored(1, None, (11, [1, 1, 1, 1]))]).encode()
    answers = iter([good, answer, answer, json.dumps([stored(5, None, (15, [5, 5, 5, 5]))]).encode()])
    adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m"))

    async def fetch(path: str, method: str = "GET", timeout: object = None) -> bytes:
        return next(answers, b"[]")

    monkeypatch.setattr(adapter, "fetch", fetch)
    got: list[EngineBatch] = []
    with caplog.at_level(logging.WARNING, logger="worker_shim.adapters"):
        task = asyncio.create_task(adapter.run_events(collector(got), asyncio.Event()))
        await asyncio.sleep(0.2)
        assert not task.done(), task.exception()
        task.cancel()
    assert [(b.reset, b.complete, len(b.events)) for b in got] == [
        (True, False, 0),  # the reader's start
        (True, True, 1),  # the engine's created event, then event 1
        (True, False, 0),  # the lost answer: a gap
        (True, False, 0),  # and the second
        (False, True, 1),  # event 5, past the lost ids: no second reset
    ]
    assert adapter.event_stats() == {"gaps": 0, "restarts": 0, "ignored": 0, "partial": 0, "malformed": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "the events the engine handed over for it are lost" in warnings[0]


async def test_an_event_of_a_type_the_shim_does_not_know_is_counted_by_type_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 it went into `ignored` with the expected `updated` events, with no word and
    no count by type (a `stored` renamed by a newer engine left every chain under it with an
    unknown parent), and data with no type did too. `updated` stays ignored; data with no string
    type is malformed; both keep their event ids, so no gap."""
    monkeypatch.setattr(trtllm, "POLL_S", 0.001)
    adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m"))
    renamed = {"event_id": 2, "data": {**stored(0, None, (12, [2, 2, 2, 2]))["data"], "type": "stored_v2"}}
    updated = {"event_id": 5, "data": {"type": "updated", "block_hash": 11, "cache_level": 1, "priority": 35}}
    polls = iter(
        [
            [CREATED, stored(1, None, (11, [1, 1, 1, 1])), renamed, {**renamed, "event_id": 3}],
            [{"event_id": 4, "data": {"type": "pinned", "block_hash": 11}}, updated],
            [{"event_id": 6, "data": {"block_hashes": [11]}}, {"event_id": 7, "data": {"type": 3}}],
            [stored(8, None, (13, [3, 3, 3, 3]))],
        ]
    )

    async def answer(method: str, path: str, timeout: object = None) -> Any:
        return next(polls, None) or []

    monkeypatch.setattr(adapter, "_json", answer)
    got: list[EngineBatch] = []
    with caplog.at_level(logging.WARNING, logger="worker_shim"):
        task = asyncio.create_task(adapter.run_events(collector(got), asyncio.Event()))
        await asyncio.sleep(0.2)
        task.cancel()
    assert adapter.unknown_event_types() == {"stored_v2": 2, "pinned": 1}
    assert adapter.event_stats() == {"gaps": 0, "restarts": 0, "ignored": 1, "partial": 0, "malformed": 2}
    assert sum(len(b.events) for b in got) == 2 and not any(b.reset for b in got[2:])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and sum("no string type" in w for w in warnings) == 1
    assert [w for w in warnings if "stored_v2" in w] and [w for w in warnings if "pinned" in w]


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.glob("kv_cache_events_*.json")))
def test_every_captured_event_is_of_a_known_type(name: str) -> None:
    """`updated` events, `{}` entries and a sliding window's events are expected and only ignored."""
    tracker = TrtllmEventTracker()
    try:
        tracker.fold(load(name))
    except ConfigError:  # the attention-DP capture: a second rank is refused at its first event
        assert name == "kv_cache_events_attention_dp.json"
    assert (tracker.unknown.counts, tracker.malformed) == ({}, 0)


async def test_run_events_keeps_the_state_through_malformed_polls(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A poll holding a malformed event was a reset (complete=False) and a WARNING, every time."""
    monkeypatch.setattr(trtllm, "POLL_S", 0.001)
    adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m"))
    polls = iter(
        [
            [CREATED],
            [stored(1, None, (None, [1, 2, 3, 4]))],
            [stored(2, None, (None, [1, 2, 3, 4]))],
            [stored(3, None, ("ab03", [4, 5, 6, 7]))],
        ]
    )

    async def answer(method: str, path: str, timeout: object = None) -> Any:
        return next(polls, None) or []

    monkeypatch.setattr(adapter, "_json", answer)
    got: list[EngineBatch] = []
    with caplog.at_level(logging.WARNING):
        task = asyncio.create_task(adapter.run_events(collector(got), asyncio.Event()))
        await asyncio.sleep(0.2)
        task.cancel()
    assert [(b.reset, b.complete, len(b.events)) for b in got] == [(True, False, 0), (True, True, 0), (False, True, 1)]
    assert adapter.event_stats() == {"gaps": 0, "restarts": 0, "ignored": 0, "partial": 0, "malformed": 2}
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_sliding_window_layers_start_once_and_fold_only_the_largest_window() -> None:
    """A VSWA model's engine sends a created event per window and stores each block once per
    window: the second created event was a restart (reset incomplete), and the sliding window's
    removals dropped blocks the full-attention window still held."""
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    (batch,) = folded(tracker, norm, load("kv_cache_events_vswa.json"))
    assert batch.reset and batch.complete and (tracker.restarts, tracker.gaps) == (0, 0)
    assert norm.canonical_hashes() == set(block_hashes(list(range(1, 9)), 4))
    assert (tracker.window, tracker.ignored) == (4096, 2)


def test_a_larger_window_seen_late_voids_what_was_folded() -> None:
    """A shim that never saw the created events folds the first window it meets; a larger one
    later means those were a sliding window's: reset, incomplete."""
    tracker = TrtllmEventTracker()
    tracker.fold([{**stored(7, None, (161, [1, 2, 3, 4])), "window_size": 128}])
    batch = tracker.fold([stored(8, None, (161, [1, 2, 3, 4]))])
    assert batch.reset and not batch.complete and len(batch.events) == 1 and tracker.window == 4096


def test_one_tagged_attention_dp_rank_folds_as_usual() -> None:
    tracker, norm = TrtllmEventTracker(), Normaliser(4)
    poll = [{**e, "attention_dp_rank": 0} for e in load("kv_cache_events_poll1.json")]
    (batch,) = folded(tracker, norm, poll)
    assert batch.complete and tracker.ranks == {0} and len(norm) == 3


async def test_several_attention_dp_ranks_are_refused_naming_the_flag() -> None:
    """Each rank numbers its events from 0: one stream for all was a restart every poll, and one
    worker credited with every rank's cache while trtllm-serve puts a request on any rank."""
    adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m"))
    with pytest.raises(ConfigError) as err:
        adapter.tracker.fold(load("kv_cache_events_attention_dp.json"))
    why = str(err.value)
    assert err.value.setting == "data_parallel_rank" and "--data-parallel-rank" in why
    assert "attention data-parallel ranks 0, 1" in why and "enable_attention_dp" in why
    with pytest.raises(ConfigError) as again:  # the next session's limits, before any request
        await adapter.limits()
    assert str(again.value) == why
    with pytest.raises(ConfigError, match="only vLLM takes a rank per request"):  # no request can name one
        ShimConfig(engine="trtllm", model="m", data_parallel_rank=1).validate()


async def test_a_shim_before_an_attention_dp_engine_exits_without_registering(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    metrics = (FIX / "metrics.json").read_bytes()
    events = (FIX / "kv_cache_events_attention_dp.json").read_bytes()
    routes: dict[str, bytes | int] = {"/health": b"", "/metrics": metrics, "/kv_cache_events": events}
    async with fake_engine(routes) as url:
        cfg = ShimConfig(engine="trtllm", engine_url=url, model="m", namespace=ns, health_interval_s=0.1)
        shim = WorkerShim(cfg, NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url]))
        async with shim:
            await asyncio.wait_for(shim.done.wait(), 10)
        assert shim.status is ShimStatus.FAILED and isinstance(shim.failure, ConfigError)
        assert "attention data-parallel ranks 0, 1" in str(shim.failure)
        assert shim.registration_count == 0


def test_limits_and_load_from_iteration_stats() -> None:
    stats = load("metrics.json")
    lim = limits_from_stats(stats)
    assert (lim.block_size, lim.kv_total_blocks) == (32, 512)
    got = load_from_stats(stats, EngineLoad())
    assert (got.running, got.waiting, got.kv_total_blocks) == (4, 2, 512) and got.kv_usage == 112 / 512
    assert not got.stale
    previous = EngineLoad(running=9)
    # No iteration since the last read: the last figures, marked stale (until 2026-12-07 returned as fresh).
    assert load_from_stats([], previous) == replace(previous, stale=True)


@pytest.mark.parametrize(
    ("kv", "field"),
    [
        ([{"maxNumBlocks": 512}], "kvCacheStats is [{"),
        ({"maxNumBlocks": "512", "usedNumBlocks": 112}, "kvCacheStats.maxNumBlocks is '512'"),
        ({"maxNumBlocks": 512, "usedNumBlocks": "112"}, "kvCacheStats.usedNumBlocks is '112'"),
    ],
    ids=["list", "max-string", "used-string"],
)
def test_a_badly_typed_kv_cache_stat_is_the_engines_protocol_error_naming_it(kv: Any, field: str) -> None:
    """Until 2026-12-07 .get or the division raised AttributeError or TypeError: the load poll
    logged an ERROR with a traceback and /health named no field."""
    stats = load("metrics.json")
    stats[-1]["kvCacheStats"] = kv
    with pytest.raises(EngineError) as caught:
        load_from_stats(stats, EngineLoad())
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol") and field in caught.value.message


@pytest.mark.parametrize("field", ["tokensPerBlock", "maxNumBlocks"])
@pytest.mark.parametrize("value", ["32", -16, 0, 32.5, 32.0, True, None], ids=repr)
def test_a_limit_that_is_no_positive_integer_is_the_engines_protocol_error_naming_it(field: str, value: Any) -> None:
    """Until 2026-12-07 limits_from_stats passed them through: "32" crashed the normaliser with a
    TypeError, True registered a block size of 1, 0 and -16 limits no engine has. None (absent) is
    an engine that does not say: the flags stand in."""
    stats = load("metrics.json")
    stats[-1]["kvCacheStats"][field] = value
    if value is None:
        assert (
            getattr(limits_from_stats(stats), "block_size" if field == "tokensPerBlock" else "kv_total_blocks") is None
        )
        return
    with pytest.raises(EngineError) as caught:
        limits_from_stats(stats)
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert f"kvCacheStats.{field} is {value!r}, not a positive integer" in caught.value.message


def test_disaggregated_params_per_leg() -> None:
    s = SamplingParams(max_tokens=20)
    ctx = disagg_body(LegRequest("r", "m", [1, 2], s, prefill_only=True))
    assert ctx["disaggregated_params"] == {"request_type": "context_only"} and ctx["max_tokens"] == 1
    handle = load("completion_context_only.json")["choices"][0]["disaggregated_params"]
    gen = disagg_body(LegRequest("r", "m", [1, 2], s, transfer=handle))
    assert gen["disaggregated_params"]["request_type"] == "generation_only"
    assert gen["disaggregated_params"]["ctx_request_id"] == 77 and gen["stream"] is True
    assert disagg_body(LegRequest("r", "m", [1], s))["disaggregated_params"] == {
        "request_type": "context_and_generation"
    }


@pytest.mark.parametrize("endpoint", ["", "completions"])
def test_a_lora_request_is_refused(endpoint: str) -> None:
    """TensorRT-LLM caches an adapter's prompts apart; routers hash this request as the base
    model's and would credit it with prefixes the engine will not reuse for it."""
    params = {"prompt": [1, 2], "lora_request": {"lora_name": "a", "lora_int_id": 7, "lora_path": "/a"}}
    leg = LegRequest("r", "m", [1, 2], SamplingParams(max_tokens=2), endpoint=endpoint, params=params)
    with pytest.raises(EngineError) as caught:
        disagg_body(leg)
    assert caught.value.code == 400 and caught.value.message.startswith("lora_request: TensorRT-LLM caches")


async def test_a_poll_the_engine_holds_past_two_seconds_keeps_its_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """trtllm-serve revisions calling get_kv_cache_events_async(2) answer after 2 s with no new event.
    The probes' 2 s total timed that poll out, lost the events the engine had handed over (it has no
    replay) and ended the session with a 503."""
    monkeypatch.setattr(trtllm, "POLL_S", 0.001)
    polls = 0

    async def kv_cache_events(request: web.Request) -> web.Response:
        nonlocal polls
        polls += 1
        if polls == 1:
            await asyncio.sleep(2.5)
            return web.json_response([CREATED])
        await asyncio.sleep(0.05)
        return web.json_response([])

    app = web.Application()
    app.router.add_post("/kv_cache_events", kv_cache_events)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    adapter = TrtllmAdapter(ShimConfig(engine="trtllm", model="m", engine_url=f"http://127.0.0.1:{port}"))
    await adapter.open()
    got: list[EngineBatch] = []
    try:
        task = asyncio.create_task(adapter.run_events(collector(got), asyncio.Event()))
        await asyncio.sleep(3.0)
        assert not task.done(), task.exception()
        task.cancel()
        assert [(b.reset, b.complete) for b in got] == [(True, False), (True, True)]
    finally:
        await adapter.close()
        await runner.cleanup()
