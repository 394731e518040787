"""The mean context of the requests an engine is decoding, as the shim counts them.

A decode step reads every running sequence's whole KV, shared prefix blocks included, so its cost
grows with the sequences' own lengths. The engine's KV use cannot give that: a prefix shared by
many sequences occupies its blocks once (`LoadReport.kv_used_blocks`). The shim sees every leg it
serves: a leg counts from its first output token until it ends, at its prompt plus the tokens
streamed so far. Routers fit their decode timing against this mean (router.calibration).
"""

from __future__ import annotations

__all__ = ["DecodeContext"]


class DecodeContext:
    """Legs past their first token and the sum of their lengths; O(1) per update."""

    def __init__(self) -> None:
        self._lengths: dict[str, int] = {}
        self._total = 0

    def grow(self, leg: str, tokens: int, prompt_tokens: int) -> None:
        """`tokens` more output tokens of `leg`, whose prompt has `prompt_tokens`."""
        if leg not in self._lengths:
            self._lengths[leg] = prompt_tokens
            self._total += prompt_tokens
        self._lengths[leg] += tokens
        self._total += tokens

    def end(self, leg: str) -> None:
        self._total -= self._lengths.pop(leg, 0)

    def mean(self) -> float:
        """Mean tokens per decoding leg; 0.0 while none decodes."""
        return self._total / len(self._lengths) if self._lengths else 0.0

    def __len__(self) -> int:
        return len(self._lengths)
