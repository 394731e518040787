"""The decode guard: vetoes a bypass that would push the decode worker's KV cache too far.

Rule (DESIGN.md): with decode_busy_threshold set, a bypass is vetoed while

    (kv_used_blocks(d) + request_blocks) / kv_total_blocks(d) > decode_busy_threshold   (strict)

where `kv_used_blocks` is d's KV use as the load view knows it (its last report plus the decode
blocks routers booked on it that no report covers yet, i.e. `active_blocks`), `request_blocks` all
the blocks of this prompt, its prefix d caches included. An engine's KV use counts only blocks
requests hold (vLLM's usage, engine_sim's BlockPool.num_used): a cached prefix no running request
holds is free until this request takes it, so admitting the request adds its whole prompt. That is
an upper bound for this request: it counts twice the prefix blocks a running request shares at
that moment. Not for the requests booked on d since its last report: each counts only its blocks
beyond d's cached prefix (the ledger books those, for selection too), so a burst of next turns
within one report period is counted low by the idle prefixes they take back, until the report that
follows their admission (a per-booking prefix count over-counted a prefix the burst shares: review
of 2026-12-07, docs/decisions.md). Unknown
capacity (no kv_total_blocks in the report or the worker record) vetoes. Unset threshold: the guard
is off. Applies to every policy's bypass, not to those the router forces (`bypass_sequences`,
`bypass_transfer_failing` and the like: router.disagg, docs/decisions.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import ConfigError
from protocol.config import ConditionalDisaggConfig
from router.request_context import RequestContext

__all__ = ["DecodeGuard"]


@dataclass(frozen=True, slots=True)
class DecodeGuard:
    decode_busy_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.decode_busy_threshold is not None and self.decode_busy_threshold < 0:
            raise ConfigError("decode_busy_threshold", self.decode_busy_threshold, "must be >= 0")

    @classmethod
    def from_settings(cls, cfg: ConditionalDisaggConfig) -> DecodeGuard:
        return cls(decode_busy_threshold=cfg.decode_busy_threshold)

    def veto(self, ctx: RequestContext) -> str | None:
        """Why the bypass must not happen, or None when it may."""
        threshold, d = self.decode_busy_threshold, ctx.decode
        if threshold is None or d is None:
            return None
        total = d.kv_total_blocks
        if not total:
            return f"decode worker {d.worker}: KV capacity unknown"
        used = max(d.kv_used_blocks, d.active_blocks) + ctx.request_blocks
        if used / total > threshold:
            return f"decode worker {d.worker} KV {used}/{total} blocks > {threshold:g}"
        return None
