"""Conditional disaggregation policies: the single registry (STYLE.md #4).

Each module holds one policy: its rule and parameters in the docstring, a NAME, a frozen config
that validates itself, and the class. `make_policy` builds the one the settings name; a factory
reads the conditional settings and, for the SLO-aware policy, the router's SLOs.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol import ConfigError
from protocol.config import POLICY_NAMES, ConditionalDisaggConfig, RouterSettings
from router.policies import isl_bounding, isl_or_load, prefill_load, slo_aware, ttft_model
from router.policies.decision import Decision, DecodeRoom, Outcome, Path, Policy, PrefillRoom
from router.policies.decode_guard import DecodeGuard

__all__ = [
    "LOAD_POLICIES",
    "POLICIES",
    "SEED_POLICIES",
    "Decision",
    "DecodeGuard",
    "DecodeRoom",
    "Outcome",
    "Path",
    "Policy",
    "PrefillRoom",
    "make_policy",
]

POLICIES: dict[str, Callable[[ConditionalDisaggConfig, RouterSettings], Policy]] = {
    isl_bounding.NAME: lambda cfg, _: isl_bounding.IslBounding(isl_bounding.IslBoundingConfig.from_settings(cfg)),
    prefill_load.NAME: lambda cfg, _: prefill_load.PrefillLoad(prefill_load.PrefillLoadConfig.from_settings(cfg)),
    isl_or_load.NAME: lambda cfg, _: isl_or_load.IslOrLoad(isl_or_load.IslOrLoadConfig.from_settings(cfg)),
    ttft_model.NAME: lambda cfg, _: ttft_model.TtftModel(ttft_model.TtftModelConfig.from_settings(cfg)),
    slo_aware.NAME: lambda _, settings: slo_aware.SloAware(slo_aware.SloAwareConfig.from_settings(settings)),
}
assert set(POLICIES) == set(POLICY_NAMES), "the registry and protocol.config must list the same policies"
SEED_POLICIES = frozenset({isl_bounding.NAME, prefill_load.NAME, isl_or_load.NAME})
"""DESIGN.md's policies, "the seed's semantics, exactly": bypass iff their rule says so. No room
rule of the router's takes a prefill worker away from them (router.planner)."""
LOAD_POLICIES = frozenset({prefill_load.NAME, isl_or_load.NAME})
"""Policies with prefill_load's rule, which cannot judge a prefill worker whose record lacks
max_num_batched_tokens busy: no request is bypassed for that worker's load."""


def make_policy(cfg: ConditionalDisaggConfig, settings: RouterSettings | None = None) -> Policy:
    """The policy `cfg` names. `settings`: the router's settings `cfg` belongs to (their SLOs);
    None takes RouterSettings' defaults around `cfg`."""
    factory = POLICIES.get(cfg.conditional_disagg_policy)
    if factory is None:
        raise ConfigError.one_of("conditional_disagg_policy", cfg.conditional_disagg_policy, POLICIES)
    return factory(cfg, settings if settings is not None else RouterSettings(conditional=cfg))
