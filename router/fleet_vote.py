"""The value a model is served with where its workers disagree on it: its block size
(router.eligibility) and its max_model_len (router.worker_registry), by one rule.

- **Decode and agg workers decide.** Every request needs one of them; a prefill worker cannot
  serve alone, so a fault confined to the prefill pool (two prefill workers at block size 32
  against one decode worker at 16) must never outvote the pool that serves and take the model
  down: the prefill workers that differ are left out instead, and named. Only a model with no
  decode or agg worker, which serves no request either way, counts its prefill workers, so that
  its views still say which of them are at odds.
- **Of those, the workers that can serve decide** (`Ballot.serves`: no exclusion but the one
  this vote decides; router.eligibility's list). A record whose shim never bootstrapped, a worker
  gone silent, one whose shim sees no KV events or whose engine fails, cannot outvote one that
  serves; only where none of them serves do they all count. Until 2026-12-07 (second fix) a
  decode worker at 32 joining a model served at 16 tied 1-1 and took it over even while it was
  silent or unhealthy: the model 503'd while its old worker was healthy.
- **Most of them win. A tie goes to the value more of the model's serving workers hold, prefill
  included, then to the one its longest-registered worker holds** (the least etcd create_revision
  of its key), then to the greater value. A lone misconfigured newcomer never unroutes a pool that
  serves: one decode worker at 32 joining one at 16 and a prefill pool at 16 loses to the pool,
  and joining a lone decode worker at 16 loses to the incumbent. The create_revision is etcd's, so
  every replica breaks a tie alike whatever order it saw the workers in; a shim started again
  registers its key anew and so ranks as the newest. Before, a tie went to the greater value (a
  newcomer at 32 took the model over), and before that to the worker this router saw first.

What replicas agree on: the value, wherever they agree on which workers serve. Which serve is
each replica's own reading (its dump of the worker's state, the load reports it heard, its clock),
so while one replica has bootstrapped a new worker and another has not, or around a worker going
silent, two replicas can transiently serve a model at different values; they agree again once
their readings do (a dump, or SILENT_PERIODS of reports: a few seconds).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Ballot", "model_value", "votes"]


def votes(role: str) -> bool:
    """A worker of `role` decides its model's value (prefill workers only where none does)."""
    return role != "prefill"


class Ballot(NamedTuple):
    """One worker's say in its model's value."""

    value: int
    decides: bool  # votes(its role)
    serves: bool  # routable but for this vote's own exclusion (block_size, context_conflict)
    created: int  # its key's etcd create_revision: the least is the longest registered (0: not known)


def model_value(ballots: Iterable[Ballot]) -> int:
    """The value a model is served with, of its workers' `ballots` (not empty): the module's rule."""
    every = list(ballots)
    deciding = [b for b in every if b.decides] or every
    voters = [b for b in deciding if b.serves] or deciding
    backers = [b for b in every if b.serves] or every
    count: dict[int, int] = {}
    for b in voters:
        count[b.value] = count.get(b.value, 0) + 1
    backed: dict[int, int] = {}
    for b in backers:
        backed[b.value] = backed.get(b.value, 0) + 1
    first: dict[int, int] = {}
    for b in voters:
        first[b.value] = min(first.get(b.value, b.created), b.created)
    return max(count, key=lambda v: (count[v], backed.get(v, 0), -first[v], v))
