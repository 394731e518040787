"""KV events over ZMQ with replay (vLLM's transport; SGLang uses the same one; frames and payloads:
protocol/vllm_events.py).

Sockets: a SUB on the event endpoint, subscribed to the topic and checking it exactly (ZMQ filters
by prefix), except for the suffix SGLang's main branch (not 0.5.23) adds with a
`snapshot_endpoint`: `\x00sgl-kv-epoch=` and its publisher's epoch (a token per publisher run), and
on a snapshot barrier (no events) `\x00sgl-kv-snapshot=` and the barrier's id; a DEALER to the
replay endpoint. Which side binds: `auto` reads the engine's own rule backwards: an endpoint with
`*` or `::` (or ipc://, inproc://; for SGLang `0.0.0.0` too) means the engine's PUB binds, so the
shim connects (to the engine host, for `*`, `0.0.0.0` and `::`); otherwise the engine's PUB
connects, so the shim binds that address. The engine's replay ROUTER always binds: the shim
connects, to the engine host for `*`, `0.0.0.0` and `::`. A socket whose address is an IPv6 one
sets zmq.IPV6 (ZMQ refuses it otherwise, "No such device", and a connect never delivers); one given
a name does not: ZMQ then resolves the name to its IPv6 address first, where an engine's IPv4-only
PUB (vLLM's and SGLang's set no zmq.IPV6) never answers. A bind this host cannot make (another
process listens there, no interface has the address, a name that keeps failing) is a ConfigError
naming the setting; one a later session may make (a name not resolving yet, a tentative IPv6
address) is tried again (zmq_bind). A `*` or `0.0.0.0` endpoint reached at an IPv6 engine host is a
ConfigError: the engine's sockets bind them on IPv4 only.

Sequence handling (seq is the engine's, per engine run, from 0):
- at start, and whenever the whole state is wanted again (`request_rebuild`), replay from 0: a replay
  that starts at 0 rebuilds exactly; one that starts later (the engine's buffer wrapped) or no
  replay at all leaves a partial state (`complete=False`);
- the next seq is delivered; a gap is filled by replay from the first missing seq (what of it came
  live, held by the live socket, is delivered as live; only the missing seqs as replayed); a replay that
  cannot fill it (it starts later than asked, or times out) resets with `complete=False`; so does a
  probe (below) whose replay starts later than the next seq;
- a seq at or below the last one outside the window right after a replay means the engine restarted;
  so does another publisher epoch (SGLang), whatever its seq;
- a snapshot barrier (SGLang) is counted; it holds no events, but takes a seq like any batch;
- the SUB socket reconnecting (ZMQ monitor: a peer whose ZMTP handshake succeeded) replays from
  the last seq delivered: a restarted engine's first batches may have gone out before the link was
  back, and nothing else would reveal them. If the replay holds that seq with the payload received
  live (replayed payloads are byte-identical, and each carries its step's timestamp), the engine's
  run goes on: the batches after it are delivered (what the new link holds by then as live) and
  nothing is reset. With replay and no batch delivered yet, the shim holds nothing of the engine's
  to lose: the engine's limits and served names are read again (`engine_changed`), and only a
  difference ends the run. Otherwise (the seq went back, the payload differs, the buffer no longer
  holds it, or there is no replay to ask) the engine restarted, or cannot be shown not to have.
  Rebuilding on every reconnection wiped the index of a long-lived engine, whose buffer (vLLM: the
  last `buffer_steps` batches) no longer starts at 0;
- an engine that restarted (or cannot be shown not to have) ends `run` with EngineRestarted, before
  any batch of its new run is delivered: a restarted engine may run with another block size, KV
  capacity or context length, so the shim ends the session and registers anew, reading them again.
  Until 2026-12-07 the stream was reset and rebuilt from the new run, and an engine back within the
  shim's health checks kept its worker id and the old run's limits (docs/worker_shim.md);
- SETTLE_S after every connection, a replay from the next seq fetches what the PUB dropped before
  the subscription reached it: a later batch would reveal that gap, but an engine that then goes
  quiet sends none, and the index would miss those blocks until it did. For the same reason a
  replay from the next seq follows every QUIET_PROBE_S of quiet after a live batch: the last batch
  before a quiet spell, lost on the way, has no later one to reveal it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import ClassVar

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.errors import ConfigError, ProtocolError
from protocol.vllm_events import END_SEQ, decode_pub_frames, decode_replay_reply, publisher_binds, replay_request
from protocol.zmq_endpoint import ZmqEndpoint, split_endpoint
from runtime.turns import SLICE_S, Turns
from worker_shim.adapters.http_engine import HttpEngineAdapter
from worker_shim.adapters.vllm_events import decode_stamped
from worker_shim.adapters.zmq_bind import UNBINDABLE, BindFailures, socket_for
from worker_shim.config import KvEventsMode, ShimConfig
from worker_shim.engine_events import EngineBatch, EngineEvent, EngineRestarted, EventSink, UnknownEngineEvent
from worker_shim.event_health import EventHealth, EventProblem
from worker_shim.unknown_event_types import UnknownEventTypes

__all__ = ["ZmqEventSource", "ZmqEventStats", "ZmqEventsAdapter", "engine_binds", "resolve_endpoint"]

log = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 2.0
POLL_MS = 250
# After a connection, the PUB drops batches until the SUB's subscription reaches it (ZMQ's slow
# joiner); a replay this long after the connection fetches what went out in that window.
SETTLE_S = 1.0
# Once the live socket has been quiet this long after a batch, a replay from the next seq: a batch
# lost on the way (the PUB's high-water mark) shows as a gap only when a later one comes, and the
# last before the engine goes quiet has none after it. The index lacked its blocks until then.
QUIET_PROBE_S = 1.0
# SGLang with a snapshot_endpoint: live topic = topic + EPOCH_MARKER + epoch, and a snapshot
# barrier's = that + BARRIER_MARKER + its id (sglang/srt/disaggregation/kv_events.py).
EPOCH_MARKER = b"\x00sgl-kv-epoch="
BARRIER_MARKER = b"\x00sgl-kv-snapshot="
# A connection's ZMTP handshake, succeeded (a peer) or failed (no peer: its disconnection, which
# libzmq's one I/O thread reports right after, is no peer's either).
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED


def _digest(payload: bytes) -> bytes:
    """What the source keeps of the last payload delivered (not the payload: a batch may hold a long
    prompt's tokens): enough to tell a replay of it from another engine run's batch at that seq."""
    return xxhash.xxh3_128_digest(payload)


def engine_binds(endpoint: str, engine: str) -> bool:
    """Whether the engine's PUB binds `endpoint`: vLLM's rule; SGLang's PUB binds `0.0.0.0` too
    (its ZmqEventPublisher._socket_setup), where vLLM 0.32's connects to it."""
    return publisher_binds(endpoint) or (engine == "sglang" and "0.0.0.0" in endpoint)


def _rule(engine: str) -> str:
    wildcards = (
        "SGLang's rule: an endpoint with `*` or `0.0.0.0`"
        if engine == "sglang"
        else "vLLM's rule: an endpoint with `*`"
    )
    return (
        f"{wildcards} (or `::`, ipc://, inproc://) makes the engine BIND it and the shim connect to the engine "
        "host; any other endpoint makes the engine CONNECT to it and the shim must bind that address"
    )


def _on_engine_host(address: str, engine_host: str) -> str:
    """An address the engine binds, as the shim reaches it: a bind-all host (`*`, `0.0.0.0`,
    `::`) is the engine host."""
    split = split_endpoint(address)
    return split.on_host(engine_host) if split is not None and split.wildcard else address


def _ipv4_only(endpoint: str, engine_host: str) -> ZmqEndpoint | None:
    """`endpoint` split if the engine binds it on IPv4 only (`*`, `0.0.0.0`: vLLM's and SGLang's
    sockets set no zmq.IPV6) and the shim would reach it at an IPv6 engine host; else None."""
    split = split_endpoint(endpoint)
    if split is None or split.host not in ("*", "0.0.0.0"):
        return None
    try:
        host = ipaddress.ip_address(engine_host.partition("%")[0])
    except ValueError:
        return None
    return split if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is None else None


def _ipv4_only_error(setting: str, given: str, port: int | None, reached: str, socket_: str) -> ConfigError:
    """Refusing an endpoint the shim would reach at an IPv6 engine host, naming the way out."""
    flag = (
        f"--kv-events tcp://<engine IPv4>:{port} --kv-events-mode connect"
        if socket_ == "PUB"
        else f"--kv-replay tcp://<engine IPv4>:{port}"
    )
    return ConfigError(
        setting,
        given,
        f"the engine's {socket_} listens on IPv4 only (vLLM's and SGLang's set no zmq.IPV6), and the shim "
        f"would reach it at the IPv6 engine host of --engine-url ({reached}), where nothing answers: "
        f"give {flag}, or an --engine-url with the engine's IPv4 address",
    )


def resolve_endpoint(endpoint: str, mode: KvEventsMode, engine_host: str, engine: str) -> tuple[str, bool]:
    """(address, bind) for the shim's SUB socket from the engine's endpoint string."""
    bind = mode == "bind" or (mode == "auto" and not engine_binds(endpoint, engine))
    if bind:
        return endpoint, True
    return _on_engine_host(endpoint, engine_host), False


@dataclass(slots=True)
class ZmqEventStats:
    messages: int = 0
    malformed: int = 0
    other_topic: int = 0
    barriers: int = 0  # SGLang's snapshot barriers: no events
    other_rank: int = 0  # batches of another data-parallel rank, dropped
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    duplicates: int = 0
    reconnects: int = 0


class ZmqEventSource:
    """One run of the engine's event stream; `stats` and `health` may outlive it (the adapter's)."""

    def __init__(
        self,
        engine: str,
        endpoint: str,
        mode: KvEventsMode,
        topic: str,
        replay: str | None,
        engine_host: str,
        *,
        health: EventHealth | None = None,
        stats: ZmqEventStats | None = None,
        unknown: UnknownEventTypes | None = None,
        rank: int | None = None,
        rank_given: bool = True,
        setting: str = "kv_events",
        bind_failures: BindFailures | None = None,
        engine_changed: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        """`rank`: the data-parallel rank whose events these must be (vLLM's batches name it); None
        checks nothing. `rank_given`: whether --data-parallel-rank named it (else the server's one rank).
        `setting`: where the endpoint came from, named by a ConfigError (kv_events or kv_events_config).
        `bind_failures`: the failed binds so far (the adapter's, across sessions). `engine_changed`:
        what the engine's limits or served names now differ in from the session's (None: nothing),
        asked on a reconnection with nothing delivered yet; without it such a one ends the run."""
        self.engine_changed = engine_changed
        self.setting = setting
        self.bind_failures = bind_failures or BindFailures()
        self.engine = engine
        self.rank = rank
        self.rank_given = rank_given
        self.endpoint = endpoint
        self.mode = mode
        self.address, self.bind = resolve_endpoint(endpoint, mode, engine_host, engine)
        self.topic = topic.encode()
        self.replay_address = _on_engine_host(replay, engine_host) if replay else None
        replay_setting = "kv_replay" if setting == "kv_events" else setting
        for name, given, reached, socket_ in (
            (setting, endpoint, None if self.bind else self.address, "PUB"),
            (replay_setting, replay, self.replay_address, "replay ROUTER"),
        ):
            if given is not None and reached is not None and (split := _ipv4_only(given, engine_host)):
                raise _ipv4_only_error(name, given, split.port, reached, socket_)
        self.health = health or EventHealth()
        self.stats = stats or ZmqEventStats()
        self.unknown = unknown or UnknownEventTypes()
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._last: int | None = None
        self._last_digest: bytes | None = None  # _digest of seq _last's payload
        self._epoch: bytes | None = None  # the publisher run's, when the topic names one (SGLang)
        self._replayed_until = -1
        self._rebuild = False
        self._connections = 0
        self._peers = 0
        self._handshake_failed = False  # the next disconnection is that connection's (no peer)
        self._alone_since: float | None = None
        self._probed = False
        self._settle_at: float | None = None
        self._quiet_probe_at: float | None = None  # due after the last live batch, once
        self._logged: set[str] = set()

    def request_rebuild(self) -> None:
        self._rebuild = True

    async def run(self, sink: EventSink, live: asyncio.Event) -> None:
        ctx = self._ctx = zmq.asyncio.Context()
        sub = self._sub = socket_for(ctx, zmq.SUB, self.address)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        # Connection events: a peer that reconnects may be a restarted engine whose first batches
        # went out before the link was back, so every reconnection is checked against a replay; no
        # peer for long is a wrong endpoint or side, or, once one was connected, an engine restarting.
        # A peer is one whose ZMTP handshake succeeded: a TCP connection that never speaks ZMTP (a
        # port check, nc -z, a scan) is accepted by a bound SUB too, and until 2026-12-07 each one
        # counted as the engine reconnecting (without --kv-replay: a new worker id every time).
        monitor = sub.get_monitor_socket(HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED)
        self._alone_since = time.monotonic()
        try:
            if self.bind:
                await self._bind(sub)
            else:
                sub.connect(self.address)
            if self.replay_address is not None:
                replayed = await self._replay(0)
                if replayed is None:
                    raise ConnectionError(f"{self.engine} replay endpoint {self.replay_address} does not answer")
                await self._deliver_rebuild(replayed, sink)
            else:
                await sink(EngineBatch(reset=True, complete=False))
            live.set()
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll(POLL_MS))
                if monitor in ready and await self._on_monitor(monitor):
                    # Before the live socket's batches: they may be a restarted engine's.
                    await self._on_reconnect(sink)
                self._check_peer()
                if self._settle_at is not None and time.monotonic() >= self._settle_at:
                    self._settle_at = None
                    await self._probe(sink, "after the connection settled")
                if self._quiet_probe_at is not None and time.monotonic() >= self._quiet_probe_at:
                    self._quiet_probe_at = None
                    await self._probe(sink, f"after {QUIET_PROBE_S:g} s of quiet")
                if sub in ready:
                    turn = Turns(SLICE_S)
                    while True:
                        try:
                            frames = await sub.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        await self._on_message(frames, sink)
                        await turn.take()
                if self._rebuild:
                    self._rebuild = False
                    await self._deliver_rebuild(await self._replay(0), sink)
                if self.health.silent.is_set() != self._probed:
                    self._probed = self.health.silent.is_set()
                    if self._probed:
                        await self._probe(sink, "after a served request looked unannounced")
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            ctx.term()
            self._ctx = self._sub = None

    async def _bind(self, sub: zmq.asyncio.Socket) -> None:
        try:
            sub.bind(self.address)
        except zmq.ZMQError as exc:
            if exc.errno not in UNBINDABLE:
                raise
            # The same errnos for a bind that never works and one a later session makes: a
            # ConfigError, or a BindPending whose cause is said once naming the setting.
            raise await self.bind_failures.error(self.setting, self.endpoint, self.address, exc) from exc
        self.bind_failures.bound()

    async def _on_monitor(self, monitor: zmq.asyncio.Socket) -> bool:
        """Handle every connection event queued; whether one was a reconnection. Every one: a
        disconnection and the reconnection may be queued together, and the new link's batches must
        not be read before the reconnection is handled."""
        reconnected = False
        while True:
            try:
                frames = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return reconnected
            reconnected |= self._on_connection_event(parse_monitor_message(frames)["event"])

    def _on_connection_event(self, event: int) -> bool:
        if event & HANDSHAKE_FAILED:
            self._handshake_failed = True
            return False
        if event == zmq.EVENT_DISCONNECTED:
            if self._handshake_failed:  # the connection whose handshake failed just now: no peer
                self._handshake_failed = False
                return False
            self._peers = max(0, self._peers - 1)
            if self._peers == 0:
                self._alone_since = time.monotonic()
            return False
        self._peers += 1
        self._alone_since = None
        self._settle_at = time.monotonic() + SETTLE_S
        self.health.connected()
        self._connections += 1
        if self._connections > 1:
            self.stats.reconnects += 1
            return True
        return False

    async def _on_reconnect(self, sink: EventSink) -> None:
        """Carry on from the last seq delivered if the engine's run continues it, else end the run
        (EngineRestarted). Judged with a rebuild pending too: a rebuild from 0 of a restarted
        engine's run kept the old run's session."""
        last, digest = self._last, self._last_digest
        if last == -1 and self.engine_changed is not None:
            await self._reconnect_before_any_batch(self.engine_changed)
            return
        if last is None or last < 0 or digest is None:
            raise self._restarted(
                "its KV event socket reconnected before any batch of the engine's run was delivered, so the run "
                "cannot be shown to go on"
            )
        replayed = await self._replay(last)
        if replayed is None:
            no = "the shim has no replay socket (--kv-replay)" if self.replay_address is None else "its replay failed"
            raise self._restarted(f"its KV event socket reconnected and {no} to show the run goes on")
        if replayed and replayed[0][0] == last and _digest(replayed[0][1]) == digest:
            # The same run: the shim holds all up to `last`. A rebuild from 0 would lose it all
            # once the engine's buffer has wrapped (vLLM keeps only the last buffer_steps).
            log.info("%s KV events: peer reconnected; the engine's run continues from seq %d", self.engine, last)
            # The replay runs to the newest seq: what the new link holds by its answer came live
            # and is delivered as live, as in _fill_gap. Until 2026-12-07 all of it counted as
            # replayed, so the live-batch count fell short after every reconnection.
            queued, came = await self._queued()
            turn = Turns(SLICE_S)
            for s, p in replayed[1:]:
                await self._deliver(s, p, sink, live=s in came)
                await turn.take()
            self._replayed_until = replayed[-1][0]
            for frames in queued:  # those delivered just now are duplicates; later ones follow
                await self._on_message(frames, sink)
                await turn.take()
            return
        # Seq `last` gone (the seq went back, or the buffer wrapped past it) or another run's: a
        # restart, or nothing to prove there was none.
        held = "another batch" if replayed and replayed[0][0] == last else "no batch"
        raise self._restarted(
            f"its KV event socket reconnected and its replay holds {held} at seq {last}, the last the shim "
            "delivered: not provably the same engine run"
        )

    async def _reconnect_before_any_batch(self, engine_changed: Callable[[], Awaitable[str | None]]) -> None:
        """A reconnection with replay on and nothing delivered yet (an idle SGLang engine has no
        endpoint probe to publish for it): the shim holds nothing of the engine's to lose, and a
        restarted engine's seqs start at 0, as the shim expects; what a restart may change is the
        engine's limits and served names, read again. Until 2026-12-07 (056b6ce) such a reconnection
        ended the session even with --kv-replay."""
        changed = await engine_changed()
        if changed is not None:
            raise self._restarted(
                f"its KV event socket reconnected before any batch of the engine's run was delivered, and {changed}"
            )
        # The new link's batches follow, from seq 0; what it missed, the settle probe replays.
        log.info("%s KV events: peer reconnected before any batch; the engine's limits are unchanged", self.engine)

    def _check_peer(self) -> None:
        since = self._alone_since
        timeout = self.health.timeout_s
        if since is None or time.monotonic() - since < timeout or EventProblem.NO_CONNECTION in self.health.problems:
            return
        if self._connections:
            # The endpoint was right a moment ago: the engine went away, most likely restarting.
            self.health.problem(
                EventProblem.NO_CONNECTION,
                f"the engine's KV event connection at {self.address} dropped {time.monotonic() - since:.1f}s ago "
                "and has not come back (engine restarting?). If the engine is up again, it was restarted without "
                "its KV events config (vLLM: --kv-events-config) or with another endpoint",
                logging.WARNING,
            )
            return
        if self.bind:
            what = f"no engine connected to the KV event socket the shim bound at {self.address} within {timeout:g}s"
        else:
            what = f"the shim's KV event socket found no engine at {self.address} within {timeout:g}s"
        side = (
            f"--kv-events-mode {self.mode} forces the shim to {'bind' if self.bind else 'connect'}"
            if self.mode != "auto"
            else f"the endpoint {self.endpoint!r} makes the shim {'bind' if self.bind else 'connect'}"
        )
        self.health.problem(
            EventProblem.NO_CONNECTION,
            f"{what}. {_rule(self.engine)}; {side}. Give --kv-events the endpoint exactly as the engine was given it "
            "(or the engine's whole JSON with --kv-events-config) and check that the engine host in "
            "--engine-url is where its PUB socket is",
        )

    async def _probe(self, sink: EventSink, when: str) -> None:
        """Ask the replay socket what the engine sent after the last seq delivered, and deliver what
        the live socket missed (the engine looked silent after a served request, or a connection
        has just settled)."""
        start = self._last + 1 if self._last is not None and self._last >= 0 else 0
        replayed = await self._replay(start)
        missed = [(s, p) for s, p in replayed or [] if self._last is None or s > self._last]
        if not missed:
            return
        # A batch the engine sent while the replay was asked for is in the replay and on the live
        # socket (vLLM's publisher sends a batch, then buffers it, and answers a replay between two
        # batches): what the live socket holds now came live and is delivered as live. Taken for
        # lost, it was delivered as replayed (proving nothing of the live stream: event_health) with
        # a WARNING that the live socket missed it, about once a second per shim against real vLLM.
        queued, came = await self._queued()
        lost = [s for s, _ in missed if s not in came]
        if lost:
            log.warning(
                "%s KV events: the replay socket holds seq %d..%d that the live socket at %s never delivered (%s)",
                self.engine,
                lost[0],
                lost[-1],
                self.address,
                when,
            )
        reset = self._last is not None and missed[0][0] != start
        if reset:
            # The buffer wrapped past what the live socket missed (BlockRemoved among it, maybe):
            # a gap that cannot be replayed, as in _fill_gap.
            self.stats.gaps += 1
            self.stats.replay_failures += 1
            log.warning("%s KV events: gap %d..%d cannot be replayed: resetting", self.engine, start, missed[0][0] - 1)
        turn = Turns(SLICE_S)
        for i, (s, p) in enumerate(missed):
            await self._deliver(s, p, sink, reset=reset and i == 0, complete=False, live=s in came)
            await turn.take()
        self._replayed_until = missed[-1][0]
        for frames in queued:  # those delivered just now are duplicates; later ones follow
            await self._on_message(frames, sink)
            await turn.take()

    async def _queued(self) -> tuple[list[list[bytes]], set[int]]:
        """The messages the live socket holds, unread, and the seqs of this engine run's among them:
        a replay holding those seqs delivers them as live (they came live)."""
        out: list[list[bytes]] = []
        sub = self._sub
        while sub is not None:
            try:
                out.append(await sub.recv_multipart(flags=zmq.NOBLOCK, copy=True))
            except zmq.Again:
                break
        # No epoch known yet (SGLang's first rebuild): the first among these is the one _on_message
        # takes from them; until 2026-12-07 none matched, and all of them counted as replayed.
        epoch, came = self._epoch, set[int]()
        for live in map(self._live_seq, out):
            if live is None:
                continue
            their, seq = live
            if epoch is None:
                epoch = their
            if their in (None, epoch):
                came.add(seq)
        return out, came

    def _live_seq(self, frames: list[bytes]) -> tuple[bytes | None, int] | None:
        """(publisher epoch, seq) of a live message of this engine's topic; None for any other."""
        try:
            topic, seq, _ = decode_pub_frames(frames)
        except ProtocolError:
            return None
        parts = self._topic_parts(topic)
        return (parts[0], seq) if parts is not None else None

    def _malformed(self, exc: ProtocolError) -> None:
        self.stats.malformed += 1
        if exc.kind not in self._logged:
            self._logged.add(exc.kind)
            log.warning("%s KV events: %s (logged once per kind)", self.engine, exc)

    async def _on_message(self, frames: list[bytes], sink: EventSink) -> None:
        self.stats.messages += 1
        if self.replay_address is not None:
            self._quiet_probe_at = time.monotonic() + QUIET_PROBE_S
        try:
            topic, seq, payload = decode_pub_frames(frames)
        except ProtocolError as exc:
            self._malformed(exc)
            return
        parts = self._topic_parts(topic)
        if parts is None:
            self.stats.other_topic += 1
            return
        epoch, barrier = parts
        if barrier:
            self.stats.barriers += 1  # no events, but its seq is one of the run's like any batch's
        known, last = self._epoch, self._last
        if epoch is not None:
            if known is not None and epoch != known:
                # A new publisher run, whose seqs start from 0 again: a seq that looks like the next
                # one, or a gap, is no continuation of what the shim holds.
                old, new = known.decode(errors="replace"), epoch.decode(errors="replace")
                raise self._restarted(f"its KV event publisher's epoch went from {old} to {new}")
            self._epoch = epoch
        if last is not None and seq <= last:
            if seq <= self._replayed_until:
                self.stats.duplicates += 1  # already delivered by the replay just before
                return
            raise self._restarted(f"its KV event seq went back from {last} to {seq}")
        if seq > self._replayed_until >= 0:
            self._replayed_until = -1  # live past the replay (ZMQ keeps order): no copy of it comes now
        if last is not None and seq > last + 1:
            self.stats.gaps += 1
            await self._fill_gap(last + 1, seq, payload, sink)
            return
        await self._deliver(seq, payload, sink)

    def _topic_parts(self, topic: bytes) -> tuple[bytes | None, bool] | None:
        """(publisher epoch, whether a snapshot barrier) of a live message's topic; None for
        another topic. Without a topic of its own the shim takes every topic, as ZMQ then does."""
        if not topic.startswith(self.topic):
            return None
        rest = topic[len(self.topic) :]
        if rest.startswith(EPOCH_MARKER):
            epoch, marker, _ = rest[len(EPOCH_MARKER) :].partition(BARRIER_MARKER)
            return epoch, bool(marker)
        return (None, False) if not rest or not self.topic else None

    def _restarted(self, why: str) -> EngineRestarted:
        """What ends `run` on a new engine run (counted in `restarts`); said by the shim, which ends
        the session."""
        self.stats.restarts += 1
        return EngineRestarted(self.engine, why)

    async def _fill_gap(self, first_missing: int, seq: int, payload: bytes, sink: EventSink) -> None:
        # The SUB socket queues what arrives meanwhile, and the replay holds it too (it runs to the
        # newest seq): `seq` and what the live socket holds are delivered from the replay as live,
        # as in _probe, their live copies then skipped as duplicates. Until 2026-12-07 all of it
        # counted as replayed, so the live-batch count fell short after every gap.
        replayed = await self._replay(first_missing)
        if replayed and replayed[0][0] == first_missing:
            queued, came = await self._queued()
            came.add(seq)
            turn = Turns(SLICE_S)
            for s, p in replayed:
                await self._deliver(s, p, sink, live=s in came)
                await turn.take()
            self._replayed_until = replayed[-1][0]
            if seq > self._replayed_until:
                await self._deliver(seq, payload, sink)
            for frames in queued:
                await self._on_message(frames, sink)
                await turn.take()
            return
        if replayed is not None:  # a timeout is counted by _replay
            self.stats.replay_failures += 1
        log.warning("%s KV events: gap %d..%d cannot be replayed: resetting", self.engine, first_missing, seq - 1)
        await self._deliver(seq, payload, sink, reset=True, complete=False)

    async def _deliver(
        self,
        seq: int,
        payload: bytes,
        sink: EventSink,
        *,
        reset: bool = False,
        complete: bool = True,
        live: bool = True,
    ) -> None:
        self._last, self._last_digest = seq, _digest(payload)
        events: list[EngineEvent] = []
        ts: float | None = None
        try:
            events, rank, ts, errors = decode_stamped(payload, self.engine)
        except ProtocolError as exc:
            self._malformed(exc)
        else:
            for error in errors:  # each left out; the batch's other events still count
                if isinstance(error, UnknownEngineEvent):
                    self.unknown.add(self.engine, error.event_type)
                else:
                    self._malformed(error)
            if self.rank is not None and rank is not None and rank != self.rank:
                self._wrong_rank(rank)
                events = []
        if events or reset:
            await sink(EngineBatch(events=events, reset=reset, complete=complete, live=live, ts=ts))

    async def _deliver_rebuild(self, replayed: list[tuple[int, bytes]] | None, sink: EventSink) -> None:
        # An empty replay means the engine has published nothing yet: nothing is missing.
        complete = replayed is not None and (not replayed or replayed[0][0] == 0)
        # With replay, the next live seq must follow what it returned (-1: expect seq 0).
        self._last, self._last_digest = (None if replayed is None else -1), None
        # The replay runs to the newest seq: what the live socket holds by its answer came live and
        # is delivered as live, as in _fill_gap. Until 2026-12-07 all of it counted as replayed, so
        # the live-batch count fell short after every rebuild.
        queued, came = await self._queued()
        await sink(EngineBatch(reset=True, complete=complete, live=False))
        turn = Turns(SLICE_S)
        for s, p in replayed or []:
            await self._deliver(s, p, sink, live=s in came)
            await turn.take()
        if replayed:
            self._replayed_until = replayed[-1][0]
        for frames in queued:  # those delivered just now are duplicates; later ones follow
            await self._on_message(frames, sink)
            await turn.take()

    def _wrong_topic(self, topic: bytes) -> None:
        self.stats.other_topic += 1
        real, ours = topic.decode(errors="replace"), self.topic.decode(errors="replace")
        self.health.problem(
            EventProblem.WRONG_TOPIC,
            f"the engine publishes KV events under topic {real!r} (its replay socket shows it) but the shim "
            f"subscribes to {ours!r}, and the live socket filters by topic, so it delivers nothing: set "
            f"--kv-events-topic {real} (the topic of the engine's --kv-events-config)",
        )

    def _wrong_rank(self, rank: int) -> None:
        self.stats.other_rank += 1
        if self.rank_given:
            fix = (
                f"give --data-parallel-rank {rank}, or the endpoint the engine was given (the shim offsets it "
                "by its rank, as vLLM does)"
            )
        else:  # the server's one rank (an external load-balanced vLLM: an API server per rank)
            fix = (
                f"give --data-parallel-rank {self.rank} with the engine's --kv-events-config (the shim offsets "
                f"its endpoints by the rank, as vLLM does), or the endpoints rank {self.rank} publishes on"
            )
        self.health.problem(
            EventProblem.WRONG_RANK,
            f"the KV events on {self.endpoint} come from data-parallel rank {rank}, but this shim serves rank "
            f"{self.rank}, whose requests go to another rank's cache: {fix}",
        )

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Everything the engine still buffers from `start` on; None when replay is unavailable."""
        if self.replay_address is None or self._ctx is None:
            return None
        self.stats.replays += 1
        dealer = socket_for(self._ctx, zmq.DEALER, self.replay_address)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_address)
            await dealer.send_multipart(replay_request(start))
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                turn = Turns(SLICE_S)
                while True:
                    await turn.take()
                    frames = await dealer.recv_multipart()
                    try:
                        topic, seq, payload = decode_replay_reply(frames)
                    except ProtocolError as exc:
                        self._malformed(exc)
                        continue
                    if seq == END_SEQ:
                        return out
                    if topic is not None and self.topic and topic != self.topic:
                        self._wrong_topic(topic)
                        continue
                    if seq >= start:
                        out.append((seq, payload))
        except TimeoutError:
            self.stats.replay_failures += 1
            log.warning("%s KV replay from %d: no end marker within %.0fs", self.engine, start, REPLAY_TIMEOUT_S)
            return None
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)


class ZmqEventsAdapter(HttpEngineAdapter):
    """An HTTP-served engine whose KV events come over ZMQ (vLLM, SGLang): one ZmqEventSource per
    `run_events` call, on the endpoints the shim was given (validated by ShimConfig)."""

    # vLLM's batches name the data-parallel rank that published them; SGLang's dp attention ranks
    # are not vLLM's, so only vLLM's adapter checks them.
    checks_rank: ClassVar[bool] = False

    def __init__(self, config: ShimConfig) -> None:
        super().__init__(config)
        self._events: ZmqEventSource | None = None
        self.stats = ZmqEventStats()
        self.unknown = UnknownEventTypes()
        self.bind_failures = BindFailures()
        # The rank whose events these must be: the shim's, or the one rank its server lists (an
        # external load-balanced vLLM rank's shim given the shared endpoints would read rank 0's).
        self.events_rank = config.data_parallel_rank
        # Set by the shim: what the engine's limits or served names now differ in from the session's.
        self.engine_changed: Callable[[], Awaitable[str | None]] | None = None

    async def run_events(self, sink: EventSink, live: asyncio.Event) -> None:
        c = self.config
        assert c.kv_events is not None  # ShimConfig requires it for these engines
        self._events = ZmqEventSource(
            self.kind,
            c.kv_events,
            c.kv_events_mode,
            c.kv_events_topic,
            c.kv_replay,
            c.engine_host,
            health=self.event_health,
            stats=self.stats,
            unknown=self.unknown,
            rank=self.events_rank if self.checks_rank else None,
            rank_given=c.data_parallel_rank is not None,
            setting="kv_events" if c.kv_events_config is None else "kv_events_config",
            bind_failures=self.bind_failures,
            engine_changed=self.engine_changed,
        )
        await self._events.run(sink, live)

    def event_stats(self) -> dict[str, int]:
        return asdict(self.stats)

    def unknown_event_types(self) -> dict[str, int]:
        return dict(self.unknown.counts)

    def request_rebuild(self) -> None:
        if self._events is not None:
            self._events.request_rebuild()
