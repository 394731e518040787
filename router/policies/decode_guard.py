"""The decode guard: vetoes a bypass that would push the decode worker's KV cache too far.

Rule (DESIGN.md): with decode_busy_threshold set, a bypass is vetoed while

    (kv_used_blocks(d) + new_blocks) / kv_total_blocks(d) > decode_busy_threshold   (strict)

where `kv_used_blocks` is d's KV use as the load view knows it (its last report plus the decode
blocks routers booked on it that no report covers yet, i.e. `active_blocks`), `new_blocks` the
blocks this prompt adds beyond the prefix d already caches. Unknown capacity (no kv_total_blocks in the
report or the worker record) vetoes. Unset threshold: the guard is off. Applies to every policy.
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
        used = max(d.kv_used_blocks, d.active_blocks) + ctx.new_blocks(d)
        if used / total > threshold:
            return f"decode worker {d.worker} KV {used}/{total} blocks > {threshold:g}"
        return None
