"""Whole-fleet answers, worked out from scratch, that router.worker_registry keeps one record at a
time: its tests check the registry against these. Nothing routes by them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from protocol import WorkerInfo
from router.served_names import Resolved, served_as


def resolve_names(infos: Iterable[WorkerInfo]) -> Resolved:
    """Every name a request may give, with the workers it resolves to, by model (workers in the
    order given: the registry's is by id)."""
    infos = list(infos)
    models = {info.model for info in infos}
    serving: dict[str, list[WorkerInfo]] = {}
    for info in infos:
        # A model's own name wins over another model's alias or adapter of that name.
        aliases = (name for name in info.aliases if name not in models)
        adapters = (name for name in info.adapters if name not in models)
        for name in dict.fromkeys((info.model, *aliases, *adapters)):
            serving.setdefault(name, []).append(info)
    return {name: served_as(name, ws) for name, ws in serving.items()}


def shadowed(infos: Iterable[WorkerInfo]) -> Resolved:
    """The aliases that are another registered model's own name, each with the workers serving it
    so, by their model (workers in the order given): requests naming it go to that model's workers,
    never to these."""
    infos = list(infos)
    models = {info.model for info in infos}
    out: Resolved = {}
    for info in infos:
        for name in info.aliases:
            if name in models and name != info.model:
                out.setdefault(name, {}).setdefault(info.model, []).append(info.worker)
    return out


def model_contexts(infos: Iterable[WorkerInfo], standing: dict[str, int]) -> dict[str, int | None]:
    """Each model's max_model_len, every worker serving and every key created alike (events made by
    hand): the one most of its decode and agg workers that register one register, of all its
    workers that do where none of those does (ties: the one more of all its workers register, then
    the model's `standing` length, then the longest), None where none does. `standing`, model -> the
    length last decided, is kept as router.fleet_vote.Standing keeps it within its hold: a length
    decided replaces it where it had a vote, or was decided before."""
    counts: dict[str, tuple[Counter[int], Counter[int]]] = {}
    for info in infos:
        deciding, every = counts.setdefault(info.model, (Counter(), Counter()))
        if info.max_model_len is not None:
            every[info.max_model_len] += 1
            if info.role != "prefill":
                deciding[info.max_model_len] += 1
    out: dict[str, int | None] = {}
    for model, (deciding, every) in counts.items():
        seen = deciding or every
        held = standing.get(model)
        out[model] = won = max(seen, key=lambda n: (seen[n], every[n], n == held, n)) if seen else None
        if won is not None and (held is None or held in seen):
            standing[model] = won
    return out
