"""The engine's tokenizer fingerprint, probed again while the engine fails the probe for now.

A shim registers its engine's tokenizer fingerprint (protocol.fingerprint, through vLLM's
/tokenize), and a router sends a worker text prompts only when it equals its own: a worker
registered without one ("") gets none from any router. The probe runs as a session starts, where a
busy engine may time out or answer 5xx: until 2026-12-07 that left the worker without a fingerprint
for its whole session. Now such a failure (a 5xx, 408 or 429, or no answer, which the adapter
gives as a 503) is probed again in the background, after RETRY_S and twice as long each time up to
RETRY_MAX_S, until the engine answers; the fingerprint then goes to `on_found`, which registers
it. A definitive answer is not probed again: a 4xx (an engine without /tokenize), or an adapter
that cannot ask (SGLang, TensorRT-LLM: None). One episode says a WARNING as it starts and an INFO
as it ends, never a line per try.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from protocol.fingerprint import BUILTIN, builtin_fingerprint
from runtime import background, cancel_and_wait
from worker_shim.adapters import EngineError

__all__ = ["RETRY_MAX_S", "RETRY_S", "TokenizerRetry", "registered_as", "transient"]

log = logging.getLogger(__name__)

RETRY_S = 2.0  # the first wait before a failed probe is tried again
RETRY_MAX_S = 60.0  # the longest: the probe is a handful of /tokenize calls
_TRANSIENT_4XX = frozenset({408, 429})  # the engine's "not now"


def transient(exc: EngineError) -> bool:
    """Whether the engine may answer the probe later: it failed, or was busy, not refused it."""
    return exc.code >= 500 or exc.code in _TRANSIENT_4XX


def registered_as(fp: str) -> str:
    """`fp` as the shim registers it: engine_sim's built-in vocabulary as `builtin`."""
    return BUILTIN if fp == builtin_fingerprint() else fp


class TokenizerRetry:
    """Probes the engine's tokenizer again (`probe`: the adapter's tokenizer_fingerprint), after a
    wait that doubles, until it answers; then `on_found(fingerprint)`. Owned by one session, whose
    end calls `stop()`."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[str | None]],
        failure: EngineError,
        on_found: Callable[[str], None],
    ) -> None:
        self._probe = probe
        self._on_found = on_found
        self.tries = 1
        log.warning(
            "the engine's tokenizer could not be probed (%s): tokenizer unknown, so routers refuse text "
            "requests for this worker until a probe succeeds; probing again in %.0fs, then less often",
            failure,
            RETRY_S,
        )
        self.task = background(
            self._run(),
            "tokenizer-probe",
            "the engine's tokenizer is not probed again this session: routers refuse this worker text requests",
        )

    async def _run(self) -> None:
        wait = RETRY_S
        while True:
            await asyncio.sleep(wait)
            self.tries += 1
            try:
                fp = await self._probe()
            except EngineError as exc:
                if transient(exc):
                    wait = min(wait * 2, RETRY_MAX_S)
                    continue
                why = str(exc)
            else:
                if fp is not None:
                    found = registered_as(fp)
                    log.info(
                        "the engine's tokenizer was probed on try %d (%s): registered, so routers send text "
                        "requests to this worker again",
                        self.tries,
                        found,
                    )
                    self._on_found(found)
                    return
                why = "the adapter cannot ask the engine to tokenize"
            log.warning(
                "the engine's tokenizer could not be probed (%s, on try %d): tokenizer unknown for this session, "
                "so routers refuse text requests for this worker",
                why,
                self.tries,
            )
            return

    async def stop(self) -> None:
        await cancel_and_wait(self.task)
