"""The modelled delays of the live stack's hops, in seconds, each a flag of the virtual clock.

What each one stands for (live: `kvswitch up` on one machine, engines at 1x):

- `kv_event_s`: an engine step ends -> its KV events are in every router's index (engine ZMQ PUB ->
  shim normaliser -> NATS -> router ingest);
- `load_report_s`: a shim builds a LoadReport -> the routers' load views hold it (NATS);
- `sync_s`: a router books a request -> its peers' load views hold the booking (the replica sync's
  flush window, then NATS);
- `leg_s`: a router sends a leg -> the engine has the request (NATS to the shim, HTTP to the engine);
- `token_s`: an engine emits a token -> the router has it (HTTP stream to the shim, NATS);
- `client_s`: client <-> router, one way (HTTP in, server-sent events out);
- `engine_read_s`: a shim asks its engine for its load -> it has the reading (HTTP GET /metrics,
  parsed); its next poll starts `POLL_S` after that. Measured as the live poll period's mean
  overrun of `POLL_S` (the read, and the event loop's lateness waking from the sleep), as those add
  up to the poll's drift.

The defaults were measured from the live stack by `python -m bench.virtual.measure_delays`
(docs/benchmarks.md, "Virtual clock", gives the command, the machine and what it printed).
"""

from __future__ import annotations

import msgspec

__all__ = ["DEFAULT_DELAYS", "Delays"]


class Delays(msgspec.Struct, frozen=True, kw_only=True):
    kv_event_s: float = 0.0016
    load_report_s: float = 0.0008
    sync_s: float = 0.0028
    leg_s: float = 0.0040
    token_s: float = 0.0040
    client_s: float = 0.0018
    engine_read_s: float = 0.0049

    def validate(self) -> Delays:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                flag = "--" + name.removesuffix("_s").replace("_", "-") + "-delay"
                raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
        return self


DEFAULT_DELAYS = Delays()
