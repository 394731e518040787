"""One choice's output text, built as vLLM's incremental detokenizer builds it (vllm/v1/engine/
detokenizer.py), one token at a time:

- a token that ended the request as a stop token id adds no text (it stays in the token ids and
  the usage), unless `include_stop_str_in_output`;
- stop strings are looked for only once more than `min_tokens` tokens are out, in the text that
  could have just completed one; on a match the text ends before the stop string (or after it,
  with `include_stop_str_in_output`) and `stop_reason` names it. Of several, the one that
  completes earliest in the text wins, list order breaking ties (vLLM's check_stop_strings);
- while stop strings are set (and not included), the last `len(longest) - 1` characters are held
  back from the stream, since they could still begin one.
"""

from __future__ import annotations

__all__ = ["ChoiceText"]


class ChoiceText:
    __slots__ = ("_hold", "_include", "_min_tokens", "_sent", "_tokens", "stop_reason", "stops", "text")

    def __init__(self, stops: list[str], *, include_stop: bool = False, min_tokens: int = 0) -> None:
        self.stops = stops
        self._include = include_stop
        self._min_tokens = min_tokens
        self._hold = max((len(s) for s in stops), default=1) - 1 if stops and not include_stop else 0
        self.text = ""
        self._sent = 0
        self._tokens = 0
        self.stop_reason: str | int | None = None

    def add(self, piece: str, *, stop_token: int | None = None) -> str:
        """One output token's text (`stop_token`: its id, when it ended the request as a stop token
        id). Returns the text that may be sent now, possibly ""; `stop_reason` is set once stopped."""
        self._tokens += 1
        offset = len(self.text)
        if stop_token is None or self._include:
            self.text += piece
        if stop_token is not None:
            self.stop_reason = stop_token
        if self.stops and self._tokens > self._min_tokens:
            best: tuple[int, int, str] | None = None  # (end, start, stop string)
            for s in self.stops:
                i = self.text.find(s, max(0, offset + 1 - len(s)))
                if i >= 0 and (best is None or i + len(s) < best[0]):
                    best = (i + len(s), i, s)
            if best is not None:
                end, start, s = best
                self.text = self.text[: end if self._include else start]
                self.stop_reason = s
                return self.finish()
        return self._release(len(self.text) - self._hold)

    def finish(self) -> str:
        """Everything not sent yet: the request has ended."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self.text[self._sent : upto]
        self._sent = upto
        return out
