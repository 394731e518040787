"""Settings of one simulated engine. Field names are vLLM's flag names (`max_num_seqs` is
`--max-num-seqs`), so a sim can stand in for `vllm serve` without renaming anything.

Two defaults differ between the CLI and the Python API, on purpose:
- KV events: the CLI follows vLLM (off unless `--kv-events-config` is given); `SimConfig()` turns
  them on with PUB and replay sockets bound on free loopback ports, which is what tests want.
- port: the CLI listens on 8000 like vLLM; `SimConfig()` picks a free port (0).

Nothing binds beyond 127.0.0.1 unless told to: the HTTP host defaults to 127.0.0.1 (vLLM's to
0.0.0.0) and the events endpoint to LOOPBACK_PUB_ENDPOINT (vLLM's to `tcp://*:5557`).
"""

from __future__ import annotations

import json
import math
from typing import Literal, get_args

import msgspec

from engine_sim.errors import SimConfigError
from engine_sim.lora import LoraModule, lora_requests
from protocol.timing import DEFAULT_PROFILE, load_profile
from protocol.vllm_events import EVENT_FORMS, EventForm
from protocol.zmq_endpoint import split_endpoint

__all__ = [
    "EVENT_FORMS",
    "KV_LOAD_FAILURE_POLICIES",
    "LOOPBACK_PUB_ENDPOINT",
    "ROLES",
    "TOOL_CALL_PARSERS",
    "KVEventsConfig",
    "SimConfig",
]

Role = Literal["prefill", "decode", "agg"]
ROLES: tuple[str, ...] = get_args(Role)
# vLLM's kv_transfer_config.kv_load_failure_policy: a failed KV pull ends the request with an
# error (vLLM's default), or the request prefills its prompt itself.
KvLoadFailurePolicy = Literal["fail", "recompute"]
KV_LOAD_FAILURE_POLICIES: tuple[str, ...] = get_args(KvLoadFailurePolicy)
# vLLM 0.32's --tool-call-parser names (ToolParserManager.list_registered(): the keys of
# vllm/tool_parsers/__init__.py's _TOOL_PARSERS_TO_REGISTER; no parser plugins here).
TOOL_CALL_PARSERS: tuple[str, ...] = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
    "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45",
    "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral",
    "muse_glimmer", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic", "qwen3_coder",
    "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
)  # fmt: skip

# Memory the default KV pool is sized from: an H200's 141 GB at vLLM's default
# gpu_memory_utilization 0.9, less bf16 weights and ~4 GiB of activations and CUDA graphs.
_H200_BYTES = 141e9
_GPU_UTIL = 0.9
_RUNTIME_OVERHEAD = 4 * 2**30

LOOPBACK_PUB_ENDPOINT = "tcp://[::ffff:127.0.0.1]:5557"
"""The default events endpoint: by vLLM's rule it binds (it contains `::`), and ZMQ binds the
IPv4-mapped address on 127.0.0.1 alone. vLLM given the same string does the same."""


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's KVEventsConfig, same keys and defaults (`--kv-events-config` takes it as JSON).

    endpoint: the PUB socket binds when it contains `*` or `::` (or is ipc:// / inproc://) and
        connects otherwise (the subscriber then binds), exactly as vLLM decides. The default is
        LOOPBACK_PUB_ENDPOINT, not vLLM's `tcp://*:5557`, so that nothing listens beyond loopback.
    replay_endpoint: the ROUTER socket for replay, always bound (as vLLM binds it, whatever the
        endpoint); None disables replay.
    buffer_steps: how many batches the replay buffer keeps. hwm: the PUB send high-water mark.
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = LOOPBACK_PUB_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        """vLLM publishes when events are enabled and the publisher is not `null`."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def problem(self) -> str | None:
        """What ZMQ (or vLLM's replay deque) would refuse when the publisher starts, naming the key;
        None if nothing. Checked only when active: an inactive config is never used, as in vLLM."""
        if not self.active:
            return None
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if (key == "endpoint" or value) and (why := _zmq_endpoint_problem(value)) is not None:
                return f"{key} {value!r}: {why}"
        for key in ("hwm", "buffer_steps"):
            if getattr(self, key) < 0:
                return f"{key} must be >= 0, got {getattr(self, key)}"
        return None

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SimConfigError("kv_events_config", text, f"not JSON ({exc.msg})") from exc
        try:
            config = msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise SimConfigError("kv_events_config", text, str(exc)) from exc
        if (problem := config.problem()) is not None:
            raise SimConfigError("kv_events_config", text, problem)
        return config

    @classmethod
    def ephemeral(cls, topic: str = "") -> KVEventsConfig:
        """Events on, PUB and replay bound on free loopback ports (the Python API default)."""
        return cls(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=LOOPBACK_PUB_ENDPOINT.rsplit(":", 1)[0] + ":0",
            replay_endpoint="tcp://127.0.0.1:0",
            topic=topic,
        )


def _zmq_endpoint_problem(endpoint: str) -> str | None:
    split = split_endpoint(endpoint)
    if split is None and endpoint.startswith("tcp://"):
        return "a tcp:// endpoint needs HOST:PORT, PORT in [0, 65535] or * (an IPv6 HOST in brackets)"
    if split is None:
        return "must be tcp://HOST:PORT, ipc://PATH or inproc://NAME"
    if split.ipv6 and not split.ipv4_mapped:
        # vLLM's publisher sets no zmq.IPV6: ZMQ refuses the address at its bind ("No such device").
        return "vLLM's publisher opens no IPv6 address (it sets no zmq.IPV6); an IPv4-mapped one binds its IPv4"
    return None


class SimConfig(msgspec.Struct, kw_only=True):
    """One simulated engine. `validate()` raises SimConfigError naming the flag and what it allows.

    num_gpu_blocks: None sizes the pool as vLLM would on one H200 for the profile's model.
    speedup: divides every modelled duration (steps, KV transfers); metrics stay in simulated time.
    role: as in a real deployment, a `decode` sim still prefills locally when a request carries no
        kv_transfer_params (the bypass path), and any sim serves the P/D fields; `prefill` and
        `decode` sims are engines started with a KV connector (vLLM's --kv-transfer-config), whose
        `vllm:external_prefix_cache_queries` count every request, an `agg` sim's only those that pull KV.
    kv_transfer_gbps: the link a decode sim pulls KV over, GB/s.
    kv_lease_duration: vLLM 0.32's `kv_transfer_config.kv_connector_extra_config.kv_lease_duration`
        (30 s): a prefill sim holds blocks for a decode sim under a lease of this many wall seconds,
        which a decode sim renews while it holds the request (a heartbeat every `lease // 6`, at
        least every 0.1 s, each extending the lease to `lease * 2 // 3` (the prefill sim's lease)
        from then, so on a 1 s lease not at all) until it pulls;
        a lease nobody renews runs out and frees the blocks. A decode request aborted before its
        pull frees them at once (engine_sim/disagg.py).
    kv_load_failure_policy: what a decode sim does when its pull fails (the prefill sim is gone,
        the pin expired): `fail` (vLLM 0.32's default) answers the request with vLLM's 500
        "Internal server error" (an error event on a stream); `recompute` prefills it locally.
    event_form: `map` (vLLM 0.26+, tagged maps) or `array` (the older positional form).
    crash_after / hang_after: fault knobs, see engine_sim/faults.py.
    restart_after_crash_s: come back this long after a crash (a supervisor restarting vLLM); None
        stays down.
    enable_prompt_tokens_details: vLLM's flag: usage.prompt_tokens_details (cached tokens; chat's
        also the tokens the prompt wrote to the cache).
    enable_request_id_headers: vLLM's flag (off by default): every answer carries X-Request-Id, the
        request's own or a fresh uuid4 hex.
    enable_server_load_tracking: vLLM's flag (off by default): GET /load counts the completions and
        chat requests in flight; off, it answers 0.
    aliases: further names the model is served under (vLLM's --served-model-name with several:
        `model` is the first, the name answers carry); requests may name any, with one cache.
    root: the model's path as the server was given it (its cards' `root`); "": `model`.
    enable_prefix_caching: vLLM's flag (on by default): off, no block is cached, hit or reported.
    lora_modules: LoRA adapters served next to `model` (engine_sim/lora.py); a request may name
        any of them.
    runtime_lora_updating: serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM:
        the environment's VLLM_ALLOW_RUNTIME_LORA_UPDATING, which the CLI reads).
    enable_auto_tool_choice / tool_call_parser: vLLM's flags. Without the first, a chat request whose
        tool_choice is not "none" (`tools` alone make it "auto") gets vLLM's 400; with it (it needs a
        registered parser name), such requests are served, and the sim's random tokens form no tool call.
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-llama"
    aliases: tuple[str, ...] = ()
    root: str = ""
    max_model_len: int = 32768
    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_events: KVEventsConfig = msgspec.field(default_factory=KVEventsConfig.ephemeral)
    profile: str = DEFAULT_PROFILE
    speedup: float = 1.0
    role: Role = "agg"
    kv_transfer_gbps: float = 50.0
    kv_lease_duration: float = 30.0
    kv_load_failure_policy: KvLoadFailurePolicy = "fail"
    event_form: EventForm = "map"
    crash_after: int | None = None
    hang_after: int | None = None
    slowdown: float = 1.0
    drop_event_fraction: float = 0.0
    restart_after_crash_s: float | None = None
    data_parallel_rank: int = 0
    enable_prompt_tokens_details: bool = False
    enable_request_id_headers: bool = False
    enable_server_load_tracking: bool = False
    enable_prefix_caching: bool = True
    lora_modules: tuple[LoraModule, ...] = ()
    runtime_lora_updating: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def validate(self) -> SimConfig:
        try:
            load_profile(self.profile)
        except ValueError as exc:
            # load_profile's own words: the known names for an unknown one, else the table's file and
            # its fault (a JSON error's line, a missing or badly typed key). Until 2026-12-07 every
            # fault was "allowed values: ...", which could list the very name refused.
            raise SimConfigError("profile", self.profile, str(exc)) from None
        if self.role not in ROLES:
            raise SimConfigError("role", self.role, "allowed values: " + ", ".join(ROLES))
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise SimConfigError(
                "kv_load_failure_policy",
                self.kv_load_failure_policy,
                "allowed values: " + ", ".join(KV_LOAD_FAILURE_POLICIES),
            )
        if self.event_form not in EVENT_FORMS:
            raise SimConfigError("event_form", self.event_form, "allowed values: " + ", ".join(EVENT_FORMS))
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise SimConfigError(name, getattr(self, name), "must be a positive integer")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise SimConfigError(
                "num_gpu_blocks", self.num_gpu_blocks, "must be an integer >= 2 (block 0 is vLLM's null block)"
            )
        for name in ("speedup", "kv_transfer_gbps", "slowdown", "kv_lease_duration", "restart_after_crash_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):  # NaN fails `> 0` too
                raise SimConfigError(name, value, "must be a finite number > 0")
        if not 0.0 <= self.drop_event_fraction <= 1.0:
            raise SimConfigError("drop_event_fraction", self.drop_event_fraction, "must be in [0, 1]")
        for name in ("crash_after", "hang_after"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise SimConfigError(name, value, "must be >= 0")
        if not 0 <= self.port <= 65535:
            raise SimConfigError("port", self.port, "must be in [0, 65535]")
        if (problem := self.kv_events.problem()) is not None:
            raise SimConfigError("kv_events_config", msgspec.json.encode(self.kv_events).decode(), problem)
        names = (self.model, *self.aliases)
        if len(set(names)) != len(names) or not all(names):
            raise SimConfigError("served_model_name", " ".join(names), "names must be distinct and non-empty")
        lora_requests(self.lora_modules, names)
        # vLLM looks the parser up only for --enable-auto-tool-choice, which refuses to start without one
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise SimConfigError("enable_auto_tool_choice", True, "requires --tool-call-parser, as vLLM's does")
        if self.enable_auto_tool_choice and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise SimConfigError(
                "tool_call_parser", self.tool_call_parser, "allowed values: " + ", ".join(TOOL_CALL_PARSERS)
            )
        return self

    def check_kv_fits_max_model_len(self) -> SimConfig:
        """vLLM refuses to start when its KV cache cannot hold one request of max_model_len tokens
        (vllm.v1.core.kv_cache_utils, "KV cache is needed"); a sim that started anyway would leave
        such a request waiting for blocks forever. Checked where the sim starts as vLLM does (the
        CLI), not in `validate()`: tests build small pools under the default max_model_len."""
        blocks = self.usable_gpu_blocks
        needed = -(-self.max_model_len // self.block_size)
        if needed > blocks:
            raise SimConfigError(
                "max_model_len",
                self.max_model_len,
                f"To serve at least one request with the model's max seq len ({self.max_model_len}), "
                f"{needed} KV cache blocks are needed, which is larger than the available KV cache "
                f"({blocks} blocks of {self.block_size} tokens). Based on the available KV cache, the "
                f"estimated maximum model length is {self.longest_max_model_len}. Try increasing "
                f"--num-gpu-blocks or decreasing --max-model-len when initializing the engine.",
            )
        return self

    @property
    def kv_bytes_per_token(self) -> int:
        return load_profile(self.profile).kv_bytes_per_token

    @property
    def resolved_num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        prof = load_profile(self.profile)
        free = _H200_BYTES * _GPU_UTIL - 2 * prof.params - _RUNTIME_OVERHEAD
        return max(2, int(free // (prof.kv_bytes_per_token * self.block_size)))

    @property
    def usable_gpu_blocks(self) -> int:
        """The blocks a request can hold: all but block 0, vLLM's null block."""
        return self.resolved_num_gpu_blocks - 1

    @property
    def longest_max_model_len(self) -> int:
        """The longest max_model_len `check_kv_fits_max_model_len` accepts."""
        return self.usable_gpu_blocks * self.block_size

    def replace(self, **changes: object) -> SimConfig:
        return msgspec.structs.replace(self, **changes)
