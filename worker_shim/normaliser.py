"""Engine hashes to canonical hashes, with reference counts (DESIGN.md, "The canonical block hash").

Rules:
- A stored block's canonical hash is `protocol.block_hashes(its tokens, B, parent=canonical parent)`;
  the canonical parent comes from the engine parent's mapping (None: the root for the event's salt).
- References are counted per engine hash and per canonical hash: an engine may store one block twice
  (two physical copies), and two engine hashes may name one canonical block (extra keys the canonical
  hash does not see). `Stored` is emitted only when a canonical hash goes 0 -> 1, `Removed` only on
  1 -> 0, so a subscriber holding a plain set stays exact.
- An unknown parent never yields a hash: the chain is dropped and counted. In exact mode that means
  the shim lost events, so `needs_rebuild` is raised for the owner to resync; after a reset that could
  not replay the engine's whole history (`exact` False) such drops are expected and only counted.
- Mappings of removed blocks are remembered (bounded) so a parent evicted before its child still
  resolves: an engine hash names fixed content, so the mapping cannot go stale.
- Malformed events (token count not blocks x B, wrong block size) are counted, logged once, dropped.
  Their engine hashes are remembered (bounded, kept over resets), and so are their descendants':
  an engine hash names fixed content, so a replay sends them malformed again, and a child of one is
  dropped quietly (counted as malformed) instead of raising `needs_rebuild`, whose replay would
  loop. An engine hash the normaliser knows is never voided: it names fixed content, so a known
  mapping beats a malformed re-announcement.
- Offload tiers: a block is on the worker whatever tier holds it. A Stored on a medium other than
  the GPU's (None or "GPU") adds a reference of that medium, and a Removed on a medium undoes only
  a reference of that medium (else it is an unknown removal). vLLM's OffloadingConnector (unless
  `self_describing_kv_events`) and simple_kv_offload send a *placeholder* for an offloaded block:
  its engine hash only, no tokens, no parent (block_size 0). One of a held block is one more
  reference; of any other block (and of a sliding-window group's) it is counted and dropped, never
  voided, and never sets its group's kind (it names none). A tier that never reports an eviction
  (vLLM 0.32's disk tiers, medium STORAGE) is not credited at all: its stores, placeholders or
  self-describing, are counted and dropped.
- SGLang with EAGLE sends bigram pages, read as their own tokens (protocol.vllm_events
  BigramTokenIds): SGLang reuses such a page only when the token after it matches too, so the
  last page of a matched prefix can be over-credited; said once per shim at WARNING.
- A hybrid model's engine caches blocks once per KV cache group (EngineStored.kind): the
  full-attention group's events are the chain above; a sliding-window group's go to
  worker_shim.window_endpoints, whose hit ends are published as `endpoint_key`s. Within a batch the
  full-attention events are folded first (vLLM sends group 0 first, which may be the window's), so
  a window block's engine hash always names a known canonical one. A group of a kind kvswitch does
  not model is counted and logged once, and its events dropped. Several full-attention groups fold
  into one chain: a block counts while any of them holds it, though vLLM reuses it only while all
  do, so it is over-credited once one evicts it; each group past the first is counted and said once.
- A LoRA adapter unloaded or re-pointed at another path (`drop_adapter`): vLLM 0.32 hashes an
  adapter's blocks by its name and path, so the engine reuses its chains no more, though it holds
  them until evicted; its events name the adapter only (the chain's salt up to the NUL,
  protocol.hashing.chain_salt). Its chains are removed (`Removed` for every canonical block no other
  chain holds) and their engine hashes remembered (bounded, as the removed mappings are), so that
  what the engine still says of them is dropped quietly: a replay re-storing them, a request begun
  before the change adding blocks to them (no unknown parent, no rebuild), their eviction (no
  unknown removal). They outlive resets and the shim's sessions (`after`), since a replay re-sends
  them, and are forgotten when the
  adapter is loaded from that path again (`revive_adapter`).

Single-owner and synchronous: nothing here awaits. `apply` folds a batch in one go; `folding`
pauses within a long stored chain every FOLD_BLOCKS blocks, so that its owner can let its loop run
(a 128 k-token prompt's one Stored is 8,192 blocks), the event already validated and hashed whole.
A `reset` while it is paused ends it: the rest of its chain and batch came before the reset, which
withdraws all that came before, so none of it is linked into the cleared set.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from protocol import Cleared, KvEvent, Removed, Stored
from protocol.hashing import block_hashes, endpoint_key, root_hash
from protocol.vllm_events import BigramTokenIds
from worker_shim.engine_events import FULL, WINDOW, EngineCleared, EngineEvent, EngineRemoved, EngineStored
from worker_shim.window_endpoints import UNKNOWN_PARENT, WindowEndpoints

__all__ = ["DROPPED_FOR_S", "FOLD_BLOCKS", "Normaliser", "NormaliserStats"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NormaliserStats:
    malformed: int = 0
    unknown_parent: int = 0
    unknown_removed: int = 0
    resets: int = 0
    other_groups: int = 0  # events of a KV cache group kind kvswitch does not model
    full_groups_folded: int = 0  # full-attention KV cache groups past the first, folded into one chain
    bigram_stored: int = 0  # Stored events of SGLang's bigram pages (EAGLE)
    placeholders_dropped: int = 0  # offload tiers' placeholder blocks the normaliser does not hold


def _parent_first(parents: dict[int, int | None], ends: list[int]) -> Iterator[list[int]]:
    """Runs of `parents`' keys (consumed), each parent-first and after its parent's run, then `ends`."""
    while parents:
        h, p = parents.popitem()
        chain = [h]
        while p is not None and p in parents:  # a parent no longer in `parents` is out already, or not held
            chain.append(p)
            p = parents.pop(p)
        chain.reverse()
        yield chain
    if ends:
        yield ends


_CHAIN = -1  # the group key of the full-attention chain's offload references (its groups fold into one)


def _tier_of(medium: str | None) -> str | None:
    """The offload tier a medium names; None: the engine's own cache (None or "GPU"). A Stored with
    no tokens on a tier is a placeholder: it names blocks by engine hash only."""
    return None if medium is None or medium == "GPU" else medium


_CREDITED_TIERS = frozenset({"CPU", "CPU_PINNED"})
"""Offload tiers whose placeholders keep a block published: vLLM 0.32's CPU tier reports each
eviction, as SGLang's HiCache host tier (medium CPU_PINNED, its StorageMedium.CPU) does; vLLM's
disk tiers (fs, obj: medium STORAGE) report none, so a block only they held would stay credited to
the worker for the engine's life."""

_REBUILD_PARENTS = 64
FOLD_BLOCKS = 1024
"""Blocks of a stored chain linked between two pauses of `folding` (about 1 ms of work)."""
DROPPED_FOR_S = 60.0
"""How long a dropped adapter chain's blocks stay dropped whatever the engine says of them."""


class Normaliser:
    """Folds engine events into the canonical set and says what changed, as protocol events."""

    def __init__(
        self,
        block_size: int,
        memo_size: int = 1 << 16,
        stats: NormaliserStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        after: Normaliser | None = None,
    ) -> None:
        """`after`: the normaliser of the engine's previous session; the adapter chains it dropped
        stay dropped here (the new session's replay re-sends them), as within one."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.memo_size = memo_size
        self.stats = stats or NormaliserStats()  # shared by the shim's successive normalisers
        self.exact = True
        # engine hashes of the unknown parents that ask for a rebuild (a few: enough to tell
        # whether a rebuild's own replay names the same ones again); the owner takes them
        self.rebuild_parents: set[int] = set()
        # engine hash -> [canonical hash, references]
        self._engine: dict[int, list[int]] = {}
        # (group, engine hash, medium) -> references on that offload tier (group _CHAIN: counted in
        # _engine too; else a sliding-window group's), and the tiers seen
        self._tiers: dict[tuple[int, int, str], int] = {}
        self._media: set[str] = set()
        # canonical hash -> references (over all engine hashes naming it)
        self._canon: dict[int, int] = {}
        # canonical hash -> canonical parent (None: root), for the parent-first dump
        self._canon_parent: dict[int, int | None] = {}
        self._retired: OrderedDict[int, int] = OrderedDict()
        # engine hash -> the LoRA adapter whose chain holds it (adapters' chains only)
        self._adapter_of: dict[int, str] = {}
        # engine hash -> ((adapter, path), when) of chains dropped as the engine reuses them no more
        self._dropped: OrderedDict[int, tuple[tuple[str, str | None], float]] = (
            OrderedDict(after._dropped) if after is not None and after.block_size == block_size else OrderedDict()
        )
        # engine hashes of blocks dropped as malformed, and of their descendants
        self._void: OrderedDict[int, None] = OrderedDict()
        self._clock = clock
        self._logged: set[str] = set()
        # KV cache group -> kind, as its Stored events say: the engine's layout, kept over resets.
        self._groups: dict[int, str] = {}
        self.windows = WindowEndpoints()
        self._resets = 0  # `reset`s so far: a paused `folding` ends when one came meanwhile

    # --- reading ------------------------------------------------------------------------------

    def canonical_hashes(self) -> set[int]:
        """Every key published and held: the blocks, and a hybrid model's hit ends."""
        return set(self._canon) | {endpoint_key(c) for c in self.windows.endpoints}

    def __len__(self) -> int:
        return len(self._canon)

    def holds(self, canonical: int) -> bool:
        return canonical in self._canon

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its canonical hashes) the engine holds, and for a
        hybrid model would reuse: up to a hit end of its sliding windows."""
        canon = self._canon
        held = next((i for i, h in enumerate(hashes) if h not in canon), len(hashes))
        if not self.windows.window:
            return held
        ends = self.windows.endpoints
        return next((n for n in range(held, 0, -1) if hashes[n - 1] in ends), 0)

    def dump(self) -> list[int]:
        """Every canonical hash held, each parent before its children."""
        return list(self.dump_lazily())

    def dump_lazily(self) -> Iterator[int]:
        """What `dump()` lists, as of now: the set is copied now (~70 ms for 4 M blocks) and ordered
        as it is read (~1 s for 4 M), so a caller may send it in pieces, letting its loop run, while
        the set moves on."""
        runs = _parent_first(dict(self._canon_parent), [endpoint_key(c) for c in self.windows.endpoints])
        return itertools.chain.from_iterable(runs)

    def snapshot(self) -> list[KvEvent]:
        """Events that rebuild the current set from nothing: one Stored per run of `dump()` (a chain,
        parent-first, after its parent's run; a hybrid model's hit ends last, as they are published),
        ~8 B a block on the wire. One Stored per block took ~54 B: a registration's snapshot of 100k
        blocks went past a router's byte burst (router.sender_budget) and the worker was quarantined."""
        parents = self._canon_parent
        runs = _parent_first(dict(parents), [endpoint_key(c) for c in self.windows.endpoints])
        return [Stored(hashes=run, parent=parents.get(run[0])) for run in runs]

    # --- folding ------------------------------------------------------------------------------

    @property
    def needs_rebuild(self) -> bool:
        """The shim lost events (an unknown parent in exact mode): the owner should resync."""
        return bool(self.rebuild_parents)

    def reset(self, *, exact: bool) -> list[KvEvent]:
        """Forget everything (the engine restarted or events were lost): emits Cleared. Dropped
        adapter chains stay dropped: a replay re-sends them."""
        self._engine.clear()
        self._tiers.clear()
        self._adapter_of.clear()
        self._canon.clear()
        self._canon_parent.clear()
        self._retired.clear()
        self.windows.clear()
        self._resets += 1
        self.exact = exact
        self.rebuild_parents = set()
        self.stats.resets += 1
        return [Cleared()]

    def apply(self, events: Iterable[EngineEvent]) -> list[KvEvent]:
        """Fold a batch of engine events in one go; what changed, as protocol events."""
        out: list[KvEvent] = []
        for _ in self.folding(events, out):
            pass
        return out

    def folding(self, events: Iterable[EngineEvent], out: list[KvEvent]) -> Iterator[None]:
        """`apply`, appending to `out`, pausing (yielding) after every FOLD_BLOCKS blocks of a long
        stored chain. At a pause `out` says all the normaliser holds that it did not before: the
        owner publishes it then, as whatever runs meanwhile (a kvstate dump) reads the set. A
        `reset` meanwhile (the stream found to be another engine's) ends it: nothing more is folded, the
        rest of the batch included."""
        window: list[EngineStored | EngineRemoved] = []
        resets = self._resets
        for ev in events:
            if isinstance(ev, EngineCleared):
                self._windowed(window, out)
                window = []
                out.extend(self.reset(exact=True))
                resets = self._resets
                continue
            kind = self._kind_of(ev)
            if kind == FULL:
                if isinstance(ev, EngineRemoved):
                    self._removed(ev, out)
                elif (tier := _tier_of(ev.medium)) is not None and (not ev.token_ids or tier not in _CREDITED_TIERS):
                    self._offloaded(ev.hashes, tier)
                else:
                    yield from self._stored(ev, out)
                    if self._resets != resets:
                        return
            elif kind == WINDOW:
                window.append(ev)
            elif kind is None:  # a removal or placeholder of a group no Stored has named yet
                if isinstance(ev, EngineRemoved):
                    self.stats.unknown_removed += len(ev.hashes)
                else:
                    self.stats.placeholders_dropped += len(ev.hashes)
            else:
                self.stats.other_groups += 1
                self._say_once(
                    f"KV cache group {ev.group} is of kind {kind!r}, which kvswitch does not model: its events "
                    "are dropped, and routers count this worker's full-attention prefix as cached"
                )
        self._windowed(window, out)

    def _kind_of(self, ev: EngineStored | EngineRemoved) -> str | None:
        """The event's group kind; None: a removal or placeholder of a group no Stored has named yet."""
        if isinstance(ev, EngineStored) and (ev.token_ids or _tier_of(ev.medium) is None):
            if ev.group not in self._groups and ev.kind == FULL and FULL in self._groups.values():
                self.stats.full_groups_folded += 1
                self._say_once(
                    f"KV cache group {ev.group} is another full-attention group: kvswitch folds them into one "
                    "chain, so a block one of them evicted stays credited until all have (vLLM reuses it only "
                    "while every one holds it), and routers may over-credit this worker's cached prefix"
                )
            self._groups[ev.group] = ev.kind
            return ev.kind
        kind = self._groups.get(ev.group)
        if kind is None and isinstance(ev, EngineRemoved) and ev.kind is not None:
            return ev.kind  # the removal names its group's kind (an SGLang component): no Stored needed
        if kind is None and ev.group == 0 and not self._groups:
            return FULL  # an engine with one group, before its first Stored since a reset
        return kind

    def _windowed(self, events: list[EngineStored | EngineRemoved], out: list[KvEvent]) -> None:
        """Fold window groups' events, after the batch's full-attention ones, and publish the
        hit ends they moved."""
        windows = self.windows
        if events and FULL not in self._groups.values():
            self._say_once(
                f"KV cache group {events[0].group} is a sliding window and the engine has no full-attention group: "
                "kvswitch chains a window's blocks through the full-attention ones, so none of this worker's "
                "cached prefixes is published and routers give it no prefix credit (counted in "
                "kvswitch_shim_kv_unknown_parent_total)"
            )
        for ev in events:
            if isinstance(ev, EngineRemoved):
                self.stats.unknown_removed += windows.removed(ev.group, self._window_removed(ev))
                continue
            if not ev.token_ids and _tier_of(ev.medium) is not None:
                self.stats.placeholders_dropped += len(ev.hashes)
                continue
            if ev.block_size != self.block_size:
                self._malformed(
                    "window block_size",
                    f"window group block_size {ev.block_size} differs from the worker's {self.block_size}",
                )
                continue
            blocks = []
            tier = _tier_of(ev.medium)
            for eh in ev.hashes:
                ch = self._canonical_of(eh)
                if ch is None:
                    self.stats.unknown_parent += 1
                    continue
                blocks.append((eh, ch, self._canon_parent.get(ch, UNKNOWN_PARENT)))
                if tier is not None:
                    self._add_tier(ev.group, eh, tier)
            windows.stored(ev.group, ev.window, ev.block_size, blocks)
        gained, lost = windows.settle()
        if gained:
            out.append(Stored(hashes=[endpoint_key(c) for c in gained]))
        if lost:
            out.append(Removed(hashes=[endpoint_key(c) for c in lost]))

    def _window_removed(self, ev: EngineRemoved) -> Sequence[int]:
        """The hashes a window group's removal takes from it: on an offload tier, only those with a
        reference of that medium (the rest are counted as unknown removals)."""
        tier = _tier_of(ev.medium)
        if tier is None:
            return ev.hashes
        kept = [eh for eh in ev.hashes if self._untier(ev.group, eh, tier)]
        self.stats.unknown_removed += len(ev.hashes) - len(kept)
        return kept

    def _add_tier(self, group: int, engine_hash: int, tier: str) -> None:
        key = (group, engine_hash, tier)
        self._tiers[key] = self._tiers.get(key, 0) + 1
        self._media.add(tier)

    def _untier(self, group: int, engine_hash: int, tier: str) -> bool:
        """Undo one reference of `engine_hash` on offload tier `tier`; False when it has none."""
        key = (group, engine_hash, tier)
        n = self._tiers.get(key)
        if n is None:
            return False
        if n == 1:
            del self._tiers[key]
        else:
            self._tiers[key] = n - 1
        return True

    def _undo(self, engine_hash: int, refs: int, tier: str | None) -> bool:
        """Whether a held engine hash (`refs` references) has one on `tier` (None: the engine's own
        cache) for a removal to undo; a tier's is undone here."""
        if tier is not None:
            return self._untier(_CHAIN, engine_hash, tier)
        tiers = self._tiers
        return refs > sum(tiers.get((_CHAIN, engine_hash, m), 0) for m in self._media)

    def drop_adapter(self, name: str, path: str | None) -> list[KvEvent]:
        """Stop publishing the chains of LoRA adapter `name`, computed with its weights from `path`:
        it was unloaded or re-pointed, so the engine reuses them no more. Emits Removed for every
        canonical block no other chain holds."""
        engine = self._engine
        gone: list[int] = []
        now = self._clock()
        for eh in [eh for eh, adapter in self._adapter_of.items() if adapter == name]:
            del self._adapter_of[eh]
            ch, refs = engine.pop(eh)
            for m in self._media:
                self._tiers.pop((_CHAIN, eh, m), None)
            self._drop(eh, (name, path), now)
            self._release(ch, refs, gone)
        return [Removed(hashes=gone)] if gone else []

    def revive_adapter(self, name: str, path: str | None) -> bool:
        """Forget the chains of adapter `name` dropped at `path`: it loads from that path again, so
        the engine reuses them again. True when there were some: the owner then asks the engine for
        a replay, which stores them again."""
        tag = (name, path)
        revived = [eh for eh, (was, _) in self._dropped.items() if was == tag]
        for eh in revived:
            del self._dropped[eh]
        return bool(revived)

    def _drop(self, engine_hash: int, tag: tuple[str, str | None], at: float) -> None:
        dropped = self._dropped
        dropped[engine_hash] = (tag, at)
        dropped.move_to_end(engine_hash)
        if len(dropped) > self.memo_size:
            dropped.popitem(last=False)

    def _still_dropped(self, ev: EngineStored) -> bool:
        """Whether `ev` stores blocks of a dropped chain (a replay, or a request begun before its
        adapter changed); its blocks are then dropped too, as of the same drop. For DROPPED_FOR_S
        only: what the engine cached between the change and the shim's reading of it was dropped
        too, though it may be the new path's, and a chain still growing from it after that is live
        (no request runs the old path for long). It then reads as an unknown parent, and the
        rebuild from the engine's replay takes back whatever the engine still holds."""
        dropped = self._dropped
        if not dropped:
            return False
        key = ev.parent if ev.parent in dropped else ev.hashes[0] if ev.hashes else None
        if key is None or key not in dropped:
            return False
        tag, at = dropped[key]
        if self._clock() - at > DROPPED_FOR_S:
            del dropped[key]
            return False
        for eh in ev.hashes:
            self._drop(eh, tag, at)
        return True

    def _say_once(self, why: str) -> None:
        if why not in self._logged:
            self._logged.add(why)
            log.warning("%s", why)

    def _malformed(self, kind: str, why: str, void: Iterable[int] = ()) -> None:
        """Count and drop a malformed event; `void`: its engine hashes, whose children are dropped too.
        Logged once per `kind`, with the first one's `why` (which names its values)."""
        self.stats.malformed += 1
        self._voided(void)
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("dropping malformed KV event (logged once per kind): %s", why)

    def _voided(self, hashes: Iterable[int]) -> None:
        void = self._void
        for eh in hashes:
            if self._canonical_of(eh) is not None:
                continue  # it names fixed content: a known mapping beats a malformed re-announcement
            void[eh] = None
            void.move_to_end(eh)
        while len(void) > self.memo_size:
            void.popitem(last=False)

    def _canonical_of(self, engine_hash: int) -> int | None:
        entry = self._engine.get(engine_hash)
        if entry is not None:
            return entry[0]
        return self._retired.get(engine_hash)

    def _stored(self, ev: EngineStored, out: list[KvEvent]) -> Iterator[None]:
        bs = self.block_size
        n = len(ev.hashes)
        if isinstance(ev.token_ids, BigramTokenIds):
            if not self.stats.bigram_stored:
                log.warning(
                    "the engine sends bigram pages (SGLang with EAGLE): SGLang reuses a page only when the "
                    "token after it matches too, so routers can over-credit the last page of a cached prefix"
                )
            self.stats.bigram_stored += 1
        if ev.parent is not None and ev.parent in self._void:
            self.stats.malformed += 1  # its chain cannot be hashed: quietly, the parent was logged
            self._voided(ev.hashes)
            return
        if ev.block_size != bs:
            self._malformed("block_size", f"block_size {ev.block_size} differs from the worker's {bs}", ev.hashes)
            return
        if len(ev.token_ids) != n * bs:
            self._malformed("token count", f"{len(ev.token_ids)} token ids for {n} blocks of {bs}", ev.hashes)
            return
        if self._still_dropped(ev):
            return
        if ev.parent is None:
            parent: int | None = None
            start = root_hash(ev.salt)  # ~100 ns; a cache of it per salt grew with clients' salts
        else:
            parent = self._canonical_of(ev.parent)
            if parent is None:
                self.stats.unknown_parent += 1
                if self.exact and len(self.rebuild_parents) < _REBUILD_PARENTS:
                    self.rebuild_parents.add(ev.parent)
                return
            start = parent
        if ev.media:  # blocks of media placeholders: a domain no prompt's chain reaches
            start = root_hash(f"{start}\x01{ev.media}")
        try:
            canon = block_hashes(ev.token_ids, bs, parent=start)
        except ValueError as exc:
            self._malformed("token ids", str(exc), ev.hashes)
            return
        adapter = ev.salt.partition("\x00")[0]  # chain_salt(lora, cache_salt)
        yield from self._link(ev.hashes, canon, parent, ev.medium, out, adapter)

    def _link(
        self,
        hashes: Sequence[int],
        canon: list[int],
        parent: int | None,
        medium: str | None,
        out: list[KvEvent],
        adapter: str = "",
    ) -> Iterator[None]:
        engine, counts, parents = self._engine, self._canon, self._canon_parent
        tier = _tier_of(medium)
        run: list[int] = []
        run_parent = parent
        prev = parent
        resets = self._resets
        for i, (eh, ch) in enumerate(zip(hashes, canon, strict=True)):
            if i and not i % FOLD_BLOCKS:
                if run:
                    out.append(Stored(hashes=run, parent=run_parent, medium=medium))
                    run = []
                yield
                if self._resets != resets:  # the set was cleared meanwhile: its parent is gone
                    return
                dropped = self._dropped.get(hashes[i - 1])
                if dropped is not None:  # its adapter was dropped meanwhile: the rest of the chain with it
                    for rest in hashes[i:]:
                        self._drop(rest, *dropped)
                    return
            entry = engine.get(eh)
            if entry is None:
                engine[eh] = [ch, 1]
                self._retired.pop(eh, None)
                if adapter:
                    self._adapter_of[eh] = adapter
            else:
                entry[1] += 1
            if tier is not None:
                self._add_tier(_CHAIN, eh, tier)
            c = counts.get(ch, 0)
            counts[ch] = c + 1
            if c == 0:
                parents[ch] = prev
                if not run:
                    run_parent = prev
                run.append(ch)
            elif run:
                out.append(Stored(hashes=run, parent=run_parent, medium=medium))
                run = []
            prev = ch
        if run:
            out.append(Stored(hashes=run, parent=run_parent, medium=medium))

    def _offloaded(self, hashes: Iterable[int], tier: str) -> None:
        """An offload tier's placeholder: one more reference of each block held (already published),
        of that tier; one not held cannot be hashed and is dropped. Any store of a tier that never
        reports an eviction (_CREDITED_TIERS), placeholder or self-describing, is dropped too."""
        engine, counts = self._engine, self._canon
        for eh in hashes:
            entry = engine.get(eh)
            if entry is None or tier not in _CREDITED_TIERS:
                self.stats.placeholders_dropped += 1
                continue
            entry[1] += 1
            counts[entry[0]] += 1
            self._add_tier(_CHAIN, eh, tier)

    def _removed(self, ev: EngineRemoved, out: list[KvEvent]) -> None:
        engine = self._engine
        tier = _tier_of(ev.medium)
        gone: list[int] = []
        for eh in ev.hashes:
            entry = engine.get(eh)
            if entry is None:
                # a dropped or malformed chain's eviction is expected
                if eh not in self._dropped and eh not in self._void:
                    self.stats.unknown_removed += 1
                continue
            if (tier is not None or self._media) and not self._undo(eh, entry[1], tier):
                self.stats.unknown_removed += 1  # no reference of that medium: only other tiers hold it
                continue
            ch = entry[0]
            entry[1] -= 1
            if entry[1] == 0:
                del engine[eh]
                self._adapter_of.pop(eh, None)
                self._retire(eh, ch)
            self._release(ch, 1, gone)
        if gone:
            out.append(Removed(hashes=gone, medium=ev.medium))

    def _release(self, canonical: int, refs: int, gone: list[int]) -> None:
        """`refs` fewer engine blocks map to `canonical`; at none it is gone (appended to `gone`)."""
        counts = self._canon
        c = counts[canonical] - refs
        if c == 0:
            del counts[canonical]
            self._canon_parent.pop(canonical, None)
            gone.append(canonical)
        else:
            counts[canonical] = c

    def _retire(self, engine_hash: int, canonical: int) -> None:
        retired = self._retired
        retired[engine_hash] = canonical
        if len(retired) > self.memo_size:
            retired.popitem(last=False)
