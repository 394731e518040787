"""The vLLM adapter on the real vLLM 0.32 captures: events to EngineEvents to canonical hashes, in both
event forms, plus its metrics and request bodies (the wire format itself: tests/protocol/test_vllm_events.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from protocol import ConfigError, Removed, SamplingParams, Stored
from protocol.hashing import block_hashes, chain_salt
from protocol.vllm_events import END_SEQ, decode_pub_frames, decode_replay_reply
from tests.protocol.vllm_captures import CAPTURES, FIXTURES, expected_set, pub_frames
from worker_shim import EngineCleared, EngineRemoved, EngineStored, Normaliser
from worker_shim.adapters.base import LegRequest
from worker_shim.adapters.vllm import check_rank, completion_body, limits_from_metrics, load_from_metrics
from worker_shim.adapters.vllm_events import decode_payload, decode_ranked
from worker_shim.engine_events import EventDecodeError


@pytest.mark.parametrize("capture", list(CAPTURES))
def test_every_captured_vllm_032_frame_decodes_and_normalises(capture: str) -> None:
    bs = CAPTURES[capture]
    frames = pub_frames(capture, extra=capture == "bs16_patched")
    n = Normaliser(bs)
    seqs = []
    for f in frames:
        topic, seq, payload = decode_pub_frames(f)
        assert topic == b"kv-events"
        seqs.append(seq)
        n.apply(decode_payload(payload))
    assert seqs == list(range(len(seqs)))
    assert n.stats.malformed == n.stats.unknown_parent == n.stats.unknown_removed == 0
    assert n.canonical_hashes() == expected_set(frames, bs) != set()


def test_the_captured_duplicate_store_and_remove_of_one_hash_emit_once() -> None:
    frames = pub_frames("bs16_patched", extra=True)
    n = Normaliser(16)
    held: dict[int, int] = {}  # engine references, to find the moments a hash is held twice
    subscriber: set[int] = set()
    doubled = 0
    for f in frames:
        for ev in decode_payload(f[2]):
            for out in n.apply([ev]):
                if isinstance(out, Stored):
                    assert not subscriber & set(out.hashes), "Stored for a hash already held"
                    subscriber.update(out.hashes)
                elif isinstance(out, Removed):
                    assert set(out.hashes) <= subscriber, "Removed for a hash not held"
                    subscriber.difference_update(out.hashes)
                else:
                    subscriber.clear()
            if isinstance(ev, EngineStored):
                for h in ev.hashes:
                    held[h] = held.get(h, 0) + 1
                    doubled += held[h] == 2
            elif isinstance(ev, EngineRemoved):
                for h in ev.hashes:
                    held[h] -= 1
            else:
                held.clear()
    assert doubled >= 1, "the capture stores one hash twice while it is held"
    assert subscriber == n.canonical_hashes() == expected_set(frames, 16)


def _as_array_form(payload: bytes, bytes_hashes: bool) -> bytes:
    ts, events, _rank = msgspec.msgpack.decode(payload)

    def h(x: int | None) -> object:
        return x.to_bytes(8, "big") if bytes_hashes and x is not None else x

    arr = []
    for e in events:
        if e["type"] == "BlockStored":
            arr.append(
                [
                    "BlockStored",
                    [h(x) for x in e["block_hashes"]],
                    h(e["parent_block_hash"]),
                    e["token_ids"],
                    e["block_size"],
                    e["lora_id"],
                    e["medium"],
                ]
            )
        elif e["type"] == "BlockRemoved":
            arr.append(["BlockRemoved", [h(x) for x in e["block_hashes"]], e["medium"]])
        else:
            arr.append(["AllBlocksCleared"])
    return msgspec.msgpack.encode([ts, arr])


@pytest.mark.parametrize("bytes_hashes", [False, True])
def test_the_older_array_form_and_bytes_hashes_give_the_same_canonical_set(bytes_hashes: bool) -> None:
    frames = pub_frames("bs32")
    n_map, n_arr = Normaliser(32), Normaliser(32)
    for f in frames:
        n_map.apply(decode_payload(f[2]))
        n_arr.apply(decode_payload(_as_array_form(f[2], bytes_hashes)))
    assert n_arr.canonical_hashes() == n_map.canonical_hashes() != set()


def test_unknown_fields_and_event_types_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "new_field": 3}, {"type": "Future"}], 0]
    )
    assert decode_payload(payload) == [EngineRemoved(hashes=[1], medium="GPU")]
    assert decode_payload(msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])) == [EngineCleared()]


def test_a_malformed_payload_raises_a_decode_error_naming_the_engine() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])
    with pytest.raises(EventDecodeError, match="malformed sglang KV event: BlockStored needs") as info:
        decode_payload(payload, "sglang")
    assert info.value.engine == "sglang"


@pytest.mark.parametrize(
    ("lora", "salt"), [({}, ""), ({"lora_id": 3}, "3"), ({"lora_id": 3, "lora_name": "sql-adapter"}, "sql-adapter")]
)
def test_a_stored_chain_is_salted_by_its_lora_adapter(lora: dict[str, object], salt: str) -> None:
    stored = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1] * 16}
    payload = msgspec.msgpack.encode([1.0, [{**stored, "block_size": 16, **lora}]])
    expected = EngineStored(hashes=[5], parent=None, token_ids=[1] * 16, block_size=16, salt=salt)
    assert decode_payload(payload) == [expected]


@pytest.mark.parametrize(
    ("fields", "salt"),
    [
        ({"extra_keys": [["tenant-1"], None]}, "\x00tenant-1"),
        (
            {"extra_keys": [["sql-adapter", "tenant-1"], ["sql-adapter"]], "lora_name": "sql-adapter"},
            "sql-adapter\x00tenant-1",
        ),
        ({"extra_keys": [["sql-adapter"], ["sql-adapter"]], "lora_name": "sql-adapter"}, "sql-adapter"),
        ({"extra_keys": [None, None]}, ""),
        ({"extra_keys": [["tenant-1"], None], "parent_block_hash": 9}, ""),  # a chain's later blocks: no root to salt
    ],
)
def test_a_stored_chain_is_salted_by_its_requests_cache_salt(fields: dict[str, object], salt: str) -> None:
    """vLLM puts a request's cache_salt in its first block's extra keys, after the adapter's name."""
    stored = {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None, "token_ids": [1] * 32}
    payload = msgspec.msgpack.encode([1.0, [{**stored, "block_size": 16, **fields}]])
    (event,) = decode_payload(payload)
    assert isinstance(event, EngineStored) and event.salt == salt


def test_the_array_forms_later_positions_carry_the_adapter_and_cache_salt() -> None:
    """Positions after `medium` follow the maps' field order (vLLM's; SGLang's longer layout keeps
    it): extra_keys at position 8 salted nothing while the decoder stopped at lora_name."""
    event = ["BlockStored", [5, 6], None, [1] * 32, 16, 3, "GPU", "sql-adapter", [["sql-adapter", "tenant-1"], None]]
    (stored,) = decode_payload(msgspec.msgpack.encode([1.0, [event]]))
    assert isinstance(stored, EngineStored) and stored.salt == chain_salt("sql-adapter", "tenant-1")


@pytest.mark.parametrize("capture", list(CAPTURES))
def test_a_malformed_event_leaves_the_rest_of_its_batch(capture: str) -> None:
    """One event the decoder cannot read voided its whole batch: the captured batches with a bad
    event spliced in still give every captured event, and the bad one's error."""
    for f in pub_frames(capture):
        ts, events, rank = msgspec.msgpack.decode(f[2])
        spliced = [*events[:1], {"type": "BlockStored", "block_hashes": [1]}, *events[1:]]
        got, got_rank, errors = decode_ranked(msgspec.msgpack.encode([ts, spliced, rank]), "vllm")
        assert (got, got_rank) == (decode_payload(f[2]), rank)
        assert [e.detail for e in errors] == ["BlockStored needs block_hashes, token_ids and block_size"]
        with pytest.raises(EventDecodeError):  # the strict form still refuses the batch
            decode_payload(msgspec.msgpack.encode([ts, spliced, rank]))


def _normalised_replay(fixture: str) -> set[int]:
    """The canonical hashes a shim holds after a captured replay (the request line first)."""
    norm = Normaliser(32)
    for line in (FIXTURES / "bs32" / fixture).read_text().splitlines()[1:]:
        _, seq, payload = decode_replay_reply([bytes.fromhex(h) for h in json.loads(line)["frames_hex"]])
        if seq != END_SEQ:
            norm.apply(decode_payload(payload))
    return norm.canonical_hashes()


def test_vllms_own_salted_chains_normalise_to_the_salted_canonical_hashes() -> None:
    """Captured from vLLM 0.32 (tests/vllm/capture_cache_salt.py): one prompt served with salt
    tenant-1, none, tenant-1 again (a hit: nothing stored) and tenant-2."""
    prompt = list(range(100, 165))
    expected = {
        *block_hashes(prompt, 32, salt=chain_salt(cache_salt="tenant-1")),
        *block_hashes(prompt, 32),
        *block_hashes(prompt, 32, salt=chain_salt(cache_salt="tenant-2")),
    }
    assert _normalised_replay("cache_salt_replay_from_0.jsonl") == expected and len(expected) == 6


def test_vllms_own_lora_chains_normalise_to_chains_salted_by_the_adapters_name() -> None:
    """Captured from vLLM 0.32 (tests/vllm/capture_lora.py): one prompt served as adapter tiny-lora,
    as the model, as tiny-lora again (a hit), as tiny-lora with cache_salt tenant-1, and as
    tiny-lora-2, loaded at run time (lora_id 3: the ids are not dense, only the names name them)."""
    prompt = list(range(100, 165))
    expected = {
        *block_hashes(prompt, 32, salt=chain_salt("tiny-lora")),
        *block_hashes(prompt, 32),
        *block_hashes(prompt, 32, salt=chain_salt("tiny-lora", "tenant-1")),
        *block_hashes(prompt, 32, salt=chain_salt("tiny-lora-2")),
    }
    assert _normalised_replay("lora_replay_from_0.jsonl") == expected and len(expected) == 8


def test_one_data_parallel_ranks_events_are_its_own_requests() -> None:
    """Captured from vLLM 0.32 with two ranks (tests/vllm/capture_dp.py): completions named rank 1,
    0 and 1 with X-data-parallel-rank; rank 1's replay socket (its port offset by 1) holds exactly
    the two of rank 1, each batch naming rank 1."""
    lines = (FIXTURES / "bs32" / "dp2_rank1_replay_from_0.jsonl").read_text().splitlines()[1:]
    ranks = set()
    for line in lines:
        _, seq, payload = decode_replay_reply([bytes.fromhex(h) for h in json.loads(line)["frames_hex"]])
        if seq != END_SEQ:
            ranks.add(decode_ranked(payload)[1])
    expected = {*block_hashes(list(range(1000, 1070)), 32), *block_hashes(list(range(3000, 3070)), 32)}
    assert ranks == {1} and _normalised_replay("dp2_rank1_replay_from_0.jsonl") == expected


def test_one_data_parallel_ranks_load_and_limits_are_its_engines_metrics() -> None:
    """The same run's /metrics: every series per `engine`; rank 1 prefilled two requests, rank 0 one.
    Each rank holds 80 blocks (kv_cache_size_tokens 2,560): num_gpu_blocks says 160, the sum."""
    text = (FIXTURES / "bs32" / "metrics_dp2.txt").read_text()
    assert [load_from_metrics(text, rank).timing.prefill_requests for rank in (0, 1, None)] == [1, 2, 3]
    assert [load_from_metrics(text, rank).kv_total_blocks for rank in (0, 1, None)] == [80, 80, 160]
    assert limits_from_metrics(text, 1).kv_total_blocks == 80 and limits_from_metrics(text, 1).block_size == 32
    assert limits_from_metrics(text, 5).block_size is None


def test_vllm_says_on_metrics_whether_it_caches_prefixes() -> None:
    """vLLM 0.32 with --no-enable-prefix-caching (tests/vllm/capture_no_prefix_caching.py: two equal
    completions, no KV event at all) labels cache_config_info so."""
    off = (FIXTURES / "bs32" / "metrics_no_prefix_caching.txt").read_text()
    on = (FIXTURES / "bs32" / "metrics_after.txt").read_text()
    assert (limits_from_metrics(off).prefix_caching, limits_from_metrics(on).prefix_caching) == (False, True)


def test_a_server_of_several_ranks_takes_a_shim_per_rank() -> None:
    """One shim for vLLM's two ranks would index two caches as one: refused, naming the flag; so is
    a rank the server does not run. One rank of its own (any number) needs no flag."""
    dp2 = (FIXTURES / "bs32" / "metrics_dp2.txt").read_text()
    with pytest.raises(ConfigError, match="runs data-parallel ranks 0, 1, each with a cache of its own") as err:
        check_rank(dp2, None, "http://e")
    assert err.value.setting == "data_parallel_rank"
    with pytest.raises(ConfigError, match=r"runs data-parallel ranks 0, 1$"):
        check_rank(dp2, 2, "http://e")
    assert check_rank(dp2, 1, "http://e") == (1, 1)
    one = (FIXTURES / "bs32" / "metrics_after.txt").read_text()
    assert check_rank(one, None, "http://e") == (None, 0)
    assert check_rank(one.replace('engine="0"', 'engine="3"'), None, "http://e") == (None, 3), "its events' rank"


def test_the_rank_header_is_the_ranks_place_among_the_servers_engines() -> None:
    """vLLM reads X-data-parallel-rank as an index into the engines its API server manages: on an
    external load-balanced rank's server (only engine="1") rank 1 is index 0, on a hybrid one
    managing ranks 1 and 2, rank 2 is index 1; ranks with a gap cannot be placed."""
    dp2 = (FIXTURES / "bs32" / "metrics_dp2.txt").read_text()
    one = (FIXTURES / "bs32" / "metrics_after.txt").read_text()
    assert check_rank(one.replace('engine="0"', 'engine="1"'), 1, "http://e") == (0, 1)
    hybrid = dp2.replace('engine="1"', 'engine="2"').replace('engine="0"', 'engine="1"')
    assert [check_rank(hybrid, r, "http://e") for r in (1, 2)] == [(0, 1), (1, 2)]
    gap = dp2.replace('engine="1"', 'engine="3"')
    with pytest.raises(ConfigError, match="ranks 0, 3, not a contiguous range") as err:
        check_rank(gap, 3, "http://e")
    assert err.value.setting == "data_parallel_rank"


def test_limits_and_load_from_captured_metrics() -> None:
    text = (FIXTURES / "bs32" / "metrics_after.txt").read_text()
    lim = limits_from_metrics(text)
    assert (lim.block_size, lim.kv_total_blocks, lim.cache_dtype) == (32, 80, "auto")
    assert lim.max_num_batched_tokens is None, "vLLM does not report it: it must come from the flag"
    load = load_from_metrics(text)
    assert (load.running, load.waiting, load.kv_total_blocks, load.kv_usage) == (0, 0, 80, 0.0)
    t = load.timing  # what the routers calibrate from: the fixture's histogram counts and sums
    assert (t.iterations, t.iteration_tokens, t.itl_count) == (137, 11288, 186)
    assert (t.prefill_requests, t.prefill_computed_tokens) == (30, 11072)
    assert t.prefix_hit_tokens == 736  # vllm:prefix_cache_hits_total, a counter
    # vllm:generation_tokens_total: a step's tokens less those it generated are what it prefilled
    # (itl_count misses each request's first token, and counts a speculative step's drafts once)
    assert t.generation_tokens == 216 and t.iteration_tokens - t.generation_tokens == t.prefill_computed_tokens
    assert t.prefill_seconds == pytest.approx(0.4404758340008357)
    assert t.itl_seconds == pytest.approx(0.8208445909992861)
    assert load.reused_tokens == 736  # prefix cache hits plus the connector's (0), for the credit check
    ext = 'vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny-llama"}'
    assert load_from_metrics(text.replace(f"{ext} 0.0", f"{ext} 64.0")).reused_tokens == 800
    no_external = text.replace(ext, "other")
    assert load_from_metrics(no_external).reused_tokens == 736
    assert load_from_metrics(no_external.replace("vllm:prefix_cache_hits_total", "other")).reused_tokens is None
    # A decode engine's P/D pulls are connector hits too ("p2p"), but no reuse of its own cache:
    # of 64 + 4096 external tokens, the 4096 pulled are left out; a host tier's 64 stay in.
    p2p = 'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tiny-llama",source="p2p"}'
    host = p2p.replace('"p2p"', '"host"')
    assert f"{p2p} 0.0" in text and f"{host} 0.0" in text
    pd = text.replace(f"{ext} 0.0", f"{ext} 4160.0").replace(f"{p2p} 0.0", f"{p2p} 4096.0")
    assert load_from_metrics(pd.replace(f"{host} 0.0", f"{host} 64.0")).reused_tokens == 800
    # vLLM exports its NixlConnector's failed pulls only with that connector: none in the capture.
    assert load.failed_transfers is None
    nixl = 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 3.0\n'
    assert load_from_metrics(text + nixl).failed_transfers == 3


def test_prefill_leg_body_asks_for_remote_decode_and_one_token() -> None:
    leg = LegRequest("r1", "m", [1, 2, 3], SamplingParams(max_tokens=50), prefill_only=True)
    body = completion_body(leg)
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    decode = completion_body(LegRequest("r1", "m", [1], SamplingParams(), transfer={"do_remote_prefill": True}))
    assert decode["kv_transfer_params"] == {"do_remote_prefill": True} and decode["stream"] is True
    assert decode["return_token_ids"] is True
