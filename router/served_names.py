"""The names a request may give (models, their other names, LoRA adapters), and the ones that clash.

A request's `model` resolves as protocol.serving does: to the workers of that model or serving it
under that alias, else to the workers serving a LoRA adapter of that name. A name that resolves to
workers of more than one model (worker A serves `llama`, worker B serves `qwen` under the alias
`llama`; an adapter `sql` on two base models) has no one answer: routed, each request went to
whichever model ranked first, its prompt hashed at one model's block size and chain, and the
client got another model's answer now and then. So such a name is refused (503) for as long as it
clashes; the worker registry logs each clash once and /ready lists it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from protocol import WorkerInfo

__all__ = ["Resolved", "by_model", "clash_message", "resolve_names"]

Resolved = dict[str, dict[str, list[str]]]
"""name -> model -> the workers (sorted) a request naming it runs on, of that model."""

_NAMED = 8  # workers a clash's text names per model; the rest are counted


def resolve_names(infos: Iterable[WorkerInfo]) -> Resolved:
    """Every name a request may give, with the workers it resolves to, by model (workers in the
    order given: the registry's is by id)."""
    named: Resolved = {}  # models and their other names
    adapters: Resolved = {}
    for info in infos:
        for name in dict.fromkeys((info.model, *info.aliases)):
            named.setdefault(name, {}).setdefault(info.model, []).append(info.worker)
        for name in info.adapters:
            adapters.setdefault(name, {}).setdefault(info.model, []).append(info.worker)
    return {**adapters, **named}  # a model's name (or one of its other names) wins over an adapter's


def by_model(infos: Iterable[WorkerInfo]) -> dict[str, list[str]]:
    """The workers of `infos` by model (for the text of a clash)."""
    out: dict[str, list[str]] = {}
    for info in sorted(infos, key=lambda i: i.worker):
        out.setdefault(info.model, []).append(info.worker)
    return out


def clash_message(name: str, models: Mapping[str, Sequence[str]]) -> str:
    """Why requests naming `name` are refused, naming the models and (up to 8 of each's) workers."""

    def workers(ids: Sequence[str]) -> str:
        more = f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else ""
        return ", ".join(ids[:_NAMED]) + more

    each = "; ".join(f"model {model} on {workers(ids)}" for model, ids in sorted(models.items()))
    return (
        f"the name `{name}` is served as {len(models)} different models ({each}): requests naming it are "
        "refused until one model alone serves it (a worker's model, alias or LoRA adapter names another's)"
    )
