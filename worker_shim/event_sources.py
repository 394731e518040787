"""EventSources: the KV event endpoints a vLLM shim takes from the engine's own list.

vLLM 0.32 lists each data-parallel rank's KV event endpoints on GET /kv_event_sources, already
offset by the rank. A vLLM shim given no `--kv-events`, or vLLM's `tcp://*:0` (the port the engine
bound is listed there), reads that list at each session's start, as a restarted engine may publish
elsewhere, and takes the endpoint, replay endpoint and topic of the rank it serves
(`--data-parallel-rank`, else the server's one engine). Which side of a listed endpoint it takes
(bind or connect: kv_events_config.listed_mode) is judged once per endpoint, from the operator's
own `--kv-events` and `--kv-events-mode`, and failed binds of a listed endpoint count across
sessions. What the engine lists that cannot serve is a ConfigError naming the setting.
"""

from __future__ import annotations

import msgspec

from protocol import ConfigError
from protocol.vllm_events import RESOLVED_BY_ENGINE
from worker_shim.adapters import EngineAdapter
from worker_shim.adapters.zmq_bind import BindFailures
from worker_shim.config import KvEventsMode, ShimConfig
from worker_shim.kv_events_config import listed_mode

__all__ = ["EventSources"]


class EventSources:
    """Made from the operator's config (what it gave, before any list was read); `discovers` says
    whether the engine's list is read at all, `take` reads it for one session."""

    def __init__(self, config: ShimConfig) -> None:
        given = config.kv_events
        # vLLM lists `tcp://*:0` as the port it bound: read on /kv_event_sources, like no endpoints.
        self.discovers = config.engine == "vllm" and (given is None or RESOLVED_BY_ENGINE in (given, config.kv_replay))
        self._events_given, self._mode_given = given, config.kv_events_mode  # the operator's
        self._listed: tuple[str, KvEventsMode] | None = None  # the listed endpoint and the side taken
        self._listed_binds = BindFailures()  # failed binds of a listed endpoint, across sessions
        self._topic_given = config.kv_events_topic  # the operator's, not a discovered one

    async def take(self, adapter: EngineAdapter, c: ShimConfig) -> tuple[ShimConfig, int]:
        """`c` with the KV event endpoints, side and topic of the rank this shim serves, as the
        engine lists them, and that rank."""
        sources = await adapter.event_sources()
        give = "give --kv-events-config as the engine was given it"
        if sources is None:
            raise ConfigError(
                "kv_events", None, f"the engine at {c.engine_url} does not list its KV event endpoints "
                f"(GET /kv_event_sources, vLLM 0.32 and later): {give}",
            )  # fmt: skip
        # Without a rank: the server's one engine (several were refused with the limits).
        rank = c.data_parallel_rank if c.data_parallel_rank is not None else next(iter(sources), 0)
        source = sources.get(rank)
        if source is None and sources:
            ranks = ", ".join(map(str, sorted(sources)))
            why = f"the engine at {c.engine_url} lists KV events for data-parallel ranks {ranks}: give one of them"
            raise ConfigError("data_parallel_rank", c.data_parallel_rank, why)
        if source is None:
            raise ConfigError(
                "kv_events", None, f"the engine at {c.engine_url} publishes no KV events: start it with "
                "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", ...}'",
            )  # fmt: skip
        if self._topic_given and self._topic_given != source.topic:
            raise ConfigError(
                "kv_events_topic",
                self._topic_given,
                f"the engine publishes under topic {source.topic!r}: drop the flag",
            )
        if self._listed is None or self._listed[0] != source.endpoint:
            # Once per endpoint: the last session's own listener there must not read as the engine's.
            mode = await listed_mode(
                source.endpoint, self._events_given, self._mode_given, c.engine_url, self._listed_binds
            )
            self._listed = (source.endpoint, mode)
        taken = msgspec.structs.replace(
            c,
            kv_events=source.endpoint,
            kv_events_mode=self._listed[1],
            kv_replay=source.replay_endpoint,
            kv_events_topic=source.topic,
        )
        return taken, rank
