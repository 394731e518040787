"""The virtual clock's arithmetic: where a periodic loop stands after a skip is the very float its
repeated additions reach."""

from __future__ import annotations

import random
from collections.abc import Sequence

from bench.virtual.clock import last_round


def _added(start: float, steps: Sequence[float], until: float) -> float:
    t = start
    while True:
        after = t
        for step in steps:
            after += step
        if not t < after <= until:
            return t
        t = after


def test_a_loops_last_round_is_the_float_its_additions_reach() -> None:
    """The shims' polls resumed after a quiet stretch at `due + n * period`, which differs from the
    sums ticking through reaches in its last bits (an engine_ts of 68.84259341569084 against
    ...154 after 68 s). Here the steps include ties, which round to even, at a binade the loop
    crosses (0.25 + 2**-47 in [64, 128)), a read's halves and the heartbeat's 0.5."""
    rng = random.Random(0)

    def step() -> float:
        x = 0.05 + rng.random() * 0.3
        return rng.choice([x, 0.25, round(x * 2**20) / 2**20 + 2.0 ** -rng.randint(38, 52)])

    cases = [((0.5,), 0.0), ((0.002, 0.002, 0.25), 0.1), ((0.25 + 2**-47,), 1.0), ((0.25 + 2**-47, 0.001), 0.01)]
    cases += [(tuple(step() for _ in range(rng.randint(1, 3))), rng.random() * 100) for _ in range(40)]
    for steps, start in cases:
        for until in (rng.random() * 600, 512.0, start, start - 1):
            assert last_round(start, steps, until) == _added(start, steps, until), (steps, start, until)
    far = last_round(0.1, (0.002, 0.002, 0.25), 1e9)  # in a few rounds per binade, not 4e9 additions
    assert 1e9 - 0.254 < far <= 1e9


def test_a_round_that_stops_moving_the_time_ends_the_loop_where_the_additions_stop() -> None:
    # From an odd start a tie rounds up once; the next addition of half an ulp adds nothing: the
    # sums stay at 1 + 2**-51, where the jump divided by the zero period between its rounds.
    start, steps = 1.0 + 2**-52, (2.0**-53,)
    assert last_round(start, steps, 1.5) == 1.0 + 2**-51
