"""Which kind of engine answers at --engine-url, told by its /metrics: a shim given the wrong
`--engine` fails at the start of its session, naming the flag and the engine it found.

TensorRT-LLM's /metrics is JSON (a list of iteration stats, `[]` before its first iteration);
vLLM's and SGLang's are Prometheus text, their own series named `vllm:` and `sglang:`. Before,
a TensorRT-LLM shim before vLLM retried forever on "JSON is malformed", and an SGLang shim asked
for --block-size, or, given it, registered a worker every router excluded. A body no signature
matches says nothing (no body, or an engine's own series absent: a vLLM with
--disable-log-stats), so a real engine that is still starting is left to the checks and retries
that handle it.

kvswitch's own processes are recognised too, a router's (`kvswitch_router_*`) or a shim's
(`kvswitch_shim_*`): `--engine-url` given a router's address (a slip: both serve /v1/models) was
told that a vLLM started with --disable-log-stats exports no load series, a fix that does nothing.
Such a /metrics is no engine's: the error names `--engine-url`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from protocol import ConfigError

__all__ = ["SIGNATURES", "Signature", "check_engine_kind", "recognise"]


@dataclass(frozen=True, slots=True)
class Signature:
    kinds: tuple[str, ...]  # the --engine values whose engines serve such a /metrics; () for none: no engine
    looks: str  # what the engine serves, as the error says it (for no engine: what --engine-url points at)
    matches: Callable[[bytes], bool]


def _json_list(body: bytes) -> bool:
    try:
        return isinstance(msgspec.json.decode(body), list)
    except msgspec.DecodeError:
        return False


_ENGINE_PREFIXES = ("vllm:", "sglang:")


def _series_of(prefix: str) -> Callable[[bytes], bool]:
    """Samples or HELP/TYPE lines of `prefix`'s series, and of no other engine's (both is no
    engine's signature)."""

    def lines(p: str) -> re.Pattern[bytes]:
        return re.compile(rb"^(?:# (?:HELP|TYPE) )?" + re.escape(p.encode()), re.MULTILINE)

    own, others = lines(prefix), [lines(p) for p in _ENGINE_PREFIXES if p != prefix]
    return lambda body: own.search(body) is not None and not any(o.search(body) for o in others)


_PROMETHEUS = re.compile(rb"^# (?:HELP|TYPE) [a-zA-Z_:]", re.MULTILINE)

# First match wins: the engines' own series and kvswitch's before Prometheus text in general.
SIGNATURES: tuple[Signature, ...] = (
    Signature((), "a kvswitch router (its /metrics has kvswitch_router_* series)", _series_of("kvswitch_router_")),
    Signature((), "a kvswitch shim (its /metrics has kvswitch_shim_* series)", _series_of("kvswitch_shim_")),
    Signature(("trtllm",), "TensorRT-LLM's iteration stats (JSON) on /metrics", _json_list),
    Signature(("vllm",), "vLLM's metrics (vllm:*)", _series_of("vllm:")),
    Signature(("sglang",), "SGLang's metrics (sglang:*)", _series_of("sglang:")),
    Signature(
        ("vllm", "sglang"),
        "Prometheus text on /metrics, as vLLM and SGLang do (TensorRT-LLM's is JSON)",
        lambda body: _PROMETHEUS.search(body) is not None,
    ),
)


def recognise(metrics: bytes) -> Signature | None:
    """The signature an engine's /metrics body matches; None: it does not tell."""
    return next((s for s in SIGNATURES if s.matches(metrics)), None)


def check_engine_kind(engine: str, url: str, metrics: bytes) -> None:
    """ConfigError naming --engine when `metrics`, the /metrics body of the engine at `url`, is
    another kind of engine's than `engine`; naming --engine-url when it is kvswitch's own."""
    sig = recognise(metrics)
    if sig is not None and not sig.kinds:
        raise ConfigError(
            "engine_url", url, f"--engine-url points at {sig.looks}; it must be the engine's own URL, not kvswitch's"
        )
    if sig is not None and engine not in sig.kinds:
        give = " or ".join(f"--engine {kind}" for kind in sig.kinds)
        raise ConfigError("engine", engine, f"the engine at {url} serves {sig.looks}: give {give}")
