"""The SGLang adapter against payloads written from SGLang's formats (fixtures README)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from protocol import ConfigError, SamplingParams, Stored, Usage, block_hashes
from protocol.hashing import chain_salt
from protocol.messages import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from protocol.vllm_events import decode_pub_frames, decode_replay_reply
from tests.protocol.vllm_captures import frames
from tests.worker_shim.cluster import served, wait_for
from tests.worker_shim.fake_sglang import TOO_LONG as TOO_LONG_FOR_CONTEXT
from tests.worker_shim.fake_sglang import FakeSglang
from worker_shim import Normaliser
from worker_shim.adapters import openai_http
from worker_shim.adapters.base import EngineError, LegRequest
from worker_shim.adapters.sglang import (
    SglangAdapter,
    StreamFolder,
    generate_body,
    limits_from_server_info,
    load_from_metrics,
    openai_body,
)
from worker_shim.adapters.vllm_events import decode_payload
from worker_shim.adapters.zmq_events import resolve_endpoint
from worker_shim.config import ShimConfig, ShimRole
from worker_shim.engine_events import EngineEvent, EngineRemoved, EngineStored
from worker_shim.kv_events_config import EngineEventsConfig, parse_kv_events_config
from worker_shim.normaliser import NormaliserStats

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"


def _replayed(fixture: str) -> list[set[int]]:
    """The canonical hashes a normaliser holds after each batch of the fixture's PUB messages."""
    norm = Normaliser(4)
    states = []
    for f in frames(FIX / fixture):
        _, _, payload = decode_pub_frames(f)
        norm.apply(decode_payload(payload, "sglang"))
        states.append(norm.canonical_hashes())
    assert norm.stats.unknown_parent == norm.stats.malformed == 0
    return states


def test_signed_page_hashes_normalise_to_the_canonical_chain() -> None:
    states = _replayed("zmq_events_raw.jsonl")
    system = list(range(10, 18))
    q1 = block_hashes(system + list(range(50, 58)), 4)
    q2 = block_hashes(system + list(range(60, 64)), 4)
    assert states[1] == set(q1) | set(q2)  # both continuations hang off the shared system prompt
    assert states[2] == set(q1[:-1]) | set(q2)
    assert states[3] == set()
    assert states[4] == set(block_hashes([9, 9, 9, 9], 4))


def test_block_stored_matches_sglangs_map_form() -> None:
    """SGLang since PR #37482 (merged 2026-09) sends each event as a tagged msgpack map and names
    `cache_salt` (and `session_id`) on BlockStored; its event recorder merges a radix node's
    consecutive pages into one BlockStored (as it did in array-form releases): the same batches as
    the array fixture's, one event per page, hold the same blocks, and a salted chain is salted as
    the router salts that cache_salt."""
    maps = _replayed("zmq_events_map.jsonl")
    assert maps[:5] == _replayed("zmq_events_raw.jsonl")
    _, _, first = decode_pub_frames(frames(FIX / "zmq_events_map.jsonl")[0])
    (system,) = decode_payload(first, "sglang")  # two pages, one event
    assert isinstance(system, EngineStored) and len(system.hashes) == 2 and system.parent is None
    salted = block_hashes(list(range(10, 18)), 4, salt=chain_salt(cache_salt="tenant-a"))
    assert maps[5] == maps[4] | set(salted)


SALT = "tenant-a"
TOKENS = list(range(10, 18))  # two pages of 4
# SGLang's salted BlockStored (python/sglang/srt/disaggregation/kv_events.py BlockStoredWithMetadata):
# its metadata map {"cache_salt"} after the positional fields, on each event of a salted request.
SHORT = [
    ["BlockStored", [-11], None, TOKENS[:4], 4, None, "GPU", {"cache_salt": SALT}],
    ["BlockStored", [-12], -11, TOKENS[4:], 4, None, "GPU", {"cache_salt": SALT}],
]
# The same pages as an array-form KVCacheEventRecorder (mem_cache/events.py) sends them: merged.
MERGED = [["BlockStored", [-11, -12], None, TOKENS, 4, None, "GPU", {"cache_salt": SALT}]]
# The longer layout an SGLang test pins (vLLM's field order up to ownership, then the map; its
# extra_keys hold the salt prefixed for another router).
LONG = [
    ["BlockStored", [-21, -22], None, TOKENS, 4, None, "GPU", None, [[f"dynamo-cache-salt:{SALT}"]]]
    + [None] * 5
    + [{"cache_salt": SALT}]
]


@pytest.mark.parametrize("events", [SHORT, MERGED, LONG], ids=["after-medium", "merged-pages", "longer-layout"])
def test_a_salted_chain_normalises_to_the_hashes_the_router_gives_that_cache_salt(events: list[object]) -> None:
    """The salt was ignored (the longer layout) or voided the whole batch (the map read as a
    lora_name): a salted request's cached prefix was never found, or credited to unsalted ones."""
    norm = Normaliser(4)
    norm.apply(decode_payload(msgspec.msgpack.encode([1.0, events, 0]), "sglang"))
    assert norm.canonical_hashes() == set(block_hashes(TOKENS, 4, salt=chain_salt(cache_salt=SALT)))
    assert norm.stats.unknown_parent == norm.stats.malformed == 0


def test_a_salted_page_leaves_its_batchs_unsalted_events_as_they_are() -> None:
    plain = ["BlockStored", [-31], None, [9, 9, 9, 9], 4, None, "GPU"]
    batch = [plain, ["BlockRemoved", [-99], "GPU"], SHORT[0]]
    stored, removed, salted = decode_payload(msgspec.msgpack.encode([1.0, batch, 0]), "sglang")
    assert isinstance(stored, EngineStored) and stored.salt == ""
    assert removed == EngineRemoved(hashes=[-99], medium="GPU")
    assert isinstance(salted, EngineStored) and salted.salt == chain_salt(cache_salt=SALT)


# SGLang with --enable-kv-events-component-types (mem_cache/events.py,
# KVCacheEventRecorder._record_store_component and _record_remove_component; its test
# test_kv_events_component_types.py): a radix node of two pages under the root, [H1, H2], as its
# full and sliding-window chains (coalesced into one event each, as its enqueue does) and as the
# node's one Mamba checkpoint: no parent, the node's last page hash and tokens.
H1, H2 = -41, -42
_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "component_type")


def _component_stored(hashes: list[int], tokens: list[int], component: str, form: str) -> list[Any] | dict[str, Any]:
    values = [hashes, None, tokens, 4, None, "GPU", component]
    if form == "array":
        return ["BlockStored", *values]
    if form == "long":  # SGLang's longer layout (its 13 positional fields), the label after them
        return ["BlockStored", *values[:6], *[None] * 7, component]
    return {"type": "BlockStored", **dict(zip(_FIELDS, values, strict=True))}


def _component_removed(hashes: list[int], component: str, form: str) -> object:
    if form == "array":
        return ["BlockRemoved", hashes, "GPU", component]
    if form == "long":  # its 7 positional fields, the label after them
        return ["BlockRemoved", hashes, "GPU", *[None] * 5, component]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "component_type": component}


def _component_batch(*events: object) -> list[EngineEvent]:
    return decode_payload(msgspec.msgpack.encode([1.0, list(events), 0]), "sglang")


FORMS = ["map", "array", "long"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mamba_first", [False, True], ids=["full-then-mamba", "mamba-then-full"])
def test_a_mamba_checkpoint_is_no_root_block_of_the_prompts_it_does_not_start(form: str, mamba_first: bool) -> None:
    """Read as full attention, the checkpoint was a root block of the node's last page: routers
    credited any prompt starting [14, 15, 16, 17] with a block the engine cannot reuse, and no
    counter moved. In the array form its label read as lora_name: every full chain was salted
    "full", so no prompt's prefix was ever found."""
    full = _component_stored([H1, H2], TOKENS, "full", form)
    mamba = _component_stored([H2], TOKENS[4:], "mamba", form)
    norm = Normaliser(4)
    norm.apply(_component_batch(*([mamba, full] if mamba_first else [full, mamba])))
    assert norm.canonical_hashes() == set(block_hashes(TOKENS, 4))
    assert norm.stats.other_groups == 1
    assert norm.stats.unknown_parent == norm.stats.malformed == norm.stats.unknown_removed == 0


@pytest.mark.parametrize("form", FORMS)
def test_a_component_removal_takes_only_that_components_blocks(form: str) -> None:
    """A Mamba checkpoint's and a window's removals name the full chain's hashes: they took the full
    blocks away (or, in the array form, were malformed, and so was the full chain's own removal)."""
    norm = Normaliser(4)
    norm.apply(
        _component_batch(
            _component_stored([H1, H2], TOKENS, "full", form),
            _component_stored([H1, H2], TOKENS, "swa", form),
            _component_stored([H2], TOKENS[4:], "mamba", form),
        )
    )
    gone = _component_batch(_component_removed([H2], "mamba", form), _component_removed([H1, H2], "swa", form))
    assert norm.apply(gone) == []
    assert norm.canonical_hashes() == set(block_hashes(TOKENS, 4))
    norm.apply(_component_batch(_component_removed([H1, H2], "full", form)))
    assert norm.canonical_hashes() == set()
    assert norm.stats.malformed == norm.stats.unknown_removed == 0
    assert norm.stats.other_groups == 4


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("component", ["swa", "mamba", "c256"])
def test_a_component_removal_before_any_store_of_it_is_counted_as_that_component(form: str, component: str) -> None:
    """The removal names its component, so its group's kind is known without a Stored: it was
    counted as a removal of unknown blocks (unknown_removed), not as a kind kvswitch does not model."""
    norm = Normaliser(4)
    norm.apply(_component_batch(_component_stored([H1, H2], TOKENS, "full", form)))
    norm.apply(_component_batch(_component_removed([H2], component, form)))
    assert (norm.stats.other_groups, norm.stats.unknown_removed) == (1, 0)
    assert norm.canonical_hashes() == set(block_hashes(TOKENS, 4))


@pytest.mark.parametrize("form", FORMS)
def test_each_component_kvswitch_does_not_model_is_counted_and_said_once(
    form: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SWA names no window (vLLM's sliding-window groups do, which the window endpoints need); Mamba
    and a label kvswitch does not know are not modelled either."""
    norm = Normaliser(4)
    window = _component_stored([H1, H2], TOKENS, "swa", form)
    mamba = _component_stored([H2], TOKENS[4:], "mamba", form)
    other = _component_stored([H2], TOKENS[4:], "c256", form)
    with caplog.at_level(logging.WARNING, logger="worker_shim.normaliser"):
        norm.apply(_component_batch(window, mamba, mamba, window, other, other))
    said = [r.getMessage() for r in caplog.records]
    assert [next(k for k in ("'swa'", "'mamba'", "'c256'") if k in m) for m in said] == ["'swa'", "'mamba'", "'c256'"]
    assert all("which kvswitch does not model" in m for m in said)
    assert norm.stats.other_groups == 6 and norm.canonical_hashes() == set()


@pytest.mark.parametrize("form", FORMS)
def test_a_labelled_full_chain_is_the_unlabelled_one_salt_and_all(form: str) -> None:
    """Its BlockStoredWithComponentTypeAndMetadata: the label, then the salted request's metadata map."""
    event = _component_stored([H1, H2], TOKENS, "full", form)
    salted = [*event, {"cache_salt": SALT}] if isinstance(event, list) else {**event, "metadata": {"cache_salt": SALT}}
    (stored,) = _component_batch(salted)
    assert isinstance(stored, EngineStored) and (stored.group, stored.kind) == (0, "full")
    assert stored.salt == chain_salt(cache_salt=SALT)
    norm = Normaliser(4)
    norm.apply([stored])
    assert norm.canonical_hashes() == set(block_hashes(TOKENS, 4, salt=chain_salt(cache_salt=SALT)))


def test_sglangs_own_kv_events_config_with_a_snapshot_endpoint_is_taken() -> None:
    """SGLang's ZmqEventPublisherConfig takes snapshot_endpoint; its JSON was refused as unknown."""
    raw = {"publisher": "zmq", "endpoint": "tcp://*:5557", "snapshot_endpoint": "tcp://*:5600", "topic": "kv"}
    assert parse_kv_events_config("sglang", raw) == EngineEventsConfig("tcp://*:5557", None, "kv")
    with pytest.raises(ConfigError, match="snapshot_endpoint must be a str"):
        parse_kv_events_config("sglang", {**raw, "snapshot_endpoint": 5600})
    with pytest.raises(ConfigError, match=r"unknown key.*snapshot_endpoint.*vllm takes"):
        parse_kv_events_config("vllm", {"enable_kv_cache_events": True, "snapshot_endpoint": "tcp://*:5600"})


def _sglang_binds(endpoint: str, bind: bool | None) -> bool:
    """SGLang 0.5.23's ZmqEventPublisher._socket_setup, copied: whether its PUB binds."""
    if bind is not None:
        return bind
    wildcard = "*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint
    return wildcard or endpoint.startswith(("ipc://", "inproc://"))


@pytest.mark.parametrize("bind", [True, False, None], ids=["bind-true", "bind-false", "bind-unset"])
@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5557", "tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::1]:5557", "ipc:///tmp/kv"]
)
def test_sglangs_bind_key_is_taken_and_the_shim_takes_the_other_side(endpoint: str, bind: bool | None) -> None:
    """SGLang 0.5.23's KVEventsConfig.bind ("use true to bind a concrete address such as loopback"):
    until 2026-12-07 an unknown key, the shim's exit 2, though the docs ask for the JSON as the
    engine got it."""
    raw: dict[str, Any] = {"publisher": "zmq", "endpoint": endpoint}
    if bind is not None:
        raw["bind"] = bind
    cfg = ShimConfig(engine="sglang", model="m", kv_events_config=raw).validate()
    assert cfg.kv_events == endpoint
    _, shim_binds = resolve_endpoint(endpoint, cfg.kv_events_mode, "10.0.0.7", "sglang")
    assert shim_binds is not _sglang_binds(endpoint, bind)


def test_an_explicit_kv_events_mode_that_contradicts_sglangs_bind_is_refused() -> None:
    raw = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "bind": True}
    assert ShimConfig(engine="sglang", model="m", kv_events_config=raw, kv_events_mode="connect").validate()
    with pytest.raises(ConfigError) as caught:
        ShimConfig(engine="sglang", model="m", kv_events_config=raw, kv_events_mode="bind").validate()
    assert caught.value.setting == "kv_events_mode" and "bind true" in caught.value.allowed
    with pytest.raises(ConfigError, match="bind must be a bool, got 'true'"):
        parse_kv_events_config("sglang", {**raw, "bind": "true"})
    with pytest.raises(ConfigError, match=r"unknown key.*bind.*vllm takes"):
        parse_kv_events_config("vllm", {"enable_kv_cache_events": True, "bind": True})


def test_sglangs_format_key_is_taken_for_each_value_sglang_has() -> None:
    """ "dynamo" (SGLang 0.5.23) sends the same events with every hash namespaced by the request's
    extra_key and cache_salt (mem_cache/events.py record_store): other opaque keys, whose chain
    normalises to the same canonical hashes. Until 2026-12-07 the key was refused as unknown."""
    raw = {"publisher": "zmq", "endpoint": "tcp://*:5557"}
    for form in ("default", "dynamo"):
        assert parse_kv_events_config("sglang", {**raw, "format": form}) == EngineEventsConfig("tcp://*:5557", None, "")
    with pytest.raises(ConfigError, match="format 'vllm': SGLang takes 'default' or 'dynamo'"):
        parse_kv_events_config("sglang", {**raw, "format": "vllm"})


def test_sglangs_replay_reply_shows_its_topic() -> None:
    """SGLang 0.5.23's ZmqEventPublisher._service_replay sends (identity, b"", topic, seq, payload),
    which the shim's DEALER receives without the identity: its topic names a wrong --kv-events-topic,
    as vLLM's does (docs said until 2026-12-07 that SGLang's carried none)."""
    frames = [b"", b"kv-events", (7).to_bytes(8, "big"), b"payload"]
    assert decode_replay_reply(frames) == (b"kv-events", 7, b"payload")


def test_the_clients_cache_salt_reaches_sglang_on_both_kinds_of_leg() -> None:
    """The request service counts a leg's prompt as salted by its body's cache_salt; the engine must
    cache it so too, or its Stored events never match what the shim expects."""
    leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(), params={"cache_salt": SALT})
    assert generate_body(leg, None)["cache_salt"] == SALT
    assert "cache_salt" not in generate_body(LegRequest("r", "m", [1, 2, 3], SamplingParams()), None)
    chat = LegRequest(
        "r", "m", [1, 2, 3], SamplingParams(), endpoint="chat", params={"messages": [], "cache_salt": SALT}
    )
    assert openai_body(chat, None)["cache_salt"] == SALT


def test_limits_and_load() -> None:
    info = json.loads((FIX / "get_server_info.json").read_text())
    lim = limits_from_server_info(info)
    assert (lim.block_size, lim.kv_total_blocks, lim.max_num_batched_tokens) == (16, 401408 // 16, 8192)
    assert lim.prefix_caching is None  # the fixture's args do not say
    # --disable-radix-cache (a P/D decode worker's usual flag): no prefix caching, so no KV events, and
    # the routers wait for none (router.dispatch's whole answers fed by a transfer; the shim's watch).
    assert limits_from_server_info({**info, "disable_radix_cache": True}).prefix_caching is False
    assert limits_from_server_info({**info, "disable_radix_cache": False}).prefix_caching is True
    text = (FIX / "metrics.txt").read_text()
    got = load_from_metrics(text, lim.kv_total_blocks, info["max_total_num_tokens"])
    assert (got.running, got.waiting, got.kv_usage) == (5, 3, 100913 / 401408)
    assert got.reused_tokens is None, "SGLang exports no reuse counter: the shim's credit check stays off"


def _all_schedulers(
    ranks: list[tuple[int, int | None]], running: list[int], used: list[int], pp: list[int] | None = None
) -> str:
    """/metrics of SGLang 0.5.23 with --enable-metrics-for-all-schedulers: each scheduler's gauges
    under its own tp_rank and pp_rank (and dp_rank with DP attention; observability/metrics_collector.py)."""
    lines = []
    for (tp, dp), run, kv, stage in zip(ranks, running, used, pp or [0] * len(ranks), strict=True):
        labels = f'engine_type="unified",model_name="m",moe_ep_rank="{tp}",pp_rank="{stage}",tp_rank="{tp}"'
        if dp is not None:
            labels += f',dp_rank="{dp}"'
        lines += [
            f"sglang:num_running_reqs{{{labels}}} {run}.0",
            f"sglang:num_queue_reqs{{{labels}}} 1.0",
            f"sglang:token_usage{{{labels}}} 0.25",
            f"sglang:num_used_tokens{{{labels}}} {kv}.0",
        ]
    return "\n".join(lines) + "\n"


def test_every_tp_ranks_series_is_one_reading() -> None:
    """TP 4: every rank exports the same reading; until 2026-12-07 summed, the load read 4 times
    what it was, and the exact KV use fell back to the rounded gauge."""
    text = _all_schedulers([(0, None), (1, None), (2, None), (3, None)], [5, 5, 5, 5], [1000] * 4)
    load = load_from_metrics(text, 250, 4000)
    assert (load.running, load.waiting, load.kv_usage) == (5, 1, 1000 / 4000)


def test_under_dp_attention_each_dp_ranks_first_tp_rank_counts() -> None:
    """TP 4, DP 2 with DP attention: dp_rank 1's exporter is tp_rank 2, not 0."""
    text = _all_schedulers([(0, 0), (1, 0), (2, 1), (3, 1)], [5, 5, 7, 7], [1000, 1000, 3000, 3000])
    load = load_from_metrics(text, 500, 4000)
    assert (load.running, load.waiting, load.kv_usage) == (12, 2, 0.25)  # the mean gauge: two DP ranks


@pytest.mark.parametrize(
    ("ranks", "pp"),
    [([(0, None), (0, None)], [1, 0]), ([(1, None), (0, None), (1, None), (0, None)], [1, 1, 0, 0])],
    ids=["default", "all-schedulers"],
)
def test_each_pipeline_stage_exports_the_same_reading_and_the_first_counts(
    ranks: list[tuple[int, int | None]], pp: list[int]
) -> None:
    """PP 2, TP 2: by default each stage's attention-TP rank 0 exports (metrics_collector.py), and
    tp_rank starts at 0 again in each stage (data_parallel_controller.py); a stage runs the same
    requests and holds its own layers' KV for the same tokens. Until 2026-12-07 the stages were
    summed: the load read pp_size times what it was, and the exact KV use fell back to the rounded
    gauge. pp_rank 0 counts (the later stage trails here by one request)."""
    running = [6 if stage else 5 for stage in pp]
    text = _all_schedulers(ranks, running, [1234] * len(ranks), pp)
    load = load_from_metrics(text, 250, 4000)
    assert (load.running, load.waiting, load.kv_usage) == (5, 1, 1234 / 4000)


# SGLang 0.5.23's /server_info `kv_events` (runtime_context.describe_kv_events_publisher): null for
# an endpoint it cannot advertise (ipc://, inproc://), block_size page_size * dcp_size otherwise.
KV_EVENTS_ADVERTISED = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "kv-events"}


@pytest.mark.parametrize(
    "advertised", [{**KV_EVENTS_ADVERTISED, "block_size": 32}, None, "absent"], ids=["advertised", "null", "absent"]
)
def test_decode_context_parallelism_registers_the_width_sglangs_events_come_at(advertised: Any) -> None:
    """--dcp-size 2 with page_size 16: SGLang pages its radix tree, and sends its events, 32 tokens
    wide (arg_groups/overrides.py kv_event_block_size_of). Until 2026-12-07 the shim registered 16,
    and the normaliser dropped every event as malformed. SGLang's max_total_num_tokens is in
    logical tokens already (ModelRunner.logical_max_total_num_tokens, widened by dcp_size): the
    capacity is that many tokens in blocks of 32, not dcp_size times it."""
    info = {**json.loads((FIX / "get_server_info.json").read_text()), "page_size": 16, "dcp_size": 2}
    if advertised != "absent":
        info["kv_events"] = advertised
    lim = limits_from_server_info(info)
    assert (lim.block_size, lim.kv_total_blocks) == (32, 401408 // 32)
    assert lim.block_size is not None
    norm = Normaliser(lim.block_size)
    tokens = list(range(100, 132))
    norm.apply([EngineStored(hashes=[-7], parent=None, token_ids=tokens, block_size=32)])
    assert norm.stats.malformed == 0 and norm.canonical_hashes() == set(block_hashes(tokens, 32))


def test_an_advertised_event_block_size_that_is_no_positive_integer_is_the_engines_protocol_error() -> None:
    info = {**json.loads((FIX / "get_server_info.json").read_text()), "kv_events": {"block_size": "32"}}
    with pytest.raises(EngineError, match=r"/server_info kv_events.block_size is '32', not a positive integer"):
        limits_from_server_info(info)


@pytest.mark.parametrize("field", ["page_size", "max_total_num_tokens"])
@pytest.mark.parametrize("value", ["16", -16, 0, 16.5, 16.0, True, None], ids=repr)
def test_a_limit_that_is_no_positive_integer_is_the_engines_protocol_error_naming_it(field: str, value: Any) -> None:
    """Until 2026-12-07 a page_size of True registered a block size of 1, 0 or -16 crashed the
    normaliser with a ValueError, and "16" or 16.0 (a max_total_num_tokens too) was read as not
    reported. None (absent) is an engine that does not say: the flags stand in."""
    info = {**json.loads((FIX / "get_server_info.json").read_text()), field: value}
    if value is None:
        lim = limits_from_server_info(info)
        assert lim.kv_total_blocks is None and (lim.block_size is None) == (field == "page_size")
        return
    with pytest.raises(EngineError) as caught:
        limits_from_server_info(info)
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert f"/server_info {field} is {value!r}, not a positive integer" in caught.value.message


@pytest.mark.parametrize("value", ["8192", 8192.0, True, [8192]], ids=repr)
def test_a_chunked_prefill_size_that_is_no_integer_is_the_engines_protocol_error_naming_it(value: Any) -> None:
    """Until 2026-12-07 a chunked_prefill_size of the wrong type was read as not reported, without a
    word: the engine's per-step prefill budget went unregistered."""
    info = {**json.loads((FIX / "get_server_info.json").read_text()), "chunked_prefill_size": value}
    with pytest.raises(EngineError) as caught:
        limits_from_server_info(info)
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert f"/server_info chunked_prefill_size is {value!r}, not an integer" in caught.value.message


@pytest.mark.parametrize(("value", "budget"), [(-1, None), (0, None), (None, None), (4096, 4096)])
def test_chunked_prefill_off_or_unreported_registers_no_budget(value: int | None, budget: int | None) -> None:
    """SGLang's scheduler reads a chunked_prefill_size <= 0 as chunked prefill off (-1 its flag's value)."""
    info = {**json.loads((FIX / "get_server_info.json").read_text()), "chunked_prefill_size": value}
    assert limits_from_server_info(info).max_num_batched_tokens == budget


def test_a_capacity_below_one_page_is_the_engines_protocol_error_naming_both() -> None:
    """Until 2026-12-07 a max_total_num_tokens below page_size registered 0 blocks: an engine with no
    room for one block, which can serve nothing."""
    info = {**json.loads((FIX / "get_server_info.json").read_text()), "page_size": 16, "max_total_num_tokens": 15}
    with pytest.raises(EngineError) as caught:
        limits_from_server_info(info)
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert "max_total_num_tokens is 15, below its page_size 16" in caught.value.message
    one = limits_from_server_info({**info, "max_total_num_tokens": 16})
    assert one.kv_total_blocks == 1


def test_kv_use_is_exact_so_a_long_decode_shows_progress() -> None:
    """SGLang's token_usage gauge is rounded to 0.01 (100,913 and 100,929 used tokens both read
    0.25): read from it, a lone decode 16 tokens on looked like no progress to the stall watchdog
    for minutes, and free blocks were off by up to 0.5% of the pool."""
    info = json.loads((FIX / "get_server_info.json").read_text())
    lim, total = limits_from_server_info(info), info["max_total_num_tokens"]
    text = (FIX / "metrics.txt").read_text()
    before = load_from_metrics(text, lim.kv_total_blocks, total)
    after = load_from_metrics(text.replace("} 100913.0", "} 100929.0"), lim.kv_total_blocks, total)
    assert before.kv_usage is not None and after.kv_usage is not None
    assert after.kv_usage - before.kv_usage == pytest.approx(16 / total)
    # Without the server's capacity, or with one sample per DP rank, SGLang's own rounded ratio.
    assert load_from_metrics(text, lim.kv_total_blocks).kv_usage == 0.25
    used = next(line for line in text.splitlines() if line.startswith("sglang:num_used_tokens"))
    ranks = text + used.replace('tp_rank="0"', 'tp_rank="0",dp_rank="1"') + "\n"  # a DP rank's: its dp_rank
    assert load_from_metrics(ranks, lim.kv_total_blocks, total).kv_usage == 0.25


def test_stream_folding_is_right_for_cumulative_and_incremental_output() -> None:
    for name in ("generate_stream_cumulative.sse", "generate_stream_incremental.sse"):
        folder = StreamFolder()
        pieces = []
        for line in (FIX / name).read_text().splitlines():
            if line.startswith("data: {"):
                pieces.append(folder.fold(msgspec.json.decode(line[6:])))
        assert pieces == [[11], [12], [13, 14]], name
        assert folder.finish_reason == "length" and folder.usage.completion_tokens == 4
        assert folder.usage.cached_tokens == 8


def test_bootstrap_triple_rides_on_both_legs() -> None:
    triple = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
    leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=9), prefill_only=True)
    pre = generate_body(leg, triple)
    assert pre["sampling_params"]["max_new_tokens"] == 1 and pre["stream"] is False
    dec = generate_body(LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=9), transfer=triple), triple)
    assert {k: dec[k] for k in triple} == triple and dec["stream"] is True and dec["rid"] == "r"


async def test_a_prefill_worker_tells_decode_engines_the_bootstrap_host_it_was_given(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The shim reaches its engine at 127.0.0.1; a decode engine on another host told that address
    # reached its own host instead (every remote prefill failed, with no word from the shim).
    leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=9), prefill_only=True)
    for config, host, warned in (
        (_sglang(role="prefill", bootstrap_host="10.0.0.7"), "10.0.0.7", False),
        (_sglang(role="prefill"), "127.0.0.1", True),
    ):
        adapter = SglangAdapter(config.validate())
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            adapter._say_loopback(8998)
            outcome = await adapter.generate(leg, _ignore)
        await adapter.close()
        assert outcome.transfer_params is not None and outcome.transfer_params["bootstrap_host"] == host
        assert any("give --bootstrap-host" in r.getMessage() for r in caplog.records) is warned


def _sglang(**settings: Any) -> ShimConfig:
    return ShimConfig(
        engine="sglang", model="m", engine_url="http://127.0.0.1:9", kv_events="tcp://127.0.0.1:9", **settings
    )


async def _ignore(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
    return None


def test_a_bootstrap_host_is_refused_for_engines_that_take_none() -> None:
    with pytest.raises(ConfigError, match=r"bootstrap_host.*only SGLang"):
        ShimConfig(engine="vllm", model="m", bootstrap_host="10.0.0.7").validate()
    with pytest.raises(ConfigError, match=r"bootstrap_host.*no port"):
        _sglang(bootstrap_host="10.0.0.7:8998").validate()


def _bigram_pages(raw: list[int], page: int, hashes: list[int]) -> list[list[Any]]:
    """One radix node's BlockStored events as SGLang with EAGLE writes them (mem_cache/
    kv_cache_event_mixin.py _record_store_event, mem_cache/events.py record_store): the key is a
    bigram view of len(raw) - 1 positions, and each page's token_ids are its (t_j, t_j+1) pairs."""
    positions = len(raw) - 1
    out: list[list[Any]] = []
    parent = None
    for n, start in enumerate(range(0, positions, page)):
        end = min(start + page, positions)
        tokens = [(raw[j], raw[j + 1]) for j in range(start, end)]
        out.append(["BlockStored", [hashes[n]], parent, tokens, len(tokens), None, "GPU"])
        parent = hashes[n]
    return out


def test_sglangs_bigram_pages_with_eagle_are_stored_as_their_own_tokens(caplog: pytest.LogCaptureFixture) -> None:
    """Every EAGLE page was dropped as malformed ("token ids must be integers"), its children read as
    unknown parents, and the rebuild's replay of the same bytes looped: an empty index, and a
    Cleared to every router four times a second."""
    raw = list(range(1000, 1013))  # 12 positions, 3 pages of 4, and the token after them
    batch = msgspec.msgpack.encode([1.0, _bigram_pages(raw, 4, [-41, -42, -43]), 0])
    assert msgspec.msgpack.decode(batch)[1][0][3][:2] == [[1000, 1001], [1001, 1002]]
    stats = NormaliserStats()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # a shim's successive normalisers share its stats: said once
            norm = Normaliser(4, stats=stats)
            norm.reset(exact=True)
            out = norm.apply(decode_payload(batch, "sglang"))
            assert [len(e.hashes) for e in out if isinstance(e, Stored)] == [1, 1, 1]
            assert norm.dump() == block_hashes(raw[:12], 4)
            assert not norm.needs_rebuild and stats.malformed == stats.unknown_parent == 0
    assert stats.bigram_stored == 6
    said = [r.getMessage() for r in caplog.records if "bigram" in r.getMessage()]
    assert len(said) == 1 and "EAGLE" in said[0] and "over-credit the last page" in said[0]


@pytest.mark.parametrize(
    "tokens",
    [[[1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6]], [[1, 2], 2, [3, 4], [4, 5]], [[1, 2], [2, "x"], [3, 4], [4, 5]]],
    ids=["triples", "mixed", "not-ints"],
)
def test_token_ids_that_are_not_all_int_pairs_stay_malformed(tokens: list[Any]) -> None:
    batch = msgspec.msgpack.encode([1.0, [["BlockStored", [-51], None, tokens, 4, None, "GPU"]], 0])
    norm = Normaliser(4)
    assert norm.apply(decode_payload(batch, "sglang")) == []
    assert norm.stats.malformed == 1 and norm.stats.bigram_stored == 0


@pytest.mark.parametrize("endpoint", [ENDPOINT_COMPLETIONS, ENDPOINT_CHAT])
@pytest.mark.parametrize("prefill_only", [False, True])
@pytest.mark.parametrize("name", ["extra_key", "lora_path"])
def test_sglang_refuses_a_clients_extra_key_or_lora_path(endpoint: str, prefill_only: bool, name: str) -> None:
    """SGLang caches an extra_key's prompts apart from all others' and its KV events do not name
    it: the shim indexed them as plain prompts, and routers credited plain requests with them. A
    lora_path is one too (SGLang appends the adapter to the request's extra_key): 0.5.23's events
    name the adapter (lora_name), but routers salt by the adapter `model` names, not lora_path."""
    params = {"prompt": [5, 6, 7]} if endpoint == ENDPOINT_COMPLETIONS else {"messages": []}
    leg = LegRequest("r", "m", [5, 6, 7], SamplingParams(), endpoint=endpoint, prefill_only=prefill_only, params=params)
    assert name not in openai_body(leg, None)
    refused = replace(leg, params={**params, name: "tenant-a"})
    with pytest.raises(EngineError) as caught:
        openai_body(refused, None)
    err = caught.value
    assert err.code == 400 and err.kind == "bad_request"
    assert err.message.startswith(f"{name}: SGLang keeps a separate prefix cache per {name}")
    why = "its KV events do not name it" if name == "extra_key" else "routers salt a prompt by the adapter its `model`"
    assert why in err.message


TOO_LONG = "The input (9000 tokens) is longer than the model's context length (8192 tokens)."


@pytest.fixture
async def generate_url() -> AsyncIterator[str]:
    """SGLang's /generate refusing a request (http_server.py generate_request): a ValueError is a
    400 {"error": {"message"}}, or with stream=true that object as the only event, then [DONE]."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body["stream"]:
            return web.json_response({"error": {"message": TOO_LONG}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({"error": {"message": TOO_LONG}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    async with served(app) as url:
        yield url


@pytest.mark.parametrize("stream", [True, False])
async def test_a_prompt_sglang_refuses_is_the_clients_400_with_its_message(generate_url: str, stream: bool) -> None:
    """Streamed, the refusal was a 500 engine_error; not streamed, a 400 whose message was the raw
    JSON and whose body (the engine's own refusal, for the client) was lost."""
    config = ShimConfig(engine="sglang", model="m", engine_url=generate_url, kv_events="tcp://127.0.0.1:9")
    adapter = SglangAdapter(config.validate())
    await adapter.open()
    leg = LegRequest("r", "m", list(range(9000)), SamplingParams(max_tokens=8), stream=stream)
    try:
        with pytest.raises(EngineError) as caught:
            await adapter.generate(leg, _ignore)
    finally:
        await adapter.close()
    err = caught.value
    assert (err.code, err.kind, err.message) == (400, "engine_rejected", TOO_LONG)
    assert msgspec.json.decode(err.body) == {"error": {"message": TOO_LONG}}


def test_an_error_after_tokens_were_sent_is_still_the_engines() -> None:
    folder = StreamFolder()
    folder.fold({"output_ids": [11], "meta_info": {"completion_tokens": 1}})
    with pytest.raises(EngineError) as caught:
        folder.fold({"error": {"message": "boom"}})
    assert (caught.value.code, caught.value.kind, caught.value.message) == (500, "engine_error", "boom")


def test_a_completion_count_that_goes_back_sends_no_token_twice() -> None:
    """3 after 3 then 2: until 2026-12-07 the folder took 2 as its count, and the next event's
    [1, 2, 3, 4] gave [3, 4] as new, token 3 sent twice."""
    folder = StreamFolder()
    assert folder.fold({"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}}) == [1, 2, 3]
    assert folder.fold({"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}}) == []
    with pytest.raises(EngineError) as caught:
        folder.fold({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2}})
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert "meta_info.completion_tokens went back from 3 to 2" in caught.value.message
    assert folder.token_ids == [1, 2, 3] and folder.usage.completion_tokens == 3


def test_output_ids_that_go_back_with_no_count_send_no_token_twice() -> None:
    """len(output_ids) stands in for a missing count: [1] after 3 tokens set the folder's count to 1
    until 2026-12-07, and the next [1, 2, 3, 4] sent [2, 3, 4], tokens 2 and 3 twice."""
    folder = StreamFolder()
    assert folder.fold({"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}}) == [1, 2, 3]
    with pytest.raises(EngineError) as caught:
        folder.fold({"output_ids": [1]})
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert "no meta_info.completion_tokens has 1 output_ids, fewer than the 3 tokens" in caught.value.message
    assert folder.token_ids == [1, 2, 3] and folder.usage.completion_tokens == 3


def test_a_completion_count_past_the_ids_sent_loses_no_token_silently() -> None:
    """2 then 5 with one new id: until 2026-12-08 the folder sent [13] and billed 5 tokens, the
    two it never had lost with no word."""
    folder = StreamFolder()
    assert folder.fold({"output_ids": [11, 12], "meta_info": {"completion_tokens": 2}}) == [11, 12]
    with pytest.raises(EngineError) as caught:
        folder.fold({"output_ids": [13], "meta_info": {"completion_tokens": 5, "finish_reason": {"type": "length"}}})
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert "completion_tokens rose from 2 to 5, but it has only 1 output_ids" in caught.value.message
    assert folder.token_ids == [11, 12] and folder.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("ids", "count", "said"),
    [
        ([11, 12, 13], 4, "rose from 2 to 4, but it has 3 output_ids, neither all 4 nor the 2 new"),
        ([13, 14, 15], 4, "rose from 2 to 4, but it has 3 output_ids"),
        ([12], 2, "stayed at 2, but it has 1 output_ids, neither all 2 nor the 0 new"),
    ],
    ids=["cumulative-short", "incremental-long", "same-count"],
)
def test_a_completion_count_that_matches_neither_stream_mode_sends_no_token_twice(
    ids: list[int], count: int, said: str
) -> None:
    """After [11, 12] (2), [11, 12, 13] billed 4: until 2026-12-08 the folder sent [12, 13], token 12
    twice, and billed 4. SGLang sends len(ids) == count (cumulative) or count - sent (incremental)."""
    folder = StreamFolder()
    assert folder.fold({"output_ids": [11, 12], "meta_info": {"completion_tokens": 2}}) == [11, 12]
    with pytest.raises(EngineError) as caught:
        folder.fold({"output_ids": ids, "meta_info": {"completion_tokens": count}})
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert said in caught.value.message
    assert folder.token_ids == [11, 12] and folder.usage.completion_tokens == 2


@pytest.mark.parametrize("later", [[11, 12, 13, 14], [13, 14]], ids=["cumulative", "incremental"])
def test_a_completion_count_that_matches_its_ids_folds_them(later: list[int]) -> None:
    folder = StreamFolder()
    assert folder.fold({"output_ids": [11, 12], "meta_info": {"completion_tokens": 2}}) == [11, 12]
    assert folder.fold({"output_ids": later, "meta_info": {"completion_tokens": 4}}) == [13, 14]
    assert folder.token_ids == [11, 12, 13, 14] and folder.usage.completion_tokens == 4


# SGLang's TokenizerManager._handle_abort_req, for any request aborted in the waiting queue.
ABORT_BEFORE_PREFILL = {
    "text": "",
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "abort", "message": "Abort before prefill"},
        "prompt_tokens": 0,
        "completion_tokens": 0,
    },
}


@pytest.mark.parametrize("count", [0, None], ids=["zero", "missing"])
def test_an_abort_with_no_count_after_tokens_keeps_the_folded_count(count: int | None) -> None:
    """A request retracted to the waiting queue after it streamed, then aborted there, ends with
    "Abort before prefill" and counts of 0: until 2026-12-07 a 502 "went back from 3 to 0"."""
    abort = json.loads(json.dumps(ABORT_BEFORE_PREFILL))
    if count is None:
        del abort["meta_info"]["completion_tokens"]
    folder = StreamFolder()
    meta = {"completion_tokens": 3, "prompt_tokens": 5, "cached_tokens": 2}
    assert folder.fold({"output_ids": [1, 2, 3], "meta_info": meta}) == [1, 2, 3]
    assert folder.fold(abort) == []
    assert (folder.finish_reason, folder.token_ids) == ("abort", [1, 2, 3])
    assert folder.usage == Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)


def test_an_abort_whose_count_goes_back_is_still_the_engines_protocol_error() -> None:
    folder = StreamFolder()
    folder.fold({"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}})
    with pytest.raises(EngineError, match="completion_tokens went back from 3 to 2"):
        folder.fold({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "abort"}}})


async def test_a_streamed_leg_aborted_after_tokens_ends_with_abort_and_its_tokens(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]],
) -> None:
    url, answers, _ = streams
    abort = b"data: " + json.dumps(ABORT_BEFORE_PREFILL).encode() + b"\n\n"
    answers.append([_event([11, 12], None), abort, b"data: [DONE]\n\n"])
    adapter = SglangAdapter(ShimConfig(engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9"))
    await adapter.open()
    try:
        outcome = await adapter.generate(LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=8)), _ignore)
    finally:
        await adapter.close()
    assert (outcome.finish_reason, outcome.token_ids) == ("abort", [11, 12])
    assert (outcome.usage.prompt_tokens, outcome.usage.completion_tokens) == (3, 2)


# SGLang 0.5.23's FINISH_ABORT.to_json (managers/schedule_batch.py): set_finish_with_abort's for a
# prompt past max_req_input_len (managers/utils.py validate_input_length, 400 by default), a P/D
# decode server's failed KV transfer (disaggregation/decode.py, 500) and a request retracted
# without a KV backup (schedule_batch.py retract_decode, 503). Streamed, tokenizer_manager's
# _handle_abort_finish_reason yields it as an ordinary event, then [DONE].
INPUT_TOO_LONG = (
    "Input length (9000 tokens) exceeds the maximum allowed length (8191 tokens). "
    "Use a shorter input or enable --allow-auto-truncate."
)


def _abort_event(ids: list[int], message: str, status: int | None, err_type: str | None) -> bytes:
    finish = {"type": "abort", "message": message, "status_code": status, "err_type": err_type}
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids)}
    return b"data: " + json.dumps({"text": "", "output_ids": ids, "meta_info": meta}).encode() + b"\n\n"


async def test_a_streamed_refusal_is_the_400_its_unstreamed_answer_is(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]],
) -> None:
    """Until 2026-12-07 the abort finish was folded as a plain `abort`: the client got an empty
    completion for SGLang's 400."""
    url, answers, _ = streams
    answers.append([_abort_event([], INPUT_TOO_LONG, 400, "BadRequestError"), b"data: [DONE]\n\n"])
    err, seen = await _failing_generate(url, stream=True)
    assert (err.code, err.kind, err.message) == (400, "engine_rejected", INPUT_TOO_LONG)
    assert msgspec.json.decode(err.body) == {"error": {"message": INPUT_TOO_LONG}}  # SGLang's unstreamed body
    assert seen == []


@pytest.mark.parametrize(
    ("before", "message", "status"),
    [
        # disaggregation/decode.py's f"{decode_req.req.rid=}": the expression's text names each value.
        ([], "Decode transfer failed for request rank=0 decode_req.req.rid='r' decode_req.req.bootstrap_room=7", 500),
        ([11, 12], "Retracted under decode memory pressure without a KV backup. Retry later.", 503),
    ],
    ids=["transfer-500-before-tokens", "retracted-503-after-tokens"],
)
async def test_a_streamed_abort_with_an_engine_status_is_the_engines_error(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]], before: list[int], message: str, status: int
) -> None:
    """An engine's failure, before or after tokens (those sent first): until 2026-12-07 a plain
    `abort`, so the router never saw a failed KV transfer or an engine's 5xx as a fault."""
    url, answers, _ = streams
    events = [_event(before, None)] if before else []
    # SGLang's FINISH_ABORT for both carries no err_type (prepare_abort, retract_decode).
    answers.append([*events, _abort_event(before, message, status, None), b"data: [DONE]\n\n"])
    err, seen = await _failing_generate(url, stream=True)
    assert (err.code, err.kind, err.message, err.body) == (status, "engine_error", message, b"")
    assert seen == ([before] if before else [])


async def test_an_abort_with_no_status_still_ends_with_abort(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]],
) -> None:
    """A client's abort (/abort_request, FINISH_ABORT() with status_code None) is no failure."""
    url, answers, _ = streams
    answers.append([_event([11, 12], None), _abort_event([11, 12], "Aborted", None, None), b"data: [DONE]\n\n"])
    adapter = SglangAdapter(ShimConfig(engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9"))
    await adapter.open()
    try:
        outcome = await adapter.generate(LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=8)), _ignore)
    finally:
        await adapter.close()
    assert (outcome.finish_reason, outcome.token_ids) == ("abort", [11, 12])


def _event(ids: list[int], finish: str | None) -> bytes:
    meta = {"completion_tokens": len(ids), "prompt_tokens": 3, "finish_reason": finish and {"type": finish}}
    return b"data: " + json.dumps({"output_ids": ids, "meta_info": meta}).encode() + b"\n\n"


@pytest.fixture
async def streams() -> AsyncIterator[tuple[str, list[list[bytes]], list[dict[str, Any]]]]:
    """A /generate that streams the next of `answers` (its writes, then a clean EOF) and keeps each
    request's body. Unstreamed, it answers the next of `answers` as its body, or one token."""
    answers: list[list[bytes]] = []
    bodies: list[dict[str, Any]] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if not body["stream"]:
            if answers:
                return web.Response(body=b"".join(answers.pop(0)), content_type="application/json")
            return web.json_response({"output_ids": [7], "meta_info": {"completion_tokens": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for data in answers.pop(0):
            await resp.write(data)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    async with served(app) as url:
        yield url, answers, bodies


async def test_a_generate_stream_cut_before_done_is_no_answer(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]],
) -> None:
    """SGLang's /generate ends every stream with [DONE] (http_server.generate_request, after an
    error event too). Before, a stream cut after 2 of the 8 tokens asked, no finish_reason, passed
    as a whole answer."""
    url, answers, _ = streams
    adapter = SglangAdapter(ShimConfig(engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9"))
    await adapter.open()
    leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=8), stream=True)
    try:
        answers.append([_event([11, 12], None)])
        with pytest.raises(EngineError) as caught:
            await adapter.generate(leg, _ignore)
        assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
        assert "without [DONE]" in caught.value.message
        answers.append([_event([11, 12], "length"), b"data: [DONE]\n\n"])  # a whole one still is
        outcome = await adapter.generate(leg, _ignore)
        assert (outcome.finish_reason, outcome.token_ids) == ("length", [11, 12])
    finally:
        await adapter.close()


def _cumulative_event(n: int, finish: str | None) -> bytes:
    """An event of SGLang's default /generate stream (no --incremental-streaming-output): the text
    and output_ids of the whole leg so far."""
    meta = {"completion_tokens": n, "prompt_tokens": 3, "finish_reason": finish and {"type": finish}}
    data = {"text": "word " * n, "output_ids": [100000 + i for i in range(n)], "meta_info": meta}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def test_a_long_cumulative_generate_stream_is_read_whole(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]],
) -> None:
    """A 50k-token leg's last events are over 600 KB each: read by aiohttp's readline (512 KiB at most)
    until 2026-12-08, its LineTooLong was the shim's own 500 `internal`, with a traceback."""
    url, answers, _ = streams
    n = 50_000
    last = _cumulative_event(n, "length")
    assert len(last) > 512 << 10  # aiohttp's readline bound: 2 x its 256 KiB read limit
    answers.append([_cumulative_event(n - 1, None), last, b"data: [DONE]\n\n"])
    adapter = SglangAdapter(ShimConfig(engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9"))
    await adapter.open()
    seen: list[list[int]] = []

    async def on_output(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
        seen.append(token_ids)

    try:
        leg = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=n), stream=True)
        outcome = await adapter.generate(leg, on_output)
    finally:
        await adapter.close()
    ids = [100000 + i for i in range(n)]
    assert (outcome.finish_reason, outcome.token_ids, outcome.usage.completion_tokens) == ("length", ids, n)
    assert seen == [ids[:-1], ids[-1:]]


async def test_a_generate_line_past_the_line_bound_is_the_engines_protocol_error(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """/generate is read with the OpenAI path's bound on a line (openai_http.MAX_LINE_BYTES): one
    that never ends is the engine's fault, not buffered without end."""
    monkeypatch.setattr(openai_http, "MAX_LINE_BYTES", 1 << 20)
    url, answers, _ = streams
    answers.append([_event([11], None), b"data: " + b"x" * (1 << 20), b"x" * (1 << 20)])
    err, seen = await _failing_generate(url, stream=True)
    assert (err.code, err.kind) == (502, "engine_protocol") and "without a newline" in err.message
    assert seen == [[11]]


@pytest.mark.parametrize(
    "bad",
    [b"[1, 2]", b"null", b'"oops"', b'{"output_ids": [12], "meta_info": [1]}'],
    ids=["array", "null", "string", "meta_info-array"],
)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
async def test_a_generate_event_that_is_no_json_object_is_the_engines_protocol_error(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]], bad: bytes, stream: bool
) -> None:
    """Until 2026-12-07 the folder called .get on it: an AttributeError or TypeError, answered as the
    shim's own 500 `internal` with a traceback per request, so the router never judged the engine
    faulty. Streamed, the tokens before it are sent first, as for any error mid-stream."""
    url, answers, _ = streams
    if stream:
        answers.append([_event([11], None), b"data: " + bad + b"\n\n", _event([11, 12], "length")])
        answers[-1].append(b"data: [DONE]\n\n")
    else:
        answers.append([bad])
    err, seen = await _failing_generate(url, stream)
    assert (err.code, err.kind) == (502, "engine_protocol") and "not a JSON object" in err.message
    assert seen == ([[11]] if stream else [])


async def _failing_generate(url: str, stream: bool) -> tuple[EngineError, list[list[int]]]:
    """The EngineError an SGLang adapter's leg on `url` ends with, and the token ids it sent first."""
    adapter = SglangAdapter(ShimConfig(engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9"))
    await adapter.open()
    seen: list[list[int]] = []

    async def on_output(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
        seen.append(token_ids)

    try:
        with pytest.raises(EngineError) as caught:
            await adapter.generate(
                LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=8), stream=stream), on_output
            )
    finally:
        await adapter.close()
    return caught.value, seen


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"output_ids": [11, 12], "meta_info": {"completion_tokens": "x"}}, "completion_tokens is 'x'"),
        ({"output_ids": 5, "meta_info": {"completion_tokens": 2}}, "output_ids is 5"),
        ({"output_ids": [11, "b"], "meta_info": {"completion_tokens": 2}}, "output_ids hold ['b']"),
        ({"output_ids": [11, 12], "meta_info": {"completion_tokens": 2, "cached_tokens": "x"}}, "cached_tokens is"),
        ({"output_ids": [11, 12], "meta_info": {"completion_tokens": 2, "prompt_tokens": "x"}}, "prompt_tokens is"),
        ({"output_ids": [11, 12], "meta_info": {"completion_tokens": -2}}, "completion_tokens is -2, not a count"),
        ({"output_ids": [], "meta_info": {"completion_tokens": 0}}, "completion_tokens went back from 1 to 0"),
        (
            {"output_ids": [11, 12], "meta_info": {"completion_tokens": 2, "prompt_tokens": -3}},
            "/generate meta_info.prompt_tokens is -3, not a count",
        ),
        (
            {"output_ids": [11, 12], "meta_info": {"completion_tokens": 2, "cached_tokens": -1}},
            "/generate meta_info.cached_tokens is -1, not a count",
        ),
    ],
    ids=[
        "completion_tokens",
        "output_ids",
        "output_id",
        "cached_tokens",
        "prompt_tokens",
        "negative",
        "backwards",
        "negative-prompt",
        "negative-cached",
    ],
)
async def test_a_generate_event_with_a_badly_typed_field_is_the_engines_protocol_error_naming_it(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]], bad: dict[str, Any], field: str
) -> None:
    """Until 2026-12-07 int() or len() raised ValueError or TypeError, answered as the shim's own
    500 `internal` with a traceback, and a string among the ids went on as a token id; a negative
    completion_tokens, or one below the count already folded, set the folder's count back, and the
    next event's ids were sent again as new tokens; a negative prompt_tokens or cached_tokens went on
    in the leg's usage. The event's tokens are not sent."""
    url, answers, _ = streams
    event = b"data: " + json.dumps(bad).encode() + b"\n\n"
    answers.append([_event([11], None), event, _event([11, 12], "length"), b"data: [DONE]\n\n"])
    err, seen = await _failing_generate(url, stream=True)
    assert (err.code, err.kind) == (502, "engine_protocol") and field in err.message
    assert seen == [[11]]


@pytest.mark.parametrize("port", ["x", 70000])
async def test_a_bootstrap_port_that_is_no_port_is_the_engines_protocol_error(port: object) -> None:
    """int() raised ValueError on "x" (no field named) and 70000 went to decode engines as given."""
    info = {**json.loads((FIX / "get_server_info.json").read_text()), "disaggregation_bootstrap_port": port}

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(info)

    app = web.Application()
    app.router.add_get("/get_server_info", server_info)
    async with served(app) as url:
        adapter = SglangAdapter(ShimConfig(engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9"))
        await adapter.open()
        try:
            with pytest.raises(EngineError) as caught:
                await adapter.limits()
        finally:
            await adapter.close()
    assert (caught.value.code, caught.value.kind) == (502, "engine_protocol")
    assert f"disaggregation_bootstrap_port is {port!r}" in caught.value.message


@pytest.mark.parametrize(("role", "bootstrap"), [("agg", None), ("prefill", "2.2.2.2"), ("decode", "2.2.2.2")])
async def test_the_alive_request_on_a_pd_worker_goes_as_sglangs_own_health_generation(
    streams: tuple[str, list[list[bytes]], list[dict[str, Any]]], role: ShimRole, bootstrap: str | None
) -> None:
    """On a prefill or decode server a request without a bootstrap host cannot be served (a decode
    waits for a peer that never comes): the shim's one-token request after a hang goes with
    SGLang's fake bootstrap host (disaggregation/utils.py FAKE_BOOTSTRAP_HOST), as its /health's
    own generation does, which moves no KV."""
    url, _, bodies = streams
    config = ShimConfig(engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9", role=role)
    adapter = SglangAdapter(config.validate())
    await adapter.open()
    try:
        transfer = adapter.alive_transfer()
        leg = LegRequest("alive", "m", [1], SamplingParams(max_tokens=1), stream=False, transfer=transfer)
        await adapter.generate(leg, _ignore)
    finally:
        await adapter.close()
    assert bodies[-1].get("bootstrap_host") == bootstrap
    if bootstrap is not None:
        assert bodies[-1]["bootstrap_room"] == 0


_DECODE = 'engine_type="decode",model_name="m",tp_rank="0"'
_PREFILL = 'engine_type="prefill",model_name="m",tp_rank="0"'


@pytest.mark.parametrize(
    ("series", "waiting"),
    [
        (
            {"num_queue_reqs": 1, "num_decode_prealloc_queue_reqs": 40, "num_decode_transfer_queue_reqs": 12},
            53,
        ),
        ({"num_queue_reqs": 0, "num_prefill_prealloc_queue_reqs": 30, "num_prefill_inflight_queue_reqs": 8}, 38),
        ({"num_queue_reqs": 2, "num_prefill_bootstrap_queue_reqs": 30}, 32),  # its later name
    ],
    ids=["decode", "prefill", "prefill-bootstrap"],
)
def test_sglangs_pd_queues_count_as_waiting(series: dict[str, int], waiting: int) -> None:
    """A P/D server's requests waiting for their peer or their KV are in none of num_queue_reqs and
    num_running_reqs (metrics/collector.py): until 2026-12-07 a prefill server holding 30 requests
    in its bootstrap queue and 8 sending KV read as idle."""
    labels = _DECODE if "num_decode_prealloc_queue_reqs" in series else _PREFILL
    lines = [f"sglang:num_running_reqs{{{labels}}} 0.0"]
    lines += [f"sglang:{name}{{{labels}}} {value}.0" for name, value in series.items()]
    got = load_from_metrics("\n".join(lines) + "\n", 25088, 401408)
    assert (got.running, got.waiting) == (0, waiting)


def _prefill_adapter(url: str) -> SglangAdapter:
    config = ShimConfig(
        engine="sglang", model="m", engine_url=url, kv_events="tcp://127.0.0.1:9", role="prefill", bootstrap_host="h"
    )
    return SglangAdapter(config.validate())


def _prefill_leg(rid: str, tokens: int = 100) -> LegRequest:
    return LegRequest(rid, "m", list(range(tokens)), SamplingParams(max_tokens=8), prefill_only=True)


async def test_a_prefill_legs_engine_outcome_comes_after_its_triple() -> None:
    """Until 2026-12-07 the engine's answer to a prefill leg was only logged: its refusal (r2, a
    prompt past the context) reached no one."""
    engine = FakeSglang()
    async with engine.serving() as url:
        adapter = _prefill_adapter(url)
        await adapter.open()
        try:
            served = await adapter.generate(_prefill_leg("r1"), _ignore)
            refused = await adapter.generate(_prefill_leg("r2", 9000), _ignore)
            assert served.transfer_params is not None and served.engine_done is not None
            assert refused.engine_done is not None
            with pytest.raises(EngineError) as caught:
                await refused.engine_done
            assert (caught.value.code, caught.value.message) == (400, TOO_LONG_FOR_CONTEXT)
            await wait_for(lambda: "r1" in engine.held, 5, what="the engine to hold r1")
            assert not served.engine_done.done()  # it waits for its decode peer
            engine.answer("r1")
            done = await served.engine_done
            assert (done.finish_reason, done.usage.prompt_tokens, done.transfer_params) == (
                "length",
                100,
                served.transfer_params,
            )
        finally:
            await adapter.close()


async def test_close_aborts_the_prefills_in_flight_before_closing_its_session() -> None:
    """Until 2026-12-07 close() cancelled them and closed the session at once: each one's abort then
    failed with RuntimeError('adapter not open'), "Task exception was never retrieved", and the
    engine kept the requests."""
    engine = FakeSglang()
    async with engine.serving() as url:
        adapter = _prefill_adapter(url)
        await adapter.open()
        legs = [await adapter.generate(_prefill_leg(f"r{i}"), _ignore) for i in range(3)]
        await wait_for(lambda: len(engine.held) == 3, 5, what="the engine to hold all three")
        await adapter.close()
        assert sorted(engine.aborted) == ["r0", "r1", "r2"]
        assert all(leg.engine_done is not None and leg.engine_done.cancelled() for leg in legs)
