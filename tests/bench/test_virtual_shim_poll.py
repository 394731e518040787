"""The virtual shim's load loops keep worker_shim.load_reporter's timing: the poll sleeps POLL_S
after each reading comes back (so its phase drifts), each shim's first poll at a phase of its own
drawn from the run's seed, and a reading published MIN_GAP_S after it comes back, through the
publish loop's poke. The virtual shim polled every shim at 0, 0.25, 0.5 s ... and published each
reading at once: on the slice of docs/benchmarks.md "Live against virtual" `slo_aware`'s decisions
hung on that phase."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from bench.virtual.delays import Delays
from bench.virtual.fleet import FleetSpec, VirtualFleet, settings_from_args
from bench.virtual.shim import POLL_S
from engine_sim.stats import StepSeries
from protocol import LoadReport
from worker_shim.load_reporter import DEFAULT_PERIOD_S, MIN_GAP_S

READ_S = 0.004


class _Reports:
    """Stands in for a router: the reports as they arrive."""

    def __init__(self) -> None:
        self.got: list[LoadReport] = []

    def on_load(self, rep: LoadReport) -> None:
        self.got.append(rep)


def _fleet(agg: int = 1, seed: int = 0) -> VirtualFleet:
    delays = Delays(engine_read_s=READ_S, load_report_s=0.0)
    settings = settings_from_args(["--disagg", "never"])
    return VirtualFleet(FleetSpec(agg=agg, settings=settings, delays=delays, max_model_len=65536, seed=seed))


def _replay(fleet: VirtualFleet, until: float, changes_every: float | None) -> list[LoadReport]:
    """The first shim's reports until `until`; its engine's figures change every `changes_every` s
    (as a step's end publishes them), or never."""
    shim = next(iter(fleet.shims.values()))
    reports = _Reports()
    shim.routers = [reports]  # type: ignore[list-item]
    stats = shim.engine.scheduler.stats

    def step_ends(running: int) -> None:
        stats.published = StepSeries(running=running)

    if changes_every is not None:
        for i in range(int(until / changes_every)):
            fleet.clock.at(i * changes_every, step_ends, i + 1)
    shim.start()
    fleet.clock.at(until, setattr, shim, "running", False)
    fleet.clock.run()
    return reports.got


def test_the_poll_sleeps_after_each_reading_and_each_reading_goes_out_min_gap_s_after_it() -> None:
    fleet = _fleet()
    shim = next(iter(fleet.shims.values()))
    got = _replay(fleet, 12.0, changes_every=0.1)  # every reading differs from the one before
    firsts: dict[float, LoadReport] = {}
    for rep in got:
        firsts.setdefault(rep.engine_ts, rep)
    stamps = sorted(firsts)[1:]  # [0]: the idle engine's reading at the start, published then
    assert len(stamps) >= 40
    asked = [t - READ_S / 2 for t in stamps]  # engine_ts: half way through the read, as live
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert all(abs(g - (POLL_S + READ_S)) < 1e-9 for g in gaps)  # not POLL_S: the phase drifts
    # Each reading comes back READ_S after it was asked for, and goes out MIN_GAP_S after that.
    late = [firsts[t].ts - (t + READ_S / 2) for t in stamps]
    assert all(abs(d - MIN_GAP_S) < 1e-9 for d in late)
    assert abs(asked[0] - shim.poll_offset_s) < 1e-9


def test_an_idle_engines_reports_are_the_heartbeat_exactly() -> None:
    """Nothing changes: one report every DEFAULT_PERIOD_S on the publish loop's deadline, whatever
    the poll's phase (a deadline that rounded below the period re-armed at the same instant for ever)."""
    got = _replay(_fleet(), 10.0, changes_every=None)
    sent = [rep.ts for rep in got]
    assert len(sent) == 21 and sent[0] == 0.0
    assert all(abs((b - a) - DEFAULT_PERIOD_S) < 1e-9 for a, b in itertools.pairwise(sent))


def test_each_shim_polls_from_a_phase_of_its_own_drawn_from_the_seed() -> None:
    period = POLL_S + READ_S
    offsets = [s.poll_offset_s for s in _fleet(agg=4).shims.values()]
    assert len(set(offsets)) == 4 and all(0 <= o < period for o in offsets)
    assert offsets == [s.poll_offset_s for s in _fleet(agg=4).shims.values()]
    assert offsets != [s.poll_offset_s for s in _fleet(agg=4, seed=1).shims.values()]


def _phased(
    offset: float, changes: dict[float, int], pokes: Sequence[float] = (), until: float = 1.0
) -> list[LoadReport]:
    """One shim's reports, its first poll asked for at `offset`: its engine's `running` becomes
    `changes[t]` at each t (as a step's end publishes it), and the shim is poked at each of `pokes`
    (as a change of its own figures pokes it)."""
    fleet = _fleet()
    shim = next(iter(fleet.shims.values()))
    shim.poll_offset_s = offset
    stats = shim.engine.scheduler.stats
    for t, running in changes.items():
        fleet.clock.at(t, setattr, stats, "published", StepSeries(running=running))
    for t in pokes:
        fleet.clock.at(t, shim.poke)
    reports = _Reports()
    shim.routers = [reports]  # type: ignore[list-item]
    shim.start()
    fleet.clock.at(until, setattr, shim, "running", False)
    fleet.clock.run()
    return reports.got


def test_a_heartbeat_deadline_inside_a_pokes_gap_cuts_the_gap_short() -> None:
    """The start's report at 0 sets the heartbeat's deadline at DEFAULT_PERIOD_S; the first reading
    comes back (and pokes) 20 ms before it: the report goes on the deadline, not MIN_GAP_S after the
    poke, as load_reporter's `asyncio.timeout` ends the gap's sleep there."""
    answered = DEFAULT_PERIOD_S - 0.02
    got = _phased(answered - READ_S, {})
    assert [rep.ts for rep in got[:2]] == [0.0, DEFAULT_PERIOD_S]
    assert abs(got[1].engine_ts - (answered - READ_S / 2)) < 1e-9  # it carries that reading


def test_pokes_within_one_gap_fold_into_one_report_min_gap_s_after_the_first() -> None:
    """A poke at 0.17 (nothing changed yet) and a reading back at 0.2 (running 0 -> 3): one report,
    at 0.17 + MIN_GAP_S, carrying the reading; the reading's poke starts no gap of its own."""
    poked, answered = 0.17, 0.2
    got = _phased(answered - READ_S, {0.1: 3}, pokes=[poked])
    early = [rep for rep in got if 0 < rep.ts < DEFAULT_PERIOD_S]
    assert [rep.ts for rep in early] == [poked + MIN_GAP_S]
    assert early[0].running == 3 and abs(early[0].engine_ts - (answered - READ_S / 2)) < 1e-9


def test_a_reading_carries_the_engines_figures_half_way_through_the_read() -> None:
    """The figures are 5 when the poll asks, 1 from 1 ms later and 2 from 1 ms before the answer:
    the reading is the one rendered half way, as the live shim's /metrics is (its engine_ts)."""
    asked = 0.1
    got = _phased(asked, {asked / 2: 5, asked + READ_S / 4: 1, asked + 3 * READ_S / 4: 2})
    rep = next(rep for rep in got if rep.ts > 0)
    assert rep.running == 1 and abs(rep.engine_ts - (asked + READ_S / 2)) < 1e-9
