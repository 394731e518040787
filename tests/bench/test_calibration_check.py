"""bench.calibration_check: it records each fit a router's calibration makes and scores them."""

from __future__ import annotations

import math

import pytest

from bench.calibration_check import WARM_S, Fits, main
from router.calibration import Calibration
from tests.router.test_calibration import SyntheticEngine, _info


def test_every_fit_is_recorded_and_scored_after_the_warm_up() -> None:
    engine = SyntheticEngine(1.5, 1.5)
    calibration = Calibration()
    fits = Fits(lambda: engine.ts)
    fits.watch(calibration)
    info = _info()
    calibration.observe(info, engine.report(running=1, context=4096))
    for _ in range(200):
        prefill = engine.rng.choice([0, 4096, 16384])
        context = engine.rng.randrange(512, 16384)
        calibration.observe(info, engine.interval(running=engine.rng.randrange(1, 64), context=context,
                                                  prefill_tokens=prefill))  # fmt: skip
    recorded = fits.fits["w"]
    assert len(recorded) > 10 and [t for t, _, _ in recorded] == sorted(t for t, _, _ in recorded)
    assert recorded[-1][1:] == pytest.approx(calibration.factors()["w"][:2])
    k_d, k_p, n = fits.rms_log("w")
    assert n == sum(1 for t, _, _ in recorded if t >= WARM_S) and n > 0
    assert k_d == pytest.approx(math.log(1.5), rel=0.05) and k_p == pytest.approx(math.log(1.5), rel=0.1)
    none_d, none_p, none_n = fits.rms_log("prefill")  # no such worker
    assert math.isnan(none_d) and math.isnan(none_p) and none_n == 0


def test_an_aggregated_configuration_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--config", "kv"])
    assert "aggregated" in capsys.readouterr().err
