"""The mean context of the requests an engine is decoding, as the shim counts them.

A decode step reads every running sequence's whole KV, shared prefix blocks included, so its cost
grows with the sequences' own lengths. The engine's KV use cannot give that: a prefix shared by
many sequences occupies its blocks once (`LoadReport.kv_used_blocks`). The shim sees every leg it
serves: a leg counts from its first output token until it ends, at its prompt plus the tokens
streamed so far, as many times as it has sequences (a client's `n`: the engine decodes each, and
the tokens streamed are theirs together). Routers fit their decode timing against this mean
(router.calibration).
"""

from __future__ import annotations

__all__ = ["DecodeContext"]


class DecodeContext:
    """Legs past their first token, their sequences and the sum of their lengths; O(1) per update."""

    def __init__(self) -> None:
        self._lengths: dict[str, tuple[int, int]] = {}  # leg -> (its sequences' tokens, its sequences)
        self._total = 0
        self._sequences = 0

    def grow(self, leg: str, tokens: int, prompt_tokens: int, sequences: int = 1) -> None:
        """`tokens` more output tokens of `leg` (its `sequences` together), whose prompt has
        `prompt_tokens`."""
        length, seqs = self._lengths.get(leg, (0, 0))
        if not seqs:
            seqs = max(sequences, 1)
            length = seqs * prompt_tokens
            self._total += length
            self._sequences += seqs
        self._lengths[leg] = (length + tokens, seqs)
        self._total += tokens

    def end(self, leg: str) -> None:
        length, seqs = self._lengths.pop(leg, (0, 0))
        self._total -= length
        self._sequences -= seqs

    def mean(self) -> float:
        """Mean tokens per decoding sequence; 0.0 while none decodes."""
        return self._total / self._sequences if self._sequences else 0.0

    def __len__(self) -> int:
        return len(self._lengths)
