"""The value a model is served with where its workers disagree on it: its block size
(router.eligibility) and its max_model_len (router.worker_registry), by one rule.

- **Decode and agg workers decide.** Every request needs one of them; a prefill worker cannot
  serve alone, so a fault confined to the prefill pool (two prefill workers at block size 32
  against one decode worker at 16) must never outvote the pool that serves and take the model
  down: the prefill workers that differ are left out instead, and named. Only a model with no
  decode or agg worker, which serves no request either way, counts its prefill workers, so that
  its views still say which of them are at odds.
- **Most of them win; a tie goes to the greater value.** The tie-break reads the records alone,
  so every replica reaches the same verdict on the same fleet whatever order it saw the workers
  in, and no restart flips it. Before 2026-12-07 a block-size tie went to the worker this router
  saw first (its own clock): two replicas of one fleet disagreed, one serving while the other
  refused every request, and a restart of the decode worker's shim handed the tie to the
  prefill worker. The registry's records carry no etcd create_revision (the watch hands on
  values only), and a worker id says nothing about the fleet, so the value decides.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["model_value", "votes"]


def votes(role: str) -> bool:
    """A worker of `role` decides its model's value (prefill workers only where none does)."""
    return role != "prefill"


def model_value(deciding: Mapping[int, int], every: Mapping[int, int]) -> int:
    """The value a model is served with: the one most of its decode and agg workers hold
    (`deciding`: value -> how many), of all its workers (`every`) where it has none; ties: the
    greater value. `every` must not be empty."""
    counts = deciding or every
    return max(counts, key=lambda n: (counts[n], n))
