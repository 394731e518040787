"""The names a request may give (models, their other names, LoRA adapters), and the ones that clash.

A request's `model` resolves as protocol.serving does: to the workers of that model (or serving it
under that alias), else to the workers serving it as an alias or a LoRA adapter of that name. A
name that resolves to workers of more than one model (worker A serves `llama`, worker B serves
`qwen` under the alias `llama`; an adapter `sql` on two base models; an alias `chat` of `qwen`
and an adapter `chat` on `llama`) has no one answer: routed, each request went to whichever model
ranked first, its prompt hashed at one model's block size and chain, and the client got another
model's answer now and then. So such a name is refused (503) for as long as it clashes; the worker
registry logs each clash once and /ready lists it. So is a name one model serves both as itself
(an alias) and as a LoRA adapter: other weights, and another chain. Only a model's own name wins
over another model's adapter of that name (no clash).

The worker registry keeps this one record at a time (router.worker_registry); its tests check it
against the whole fleet's, worked out from scratch (tests/router/oracles.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from protocol import WorkerInfo
from protocol.messages import adapter_named
from router.eligibility import few_ids

__all__ = ["Resolved", "clash_message", "served_as", "shadow_message"]

Resolved = dict[str, dict[str, list[str]]]
"""name -> model -> the workers (sorted) a request naming it runs on, of that model (`served_as`)."""


def shadow_message(name: str, models: Mapping[str, Sequence[str]]) -> str:
    """Why workers serving another model under the name of model `name` are not routed for it."""
    each = "; ".join(f"model {model} on {few_ids(ids)}" for model, ids in sorted(models.items()))
    return (
        f"workers serve the model `{name}`'s own name as an alias of another model ({each}): requests naming "
        f"`{name}` go to model {name}'s workers only (check those workers' --served-model-name)"
    )


def served_as(name: str, infos: Iterable[WorkerInfo]) -> dict[str, list[str]]:
    """The workers of `infos` (each serving `name`) by the model a request naming it runs on there,
    in the order given. A model serving it both as itself (an alias) and as a LoRA adapter counts
    as two: the adapter's weights and chain are not the model's."""
    ways: dict[str, dict[str, list[str]]] = {}  # model -> adapter ("": the model) -> workers
    for info in infos:
        adapter = adapter_named(name, info.model, info.aliases)
        ways.setdefault(info.model, {}).setdefault(adapter, []).append(info.worker)
    return {
        model if len(by_adapter) == 1 else _with_adapter(model, adapter): ids
        for model, by_adapter in ways.items()
        for adapter, ids in by_adapter.items()
    }


def _with_adapter(model: str, adapter: str) -> str:
    return f"{model} with its LoRA adapter {adapter}" if adapter else model


def clash_message(name: str, models: Mapping[str, Sequence[str]]) -> str:
    """Why requests naming `name` are refused, naming the models and (up to 8 of each's) workers."""
    each = "; ".join(f"model {model} on {few_ids(ids)}" for model, ids in sorted(models.items()))
    return (
        f"the name `{name}` is served as {len(models)} different models ({each}): requests naming it are "
        "refused until one model alone serves it (a worker's model, alias or LoRA adapter names another's)"
    )
