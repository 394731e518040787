"""Fault knobs for the reliability tests. Every knob can be set at start (SimConfig / CLI flags),
changed live on `SimServer.faults`, or over HTTP with `POST /sim/faults` (JSON with any of the
keys below, plus `"crash": true` or `"restart": true`).

- crash_after N: the (N+1)-th generate request (completions or chat) kills the engine: the HTTP
  listener and every open connection close at once, the event sockets close, in-flight requests
  are cut mid-stream. `SimServer.restart()` (or `restart_after_crash_s`, or SIGHUP to
  `kvswitch sim`) brings it back with an empty cache and event seq from 0. A single-engine CLI
  process without `--restart-after-crash` exits with status 1, as a dead vLLM would.
- hang_after N: from the (N+1)-th generate request on, the engine stops stepping: requests are
  accepted and never answered, /health still answers 200 (a stuck GPU does not fail a liveness
  probe). `hang = False` resumes.
- slowdown F: every step takes F times its modelled duration (a throttled or shared GPU).
- drop_event_fraction F: that fraction of KV event batches is not sent on the PUB socket; each
  still takes a seq and stays in the replay buffer, as if lost on the network.
- health_delay_s S: /health answers only after S seconds (an API server too loaded to answer its
  probes in time). Live only (POST /sim/faults or `SimServer.faults`).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Faults"]


class Faults:
    __slots__ = (
        "_hang",
        "_on_change",
        "crash_after",
        "drop_event_fraction",
        "hang_after",
        "health_delay_s",
        "requests_seen",
        "slowdown",
    )

    def __init__(
        self,
        *,
        crash_after: int | None = None,
        hang_after: int | None = None,
        slowdown: float = 1.0,
        drop_event_fraction: float = 0.0,
    ) -> None:
        self.crash_after = crash_after
        self.hang_after = hang_after
        self.slowdown = slowdown
        self.health_delay_s = 0.0
        self.drop_event_fraction = drop_event_fraction
        self.requests_seen = 0
        self._hang = False
        self._on_change: Callable[[], None] | None = None

    @property
    def hang(self) -> bool:
        return self._hang

    @hang.setter
    def hang(self, value: bool) -> None:
        self._hang = bool(value)
        if self._on_change is not None:
            self._on_change()  # wake the step loop so it parks or resumes now

    def note_request(self) -> str | None:
        """Count one generate request; say "crash" or "hang" when a threshold is passed."""
        self.requests_seen += 1
        if self.crash_after is not None and self.requests_seen > self.crash_after:
            return "crash"
        if self.hang_after is not None and self.requests_seen > self.hang_after and not self._hang:
            self.hang = True
            return "hang"
        return None

    def snapshot(self) -> dict[str, object]:
        return {
            "crash_after": self.crash_after,
            "hang_after": self.hang_after,
            "hang": self._hang,
            "slowdown": self.slowdown,
            "drop_event_fraction": self.drop_event_fraction,
            "health_delay_s": self.health_delay_s,
            "requests_seen": self.requests_seen,
        }
