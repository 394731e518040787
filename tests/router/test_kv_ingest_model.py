"""KvIngest and its BlockIndex against a model of what each shim holds, on both cores.

Seeded runs: shims store chains of blocks (prefixes shared across workers), remove and clear them,
and restart under new epochs; their batches are delivered, delayed (so they arrive out of order),
delivered twice or lost; kvstate is answered with a replay or a dump in chunks, sometimes with live
batches sent as it is answered (before the answer, which has them, or after it: held until it is
in), now and then with a replay cut short (a broken shim); workers register, register again under a
new epoch, and leave; load reports carry digests, compared with the index, but none ever judges a
batch lost (that takes behind_grace_s of the clock and a KV barrier's end, and a run takes well
under the grace with the ingest never started: stats.digest_lags stays 0 on every seed and core),
and the few replays cut short all find a live batch held. So the lost batch found by a digest, and a
short replay with nothing held, are left to the unit tests in test_kv_ingest.py:
test_a_lost_last_batch_is_caught_by_the_digest_within_the_grace,
test_a_batch_lost_under_a_kv_backlog_longer_than_the_barriers_bound_is_judged_lost and
test_a_replay_short_of_the_shims_own_seq_is_malformed_and_a_dump_follows. After every step the index
must hold, for each worker, exactly its shim's state at the (epoch, seq) the ingest says it has
applied (nothing while it bootstraps or once it left): entries, digest, counts and prompt matches;
and a worker synced must be at no seq behind one that a batch or a kvstate reply of its epoch told
the ingest of. Once every batch is delivered and each shim sends one more, repairs must bring every
registered worker to its shim's own (epoch, seq). No NATS: the ingest is never started, and the
test delivers the payloads and answers its kvstate requests itself."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from operator import xor
from typing import cast

import pytest
from nats.aio.client import Client

from protocol.messages import (
    Cleared,
    KvEvent,
    KvEventBatch,
    KvStateChunk,
    KvStateRequest,
    LoadReport,
    Removed,
    Stored,
    encode_msg,
)
from router.block_index import BlockIndex
from router.kv_ingest import KvIngest
from tests.router.test_block_index import NATIVE_FLAGS

SEEDS = range(30)
STEPS = 200
WORKERS = [f"w{i}" for i in range(6)]
RING = 6  # batches a shim can replay: a longer gap takes a dump
SHORT_REPLAYS = 0.05  # of replies that replay batches, those cut short
M64 = 2**64 - 1
EDGE_HASHES = [0, 1, M64, M64 - 1, 2**63, 2**32]

State = frozenset[int]


@dataclass(frozen=True)
class Forest:
    """Blocks and their parents: chains stored on several workers share their prefixes."""

    hashes: list[int]
    parents: list[int | None]  # each block's parent, by position
    children: dict[int | None, list[int]]

    @classmethod
    def grow(cls, rng: random.Random, size: int = 60) -> Forest:
        hashes: list[int] = []
        parents: list[int | None] = []
        children: dict[int | None, list[int]] = {}
        for i in range(size):
            h = EDGE_HASHES[i] if i < len(EDGE_HASHES) and rng.random() < 0.5 else rng.getrandbits(64)
            while h in hashes:
                h = rng.getrandbits(64)
            parent = None if i < 4 or rng.random() < 0.1 else rng.randrange(i)
            hashes.append(h)
            parents.append(parent)
            children.setdefault(parent, []).append(i)
        return cls(hashes, parents, children)

    def stored(self, rng: random.Random) -> Stored:
        """A chain from a random block down random children, as an engine stores a prompt's tail."""
        start = rng.randrange(len(self.hashes))
        chain = [start]
        while self.children.get(chain[-1]) and rng.random() < 0.8:
            chain.append(rng.choice(self.children[chain[-1]]))
        hashes = [self.hashes[i] for i in chain]
        if rng.random() < 0.1:
            hashes.append(hashes[0])  # a block twice in one event
        parent = self.parents[start]
        return Stored(hashes=hashes, parent=None if parent is None else self.hashes[parent])

    def prompt(self, rng: random.Random) -> list[int]:
        """A root-to-block path (sometimes past the forest, or twice over), or blocks at random."""
        if rng.random() < 0.2:
            return [rng.choice(self.hashes) for _ in range(rng.randint(1, 8))]
        path: list[int] = []
        at: int | None = rng.randrange(len(self.hashes))
        while at is not None:
            path.append(self.hashes[at])
            at = self.parents[at]
        path.reverse()
        if rng.random() < 0.2:
            path.append(rng.getrandbits(64))
        return path * 2 if rng.random() < 0.1 else path


class Shim:
    """A worker's shim: what it holds after each batch it sent, per (epoch, seq), and the kvstate
    answers an honest one gives (but for the replays cut short)."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name, self.rng = name, rng
        self.states: dict[tuple[int, int], State] = {}
        self.restart()

    def restart(self) -> None:
        """A new engine: a new epoch, numbering from 0, holding nothing."""
        self.epoch = self.rng.getrandbits(63) | 1
        self.seq = 0
        self.held: set[int] = set()
        self.ring: deque[KvEventBatch] = deque(maxlen=RING)
        self.states[(self.epoch, 0)] = frozenset()

    def send(self, events: list[KvEvent]) -> KvEventBatch:
        self.seq += 1
        for event in events:
            if isinstance(event, Stored):
                self.held.update(cast(list[int], event.hashes))
            elif isinstance(event, Removed):
                self.held.difference_update(cast(list[int], event.hashes))
            else:
                self.held.clear()
        batch = KvEventBatch(worker=self.name, epoch=self.epoch, seq=self.seq, ts=time.time(), events=events)
        self.ring.append(batch)
        self.states[(self.epoch, self.seq)] = frozenset(self.held)
        return batch

    def answer(self, request: KvStateRequest) -> list[KvStateChunk]:
        replay = [batch for batch in self.ring if batch.seq > request.since_seq]
        covered = request.since_seq == self.seq or (bool(replay) and replay[0].seq == request.since_seq + 1)
        if request.epoch == self.epoch and covered:
            if replay and self.rng.random() < SHORT_REPLAYS:
                replay = replay[: self.rng.randrange(len(replay))]
            return [KvStateChunk(worker=self.name, epoch=self.epoch, seq=self.seq, batches=replay)]
        hashes = sorted(self.held)
        self.rng.shuffle(hashes)
        n = self.rng.randint(1, 3)
        return [
            KvStateChunk(
                worker=self.name,
                epoch=self.epoch,
                seq=self.seq,
                dump=True,
                hashes=hashes[i::n],
                chunk=i,
                final=i == n - 1,
            )
            for i in range(n)
        ]

    def report(self) -> LoadReport:
        return LoadReport(
            worker=self.name,
            ts=time.time(),
            kv_epoch=self.epoch,
            kv_seq=self.seq,
            kv_blocks=len(self.held),
            kv_xor=reduce(xor, self.held, 0),
        )


class Fleet:
    """The shims, the network between them and the ingest, and the registry's calls."""

    def __init__(self, seed: int, native: bool) -> None:
        self.rng = rng = random.Random(seed)
        self.forest = Forest.grow(rng)
        held_limit = rng.choice([3, 10_000])  # 3: held batches overflow, and a dump catches up
        self.ingest = KvIngest(cast(Client, None), "ns", BlockIndex(native=native), held_limit=held_limit)
        self.shims = {name: Shim(name, rng) for name in WORKERS}
        self.delayed: dict[str, list[KvEventBatch]] = {name: [] for name in WORKERS}
        self.registered: set[str] = set()
        self.told: dict[tuple[str, int], int] = {}  # (worker, epoch) -> the highest seq the ingest was told of

    def tell(self, name: str, epoch: int, seq: int) -> None:
        self.told[(name, epoch)] = max(seq, self.told.get((name, epoch), 0))

    def step(self) -> None:
        actions: list[tuple[Callable[[Shim], None], int]] = [
            (self.register, 10),
            (self.publish, 40),
            (self.deliver_delayed, 10),
            (self.duplicate, 5),
            (self.repair, 15),
            (self.restart, 3),
            (self.leave, 2),
            (self.report, 10),
        ]
        action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
        action(self.shims[self.rng.choice(WORKERS)])

    def deliver(self, batch: KvEventBatch) -> None:
        self.tell(batch.worker, batch.epoch, batch.seq)
        self.ingest._on_payload(batch.worker, encode_msg(batch))

    def events(self, shim: Shim) -> list[KvEvent]:
        events: list[KvEvent] = []
        for _ in range(self.rng.randint(1, 3)):
            r = self.rng.random()
            if r < 0.55:
                events.append(self.forest.stored(self.rng))
            elif r < 0.9:  # held blocks mostly, a parent of others often; some it does not hold
                pool = sorted(shim.held) + self.rng.sample(self.forest.hashes, 3)
                events.append(Removed(hashes=self.rng.sample(pool, self.rng.randint(1, 3))))
            elif r < 0.95:
                events.append(Cleared())
            else:
                events.append(Stored(hashes=[]))
        return events

    def register(self, shim: Shim) -> None:
        if shim.name not in self.registered:
            self.ingest.add_worker(shim.name, shim.epoch)
            self.registered.add(shim.name)

    def publish(self, shim: Shim) -> None:
        batch = shim.send(self.events(shim))
        fate = self.rng.random()
        if fate < 0.75:
            self.deliver(batch)
        elif fate < 0.85:
            self.delayed[shim.name].append(batch)
        # else lost

    def deliver_delayed(self, shim: Shim) -> None:
        delayed = self.delayed[shim.name]
        if delayed:
            self.deliver(delayed.pop(self.rng.randrange(len(delayed))))

    def duplicate(self, shim: Shim) -> None:
        if shim.ring:
            self.deliver(self.rng.choice(shim.ring))

    def repair(self, shim: Shim, *, live_between: bool = True) -> None:
        if shim.name not in self.registered or self.ingest.sync_state(shim.name) is None:
            return
        request = self.ingest.repair_request(shim.name)
        if live_between and self.rng.random() < 0.3:
            self.publish(shim)  # sent after the request, before the shim answers: the answer has it
        answer = shim.answer(request)
        if live_between and self.rng.random() < 0.3:
            self.publish(shim)  # sent after the answer, arriving before it: held, applied after it
        self.tell(shim.name, answer[0].epoch, answer[0].seq)
        self.ingest.repair_reply(shim.name, answer)

    def restart(self, shim: Shim) -> None:
        shim.restart()
        if shim.name in self.registered and self.rng.random() < 0.5:
            self.ingest.add_worker(shim.name, shim.epoch)  # its record's new epoch

    def leave(self, shim: Shim) -> None:
        if shim.name in self.registered:
            self.ingest.remove_worker(shim.name)
            self.registered.discard(shim.name)

    def report(self, shim: Shim) -> None:
        if shim.name in self.registered:
            self.ingest.check_digest(shim.report())

    def settle(self) -> None:
        """Every batch delivered, one more from each registered shim (it shows a lost last one),
        and repairs until every registered worker is synced."""
        for name in WORKERS:
            for batch in self.delayed[name]:
                self.deliver(batch)
            self.delayed[name].clear()
        for name in sorted(self.registered):
            shim = self.shims[name]
            self.deliver(shim.send([self.forest.stored(self.rng)]))
            for _ in range(10):
                self.repair(shim, live_between=False)

    def expected(self, name: str) -> State:
        """The shim's state at the (epoch, seq) the ingest says the index holds of it."""
        sync = self.ingest.stats.workers.get(name)
        if sync is None or sync.epoch is None:
            return frozenset()
        return self.shims[name].states[(sync.epoch, sync.last_seq)]


def leading(prompt: list[int], held: State) -> int:
    n = 0
    while n < len(prompt) and prompt[n] in held:
        n += 1
    return n


def assert_exact(fleet: Fleet, when: str) -> None:
    ingest, index = fleet.ingest, fleet.ingest.index
    for name in fleet.registered:  # synced: at no seq behind one it was told of
        sync = ingest.stats.workers[name]
        if ingest.sync_state(name) is None and sync.epoch is not None:
            assert sync.last_seq >= fleet.told.get((name, sync.epoch), 0), f"{when}: {name} synced behind"
    model = {name: fleet.expected(name) for name in WORKERS}
    for name, held in model.items():
        assert index.worker_hashes(name) == held, f"{when}: {name}'s blocks"
        assert index.digest(name) == (len(held), reduce(xor, held, 0)), f"{when}: {name}'s digest"
    assert index.workers() == sorted(name for name, held in model.items() if held), when
    assert len(index) == len(frozenset().union(*model.values())), when
    assert index.entries == sum(map(len, model.values())), when
    for _ in range(8):
        prompt = fleet.forest.prompt(fleet.rng)
        overlap = index.match(prompt)
        want = {name: leading(prompt, held) for name, held in model.items()}
        assert {name: overlap.get(name) for name in WORKERS} == want, f"{when}: matches of {prompt}"
        assert overlap.to_dict() == {name: n for name, n in want.items() if n}, f"{when}: matches of {prompt}"


@pytest.mark.parametrize("native", NATIVE_FLAGS)
@pytest.mark.parametrize("seed", SEEDS)
def test_the_index_is_each_shims_state_at_the_seq_applied(seed: int, native: bool) -> None:
    fleet = Fleet(seed, native)
    for step in range(STEPS):
        fleet.step()
        assert_exact(fleet, f"step {step}")
    fleet.settle()
    assert_exact(fleet, "settled")
    for name in sorted(fleet.registered):
        shim, sync = fleet.shims[name], fleet.ingest.stats.workers[name]
        assert fleet.ingest.sync_state(name) is None, name
        assert (sync.epoch, sync.last_seq) == (shim.epoch, shim.seq), name
        assert fleet.ingest.index.worker_hashes(name) == shim.held, name
