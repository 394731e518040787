"""Every message that crosses a process boundary (DESIGN.md, "NATS subjects" and "etcd keys").

All are msgspec Structs encoded as maps: unknown fields are ignored on decode, so a newer peer can
add fields without breaking an older one, and each carries the schema version `v` it was written
with: a reader refuses one above its own SCHEMA_VERSION. NATS payloads are msgpack
(`encode_msg`/`decode_msg`); etcd values are JSON (`encode_json`/`decode_json`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, Literal, NewType, TypeVar, get_args

import msgspec

from protocol.errors import ProtocolError

__all__ = [
    "ANNOTATION_BYPASS",
    "BAD_TRANSFER_HANDLE",
    "ENDPOINT_CHAT",
    "ENDPOINT_COMPLETIONS",
    "ENDPOINT_DETOKENIZE",
    "ENDPOINT_TOKENIZE",
    "ENGINE_HEADERS",
    "ENGINE_UTILITY_ENDPOINTS",
    "MAX_KV_TOTAL_BLOCKS",
    "NEWER_SCHEMA",
    "RETRY_AFTER_MAX_S",
    "SCHEMA_VERSION",
    "UTILITY_ENDPOINTS",
    "BlockHash",
    "CancelRequest",
    "Cleared",
    "EngineClaim",
    "ErrorInfo",
    "GenerateRequest",
    "Hashes",
    "KvEvent",
    "KvEventBatch",
    "KvStateChunk",
    "KvStateRequest",
    "LoadReport",
    "Removed",
    "ResponseChunk",
    "Role",
    "RouterInfo",
    "RouterSync",
    "SamplingParams",
    "Stored",
    "SyncBooking",
    "SyncEntry",
    "SyncKind",
    "SyncSnapshot",
    "TransferHandle",
    "Usage",
    "WorkerId",
    "WorkerInfo",
    "adapter_named",
    "asks_prompt_logprobs",
    "decode_extensible",
    "decode_json",
    "decode_msg",
    "encode_json",
    "encode_msg",
    "lax_bool",
    "lax_int",
    "load_report_problem",
    "named_sender",
    "serving",
    "transfer_handle_bound",
    "worker_info_problem",
]

SCHEMA_VERSION = 1
"""The schema every message here is written with (`_Msg.v`). It goes up only on a change an older
reader would misread (a field repurposed or dropped, a meaning changed); a field added with a
default keeps it, since decoders ignore what they do not know. A reader refuses a message whose `v`
is above its own (`decode_msg`, `decode_json`): applying what it cannot understand would be silent.
docs/deployment.md, "Upgrades"."""

WorkerId = NewType("WorkerId", str)
"""The shim's etcd lease id, lowercase hex."""
BlockHash = NewType("BlockHash", int)
"""A canonical block hash (protocol.hashing): an unsigned 64-bit integer."""

Hashes = list[int] | bytes
"""Canonical block hashes: a list of ints, or the same as little-endian u64s in one bytes value
(what shims send; protocol.packed). Call `protocol.packed.unpack_hashes` before iterating one."""

Role = Literal["prefill", "decode", "agg"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "agg")
SyncKind = Literal["add", "prefill_done", "free"]


class _Msg(msgspec.Struct, kw_only=True):
    v: int = SCHEMA_VERSION


# --- KV events: shim -> routers on {ns}.kv.{worker} -------------------------------------------


class Stored(msgspec.Struct, tag="stored", tag_field="type", kw_only=True):
    """Blocks newly cached on the worker, in chain order; `parent` precedes `hashes[0]` (None: root)."""

    hashes: Hashes
    parent: int | None = None
    medium: str | None = None


class Removed(msgspec.Struct, tag="removed", tag_field="type", kw_only=True):
    """Blocks no longer cached on the worker."""

    hashes: Hashes
    medium: str | None = None


class Cleared(msgspec.Struct, tag="cleared", tag_field="type", kw_only=True):
    """The worker holds nothing any more (engine reset or restart, or a gap that replay cannot fill)."""


KvEvent = Stored | Removed | Cleared


class KvEventBatch(_Msg, kw_only=True):
    """One batch of a shim's events. (worker, epoch, seq) orders them; seq starts at 1 per epoch."""

    worker: str
    epoch: int
    seq: int
    ts: float
    events: list[KvEvent]


class KvStateRequest(_Msg, kw_only=True):
    """Router -> shim on {ns}.kvstate.{worker}: everything after `since_seq` of `epoch`.

    `epoch` None (or not the shim's current one) asks for a full dump. Replies stream to the reply
    subject as KvStateChunks until one has `final` set.
    """

    since_seq: int = 0
    epoch: int | None = None


class KvStateChunk(_Msg, kw_only=True):
    """One reply chunk: either missed `batches`, or part of a full dump `hashes` (parent-first).

    A dump describes the state as of (`epoch`, `seq`): the receiver replaces what it held for the
    worker with the union of all dump chunks and then applies live batches with seq > `seq`.
    """

    worker: str
    epoch: int
    seq: int
    batches: list[KvEventBatch] = []
    dump: bool = False
    hashes: Hashes = []
    chunk: int = 0
    final: bool = True


# --- Load: shim -> routers on {ns}.load.{worker} --------------------------------------------------


class LoadReport(_Msg, kw_only=True):
    worker: str
    ts: float
    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int | None = None
    prefill_tokens_queued: int = 0
    kv_usage: float | None = None
    num_preemptions: int = 0
    healthy: bool = True
    # Liveness: the shim publishes at least every `period_s`; a router treats a worker silent for
    # three periods as gone, long before its lease expires.
    period_s: float = 1.0
    # False while the shim sees no KV events it should see (wrong endpoint or topic, silent engine):
    # routers then stop trusting this worker's index entries.
    events_ok: bool = True
    # Digest of the KV state the shim has published, as of (kv_epoch, kv_seq): the number of
    # distinct canonical hashes and their XOR. A router whose index for the worker is at the same
    # (epoch, seq) but differs has lost a batch; one at an older seq that stays there has lost the
    # last batch. kv_epoch 0: no digest.
    kv_epoch: int = 0
    kv_seq: int = 0
    kv_blocks: int = 0
    kv_xor: int = 0
    # Engine timing as vLLM's /metrics shows it, cumulative since the engine started: histogram
    # `_count`s and `_sum`s, all 0 when the shim forwards none. Routers fit their timing
    # coefficients from the differences between two reports of one worker (router.calibration).
    iterations: int = 0  # vllm:iteration_tokens_total_count: engine steps
    iteration_tokens: int = 0  # vllm:iteration_tokens_total_sum: tokens scheduled over those steps
    prefill_requests: int = 0  # vllm:request_prefill_time_seconds_count
    prefill_seconds: float = 0.0  # vllm:request_prefill_time_seconds_sum: first scheduled to first token
    prefill_computed_tokens: int = 0  # vllm:request_prefill_kv_computed_tokens_sum: uncached prompt tokens
    prefix_hit_tokens: int = 0  # vllm:prefix_cache_hits_total: prompt tokens found cached
    itl_count: int = 0  # vllm:inter_token_latency_seconds_count
    itl_seconds: float = 0.0  # vllm:inter_token_latency_seconds_sum
    # Wall-clock time the engine's figures above were read (the shim polls them, and a heartbeat
    # may repeat the last reading); 0: at `ts`. Calibration measures busy time between readings.
    engine_ts: float = 0.0
    # True while the shim's credit check (worker_shim.credit_check) finds the engine reusing far less
    # of the prefixes its KV events promise than they say: routers credit this worker wrongly.
    prefix_credit_short: bool = False
    # Mean tokens (prompt plus output so far) of the requests the shim sees decoding, as of `ts`;
    # 0.0: none, or a shim that does not count. A decode step reads each sequence's whole KV, so
    # calibration prices steps at this context: kv_used_blocks counts a shared prefix once.
    decode_context: float = 0.0
    # KV pulls the engine failed without failing their request (vllm:nixl_num_failed_transfers, less
    # the legs the shim saw fail: kv_load_failure_policy recompute) since the shim started; 0 from an
    # engine that exports no such counter. A rise closes the remote path into this worker for a
    # while (router.transfer_health): its prefill legs' work is being thrown away.
    kv_transfers_failed: int = 0
    # Added 2026-12-03: the shim got SIGTERM and drains. Its in-flight legs finish; a new one would
    # be refused (503 draining), so routers send new requests elsewhere.
    draining: bool = False
    # Added 2026-12-05: vllm:generation_tokens_total, cumulative like the timing counters above: every
    # token the engine's steps generated (a speculative step's accepted drafts too, which itl_count
    # counts once). 0 from a shim before the field: calibration then reads generated tokens as itl_count.
    generation_tokens: int = 0


# --- Requests: router -> shim on {ns}.gen.{role}.{worker} ----------------------------------------


class SamplingParams(msgspec.Struct, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class TransferHandle(msgspec.Struct, kw_only=True):
    """What a prefill leg hands to its decode leg, opaque to the router.

    `engine` names the adapter that produced it; `params` is engine-specific: vLLM's
    `kv_transfer_params`, TensorRT-LLM's `disaggregated_params`, SGLang's bootstrap triple.
    """

    engine: str
    params: dict[str, Any]
    prefill_worker: str = ""


HANDLE_FIELDS_BYTES = 2048
"""At most what a transfer handle holds besides a vLLM handle's block ids, encoded: vLLM 0.32's
NixlConnector's other fields (engine and request ids, host, port, sizes: ~400 B), or the whole of
another engine's (TensorRT-LLM's `disaggregated_params`, SGLang's bootstrap triple)."""


def _int_bytes(n: int) -> int:
    """msgpack's bytes for the unsigned integer `n`."""
    return 1 if n < 128 else 2 if n < 256 else 3 if n < 1 << 16 else 5 if n < 1 << 32 else 9


def transfer_handle_bound(info: WorkerInfo, prompt_tokens: int, kv_blocks: int | None = None) -> int:
    """At most the bytes the TransferHandle of a prefill leg of `prompt_tokens` on the worker `info`
    takes encoded, in a decode leg's `disagg`: a vLLM handle names one block id per prompt block
    (`remote_block_ids`), each below the worker's `kv_blocks` (its record's when not given; any
    32-bit id when unknown), and HANDLE_FIELDS_BYTES hold the rest. A hybrid model's vLLM handle
    names ids per KV cache group, more than this counts."""
    fixed = HANDLE_FIELDS_BYTES + len(info.worker.encode()) + len(info.engine.encode())
    if info.engine != "vllm":
        return fixed
    ids = -(-prompt_tokens // max(info.block_size, 1))
    capacity = kv_blocks if kv_blocks is not None else info.kv_total_blocks
    width = _int_bytes(capacity - 1) if capacity else 5
    return fixed + 5 + ids * width  # 5: the array's header


class GenerateRequest(_Msg, kw_only=True):
    """One leg of a request. The subject's role says which: prefill (one token, returns a
    TransferHandle), decode (with `disagg` from the prefill leg, or the bypass annotation to prefill
    locally) or agg.

    `annotations` are the router's alone: values a client sent are stripped at the front door.
    `deadline` is a Unix time; past it the shim aborts the request. `trace` carries W3C trace
    context (traceparent, tracestate).
    """

    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = True
    annotations: list[str] = []
    disagg: TransferHandle | None = None
    deadline: float | None = None
    trace: dict[str, str] = {}
    # The shim sends an empty (token-less, non-final) chunk whenever it has sent nothing for this
    # many seconds, so a router can tell a dead worker from a long prefill; 0 asks for none.
    heartbeat_s: float = 0.0
    # Not a new leg: the chunks of the running (or just finished) leg `request_id` from seq `resume`
    # on, sent again to this message's reply subject, where the rest of the leg then goes. A router
    # asks when chunks went missing (a NATS node died under the stream); a shim that no longer has
    # them answers with an error chunk of that seq (410, `gone`).
    resume: int | None = None
    # The client's OpenAI request, passed to an engine that serves the OpenAI API: `endpoint` is
    # ENDPOINT_COMPLETIONS or ENDPOINT_CHAT ("": a token-id leg built from `sampling`), `params`
    # the client's body as the router validated it. A completions body without `prompt` means
    # `token_ids`; a chat body carries its `messages` and the engine renders them (`token_ids`
    # are then what the router hashed, for the shim's accounting). The engine's own response
    # comes back in ResponseChunk.events / .body. UTILITY_ENDPOINTS (ENDPOINT_TOKENIZE,
    # ENDPOINT_DETOKENIZE) are no generation: `params` is the body of the engine's /tokenize or
    # /detokenize, `token_ids` is empty, and the answer comes back whole in ResponseChunk.body.
    endpoint: str = ""
    params: dict[str, Any] = {}
    # The id the engine names its answer by (sent as X-Request-Id, so `cmpl-<id>`): the client's
    # own X-Request-Id or body `request_id` when it gave one, as vLLM takes them; "": `request_id`.
    # Only `request_id` is unique: it keys the leg everywhere else.
    engine_request_id: str = ""
    # The sending router process (RouterInfo.instance): a shim aborts the legs of an instance no
    # key under /{ns}/routers/ has named for its --orphan-grace-s (a router killed without its
    # drain cannot cancel them). "": never aborted so (a router that predates it, a test client).
    origin: str = ""
    # Request headers the engine reads, as the client sent them (ENGINE_HEADERS only): vLLM takes
    # a priority and a session id from headers as well as from the body.
    headers: dict[str, str] = {}
    # A prefill leg's router takes its TransferHandle from a chunk before the final one, and the
    # final chunk as the engine's own outcome of the prefill. A shim whose engine needs the decode
    # leg running before its prefill can end (SGLang's waits for its decode peer) then sends the
    # handle at once and keeps the leg open until the engine is done; asked by no router (one of
    # before 2026-12-07), it sends the handle in its final chunk at once and the router never hears
    # how that prefill ended.
    early_transfer: bool = False


# vLLM 0.32's (entrypoints/generate/base/serving.py: PRIORITY_HEADER, SESSION_ID_HEADER).
ENGINE_HEADERS = ("X-Vllm-Priority", "X-Session-ID")

ENDPOINT_COMPLETIONS = "completions"
ENDPOINT_CHAT = "chat"
ENDPOINT_TOKENIZE = "tokenize"
ENDPOINT_DETOKENIZE = "detokenize"
UTILITY_ENDPOINTS = frozenset({ENDPOINT_TOKENIZE, ENDPOINT_DETOKENIZE})
# The utility endpoints each engine (WorkerInfo.engine) serves, as routes of the endpoint's name
# (vLLM's /tokenize, /detokenize): its shim forwards only these, and a router sends a utility call
# only to a worker whose engine serves it. SGLang's and TensorRT-LLM's routes differ (or are
# absent), so their shims guess at none. Every engine this build's shims run is a key, those
# serving none too: an engine missing is one a newer shim runs, whose routes a router cannot know.
ENGINE_UTILITY_ENDPOINTS: Mapping[str, frozenset[str]] = {
    "vllm": UTILITY_ENDPOINTS,
    "sglang": frozenset(),
    "trtllm": frozenset(),
}


ANNOTATION_BYPASS = "bypass_remote_prefill"


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The engine's own count of prompt tokens it found cached; None: its answer had none (vLLM
    # without --enable-prompt-tokens-details). Omitted then, so a reader that wants an int reads 0.
    cached_tokens: int | None = None


RETRY_AFTER_MAX_S = 86_400
"""The longest Retry-After an ErrorInfo carries (a day): an engine's larger one is cut to it. Its
99999999999999999999 overflowed the encoder (past 2**64 - 1), and the leg got no final chunk."""


PREFILL_STOPPED = "prefill_stopped"
"""The ErrorInfo kind of a prefill leg that ended "stop" on its one token with no transfer handle
(vLLM's connectors give one only for a leg that ended on its length): its request's token did
it, not the worker's engine, which routers do not hold against it."""


BAD_TRANSFER_HANDLE = "bad_transfer_handle"
"""The ErrorInfo kind of a prefill leg whose engine returned a transfer handle a decode engine
would not pull with (vLLM: kv_transfer_params without `do_remote_prefill` true, a string
`remote_host` and an integer `remote_port`). Its own kind, not `engine_protocol`, so a router tells
it from no handle at all (an engine without a KV connector): the flags are right, and something
between the engine and its shim rewrote the handle, or its connector is not NixlConnector."""


class ErrorInfo(msgspec.Struct, kw_only=True):
    """Why a stream ended badly. `code` is an HTTP-like status; `kind` a short machine word.
    `body`: the engine's own JSON error body when it refused the request (4xx), passed to the
    client as it is. `retry_after_s`: the engine's Retry-After (a 429's), in seconds, at most
    RETRY_AFTER_MAX_S."""

    code: int
    kind: str
    message: str
    body: bytes = b""
    retry_after_s: Annotated[int, msgspec.Meta(ge=0, le=RETRY_AFTER_MAX_S)] | None = None


class ResponseChunk(_Msg, kw_only=True):
    """Shim -> router on the request's reply subject. `seq` counts chunks from 0 per leg; the last
    chunk has `final` set and carries `finish_reason`, `usage` and, for a prefill leg, `transfer`;
    or `error` when the leg failed. A chunk with no tokens that is not final is a heartbeat
    (GenerateRequest.heartbeat_s), unless it carries `transfer`: a prefill leg whose request asked
    for `early_transfer` may send its handle so, before its engine is done, and its final chunk
    (the handle again, or `error`) then says how the engine's prefill ended."""

    request_id: str
    seq: int
    token_ids: list[int] = []
    final: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    transfer: TransferHandle | None = None
    error: ErrorInfo | None = None
    worker: str = ""
    # Pass-through legs (GenerateRequest.endpoint set) carry the engine's own response: `events`,
    # the JSON payloads of its SSE events in order (a stream), with `tokens` the output tokens
    # they hold (every choice; counted as the shim could: ids where the engine sent them, else one
    # per choice with output); `body`, a piece of its whole answer (in seq order the pieces make
    # the body).
    events: list[bytes] = []
    tokens: int = 0
    body: bytes = b""
    # The last of `events` is cut short: the next chunk's first event continues it. An SSE event
    # bigger than NATS's payload limit (an echoed prompt's logprobs) travels in pieces so; the
    # router joins them, so its clients see whole events only.
    continued: bool = False
    # The leg's prompt is in the engine's cache (its KV events say so): its prefill is done. Sent
    # for a whole (non-streamed) answer, which has no first token to tell.
    prefilled: bool = False


class CancelRequest(_Msg, kw_only=True):
    request_id: str


# --- Router replica sync on {ns}.router.sync -------------------------------------------------------


class SyncEntry(msgspec.Struct, kw_only=True):
    request_id: str
    worker: str
    kind: SyncKind
    tokens: int = 0
    blocks: int = 0


class SyncBooking(msgspec.Struct, kw_only=True):
    """One live booking of the sender's, as it stood when its `SyncSnapshot` was taken."""

    request_id: str
    worker: str
    tokens: int = 0
    blocks: int = 0
    prefill_done: bool = False


class SyncSnapshot(msgspec.Struct, kw_only=True):
    """Part `part` of `parts` of snapshot `seq` (increasing per sender) of the sender's live
    bookings, sent after every entry queued before it was taken (2026-12-07, an addition to
    DESIGN.md's sync: docs/decisions.md, "Snapshots of a router's bookings"). A reader drops the
    sender's bookings that a whole snapshot leaves out, and adds or corrects those it names: a lost
    message heals within one snapshot period. An older router ignores the field."""

    seq: int
    part: int
    parts: int
    bookings: list[SyncBooking]


class RouterSync(_Msg, kw_only=True):
    router: str
    entries: list[SyncEntry]
    snapshot: SyncSnapshot | None = None


# --- etcd values ------------------------------------------------------------------------------------


class WorkerInfo(_Msg, kw_only=True):
    """/{ns}/workers/{worker}: one engine behind its shim, alive exactly as long as the key."""

    worker: str
    model: str
    role: Role
    engine: str
    block_size: int
    kv_total_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    timing_profile: str | None = None
    epoch: int = 0
    version: str = ""
    engine_url: str = ""
    # Fingerprint of the served model's tokenizer (protocol.tokenizer_fingerprint), `builtin` for
    # engine_sim's built-in vocabulary, "" when the shim could not tell: a router refuses text
    # requests for workers whose tokenizer differs from its own.
    tokenizer: str = ""
    # False while the shim sees no KV events it should see (see LoadReport.events_ok).
    events_ok: bool = True
    # The shim's own HTTP address (/health, /metrics), "" when it serves none.
    shim_url: str = ""
    # The longest prompt plus output the engine takes (its /v1/models `max_model_len`); None when
    # it does not say. Routers show the least of a model's workers on their own /v1/models.
    max_model_len: int | None = None
    # The LoRA adapters the engine serves on `model` (its /v1/models cards whose parent is `model`
    # or one of `aliases`), sorted: a request naming one runs here, and its KV blocks are salted by
    # the adapter's name.
    adapters: list[str] = []
    # The other names the engine serves `model` under (vLLM's --served-model-name with several),
    # sorted: a request naming one runs here as if it named `model`, on the same KV blocks.
    aliases: list[str] = []
    # False when the engine runs without prefix caching (vLLM --no-enable-prefix-caching): it caches
    # no prompt, so a prefix routed there is no prefix it will hold.
    prefix_caching: bool = True
    # A hybrid model's sliding window in tokens (0: none, or none seen yet in its KV events). Its
    # cached prefix is reused only up to where the window is cached too: the shim publishes those
    # ends as `protocol.hashing.endpoint_key`s, and a router matches such a worker up to one.
    sliding_window: int = 0
    # False when its engine cannot prefill a request on its own, so a decode leg without a transfer
    # handle (a bypass) would wait for KV that never comes: an SGLang decode server
    # (--disaggregation-mode decode) waits for a prefill peer. A router plans no bypass there and
    # never falls back to one. A record without it (a shim of before 2026-12-07) reads as True.
    local_prefill: bool = True


def serving(infos: Collection[WorkerInfo], name: str) -> list[WorkerInfo]:
    """The workers a request naming `name` runs on: those of model `name` (or serving it under that
    alias), else those serving it as an alias or a LoRA adapter. A model's own name wins over
    another model's adapter or alias of that name (a router lists such an alias on no worker, and
    refuses a name served as several models otherwise: router.served_names)."""
    if any(i.model == name for i in infos):
        return [i for i in infos if i.model == name or name in i.aliases]
    return [i for i in infos if name in i.aliases or name in i.adapters]


def adapter_named(name: str, model: str, aliases: Collection[str] = ()) -> str:
    """The LoRA adapter a request naming `name` runs on a worker of `model` (served under `aliases`
    too); "" for the model under any of its names. It salts the prompt's blocks
    (protocol.hashing.chain_salt), so routers and shims must agree on it."""
    return "" if name == model or name in aliases else name


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: object) -> bool | None:
    """`value` as vLLM's pydantic models read a boolean field (lax mode: 1, "true", "yes", "on",
    ... and their opposites), or None for a value they refuse or an absent one."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.lower()
        return True if word in _TRUE else False if word in _FALSE else None
    return None


# What Rust's str::trim strips (Unicode White_Space); Python's str.strip() also strips \x1c-\x1f.
_RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
)
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_I64_BOUND = float(2**63)  # a float must lie strictly inside (-2^63, 2^63)


def lax_int(value: object) -> int | None:
    """`value` as vLLM's pydantic models read an integer field (lax mode), or None for a value they
    refuse or an absent one: a bool is 0 or 1, an integral float inside the int64 range is its
    integer, and text as pydantic-core's `str_as_int` reads it ("2", " 2 ", "+2", "2.00", "1_000";
    not "2.", "1e3", "0x10"). Checked against vLLM 0.32's CompletionRequest (tests record the table)."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() and -_I64_BOUND < value < _I64_BOUND else None
    if not isinstance(value, str):
        return None
    text = value if _JSON_INT.fullmatch(value) else _cleaned_int_text(value)
    if text is None or not _JSON_INT.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # over Python's 4300 digits, which pydantic refuses too
        return None


def _cleaned_int_text(text: str) -> str | None:
    """pydantic-core's `clean_int_str`: whitespace, a leading "+", leading zeros (and underscores
    among them), a ".0+" tail and inner single underscores go; None when nothing was cleaned."""
    s = text.strip(_RUST_WHITESPACE)
    if s.startswith("+"):
        if s.startswith("+-"):
            return None
        s = s[1:]
    sign = ""
    if s.startswith("-"):
        if s.startswith(("--", "-+")):
            return None
        sign, s = "-", s[1:]
    digits = _without_leading_zeros(s)
    if digits is None:
        return None
    s = digits
    point = s.find(".")
    if point >= 0 and s[point + 1 :] and s[point + 1 :].strip("0") == "":
        s = s[:point]
    if "_" in s and not s.startswith("_") and not s.endswith("_") and "__" not in s:
        return sign + s.replace("_", "")
    return None if s == text else sign + s


def _without_leading_zeros(s: str) -> str | None:
    """pydantic-core's `strip_leading_zeros`, quirks included ("0-9" is "-9")."""
    if not s or (s[0] != "0" and s[0] not in "123456789-"):
        return None
    if s[0] != "0":
        return s
    for i, c in enumerate(s[1:], 1):
        if c in "123456789-":
            return s[i:]
        if c == ".":
            return s[i - 1 :]
        if c not in "0_":
            return None
    return s[-1]


def asks_prompt_logprobs(body: Mapping[str, Any], *, chat: bool) -> bool:
    """The OpenAI body asks for the prompt's own logprobs (`prompt_logprobs`, a chat `echo`, or a
    completion's `echo` with `logprobs`): vLLM then needs every prompt token's logits, so it reads
    no cache and the prompt takes its own forward pass."""
    if body.get("prompt_logprobs") is not None:
        return True
    echo = lax_bool(body.get("echo")) is True
    # vLLM 0.32: a chat echo takes prompt_logprobs = top_logprobs (0 when unset or null) whatever
    # `logprobs` says; a completion's echo only with `logprobs`.
    return echo if chat else echo and body.get("logprobs") is not None


class RouterInfo(_Msg, kw_only=True):
    """/{ns}/routers/{router}."""

    router: str
    http_url: str
    started_at: float
    version: str = ""
    # A short digest of the routing settings the router applies now (live config included), put
    # again when they change: replicas compare it with their own and warn when a peer routes
    # differently. "" from a router that predates it.
    settings_digest: str = ""
    # A short digest of how the router turns a request into ids: its tokenizer's fingerprint and the
    # chat flags it renders with (router.peer_settings.rendering_digest), compared as settings_digest
    # is. "" from a router that predates it (2026-12-07).
    rendering_digest: str = ""
    # What each digest is of, each value as its JSON text (router.peer_settings.settings_fields and
    # rendering_fields): a peer names the settings that differ and both values, where the digests
    # alone left an operator to guess which flag to fix. Empty from a router that predates them
    # (2026-12-07).
    settings: dict[str, str] = msgspec.field(default_factory=dict)
    rendering: dict[str, str] = msgspec.field(default_factory=dict)
    # A random id of the router process, kept when it registers anew under another id (a lost
    # lease): its legs carry it (GenerateRequest.origin). "" from a router that predates it.
    instance: str = ""


class EngineClaim(_Msg, kw_only=True):
    """/{ns}/engines/{engine}: the worker that serves one engine, under that worker's lease
    (worker_shim.engine_claim). Read only to name the holder when a second shim claims it."""

    worker: str
    engine_url: str  # the holder's --engine-url, as given
    host: str  # the holder's host name (a pod's name on Kubernetes)


# --- Plausibility: what decodes but cannot be true ----------------------------------------------------
# A struct's types say nothing of its ranges, and one worker's negative count or zero block size
# would steer (or break) routing for the whole fleet: the receiver counts such a message as
# malformed and drops it.

_LOAD_COUNTS = (
    "running",
    "waiting",
    "kv_used_blocks",
    "kv_total_blocks",
    "prefill_tokens_queued",
    "kv_blocks",
    "kv_seq",
)

# A report's floats must be finite, and all but its wall-clock stamp at least 0: one inf or NaN left
# the worker's timing fit NaN for good (router.calibration). A shim sends none (it drops an engine
# reading that holds one: worker_shim.load_reporter).
_LOAD_FLOATS = ("ts", "engine_ts", "period_s", "kv_usage", "prefill_seconds", "itl_seconds", "decode_context")

# The most KV blocks one engine can say it has: 2**31 blocks of 16 tokens are 34 G tokens, some PB
# of KV at vLLM's block sizes, far past any GPU. Routers size a worker's index bound from this count
# (router.kv_ingest), so a larger one is a lie that would lift that bound.
MAX_KV_TOTAL_BLOCKS = 1 << 31


def load_report_problem(report: LoadReport) -> str | None:
    """Why `report` cannot be true (a count below zero, a KV capacity no engine has, a float
    not finite), or None."""
    for name in _LOAD_COUNTS:
        value = getattr(report, name)
        if value is not None and value < 0:
            return f"{name} {value} is negative"
    for name in _LOAD_FLOATS:
        value = getattr(report, name)
        if value is not None and not math.isfinite(value):
            return f"{name} {value} is not a finite number"
        if value is not None and value < 0 and name != "ts":
            return f"{name} {value} is negative"
    return _capacity_problem(report.kv_total_blocks)


def _capacity_problem(kv_total_blocks: int | None) -> str | None:
    if kv_total_blocks is not None and kv_total_blocks > MAX_KV_TOTAL_BLOCKS:
        return f"kv_total_blocks {kv_total_blocks} is above {MAX_KV_TOTAL_BLOCKS}"
    return None


_INFO_AT_LEAST = (
    ("block_size", 1),
    ("kv_total_blocks", 0),  # 0, like None: unknown
    ("max_num_batched_tokens", 0),
    ("kv_bytes_per_token", 0),
    ("max_model_len", 1),  # the least of a model's workers bounds every request for it
    ("epoch", 0),
    ("sliding_window", 0),
)


def worker_info_problem(info: WorkerInfo) -> str | None:
    """Why the record `info` cannot be true (a field out of its range), or None when it may be."""
    for name, least in _INFO_AT_LEAST:
        value = getattr(info, name)
        if value is not None and value < least:
            return f"{name} {value} is below {least}"
    return _capacity_problem(info.kv_total_blocks)


# --- Codecs -------------------------------------------------------------------------------------------

T = TypeVar("T")

_msg_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_msg_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}
_json_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}
# msgspec raises RecursionError past the interpreter's limit (~1,000 levels), even in a field it
# only skips: a ProtocolError (a ValueError) lets each reader isolate that message as malformed.
_TOO_DEEP = "nested too deeply"


def encode_msg(msg: msgspec.Struct) -> bytes:
    """Encode a NATS payload; raises ProtocolError for a value nested past the recursion limit."""
    try:
        return _msg_encoder.encode(msg)
    except RecursionError:
        raise ProtocolError(type(msg).__name__, _TOO_DEEP) from None


NEWER_SCHEMA = "written with a newer schema version"
"""The `ProtocolError.kind` of a message refused for its `v`: its sender runs a newer kvswitch."""


class _Version(msgspec.Struct):
    """A payload's `v` alone: decoded so, msgspec skips the rest of it unread."""

    v: int = SCHEMA_VERSION


_msg_version = msgspec.msgpack.Decoder(_Version)
_json_version = msgspec.json.Decoder(_Version)


def _newer(kind: type[Any], v: int) -> ProtocolError:
    return ProtocolError(
        kind.__name__,
        f"{NEWER_SCHEMA} ({v}) than this process reads ({SCHEMA_VERSION}): its sender runs a newer, "
        "incompatible kvswitch; upgrade this process (docs/deployment.md, Upgrades)",
        NEWER_SCHEMA,
    )


def _readable(msg: T, kind: type[T]) -> T:
    """`msg`, unless it was written with a schema newer than this process reads."""
    if isinstance(msg, _Msg) and msg.v > SCHEMA_VERSION:
        raise _newer(kind, msg.v)
    return msg


def _undecoded(
    data: bytes | str,
    kind: type[Any],
    exc: msgspec.MsgspecError,
    version: Callable[[Any], _Version],
) -> ProtocolError:
    """The error for a payload that did not decode as `kind`: its `v` is read alone, and one above
    SCHEMA_VERSION is said as a newer schema, where a newer writer's changed shape read as garbage
    (the one case `v` is raised for: docs/decisions.md, "Wire messages")."""
    if isinstance(kind, type) and issubclass(kind, _Msg):
        try:
            v = version(data).v
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            v = SCHEMA_VERSION
        if v > SCHEMA_VERSION:
            return _newer(kind, v)
    return ProtocolError(kind.__name__, str(exc))


def decode_msg(data: bytes, kind: type[T]) -> T:
    """Decode a NATS payload; raises ProtocolError naming the type for anything malformed, and for
    a message whose schema version `v` is above SCHEMA_VERSION, whether or not the rest decodes."""
    dec = _msg_decoders.get(kind)
    if dec is None:
        dec = _msg_decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        msg: T = dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _undecoded(data, kind, exc, _msg_version.decode) from exc
    except RecursionError:
        raise ProtocolError(kind.__name__, _TOO_DEEP) from None
    return _readable(msg, kind)


# The messages a newer kvswitch may extend with kinds of its items without raising `v` (docs/decisions.md,
# "Kinds a newer kvswitch adds"): message -> (its list field, the field telling its items apart,
# the values this build knows). A repair reply's batches are not among them: a reply that holds an
# unknown event is refused, and the repair takes a full dump, which carries hashes alone.
_EXTENSIBLE: dict[type[Any], tuple[str, str, frozenset[str]]] = {
    KvEventBatch: ("events", "type", frozenset(str(e.__struct_config__.tag) for e in get_args(KvEvent))),
    RouterSync: ("entries", "kind", frozenset(get_args(SyncKind))),
}
# msgspec's error for an item's tag (a tagged union's) or Literal kind (an enum's) of a value it
# does not know, as msgspec words it (tests/protocol/test_messages.py pins it); the path ends it,
# whatever the value. Any other error is malformed as it stands: no second decode.
_UNKNOWN_KIND = {
    kind: re.compile(rf"Invalid (?:enum )?value .* - at `\$\.{field}\[\d+\]\.{tag}`", re.DOTALL)
    for kind, (field, tag, _) in _EXTENSIBLE.items()
}


def decode_extensible(data: bytes, kind: type[T]) -> tuple[T, dict[str, int]]:
    """`decode_msg` for a message a newer kvswitch may extend (a KvEventBatch's events, a
    RouterSync's entries), and how many items of each kind this build does not know were left out
    of it: an item whose kind is a string this build does not know is a newer sender's addition,
    not malformed. Anything else malformed raises as `decode_msg` does, at its cost: only a message
    whose first fault is such an item is decoded again, untyped, and its other items checked."""
    try:
        return decode_msg(data, kind), {}
    except ProtocolError as exc:
        cause = exc.__cause__
        if exc.kind == NEWER_SCHEMA or not (
            isinstance(cause, msgspec.ValidationError) and _UNKNOWN_KIND[kind].fullmatch(str(cause))
        ):
            raise
        error = exc
    field, tag, known = _EXTENSIBLE[kind]
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        raise error from None
    # a map with its field twice: msgspec's strict decode read the first, this one the last
    items = raw.get(field) if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise error
    kept: list[Any] = []
    unknown: dict[str, int] = {}
    for item in items:
        name = item.get(tag) if isinstance(item, dict) else None
        if isinstance(name, str) and name not in known:
            unknown[name] = unknown.get(name, 0) + 1
        else:
            kept.append(item)
    if not unknown:
        raise error
    raw[field] = kept
    try:
        # bytes stay bytes (msgpack's bin): convert would take base64 text for them too, as decode_msg does not
        msg: T = msgspec.convert(raw, kind, builtin_types=(bytes,))
    except msgspec.ValidationError as exc:
        raise ProtocolError(kind.__name__, str(exc)) from exc
    except RecursionError:
        raise ProtocolError(kind.__name__, _TOO_DEEP) from None
    return _readable(msg, kind), unknown


_named_decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}


def named_sender(data: bytes, field: str) -> str | None:
    """The string in `field` of a payload that did not decode as its message (the sending router a
    RouterSync names), to name its sender in the line that says so; None when there is none. It is
    the sender's own word, no more to be trusted than the rest of the payload. Decoded as a struct
    of that field alone, msgspec skips the rest unread: an untyped decode built every object of a
    1 MB message (37 ms, where this costs 1.5 ms)."""
    dec = _named_decoders.get(field)
    if dec is None:
        dec = _named_decoders[field] = msgspec.msgpack.Decoder(msgspec.defstruct("_Named", [(field, str | None, None)]))
    try:
        name: str | None = getattr(dec.decode(data), field)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return name


def encode_json(msg: msgspec.Struct) -> bytes:
    return _json_encoder.encode(msg)


def decode_json(data: bytes | str, kind: type[T]) -> T:
    """Decode an etcd value; raises ProtocolError as `decode_msg` does."""
    dec = _json_decoders.get(kind)
    if dec is None:
        dec = _json_decoders[kind] = msgspec.json.Decoder(kind)
    try:
        msg: T = dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _undecoded(data, kind, exc, _json_version.decode) from exc
    except RecursionError:
        raise ProtocolError(kind.__name__, _TOO_DEEP) from None
    return _readable(msg, kind)
