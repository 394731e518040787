"""Messages about many workers name the first few and count the rest: a fleet of 1,000 stale
shims, unloadable profiles or unpaired prefill workers once made one /ready warning (and one 503)
as long as the fleet."""

from __future__ import annotations

from typing import Literal

from protocol import WorkerInfo
from router.calibration import unusable_profiles
from router.eligibility import NAMED_AT_MOST, few_ids
from router.service import RouterConfig, RouterService
from router.tokenization import shim_predates_probes
from router.worker_registry import ContextConflict, context_message

IDS = [f"w{i:04d}" for i in range(1000)]


Role = Literal["prefill", "decode", "agg"]


def _info(worker: str, role: Role = "decode", engine: str = "vllm", timing_profile: str | None = None) -> WorkerInfo:
    return WorkerInfo(worker=worker, model="m", role=role, engine=engine, block_size=16, timing_profile=timing_profile)


def _named(text: str) -> list[str]:
    return [w for w in IDS if w in text]


def test_few_ids_names_the_first_and_counts_the_rest() -> None:
    assert few_ids(IDS[:3]) == "w0000, w0001, w0002"
    assert few_ids(IDS[:NAMED_AT_MOST]) == ", ".join(IDS[:NAMED_AT_MOST])
    assert few_ids(IDS[: NAMED_AT_MOST + 1]) == ", ".join(IDS[:NAMED_AT_MOST]) + " and 1 more"
    assert few_ids(IDS).endswith(f"and {1000 - NAMED_AT_MOST} more")


def test_stale_shims_of_a_whole_fleet_are_named_a_few() -> None:
    said = shim_predates_probes(IDS)
    assert _named(said) == IDS[:NAMED_AT_MOST] and f"and {1000 - NAMED_AT_MOST} more" in said
    assert _named(shim_predates_probes(["w0007"])) == ["w0007"]


def test_unloadable_profiles_of_a_whole_fleet_are_named_a_few() -> None:
    [said] = unusable_profiles(_info(w, timing_profile="mybox:llama") for w in IDS)
    assert _named(said) == IDS[:NAMED_AT_MOST] and f"and {1000 - NAMED_AT_MOST} more" in said


def test_unpaired_prefill_workers_of_a_whole_fleet_are_named_a_few() -> None:
    router = RouterService(RouterConfig())
    [alone] = router._fleet_warnings([_info(w, "prefill") for w in IDS])
    assert _named(alone) == IDS[:NAMED_AT_MOST] and "has prefill workers" in alone
    infos = [_info(w, "prefill", engine="sglang") for w in IDS] + [_info("d", "decode")]
    [idle] = router._fleet_warnings(infos)
    assert _named(idle) == IDS[:NAMED_AT_MOST] and f"and {1000 - NAMED_AT_MOST} more" in idle


def test_a_context_conflict_of_a_whole_fleet_names_a_few_per_length() -> None:
    said = context_message("m", ContextConflict(8192, {32768: IDS[:10], 8192: IDS[10:]}))  # most register 8192
    assert _named(said) == IDS[:NAMED_AT_MOST] and "and 2 more" in said
