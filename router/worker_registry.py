"""The workers a router may route to: exactly those with a key under /{ns}/workers/ right now.

Consumes `discovery.watch_workers()`: a Snapshot replaces the whole set (workers missing from it
are removed), a Put adds or updates one, a Deleted removes one. `on_add(info)` runs for every new
or changed record and `on_remove(worker)` the moment a key goes, so routing stops at once and the
index drops the worker's entries. Callbacks run on the event loop, in watch order; one that raises
is logged and does not stop the watch, and a watch that crashes is started again (a new Snapshot).

A record that cannot be true is refused as if its key were absent, logged as an ERROR once per key
and problem, counted in `refused` (every time one is read) and listed in `refusing()` while it
lasts (/ready and /debug/route show it as `bad_record`): it does not decode as a WorkerInfo (not
JSON, a field missing or of the wrong type), its name is not a worker id (a key that is not UTF-8
or not one subject token), it names another worker, or a field is out of range (block size 0, a
negative count: protocol.messages.worker_info_problem). One such record would otherwise break
routing for its whole model; the shim behind it may be alive, so it must not vanish unseen.

Workers of one model that disagree on block size are a configuration error (DESIGN.md): the
registry logs it as an error on every change of the conflict and exposes it in
`block_size_conflicts`, model -> the block sizes seen. So is a name that resolves to workers of
more than one model (router.served_names): an ERROR once per clash, exposed in `name_clashes`,
name -> model -> workers; the planner refuses requests naming it while it lasts. A model's own
name wins over another model's alias of it: `workers()` lists such a worker without that alias
(it is not routed for the name), and the registry reports it as an ERROR once per change, exposed
in `shadowed_aliases`, name -> the aliasing model -> workers.

Workers of one model that disagree on `max_model_len` are a configuration error too: the model's
context is the length most of its workers register (ties: the longest), and `workers()` leaves out
the workers that register another (a worker that registers none is not counted and stays), so a
request's `truncate_prompt_tokens: -1` resolves to the context of every worker it may go to, and no
worker gets a prompt its engine refuses as too long for its context: an ERROR once per change,
exposed in `context_conflicts`, model -> length -> workers. Before, the least length of a model's
workers resolved -1 for all of them: one worker registering 64 cut every such prompt to 63
tokens on its 32k peers too. `get()` still returns the worker's record as registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, TypeVar

import msgspec

from discovery import Deleted, Discovery, Put, Snapshot
from discovery.watch import keep_following
from protocol import WorkerInfo, serving, subjects
from protocol.messages import worker_info_problem
from router.lifecycle import PartStatus
from router.served_names import Resolved, clash_message, resolve_names, shadow_message, shadowed
from runtime import background

__all__ = ["Refused", "WorkerRegistry", "context_message", "model_contexts"]

log = logging.getLogger(__name__)

_LEFT_MAX = 1024  # names of departed workers remembered; the oldest goes first
T = TypeVar("T")


class Refused(msgspec.Struct, frozen=True):
    """A record under /{ns}/workers/ refused: its key's name, why, and the record if it decoded."""

    name: str
    why: str
    info: WorkerInfo | None = None


class WorkerRegistry:
    def __init__(
        self,
        discovery: Discovery,
        on_add: Callable[[WorkerInfo], None],
        on_remove: Callable[[str], None],
    ) -> None:
        self._discovery = discovery
        self._on_add = on_add
        self._on_remove = on_remove
        self._workers: dict[str, WorkerInfo] = {}
        self._sorted: list[WorkerInfo] | None = None  # by id; every request reads it, membership rarely changes
        self.block_size_conflicts: dict[str, set[int]] = {}
        self.name_clashes: Resolved = {}
        self.shadowed_aliases: Resolved = {}  # a model's own name served by another model's workers as an alias
        self.context_conflicts: dict[str, dict[int, list[str]]] = {}  # model -> max_model_len -> workers
        self.refused = 0  # records refused so far
        self._refusing: dict[str, Refused] = {}  # by key name, while its record is refused
        # every name (model, alias, adapter) a worker whose key went served, with when (monotonic)
        self._left: OrderedDict[str, float] = OrderedDict()
        self.status = PartStatus.NEW
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.status is not PartStatus.NEW:
            raise RuntimeError(f"WorkerRegistry.start() called while {self.status.value}")
        self._task = background(
            keep_following(self._watch, "the worker watch"),
            "worker-registry",
            "workers that join or leave go unseen until the router restarts",
        )
        self.status = PartStatus.RUNNING

    async def stop(self) -> None:
        """Stop watching (idempotent). The workers known stay readable; no callback runs any more."""
        if self.status is PartStatus.STOPPED:
            return
        self.status = PartStatus.STOPPED
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait_ready(self, timeout: float) -> bool:
        """True once the first snapshot of the workers has been applied."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # --- reads ---------------------------------------------------------------------------------

    def workers(self, model: str | None = None, role: str | None = None) -> list[WorkerInfo]:
        """Registered workers, optionally of one model and/or role, sorted by id, as routed: without
        an alias that is another model's own name, and without those whose max_model_len is not
        their model's (the module's docstring)."""
        if self._sorted is None:
            raw = [info for _, info in sorted(self._workers.items())]
            models, contexts = {info.model for info in raw}, model_contexts(raw)
            self._sorted = [
                _unshadowed(info, models)
                for info in raw
                if info.max_model_len is None or info.max_model_len == contexts[info.model]
            ]
        return [
            info
            for info in self._sorted
            if (model is None or info.model == model) and (role is None or info.role == role)
        ]

    def get(self, worker: str) -> WorkerInfo | None:
        return self._workers.get(worker)

    def models(self) -> list[str]:
        return sorted({info.model for info in self.workers()})

    def aliases(self) -> dict[str, str]:
        """The other names registered workers serve their model under, each with that model (a
        name that is some worker's model names that model)."""
        models = self.models()
        return {name: info.model for info in self.workers() for name in info.aliases if name not in models}

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters registered workers serve, each with its base model, by name (an
        adapter's name that is some worker's model names that model; one that is some worker's
        alias is listed as that, and clashes: router.served_names)."""
        named = {*self.models(), *self.aliases()}
        return {name: info.model for info in self.workers() for name in info.adapters if name not in named}

    def left_at(self, name: str) -> float | None:
        """When a worker serving `name` (its model, an alias or a LoRA adapter) last left: its key
        went (a crash, a lease lost, a restart, a record refused). None: none has since a worker
        registered serving it, as far as the last _LEFT_MAX names go. A name no worker serves now
        that one left with may be back; one a worker still registered stopped serving (an adapter
        unloaded) is gone."""
        return self._left.get(name)

    def refusing(self) -> list[Refused]:
        """The records refused now, by name."""
        return [r for _, r in sorted(self._refusing.items())]

    def max_model_len(self, model: str) -> int | None:
        """The longest request every worker routed for `model` (a model, or a LoRA adapter) takes:
        their `max_model_len` (one model's workers routed agree on it), or None when one of them
        does not say: a request may go to any of them."""
        lengths = [info.max_model_len for info in serving(self.workers(), model)]
        known = [n for n in lengths if n is not None]
        return min(known) if known and len(known) == len(lengths) else None

    # --- the watch -----------------------------------------------------------------------------

    async def _watch(self) -> None:
        events = self._discovery.watch_workers()
        try:
            async for event in events:
                match event:
                    case Snapshot(items=items, skipped=skipped):
                        self._replace(items, skipped)
                        self._ready.set()
                    case Put(name=name, value=info):
                        self._put(name, info)
                    case Deleted(name=name, why=why) if why:
                        self._refuse(name, why)  # it does not decode
                    case Deleted(name=name):
                        self._delete(name)
                self._check_block_sizes()
                self._check_names()
                self._check_contexts()
        finally:
            if isinstance(events, AsyncGenerator):
                with contextlib.suppress(Exception):
                    await events.aclose()

    def _replace(self, items: dict[str, WorkerInfo], skipped: dict[str, str]) -> None:
        for name in [n for n in self._workers.keys() | self._refusing.keys() if n not in items and n not in skipped]:
            self._delete(name)
        for name, info in items.items():
            self._put(name, info)
        for name, why in skipped.items():
            self._refuse(name, why)

    def _put(self, name: str, info: WorkerInfo) -> None:
        if (problem := self._problem(name, info)) is not None:
            self._refuse(name, problem, info)
            return
        self._refusing.pop(name, None)
        if self._workers.get(name) == info:
            return
        self._workers[name] = info
        for served in (info.model, *info.aliases, *info.adapters):  # served again: no longer gone
            self._left.pop(served, None)
        self._sorted = None
        self._call(self._on_add, info)

    def _problem(self, name: str, info: WorkerInfo) -> str | None:
        try:
            subjects.worker_key(self._discovery.ns, name)
        except ValueError as exc:
            return str(exc)
        if info.worker != name:
            return f"it names worker {info.worker!r}"
        return worker_info_problem(info)

    def _refuse(self, name: str, problem: str, info: WorkerInfo | None = None) -> None:
        self.refused += 1
        said = self._refusing.get(name)
        self._delete(name)  # a record that was good before goes: routing must not keep a stale one
        self._refusing[name] = Refused(name, problem, info)
        if said is None or said.why != problem:
            log.error("worker record under key %r ignored: %s", name, problem)

    def _delete(self, name: str) -> None:
        self._refusing.pop(name, None)
        if (info := self._workers.pop(name, None)) is not None:
            now, left = time.monotonic(), self._left
            for served in (info.model, *info.aliases, *info.adapters):
                left[served] = now
                left.move_to_end(served)
            while len(left) > _LEFT_MAX:
                left.popitem(last=False)
            self._sorted = None
            self._call(self._on_remove, name)

    def _call(self, callback: Callable[[Any], None], arg: WorkerInfo | str) -> None:
        try:
            callback(arg)
        except Exception:
            log.exception("worker registry callback %s(%r) failed", getattr(callback, "__name__", callback), arg)

    def _check_block_sizes(self) -> None:
        sizes: dict[str, set[int]] = {}
        for info in self._workers.values():
            sizes.setdefault(info.model, set()).add(info.block_size)
        conflicts = {model: s for model, s in sizes.items() if len(s) > 1}
        if conflicts != self.block_size_conflicts:
            for model, seen in sorted(conflicts.items()):
                holders = {
                    size: sorted(i.worker for i in self._workers.values() if i.model == model and i.block_size == size)
                    for size in sorted(seen)
                }
                log.error(
                    "configuration error: workers of model %s disagree on block size %s; prefix matches "
                    "across them are meaningless. Workers by block size: %s",
                    model,
                    sorted(seen),
                    holders,
                )
            for model in self.block_size_conflicts.keys() - conflicts.keys():
                log.warning("workers of model %s agree on block size again", model)
            self.block_size_conflicts = conflicts

    def _check_contexts(self) -> None:
        by_model: dict[str, dict[int, list[str]]] = {}
        for _, info in sorted(self._workers.items()):
            if info.max_model_len is not None:
                by_model.setdefault(info.model, {}).setdefault(info.max_model_len, []).append(info.worker)
        conflicts = {model: dict(sorted(seen.items())) for model, seen in by_model.items() if len(seen) > 1}
        _say_changes(
            self.context_conflicts,
            conflicts,
            context_message,
            lambda model: f"workers of model {model} agree on max_model_len again: all of them are routed",
        )
        self.context_conflicts = conflicts

    def _check_names(self) -> None:
        shadows = shadowed(info for _, info in sorted(self._workers.items()))
        _say_changes(
            self.shadowed_aliases,
            shadows,
            shadow_message,
            lambda name: f"no worker of another model serves the model name {name} as an alias any more",
        )
        self.shadowed_aliases = shadows
        resolved = resolve_names(self.workers())
        clashes = {name: models for name, models in resolved.items() if len(models) > 1}
        _say_changes(
            self.name_clashes,
            clashes,
            clash_message,
            lambda name: f"the name {name} is served as one model again: requests naming it are routed",
        )
        self.name_clashes = clashes


def _say_changes(
    before: Mapping[str, T], now: Mapping[str, T], message: Callable[[str, T], str], again: Callable[[str], str]
) -> None:
    """A configuration ERROR for each conflict new since `before`, or whose parties changed (once,
    not on every change of the fleet), and a WARNING for each one gone."""
    for key, seen in sorted(now.items()):
        if before.get(key) != seen:
            log.error("configuration error: %s", message(key, seen))
    for key in sorted(before.keys() - now.keys()):
        log.warning("%s", again(key))


def model_contexts(infos: list[WorkerInfo]) -> dict[str, int | None]:
    """Each model's max_model_len: the one most of its workers that register one register (ties:
    the longest), None where none does."""
    counts: dict[str, Counter[int]] = {}
    for info in infos:
        seen = counts.setdefault(info.model, Counter())
        if info.max_model_len is not None:
            seen[info.max_model_len] += 1
    return {model: _most_registered(seen) if seen else None for model, seen in counts.items()}


def _most_registered(counts: Mapping[int, int]) -> int:
    """The max_model_len most workers register, of `counts` (length -> workers); ties: the longest."""
    return max(counts, key=lambda n: (counts[n], n))


def context_message(model: str, workers: dict[int, list[str]]) -> str:
    """Why workers of `model` registering another max_model_len than most (`workers`: length ->
    worker ids) are not routed."""
    chosen = _most_registered({n: len(ids) for n, ids in workers.items()})
    left = "; ".join(f"{n} on {', '.join(ids)}" for n, ids in sorted(workers.items()) if n != chosen)
    return (
        f"workers of model {model} disagree on max_model_len: it is served with {chosen}, the length most "
        f"register (ties: the longest), and the workers registering another are not routed ({left})"
    )


def _unshadowed(info: WorkerInfo, models: set[str]) -> WorkerInfo:
    """`info` without its aliases that are another model's own name (router.served_names.shadowed)."""
    if not any(name in models and name != info.model for name in info.aliases):
        return info
    kept = [name for name in info.aliases if name not in models or name == info.model]
    return msgspec.structs.replace(info, aliases=kept)
