"""How long a call made after one went unanswered waits for etcd's first answer.

A hung member (stopped, not closed) keeps its connection, so the channel's balancer goes on
picking it in turn with every call of the process until gRPC's keepalive drops it (8 s): the next
call after one it left unanswered (a lease's next keep-alive stream, a silent watch's re-read) may
go to it again. A healthy member answers at once, so a short wait then a new call, a new pick,
finds one in a fraction of a second where the call's full wait was lost. A slow etcd is still
waited for in the end: after HURRY_TRIES such calls in a row the wait doubles up to the full one.
"""

from __future__ import annotations

__all__ = ["HURRY_S", "HURRY_TRIES", "next_pick_wait"]

# Doubling at once (0.25, 0.5, 1 s) fit 3 streams in the 1 s a 2 s lease TTL leaves, and a lease
# whose three all went to the hung member was lost (1 run of 3); doubling only once the TTL had
# passed gave up every stream of an etcd answering in 0.35 s until then: a 10 s lease went 10.5 s
# unrenewed (reviews of 2026-12-07).
HURRY_S = 0.25
HURRY_TRIES = 3


def next_pick_wait(given_up: int, last: float, full: float) -> float:
    """The wait for the first answer of a call made after `given_up` calls in a row went unanswered,
    the last of them after `last` s: HURRY_S for HURRY_TRIES calls, then double the last, at most
    `full`. Doubled from the last wait, not 2 ** given_up: after ~1,000 give-ups in a row that float
    overflowed and a lease's keep-alive task died, the lease unknown for good."""
    return HURRY_S if given_up <= HURRY_TRIES else min(last * 2, full)
