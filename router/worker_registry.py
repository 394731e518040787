"""The workers a router may route to: exactly those with a key under /{ns}/workers/ right now.

Consumes `discovery.watch_workers()`: a Snapshot replaces the whole set (workers missing from it
are removed), a Put adds or updates one, a Deleted removes one. `on_add(info)` runs for every new
or changed record and `on_remove(worker)` the moment a key goes, so routing stops at once and the
index drops the worker's entries. Callbacks run on the event loop, in watch order; one that raises
is logged and does not stop the watch, and a watch that crashes is started again (a new Snapshot).

A record that cannot be true is refused as if its key were absent, logged as an ERROR once per key
while its problem stands and at most once a window while the problem keeps changing, saying how
many times it changed (discovery.refused_records; until 2026-12-07 each put of another problem was
a line), capped for a fleet of records one build or flag got wrong (the first eight in a window
named, the rest counted in one line, router.fleet_lines), counted in `refused` (every time one is
read) and
listed in `refusing()` while it lasts (/ready and /debug/route show it as `bad_record`): it does not
decode as a WorkerInfo (not JSON, a field missing or of the wrong type), its value is too large for
one read, its key is held by no lease (put by hand, it would outlive its shim), its name is not a worker id
(a key that is not UTF-8 or not one subject token), it names another worker, or a field is out of
range (block size 0, a negative count: protocol.messages.worker_info_problem). One such record would
otherwise break routing for its whole model; the shim behind it may be alive, so it must not vanish
unseen.

Workers of one model that disagree on block size are a configuration error (DESIGN.md): the
registry logs it as an error on every change of the block sizes in conflict (naming eight workers
per size and counting the rest) and exposes it in `block_size_conflicts`, model -> the block sizes
seen. So is a name that resolves to workers of more than one model (router.served_names): an
ERROR once per clash, exposed in `name_clashes`, name -> model -> workers; the planner refuses
requests naming it while it lasts. A model's own
name wins over another model's alias of it: `workers()` lists such a worker without that alias
(it is not routed for the name), and the registry reports it as an ERROR once per change of the
models aliasing it, exposed in `shadowed_aliases`, name -> the aliasing model -> workers. A clash
too is said again only when the models it resolves to change.

Workers of one model that disagree on `max_model_len` are a configuration error too: the model's
context is the length router.fleet_vote's rule gives, the block size's (most of its decode and agg
workers fit to serve register; ties: the length more of its fit workers register, then the length
it is served with, then its longest-registered worker's; its prefill workers count only where it
has none), and `workers()`
leaves out the workers that register another (a worker that registers none is not counted and
stays), so a request's `truncate_prompt_tokens: -1` resolves to the context of every worker it may
go to, and no worker gets a prompt its engine refuses as too long for its context (`unrouted()`
lists them, each with why, for the views of the fleet to show as excluded, and the planner's 503
names them): an ERROR once per change of the lengths at odds or of the one served, exposed in
`context_conflicts`, model -> the length served and the workers by length (`ContextConflict`).
Which workers register each length is no change: a rolling change of the fleet's length, one
worker at a time, says it when it starts and when most workers have moved, not per worker. The
reports keep every worker; the messages name eight per group and count the rest. Before, the
least length of a model's workers resolved -1 for all of them: one worker registering 64 cut every
such prompt to 63 tokens on its 32k peers too. `get()` still returns the worker's record as
registered.

Which workers are fit to vote is not the records' (`fit`, router.eligibility's reading: a worker
that just registered has not bootstrapped, so it has no vote at its put): a model whose workers
disagree is voted again at each `revote()`, which the service calls every second, so a newcomer
that comes up, or a worker that falls silent, moves the context within a second; a request's mark
or a blink of its engine moves nothing. Each key's etcd create_revision, the watch's, breaks ties
where the model has no standing length (`created`; router.fleet_vote's `Standing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Container, Iterable, KeysView, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

import msgspec

from discovery import Deleted, Discovery, Put, Snapshot, WatchEvent
from discovery.refused_records import RefusedRecords
from discovery.watch import ReadHealth, keep_following
from protocol import WorkerInfo, serving, subjects
from protocol.messages import adapter_named, worker_info_problem
from router.eligibility import few_ids
from router.fleet_lines import FleetLines, FleetLog
from router.fleet_vote import Ballot, Fit, Standing, votes
from router.lifecycle import PartStatus
from router.served_names import Resolved, clash_message, served_as, shadow_message
from runtime import background, cancel_and_wait

__all__ = ["ContextConflict", "Departed", "Refused", "WorkerRegistry", "context_message"]

log = logging.getLogger(__name__)

_LEFT_MAX = 1024  # names of departed workers remembered; the oldest goes first
T = TypeVar("T")
K = TypeVar("K")
Way = tuple[str, str]  # (model, LoRA adapter or ""): what a request naming a name runs on a worker


class Departed(msgspec.Struct, frozen=True):
    """A name (model, alias, LoRA adapter) the last worker to leave while serving it left with:
    when (time.monotonic) and that worker's model."""

    at: float
    model: str


class Refused(msgspec.Struct, frozen=True):
    """A record under /{ns}/workers/ refused: its key's name, why, and the record if it decoded."""

    name: str
    why: str
    info: WorkerInfo | None = None


class ContextConflict(msgspec.Struct, frozen=True):
    """Workers of one model that register different max_model_lens."""

    served: int  # the model's length (router.fleet_vote); the workers registering another are not routed
    workers: dict[int, list[str]]  # every length registered -> its workers, by id


def engines_serving(fleet: Sequence[WorkerInfo], name: str | None) -> frozenset[str]:
    """The engines (WorkerInfo.engine) of the workers of `fleet` serving `name` (a model, alias or
    adapter; None: the whole fleet's)."""
    return frozenset(info.engine for info in (serving(fleet, name) if name is not None else fleet))


class WorkerRegistry:
    """The registered workers, and what is wrong with them, as of the last watch event applied.

    A watch event is applied whole (`apply`: a Snapshot's every record, then the checks) before
    the loop runs anything else, so a request is never planned against a record whose conflicts are
    not yet known. Its cost is what it touches, not the fleet: each record is indexed by model, by
    block size, by max_model_len and by the names it serves as it comes and goes, and the checks
    then look again only at the models and names an event touched. Besides the record itself, an
    event touches the workers whose routing it changes: those naming a model (alias or adapter)
    that came or went, and those of a model whose context moved to or from their max_model_len.
    Where the fleet agrees (one block size and max_model_len per model, each name one model's), a
    put costs the same whatever the fleet's size; where it does not, about the workers of the
    models and names in conflict, which the conflict's message names anyway. Before, each event ran
    the checks over the whole fleet and sorted it again: 1,000 workers registering one by one cost
    1.9-2.4 s of CPU (docs/router.md, "2026-12-06, the rest of a replica at 1,000 workers").
    `workers()` sorts the routed records again, once read after a change (every request reads it).
    """

    def __init__(
        self,
        discovery: Discovery,
        on_add: Callable[[WorkerInfo], None],
        on_remove: Callable[[str], None],
        fleet_log: FleetLog | None = None,
        fit: Callable[[WorkerInfo], Fit] = lambda info: Fit.SERVES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`fit(info)`: how its worker votes on its model's max_model_len (router.fleet_vote's
        `Ballot.fit`; Eligibility.fit). `clock`: the standing length's hold (fleet_vote.HOLD_S)."""
        self._discovery = discovery
        self._fit = fit
        self._standing = Standing(clock)  # each model's length as last decided: a tie goes to it
        self._settling = True  # False while a Snapshot's records are applied one by one
        self._created: dict[str, int] = {}  # worker -> its key's etcd create_revision (the watch's)
        self._on_add = on_add
        self._on_remove = on_remove
        self.reading = ReadHealth()  # while reading the prefix fails, the set is as last read (or empty)
        self._workers: dict[str, WorkerInfo] = {}
        self._sorted: list[WorkerInfo] | None = None  # by id; every request reads it, membership rarely changes
        self._named: tuple[list[str], dict[str, str], dict[str, str]] | None = None  # _names(), as _sorted
        # engines(): per name served (None: the fleet), valid while _sorted is the list they were read from
        self._engines: dict[str | None, frozenset[str]] = {}
        self._engines_of: list[WorkerInfo] | None = None
        # Indexes of _workers kept one record at a time, so that a watch event costs what it touches,
        # not the fleet (the class docstring):
        self._of_model: dict[str, set[str]] = {}  # model -> its workers; the keys are the models registered
        self._sizes: dict[str, dict[int, set[str]]] = {}  # model -> block size -> workers
        self._lengths: dict[str, dict[int, set[str]]] = {}  # model -> max_model_len -> workers (those registering one)
        self._context: dict[str, int | None] = {}  # model -> its max_model_len (_vote)
        self._naming: dict[str, set[str]] = {}  # name -> workers of another model with it as an alias or adapter
        self._routed: dict[str, WorkerInfo] = {}  # what workers() lists, unsorted
        self._unrouted: dict[str, WorkerInfo] = {}  # the rest of _workers: a max_model_len not their model's
        self._serves: dict[str, dict[str, Way]] = {}  # routed worker -> each name it is routed for -> how
        self._served: dict[str, dict[Way, set[str]]] = {}  # name -> way -> routed workers (served_as)
        # since the checks last ran: models, names routed otherwise, aliases registered or dropped
        self._touched_models: set[str] = set()
        self._touched_names: set[str] = set()
        self._touched_aliases: set[str] = set()
        self.block_size_conflicts: dict[str, set[int]] = {}
        self.name_clashes: Resolved = {}
        self.shadowed_aliases: Resolved = {}  # a model's own name served by another model's workers as an alias
        self.context_conflicts: dict[str, ContextConflict] = {}
        self.refused = 0  # records refused so far
        self._refusing: dict[str, Refused] = {}  # by key name, while its record is refused
        self._refused_lines = FleetLines(
            log,
            logging.ERROR,
            "worker records ignored (one cause for many records at once: shims of a build whose records this router "
            "cannot read, or a flag they share; each is bad_record on /debug/workers, counted in "
            "kvswitch_router_worker_records_refused_total)",
            fleet_log=fleet_log,
        )
        self._records = RefusedRecords(self._refused_lines.say, "worker record under key %r ignored: %s")
        # every name (model, alias, adapter) the last worker serving it left with, when, and its model
        self._left: OrderedDict[str, Departed] = OrderedDict()
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

    @property
    def task(self) -> asyncio.Task[None] | None:
        """Its watch, while started: its owner's readiness names it should it end (runtime.ended)."""
        return self._task

    async def stop(self) -> None:
        """Stop watching (idempotent). The workers known stay readable; no callback runs any more."""
        if self.status is PartStatus.STOPPED:
            return
        self.status = PartStatus.STOPPED
        task, self._task = self._task, None
        try:
            if task is not None:
                await cancel_and_wait(task)
        finally:  # cancelled meanwhile (a start's cleanup cancelled again): raised after
            self._records.flush()  # a change held for its window's end, which no timer will say now

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
        return [
            info
            for info in self._routed_sorted()
            if (model is None or info.model == model) and (role is None or info.role == role)
        ]

    def _routed_sorted(self) -> list[WorkerInfo]:
        if self._sorted is None:
            self._sorted = [info for _, info in sorted(self._routed.items())]
        return self._sorted

    def engines(self, name: str | None) -> frozenset[str]:
        """The engines (WorkerInfo.engine) of the routed workers serving `name` (a model, alias or
        adapter; None: of the whole fleet); empty where none does. Read on every request
        (RequestPath.vllm_only), so kept until the routed records change; a name none serves is
        not kept (a client's names are unbounded)."""
        fleet = self._routed_sorted()  # current, not copied: read on every request
        if self._engines_of is not fleet:
            self._engines_of, self._engines = fleet, {}
        if (known := self._engines.get(name)) is not None:
            return known
        engines = engines_serving(fleet, name)
        if engines:
            self._engines[name] = engines
        return engines

    def get(self, worker: str) -> WorkerInfo | None:
        return self._workers.get(worker)

    def __len__(self) -> int:
        """How many workers are registered, routed or not (those `get` finds)."""
        return len(self._workers)

    def ids(self) -> KeysView[str]:
        """Every registered worker's id, routed or not (those `get` finds), unsorted."""
        return self._workers.keys()

    def models(self) -> list[str]:
        return list(self._names()[0])

    def aliases(self) -> dict[str, str]:
        """The other names registered workers serve their model under, each with that model (a
        name that is some worker's model names that model)."""
        return dict(self._names()[1])

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters registered workers serve, each with its base model, by name (an
        adapter's name that is some worker's model names that model; one that is some worker's
        alias is listed as that, and clashes: router.served_names)."""
        return dict(self._names()[2])

    def _names(self) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """models(), aliases() and adapters(), kept until the routed records change: every request
        resolves its model's name by them, and each was a pass over the fleet."""
        if self._named is None:
            routed = self.workers()
            models = sorted({info.model for info in routed})
            aliases = {name: info.model for info in routed for name in info.aliases if name not in models}
            named = {*models, *aliases}
            adapters = {name: info.model for info in routed for name in info.adapters if name not in named}
            self._named = (models, aliases, adapters)
        return self._named

    def departed(self) -> Mapping[str, Departed]:
        """The names (a model, an alias or a LoRA adapter) the last worker serving them left with,
        its key gone (a crash, a lease lost, a restart, a record refused), each with when it left
        and its model, oldest first; a name leaves it once a worker registers serving it, and the
        oldest once _LEFT_MAX are kept. Every replica sees the same departures, from the time it
        started reading the workers: a name no worker serves now that one left with may be back;
        one a worker still registered stopped serving (an adapter unloaded) is gone, even after
        other workers serving it left before."""
        return MappingProxyType(self._left)

    def refusing(self) -> list[Refused]:
        """The records refused now, by name."""
        return [r for _, r in sorted(self._refusing.items())]

    def unrouted(self, model: str | None = None) -> list[tuple[WorkerInfo, str]]:
        """The registered workers `workers()` leaves out, by id, each with why: a max_model_len
        other than their model's (the module's docstring). The views of the fleet list them as
        excluded (`context_conflict`), as a router that counted only the routed ones showed none.
        With `model`, those a request naming it would run on were they routed: `serving` over every
        registered worker as routing reads it, since one record alone does not say whether its
        alias or adapter `model` is another model's own name, which wins (router.served_names)."""
        left = sorted(self._unrouted.items())
        if model is not None and left:
            every = [*self._routed.values(), *(_unshadowed(info, self._of_model) for _, info in left)]
            theirs = {info.worker for info in serving(every, model)}
            left = [(worker, info) for worker, info in left if worker in theirs]
        return [
            (
                info,
                f"max_model_len {info.max_model_len}, but model {info.model} is served with "
                f"{self._context[info.model]}, the length most of its decode and agg workers that serve "
                "register: a configuration error",
            )
            for _, info in left
        ]

    def created(self, worker: str) -> int:
        """`worker`'s key's etcd create_revision, as the watch gave it (0: none given, or not
        registered): the same on every replica, and the least for the longest registered."""
        return self._created.get(worker, 0)

    def max_model_len(self, model: str) -> int | None:
        """The longest request every worker routed for `model` (a model, or a LoRA adapter) takes:
        their `max_model_len` (one model's workers routed agree on it), or None when one of them
        does not say: a request may go to any of them."""
        lengths = [info.max_model_len for info in serving(self.workers(), model)]
        known = [n for n in lengths if n is not None]
        return min(known) if known and len(known) == len(lengths) else None

    # --- the watch -----------------------------------------------------------------------------

    async def _watch(self) -> None:
        events = self._discovery.watch_workers(self.reading)
        try:
            async for event in events:
                self.apply(event)
        finally:
            if isinstance(events, AsyncGenerator):
                with contextlib.suppress(Exception):
                    await events.aclose()

    def apply(self, event: WatchEvent[WorkerInfo]) -> None:
        """One watch event, whole: its records, then the checks of what it touched (the class
        docstring). The watch calls it; tests and `bench.bench_router registrations` feed it."""
        match event:
            case Snapshot(items=items, skipped=skipped, created=created):
                self._replace(items, skipped, created)
                self._ready.set()
            case Put(name=name, value=info, created=created):
                self._put(name, info, created)
            case Deleted(name=name, why=why) if why:
                self._refuse(name, why)  # it does not decode
            case Deleted(name=name):
                self._delete(name)
        self._flush_checks()

    def revote(self) -> None:
        """Vote again the context of each model whose workers disagree on it, as `fit` reads
        them now (the module's docstring): the service calls it every second."""
        self._revote(list(self.context_conflicts))
        self._flush_checks()

    def _flush_checks(self) -> None:
        """Run the checks over what was touched since they last ran (nothing touched: no-ops)."""
        models, self._touched_models = self._touched_models, set()
        names, self._touched_names = self._touched_names, set()
        aliases, self._touched_aliases = self._touched_aliases, set()
        self._check_block_sizes(models)
        self._check_names(names, aliases)
        self._check_contexts(models)

    def _replace(self, items: dict[str, WorkerInfo], skipped: dict[str, str], created: dict[str, int]) -> None:
        # The fleet part applied and part not is no state of it: the standing lengths are settled by
        # the whole (a tie goes to them), else the order of the records could move them.
        gone = [n for n in self._workers.keys() | self._refusing.keys() if n not in items and n not in skipped]
        self._settling = False
        try:
            for name in gone:
                self._delete(name)
            for name, info in items.items():
                self._put(name, info, created.get(name, 0))
            for name, why in skipped.items():
                self._refuse(name, why)
        finally:
            self._settling = True
        self._revote(self._touched_models & self._context.keys())

    def _revote(self, models: Iterable[str]) -> None:
        """Vote `models`' contexts again, and route anew the workers a moved context routes otherwise."""
        routing: set[str] = set()
        for model in models:
            self._vote(model, routing)
        if routing:
            self._sorted = self._named = None  # the routed records change
        for each in routing:
            self._route(each)

    def _put(self, name: str, info: WorkerInfo, created: int) -> None:
        if (problem := self._problem(name, info)) is not None:
            self._refuse(name, problem, info)
            return
        self._refusing.pop(name, None)
        self._records.accepted(name)
        self._created[name] = created  # a key created again with the same record ranks as new
        if (old := self._workers.get(name)) == info:
            return
        self._workers[name] = info
        self._reindex(name, old, info)
        for served in (info.model, *info.aliases, *info.adapters):  # served again: no longer gone
            self._left.pop(served, None)
        self._sorted = self._named = None
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
        """Said once per key while `problem` stands, at most once a window while it keeps changing
        (discovery.refused_records); counted each time."""
        self.refused += 1
        self._remove(name)  # a record that was good before goes: routing must not keep a stale one
        self._refusing[name] = Refused(name, problem, info)
        self._records.refused(name, problem)

    def _delete(self, name: str) -> None:
        """The key `name` is gone."""
        self._refusing.pop(name, None)
        self._records.accepted(name)
        self._remove(name)

    def _remove(self, name: str) -> None:
        self._created.pop(name, None)
        if (info := self._workers.pop(name, None)) is not None:
            self._reindex(name, info, None)
            now, left = time.monotonic(), self._left
            for served in (info.model, *info.aliases, *info.adapters):
                if served in self._of_model or served in self._naming:
                    continue  # another worker still serves it: not gone, and unloaded from it later a 404
                left[served] = Departed(now, info.model)
                left.move_to_end(served)
            while len(left) > _LEFT_MAX:
                left.popitem(last=False)
            self._sorted = self._named = None
            self._call(self._on_remove, name)

    def _call(self, callback: Callable[[Any], None], arg: WorkerInfo | str) -> None:
        try:
            callback(arg)
        except Exception:
            log.exception("worker registry callback %s(%r) failed", getattr(callback, "__name__", callback), arg)

    # --- the indexes: one record at a time --------------------------------------------------------

    def _reindex(self, worker: str, old: WorkerInfo | None, new: WorkerInfo | None) -> None:
        """Bring the indexes up to date with `worker`'s record changed from `old` to `new` (None:
        absent), and mark the models and names the checks must look at again."""
        routing = {worker}  # the workers whose routing may change
        if old is not None:
            self._unindex(old)
        if new is not None:
            self._index(new)
        for model in {info.model for info in (old, new) if info is not None}:
            self._touched_models.add(model)
            if (model in self._of_model) != (model in self._context):
                # a model came or went: another model's alias of its name is shadowed or no longer,
                # and its aliases and adapters of that name are routed for it or no longer
                routing |= self._naming.get(model, set())
                self._touched_aliases.add(model)
            if model not in self._of_model:
                del self._context[model]
                continue
            self._vote(model, routing)
        for info in (old, new):
            if info is not None:
                self._touched_aliases.update(info.aliases)  # shadowed or not: as registered
        for each in routing:
            self._route(each)

    def _vote(self, model: str, routing: set[str]) -> None:
        """Set `model`'s context (router.fleet_vote) and add to `routing` the workers it routes
        otherwise: those registering the old context or the new one, should it move."""
        lengths = self._lengths.get(model, {})
        if len(lengths) > 1:
            infos = [(n, self._workers[w]) for n, ids in lengths.items() for w in ids]
            context: int | None = self._standing.decide(
                model,
                (Ballot(n, votes(i.role), self._fit(i), self._created.get(i.worker, 0)) for n, i in infos),
                self._settling,
            )
        else:  # the usual case: no vote, and a put costs the same whatever the fleet's size
            context = next(iter(lengths), None)
            if context is not None and self._settling:
                self._standing.agreed(model, context)
        if model in self._context and context != (was := self._context[model]):
            routing.update(*(lengths.get(n, ()) for n in (was, context) if n is not None))
            self._touched_models.add(model)
        self._context[model] = context

    def _index(self, info: WorkerInfo) -> None:
        worker, model = info.worker, info.model
        self._of_model.setdefault(model, set()).add(worker)
        self._sizes.setdefault(model, {}).setdefault(info.block_size, set()).add(worker)
        if info.max_model_len is not None:
            self._lengths.setdefault(model, {}).setdefault(info.max_model_len, set()).add(worker)
        for name in {*info.aliases, *info.adapters} - {model}:
            self._naming.setdefault(name, set()).add(worker)

    def _unindex(self, info: WorkerInfo) -> None:
        worker, model = info.worker, info.model
        _drop(self._of_model, model, worker)
        _drop_under(self._sizes, model, info.block_size, worker)
        if info.max_model_len is not None:
            _drop_under(self._lengths, model, info.max_model_len, worker)
        for name in {*info.aliases, *info.adapters} - {model}:
            _drop(self._naming, name, worker)

    def _route(self, worker: str) -> None:
        """Route `worker` as its record, its model's context and the models registered say now:
        listed in workers() or not, and for which names (router.served_names)."""
        self._routed.pop(worker, None)
        for name, way in self._serves.pop(worker, {}).items():
            _drop_under(self._served, name, way, worker)
            self._touched_names.add(name)
        self._unrouted.pop(worker, None)
        info = self._workers.get(worker)
        if info is None:
            return
        if info.max_model_len not in (None, self._context[info.model]):
            self._unrouted[worker] = info
            return
        info = self._routed[worker] = _unshadowed(info, self._of_model)
        serves: dict[str, Way] = {}
        for name in (info.model, *info.aliases, *info.adapters):
            if name == info.model or name not in self._of_model:  # a model's own name wins
                serves.setdefault(name, (info.model, adapter_named(name, info.model, info.aliases)))
        for name, way in serves.items():
            self._served.setdefault(name, {}).setdefault(way, set()).add(worker)
        self._serves[worker] = serves
        self._touched_names.update(serves)

    # --- the checks: the models and names an event touched -----------------------------------------

    def _check_block_sizes(self, models: set[str]) -> None:
        now = {model: set(sizes) for model in models if len(sizes := self._sizes.get(model, {})) > 1}
        if all(now.get(model) == self.block_size_conflicts.get(model) for model in models):
            return
        conflicts = _with(self.block_size_conflicts, models, now)
        for model, seen in conflicts.items():  # every conflict again, as when one changes
            log.error(
                "configuration error: workers of model %s disagree on block size %s; prefix matches "
                "across them are meaningless. Workers by block size: %s",
                model,
                sorted(seen),
                "; ".join(f"{size} on {few_ids(sorted(ids))}" for size, ids in sorted(self._sizes[model].items())),
            )
        for model in sorted(self.block_size_conflicts.keys() - conflicts.keys()):
            log.warning("workers of model %s agree on block size again", model)
        self.block_size_conflicts = conflicts

    def _check_contexts(self, models: set[str]) -> None:
        now = {
            model: ContextConflict(served, {n: sorted(ids) for n, ids in sorted(lengths.items())})
            for model in models
            if len(lengths := self._lengths.get(model, {})) > 1 and (served := self._context[model]) is not None
        }
        self.context_conflicts = _said(
            self.context_conflicts,
            models,
            now,
            context_message,
            lambda model: f"workers of model {model} agree on max_model_len again: all of them are routed",
            _context_substance,
        )

    def _check_names(self, names: set[str], aliases: set[str]) -> None:
        self.shadowed_aliases = _said(
            self.shadowed_aliases,
            aliases,
            {name: shadows for name in aliases if (shadows := self._shadows(name))},
            shadow_message,
            lambda name: f"no worker of another model serves the model name {name} as an alias any more",
            _models_involved,
        )
        self.name_clashes = _said(
            self.name_clashes,
            names,
            {name: clash for name in names if (clash := self._clash(name))},
            clash_message,
            lambda name: f"the name {name} is served as one model again: requests naming it are routed",
            _models_involved,
        )

    def _shadows(self, name: str) -> dict[str, list[str]]:
        """The workers of other models serving model `name`'s own name as an alias, by their model
        (router.served_names: a model's own name wins); {} unless `name` is a model's."""
        out: dict[str, list[str]] = {}
        if name in self._of_model:
            for worker in sorted(self._naming.get(name, ())):
                if name in (info := self._workers[worker]).aliases:
                    out.setdefault(info.model, []).append(worker)
        return out

    def _clash(self, name: str) -> dict[str, list[str]]:
        """`name`'s routed workers by model, where it resolves to more than one; else {}."""
        ways = self._served.get(name, {})
        if len(ways) < 2:
            return {}
        resolved = served_as(name, [self._routed[w] for w in sorted(set[str]().union(*ways.values()))])
        return resolved if len(resolved) > 1 else {}


def _said(
    before: dict[str, T],
    keys: set[str],
    now: dict[str, T],
    message: Callable[[str, T], str],
    again: Callable[[str], str],
    substance: Callable[[T], object],
) -> dict[str, T]:
    """`before` with `keys` as `now` has them (a key absent from `now`: no conflict any more),
    having said what changed in substance (_say_changes)."""
    _say_changes({k: before[k] for k in keys if k in before}, now, message, again, substance)
    return _with(before, keys, now)


def _with(before: dict[str, T], keys: set[str], now: dict[str, T]) -> dict[str, T]:
    """`before` with `keys` as `now` has them, a new dict where anything changed (a reader may hold
    the last one), by key."""
    if all(now.get(k) == before.get(k) for k in keys):
        return before
    return dict(sorted({**{k: v for k, v in before.items() if k not in keys}, **now}.items()))


def _drop(index: dict[K, set[str]], key: K, worker: str) -> None:
    (ids := index[key]).discard(worker)
    if not ids:
        del index[key]


def _drop_under(index: dict[str, dict[K, set[str]]], key: str, sub: K, worker: str) -> None:
    _drop(inner := index[key], sub, worker)
    if not inner:
        del index[key]


def _say_changes(
    before: Mapping[str, T],
    now: Mapping[str, T],
    message: Callable[[str, T], str],
    again: Callable[[str], str],
    substance: Callable[[T], object],
) -> None:
    """A configuration ERROR for each conflict new since `before`, or whose `substance` changed
    (once, not on every change of the fleet), and a WARNING for each one gone. The substance is
    what the conflict is (the lengths or models at odds), never which workers take part: each
    worker of a rolling change joining the minority logged the conflict again, 999 ERRORs (2 MB)
    at 1,000 workers (log-volume audit, 2026-12-06)."""
    for key, seen in sorted(now.items()):
        if key not in before or substance(before[key]) != substance(seen):
            log.error("configuration error: %s", message(key, seen))
    for key in sorted(before.keys() - now.keys()):
        log.warning("%s", again(key))


def _context_substance(conflict: ContextConflict) -> tuple[frozenset[int], int]:
    """What a context conflict is: the lengths at odds and the one the model is served with; which
    workers register each is not."""
    return frozenset(conflict.workers), conflict.served


def _models_involved(by_model: dict[str, list[str]]) -> frozenset[str]:
    """What a shadowed alias or a clash is (`by_model`: model -> worker ids): the models at odds."""
    return frozenset(by_model)


def context_message(model: str, conflict: ContextConflict) -> str:
    """Why workers of `model` registering another max_model_len than the model's are not routed."""
    left = "; ".join(f"{n} on {few_ids(ids)}" for n, ids in sorted(conflict.workers.items()) if n != conflict.served)
    return (
        f"workers of model {model} disagree on max_model_len: it is served with {conflict.served}, the length "
        "most of its decode and agg workers that serve register (ties: the one more of its serving workers "
        "register, then the one it was served with, then its longest-registered worker's; its prefill workers "
        "count only where it has none), "
        f"and the workers registering another are not routed ({left})"
    )


def _unshadowed(info: WorkerInfo, models: Container[str]) -> WorkerInfo:
    """`info` without its aliases that are another model's own name (router.served_names: its own name wins)."""
    if not any(name in models and name != info.model for name in info.aliases):
        return info
    kept = [name for name in info.aliases if name not in models or name == info.model]
    return msgspec.structs.replace(info, aliases=kept)
