"""`EndpointProbe`: whether the KV event stream the shim reads is its own engine's.

Two shims given each other's `--kv-events` / `--kv-replay` each read a live stream of Stored
events, so no other events problem fires, and each would publish the other engine's cache as its
own worker's. Judged passively (the blocks of the prompts a shim dispatched, missing or foreign),
healthy workers were flagged (docs/worker_shim.md). So the shim asks instead: on every connection
of its event socket, and after every reset of the stream (a restarted engine, a gap not replayed,
a rebuild), it has its own engine serve one request (`EngineAdapter.serve_probe`): a fresh random
prompt of one block and one token at the engine's block size, one output token, the base model,
the shim's data-parallel rank. Its first block is in no cache, so the engine stores it and its
KV events announce a root BlockStored whose `token_ids` are that block's.

- The block shows on the stream, live or replayed: confirmed (INFO the first time), and
  OTHER_ENGINE, if raised, is cleared.
- Proof that the stream is another engine's. Suppose it were the probed engine's: one publisher,
  whose batches reach the shim in seq order (a gap is replayed, or resets the stream, which voids
  the probe), so every batch the engine made after it answered the probe comes after the probe's
  block. The answer's `created` is the engine's clock (floored to the second) when it took the
  request, so by that clock it answered before `created + 1 + rtt` (rtt: from the shim's send to
  the answer, by the shim's clock), and made the probe's batch before that. A batch stamped later
  than that, holding a Stored that the probe would have had to store too (full attention or a
  window at least the probe's length, the engine's own tier, blocks no larger than the probe's),
  delivered with no sight of the probe's block, contradicts it. OTHER_ENGINE is raised
  `timeout_s` after the answer at the earliest. The stamps are the engine's own clock against
  itself: no clock of the shim's is compared. A stream of an engine whose clock runs behind the
  probed one's may prove nothing until its batches are stamped past the mark (no verdict, never a
  false one).
- ZMQ drops what a PUB sends before the SUB's subscription reaches it, and on a stream without
  replay no seq reveals it. So the proof counts only for a probe sent after a batch of the same
  connection was delivered (the subscription was up); otherwise it sends a second probe, which
  has one.
- No verdict otherwise: a stream with no Stored after the probe (NO_STORED and NO_CONNECTION judge
  silence), an engine without prefix caching, a probe the engine fails (a refusal ends the tries
  on this connection, at WARNING; an engine error or timeout is retried RETRY_S later, at INFO),
  an engine whose adapter does not probe (SGLang, TensorRT-LLM: said once at INFO).

While OTHER_ENGINE is raised the shim withholds the stream (WorkerShim._sink): its index is
cleared and nothing of the foreign engine is published. A probe's block is an ordinary cached
block of the engine: published like any other. The probe is no leg of the request service, so the
credit check, the load the shim reports and the engine's reuse counter (the block is new: no hit)
do not count it, nor does the event health's count of Stored events (`owns`). At most one probe is
sent per `timeout_s`, and a probe request is never aborted by its confirmation, a reset or a
timeout (only by the session's end): each one sent (`sent`) is one whole request on the engine, one block + 1
prompt tokens and one output token, which `settled` says have all ended.

`--no-endpoint-probe` (ShimConfig.no_endpoint_probe; `enabled` False) sends none, for operators
who want no request on their engine that no client made (its request accounting, quotas): the
swapped endpoints are then not detected (INFO once at the first connection).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from runtime import background
from worker_shim.adapters.base import PROBE_OUTPUT_TOKENS, EngineError
from worker_shim.engine_events import FULL, WINDOW, EngineBatch, EngineStored
from worker_shim.event_health import EventHealth, EventProblem

__all__ = ["RETRY_S", "EndpointProbe"]

log = logging.getLogger(__name__)
RETRY_S = 30.0
# The probe's token ids: random, and below the vocabulary size of any model worth serving (a
# tokenizer's first ids are bytes and specials, which a prompt may hold as well as any).
_TOKEN_LOW, _TOKEN_HIGH = 1, 1000
_TRANSIENT_STATUS = (408, 429)
_RECENT = 8  # probes whose blocks `owns` still knows (a late one, a replay re-sending it)

Serve = Callable[[list[int], str], Awaitable[int]]


@dataclass(slots=True)
class _Probe:
    prompt: list[int]
    block_size: int
    request_id: str
    anchored: bool  # a batch of this connection was delivered before it was sent
    after: float | None = None  # the engine's clock past which its batches come after the probe's
    answered_at: float = 0.0  # time.monotonic()
    judge: asyncio.TimerHandle | None = None

    def announced_by(self, ev: EngineStored) -> bool:
        k = ev.block_size
        return ev.parent is None and 0 < k <= self.block_size and list(ev.token_ids[:k]) == self.prompt[:k]

    def owed_by_engine(self, ev: EngineStored) -> bool:
        """Whether the probe's prompt, stored by the engine that made `ev`, shows in that group."""
        if ev.medium not in (None, "GPU") or not ev.token_ids or not 0 < ev.block_size <= self.block_size:
            return False
        return ev.kind == FULL or (ev.kind == WINDOW and ev.window >= len(self.prompt))


class EndpointProbe:
    def __init__(
        self,
        health: EventHealth,
        serve: Serve | None,
        *,
        block_size: Callable[[], int | None],
        prefix_caching: Callable[[], bool | None],
        where: Callable[[], str],
        on_foreign: Callable[[bool], None],
        engine_url: str,
        enabled: bool = True,
    ) -> None:
        """`where`: the endpoints read, as the messages name them; `on_foreign(True)` when
        OTHER_ENGINE is raised, `on_foreign(False)` when a probe clears it. `enabled` False
        (`--no-endpoint-probe`): no probe is ever sent, so no verdict either; nor where `serve` is
        None (the adapter does not probe its engine: EngineAdapter.serves_probe)."""
        self.health = health
        self.serve = serve
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.where = where
        self.on_foreign = on_foreign
        self.engine_url = engine_url
        self.enabled = enabled
        # Requests of the shim's own sent the engine: `sent` probes and `alive` one-token requests
        # after a hang (WorkerShim._serves_one_token), and the work they cost it, so that what the
        # engine served less these is exactly what clients asked.
        self.sent = 0
        self.alive = 0  # of `sent` (kvswitch_shim_alive_requests_total; the rest, endpoint_probes_total)
        self.confirmed = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self._probe: _Probe | None = None
        self._task: asyncio.Task[None] | None = None
        # Probe requests the engine is serving: never aborted by a confirmation or a reset, so
        # each probe sent is one whole request on the engine (its accounting, its log).
        self._serving: set[asyncio.Future[int]] = set()
        self._connected = False  # a connection was seen: resets re-probe from then on
        self._delivered = False  # a batch of this connection was delivered
        self._last_sent = float("-inf")
        self._said: set[str] = set()
        self._recent: deque[_Probe] = deque(maxlen=_RECENT)

    @property
    def foreign(self) -> bool:
        return EventProblem.OTHER_ENGINE in self.health.problems

    @property
    def settled(self) -> bool:
        """The probing of this connection is over (confirmed, refused, or not probed; or off) and
        every probe request sent has ended: the engine's counters hold each probe's whole work
        (`sent` requests, `prompt_tokens`, `output_tokens`) until the next connection or reset."""
        if not self.enabled:
            return True
        idle = self._probe is None and (self._task is None or self._task.done()) and not self._serving
        return self._connected and idle

    def owns(self, ev: EngineStored) -> bool:
        """Whether `ev` announces a probe's block: the event health's count of Stored events leaves
        it out (a probe is no request the shim served)."""
        return ev.parent is None and any(p.announced_by(ev) for p in self._recent)

    def alive_sent(self, prompt_tokens: int, output_tokens: int) -> None:
        """The shim sent its engine a one-token request of its own after a hang: counted with the probes."""
        self.sent += 1
        self.alive += 1
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens

    def connected(self) -> None:
        """A new connection of the event socket: probe anew."""
        if not self.enabled:
            self._say_once(
                logging.INFO, "KV event endpoints not checked: --no-endpoint-probe (no probe request is sent)"
            )
            return
        self._connected, self._delivered = True, False
        if self.serve is None:  # the adapter does not probe this engine
            self._say_once(
                logging.INFO,
                "KV event endpoints not checked: the shim cannot match a probe request in this engine's events",
            )
            return
        self._restart()

    def batch(self, batch: EngineBatch) -> None:
        """Every batch the transport delivers, before anything else reads it."""
        if batch.reset and self._connected:
            self._restart()  # events before it may be lost: a probe sent before proves nothing
        self._delivered = True
        p = self._probe
        if p is None:
            return
        stored = [e for e in batch.events if isinstance(e, EngineStored)]
        if any(p.announced_by(e) for e in stored):
            self._confirm(p)
            return
        if p.after is None or batch.ts is None or batch.ts <= p.after or not any(map(p.owed_by_engine, stored)):
            return
        if not p.anchored:
            log.debug("KV events: a batch made after the endpoint probe, without its block; probing again")
            self._restart()
            return
        if p.judge is None and not self.foreign:
            wait = max(0.0, p.answered_at + self.health.timeout_s - time.monotonic())
            p.judge = asyncio.get_running_loop().call_later(wait, self._judge, p)

    def close(self) -> None:
        """The session ended: its probe, timers and requests go (OTHER_ENGINE stays until a probe
        clears it)."""
        self._drop()
        for serving in list(self._serving):
            serving.cancel()
        self._connected = self._delivered = False

    # --- internals ---------------------------------------------------------------------------

    def _drop(self) -> None:
        p, self._probe = self._probe, None
        if p is not None and p.judge is not None:
            p.judge.cancel()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    def _restart(self) -> None:
        self._drop()
        if self.serve is None:  # the adapter does not probe this engine
            return
        self._task = background(
            self._send(),
            "endpoint-probe",
            "the KV event endpoints are not checked until the event stream reconnects or resets",
        )

    def _say_once(self, level: int, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            log.log(level, "%s", text)

    async def _send(self) -> None:
        serve = self.serve
        assert serve is not None  # _restart starts no task where the adapter does not probe
        while True:
            # At most one probe per events timeout, however often the stream resets.
            await asyncio.sleep(max(0.0, self._last_sent + self.health.timeout_s - time.monotonic()))
            bs = self.block_size()
            if self.prefix_caching() is False or not bs:
                self._say_once(  # DEBUG: the shim's own line on the engine's missing prefix cache is the news
                    logging.DEBUG,
                    "KV event endpoints not checked: the engine runs without prefix caching, so it announces no "
                    "block of a probe",
                )
                return
            rng = random.Random(secrets.randbits(64))
            prompt = [rng.randrange(_TOKEN_LOW, _TOKEN_HIGH) for _ in range(bs + 1)]
            p = _Probe(prompt, bs, f"kvswitch-endpoint-probe-{secrets.token_hex(8)}", anchored=self._delivered)
            self._probe = p
            self._recent.append(p)
            self._last_sent = sent = time.monotonic()
            self.sent += 1
            self.prompt_tokens += len(prompt)
            self.output_tokens += PROBE_OUTPUT_TOKENS
            serving = asyncio.ensure_future(serve(prompt, p.request_id))
            self._serving.add(serving)
            serving.add_done_callback(self._served)
            try:
                # Shielded: a confirmation or a reset cancels this task, not the engine's request.
                created = await asyncio.shield(serving)
            except EngineError as exc:
                self._probe = None
                if 400 <= exc.code < 500 and exc.code not in _TRANSIENT_STATUS:
                    self._say_once(
                        logging.WARNING,
                        f"KV event endpoints not checked: the engine at {self.engine_url} refuses the probe request "
                        f"({exc}); the shim cannot tell whether the events it reads are this engine's",
                    )
                    return
                log.info("KV event endpoint probe failed (%s): trying again in %.0fs", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)
                continue
            if self._probe is p:
                p.answered_at = time.monotonic()
                p.after = created + 1 + (p.answered_at - sent)
            return

    def _served(self, serving: asyncio.Future[int]) -> None:
        self._serving.discard(serving)
        if not serving.cancelled():
            serving.exception()  # retrieved: a probe no task awaits any more failed quietly

    def _confirm(self, p: _Probe) -> None:
        self._drop()
        self.confirmed += 1
        level = logging.INFO if self.confirmed == 1 else logging.DEBUG
        log.log(level, "KV events: endpoints confirmed (a probe request's block showed on %s)", self.where())
        if self.foreign:
            self.health.resolved(EventProblem.OTHER_ENGINE)
            self.on_foreign(False)

    def _judge(self, p: _Probe) -> None:
        p.judge = None
        if self._probe is not p or self.foreign:
            return
        self.health.problem(
            EventProblem.OTHER_ENGINE,
            f"the KV events on {self.where()} are another engine's: this shim's probe request (a random prompt of "
            f"{len(p.prompt)} tokens) was served by the engine at {self.engine_url}, and its block never showed "
            "there, while that stream announced blocks its engine stored after the answer. --kv-events and "
            "--kv-replay are most likely another shim's (two shims given each other's endpoints): give this shim "
            f"those of the engine at {self.engine_url} (its --kv-events-config). Its KV events are withheld from "
            "routers until a probe's block shows (--no-endpoint-probe turns this check off, and with it the probe "
            "request)",
        )
        self.on_foreign(True)
