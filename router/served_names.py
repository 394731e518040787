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

`resolve_names` and `shadowed` say this of a whole fleet at once; the worker registry keeps the
same one record at a time (router.worker_registry), and its tests check it against them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from protocol import WorkerInfo
from protocol.messages import adapter_named
from router.eligibility import few_ids

__all__ = ["Resolved", "clash_message", "resolve_names", "served_as", "shadow_message", "shadowed"]

Resolved = dict[str, dict[str, list[str]]]
"""name -> model -> the workers (sorted) a request naming it runs on, of that model (`served_as`)."""


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
