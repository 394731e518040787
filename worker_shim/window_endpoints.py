"""Where a hybrid model's cache can be hit: the block ends its sliding-window groups allow.

A model with sliding-window and full-attention layers (Gemma 2 and 3, gpt-oss) has one KV cache
group per kind in vLLM. A cached prefix of L blocks is reused only if the full-attention group
holds blocks [0, L) and every sliding-window group holds the k blocks before L, k =
ceil((window - 1) / block_size), or all of [0, L) when L < k (vLLM 0.32,
SlidingWindowManager.find_longest_cache_hit). A sliding-window group caches only the blocks inside
its window when they fill, so these ends are sparse: where a prompt ended, where a chunk of a long
prefill ended, where a prompt left a prefix it shared with an earlier one (vLLM then caches the
window at that junction). Captured on a tiny Gemma 2 (tests/fixtures/vllm-0.32/bs32/hybrid_*): a
prompt sharing 6 blocks with a cached one was reused for 0 tokens, and once another prompt had
left that prefix, the next was reused for 192; one sharing 8 blocks, for 192 again.

This folds the window groups' events into the set of valid ends: the canonical hash of the last
block of each such L. The shim publishes each as `protocol.hashing.endpoint_key(hash)` beside the
chain's hashes, and a router takes, for a hybrid worker, the longest matched prefix that ends at
one (router.planner). The full-attention blocks are the normaliser's; this only adds the windows.

Synchronous and single-owner, like the normaliser that feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["UNKNOWN_PARENT", "WindowEndpoints"]

UNKNOWN_PARENT = -1  # canonical hashes are u64: a run of window blocks stops there


@dataclass(slots=True)
class _Group:
    need: int  # blocks of the window a hit needs before its end
    held: dict[int, int] = field(default_factory=dict)  # canonical -> copies
    engine: dict[int, list[int]] = field(default_factory=dict)  # engine hash -> [canonical, copies]
    # held block -> how many blocks the group holds in a row ending there, at most `need` (`need`
    # too when they reach the root: a prefix shorter than the window, all of it held)
    runs: dict[int, int] = field(default_factory=dict)


class WindowEndpoints:
    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}
        self._parent: dict[int, int | None] = {}  # canonical -> canonical parent (None: the root)
        self._children: dict[int | None, set[int]] = {}
        self._dirty: set[int] = set()
        self.endpoints: set[int] = set()
        self.window = 0  # tokens: the widest window seen

    def stored(self, group: int, window: int, block_size: int, blocks: Iterable[tuple[int, int, int | None]]) -> None:
        """Blocks a window group cached: (engine hash, canonical hash, canonical parent) each; the
        parent None is the root, UNKNOWN_PARENT one the full-attention group no longer names."""
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group(need=-(-(window - 1) // block_size))
            self.window = max(self.window, window)
            self._dirty.update(self.endpoints)  # each must now be held by this group too
        for eh, ch, parent in blocks:
            entry = g.engine.get(eh)
            if entry is None:
                g.engine[eh] = [ch, 1]
            else:
                entry[1] += 1
            copies = g.held.get(ch, 0)
            g.held[ch] = copies + 1
            if copies == 0:
                if self._parent.get(ch, UNKNOWN_PARENT) == UNKNOWN_PARENT:
                    self._parent[ch] = parent
                    if parent != UNKNOWN_PARENT:
                        self._children.setdefault(parent, set()).add(ch)
                self._dirty.add(ch)

    def removed(self, group: int, hashes: Iterable[int]) -> int:
        """Blocks a window group no longer caches; returns how many it was not known to hold."""
        g = self._groups.get(group)
        unknown = 0
        for eh in hashes:
            entry = g.engine.get(eh) if g is not None else None
            if g is None or entry is None:
                unknown += 1
                continue
            ch = entry[0]
            entry[1] -= 1
            if entry[1] == 0:
                del g.engine[eh]
            copies = g.held[ch] - 1
            if copies:
                g.held[ch] = copies
                continue
            del g.held[ch]
            self._dirty.add(ch)
            if not any(ch in other.held for other in self._groups.values()):
                parent = self._parent.pop(ch)
                siblings = self._children.get(parent)
                if siblings is not None:
                    siblings.discard(ch)
                    if not siblings:
                        del self._children[parent]
        return unknown

    def clear(self) -> None:
        self._groups.clear()
        self._parent.clear()
        self._children.clear()
        self._dirty.clear()
        self.endpoints.clear()

    def settle(self) -> tuple[list[int], list[int]]:
        """The ends gained and lost since the last call (canonical hashes). Each changed block's
        runs are computed again from its parent's (a changed parent first), and a block whose
        runs moved passes the change to its children, again if they were settled already (one
        settled before an ancestor's change reached its parent): at most the widest window deep,
        and no deeper than the runs actually move."""
        if not self._dirty:
            return [], []
        groups = list(self._groups.values())
        queued: dict[int, None] = dict.fromkeys(self._dirty)
        order = list(queued)
        self._dirty.clear()
        done: set[int] = set()
        flipped: dict[int, bool] = {}  # block -> an end now; one settled twice may flip back
        for first in order:  # grows as changes reach children
            stack = [first]
            while stack:
                block = stack[-1]
                parent = self._parent.get(block, UNKNOWN_PARENT)
                if parent is not None and parent in queued and parent not in done:
                    stack.append(parent)
                    continue
                stack.pop()
                if block in done:
                    continue
                done.add(block)
                if self._rerun(groups, block, parent):
                    for child in self._children.get(block, ()):
                        if child not in queued or child in done:
                            queued[child] = None
                            done.discard(child)
                            order.append(child)
                ok = bool(groups) and all(g.runs.get(block, 0) >= g.need for g in groups)
                if ok != (block in self.endpoints):
                    if ok:
                        self.endpoints.add(block)
                    else:
                        self.endpoints.discard(block)
                    if flipped.pop(block, None) is None:
                        flipped[block] = ok
        return [b for b, ok in flipped.items() if ok], [b for b, ok in flipped.items() if not ok]

    @staticmethod
    def _rerun(groups: list[_Group], block: int, parent: int | None) -> bool:
        """Compute `block`'s run in each group from its parent's; whether any moved."""
        moved = False
        for g in groups:
            run = 0
            if block in g.held:
                run = g.need if parent is None else min(g.need, 1 + g.runs.get(parent, 0))
            if run != g.runs.get(block, 0):
                moved = True
                if run:
                    g.runs[block] = run
                else:
                    del g.runs[block]
        return moved
