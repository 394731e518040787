"""The value a model is served with where its workers disagree on it: its block size
(router.eligibility) and its max_model_len (router.worker_registry), by one rule.

- **Decode and agg workers decide.** Every request needs one of them; a prefill worker cannot
  serve alone, so a fault confined to the prefill pool (two prefill workers at block size 32
  against one decode worker at 16) must never outvote the pool that serves and take the model
  down: the prefill workers that differ are left out instead, and named. Only a model with no
  decode or agg worker, which serves no request either way, counts its prefill workers, so that
  its views still say which of them are at odds.
- **Of those, the workers fit to serve decide** (`Ballot.fit`, router.eligibility's reading).
  Only a lasting state takes a worker's vote away (`Fit.OUT`): a record whose shim has not
  bootstrapped (it may have none behind it), a worker gone silent, or one whose shim sees no KV
  events. A single request's mark (`unreachable`, `malformed`, `prefill_failing`), `repairing` (one
  dump) and `draining` (the shim of a worker that served is stopping: a restart) leave it its vote:
  until 2026-12-07 (third fix) they took it away, so one malformed answer handed the block size to
  a lone newcomer at another value for 30 s, and a worker blinking in and out flipped the context
  at every revote, each flip an ERROR. A worker whose engine fails its load polls
  (`engine_unhealthy`, `Fit.FAILING`: one failed poll sets it, the next good one clears it, and an
  engine that stays down has its shim deregister) votes only for the value the model is served
  with: its blink never moves the model, and newcomers whose engines fail never take it over.
  Only where none is fit do they all count.
- **Most of them win. A tie goes to the value more of the model's fit workers hold, prefill
  included, then to the value the model is served with (`Standing`: this replica's last decision),
  where it has a voter, then to the one its longest-registered worker holds** (the least etcd
  create_revision of its key), then to the greater value. A lone misconfigured newcomer never
  unroutes a pool that serves: one decode worker at 32 joining one at 16 and a prefill pool at 16
  loses to the pool, and joining a lone decode worker at 16 loses to the incumbent, also once the
  incumbent's shim has restarted (a new key, so the newest create_revision): the value a model is
  served with stands for `HOLD_S` after it was last decided, through the gap while the
  incumbent's key is gone (its shim restarting, or deregistered while its engine restarts) and it
  bootstraps again, in which the newcomer, the only worker fit, serves the model at its value.
  Before, the tie went to the least create_revision alone, and a restart of the only incumbent
  handed the model to the newcomer for good, the healthy worker named as the configuration error;
  before that, to the greater value (a newcomer at 32 took the model over), and before that to the
  worker this router saw first.

What replicas agree on: the value, wherever they agree on which workers are fit and each has
decided the model's value since before its workers tied. Which workers are fit is each replica's
own reading (its dump of the worker's state, the load reports it heard, its clock): while one
replica has bootstrapped a new worker and another has not, or around a worker going silent, two
replicas can transiently serve a model at different values, agreeing again once their readings do
(a dump, or SILENT_PERIODS of reports: a few seconds). The standing value is each replica's own
memory, shared with no other: a replica started while a model's workers tie, or within HOLD_S of
its value last being decided where that value has no voter fit now, has none and breaks the tie
by create_revision then the value; it can serve the model at the other value than a replica that
has been running, for as long as the tie lasts (the newcomer's fix, or one more worker at either
value, ends it). A replica that has run through the tie keeps its standing value until the value
loses a vote it takes part in, or HOLD_S after it was last decided. So a vote is over the model's
whole fleet, never a request's part of it (an adapter's workers): the value lost there would be
replaced for every request of the model, by which requests a replica saw.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import NamedTuple

__all__ = ["HOLD_S", "Ballot", "Fit", "Standing", "model_value", "votes"]

# How long the value a model is served with outlasts its last decision, without a voter fit: an
# incumbent's shim restarted, or deregistered while its engine restarts and loads its weights.
HOLD_S = 600.0


def votes(role: str) -> bool:
    """A worker of `role` decides its model's value (prefill workers only where none does)."""
    return role != "prefill"


class Fit(enum.Enum):
    """How a worker takes part in its model's vote (router.eligibility's reading of it)."""

    SERVES = "serves"
    FAILING = "failing"  # its engine fails its load polls: a vote for the model's standing value only
    OUT = "out"  # bootstrapping, silent or events_down: no vote (all count only where none is fit)


class Ballot(NamedTuple):
    """One worker's say in its model's value."""

    value: int
    decides: bool  # votes(its role)
    fit: Fit
    created: int  # its key's etcd create_revision: the least is the longest registered (0: not known)


def model_value(ballots: Iterable[Ballot], standing: int | None = None) -> int:
    """The value a model is served with, of its workers' `ballots` (not empty), `standing` the one
    it is served with now (None: none decided yet): the module's rule."""
    return _tally(ballots, standing)[0]


def _tally(ballots: Iterable[Ballot], standing: int | None) -> tuple[int, bool]:
    """model_value, and whether `standing` had a vote counted."""
    every = list(ballots)
    deciding = [b for b in every if b.decides] or every

    def fit(b: Ballot) -> bool:
        return b.fit is Fit.SERVES or (b.fit is Fit.FAILING and b.value == standing)

    voters = [b for b in deciding if fit(b)] or deciding
    backers = [b for b in every if fit(b)] or every
    count: dict[int, int] = {}
    for b in voters:
        count[b.value] = count.get(b.value, 0) + 1
    backed: dict[int, int] = {}
    for b in backers:
        backed[b.value] = backed.get(b.value, 0) + 1
    first: dict[int, int] = {}
    for b in voters:
        first[b.value] = min(first.get(b.value, b.created), b.created)
    won = max(count, key=lambda v: (count[v], backed.get(v, 0), v == standing, -first[v], v))
    return won, standing in count


class Standing:
    """The value each model is served with, as this replica decided it last (the module's rule: a
    tie goes to it). A value decided against it while it has no vote counted (its workers gone,
    bootstrapping or silent) serves meanwhile but takes its place only HOLD_S after it was last
    decided; one that beats it in a vote it takes part in takes it at once. A model's entry outlives
    its workers, for the same hold: one int per model this replica has seen."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._held: dict[str, tuple[int, float]] = {}  # model -> (value, when last decided)

    def decide(self, model: str, ballots: Iterable[Ballot], settle: bool = True) -> int:
        """`model`'s value, of its workers' `ballots` (not empty), by the module's rule; `settle`
        False: not a state of the fleet (a snapshot applied one record at a time), nothing kept."""
        held = self._held.get(model)
        value, contested = _tally(ballots, held[0] if held is not None else None)
        if settle:
            self._settle(model, value, contested)
        return value

    def agreed(self, model: str, value: int) -> None:
        """Every worker of `model` holds `value`: the vote's usual case, which makes no ballots."""
        self._settle(model, value, False)

    def _settle(self, model: str, value: int, contested: bool) -> None:
        now, held = self._clock(), self._held.get(model)
        if held is None or held[0] == value or contested or now - held[1] > HOLD_S:
            self._held[model] = (value, now)
