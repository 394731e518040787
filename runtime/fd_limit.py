"""The process's open-file limit, raised at start: every kvswitch process that accepts connections
holds one file descriptor per connection, and a common default soft limit (1024 under systemd) is
below what a router's clients or an engine's legs take at once. Past it the event loop's accept
fails (EMFILE); under uvloop, libuv then accepts and closes each new connection with no callback
and no log line, so every client is reset, a health probe included (audit of 2026-12-07)."""

from __future__ import annotations

import logging
import resource

__all__ = ["fd_limit", "raise_fd_limit"]

log = logging.getLogger("kvswitch.fd_limit")


def raise_fd_limit() -> int | None:
    """Raise the soft open-file limit to the hard one, as vLLM raises its own (set_ulimit); the soft
    limit now in force (None: unlimited). A limit that cannot be raised is a WARNING, not an exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit (macOS) takes no unlimited soft one: ask for vLLM's number.
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65535)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
        else:
            # DEBUG: a refused config must stay one line; the router's and the shim's caps on
            # /metrics (kvswitch_router_client_connections_cap, kvswitch_shim_max_inflight_legs) show it.
            log.debug("open-file limit raised from %d to %d (the hard limit)", soft, target)
    return fd_limit()


def fd_limit() -> int | None:
    """The soft open-file limit in force (None: unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft
