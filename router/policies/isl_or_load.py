"""isl_or_load: bypass when either isl_bounding or prefill_load would.

isl_bounding is asked first, so a request both would bypass counts as `bypass_isl`. Parameters:
those of both (eff_isl_threshold, eff_isl_ratio_threshold, prefill_busy_threshold, which
inherits queue_threshold; neither set is a startup error).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.config import ConditionalDisaggConfig
from router.policies.decision import Decision, Outcome
from router.policies.isl_bounding import IslBounding, IslBoundingConfig
from router.policies.prefill_load import PrefillLoad, PrefillLoadConfig
from router.request_context import RequestContext

__all__ = ["NAME", "IslOrLoad", "IslOrLoadConfig"]

NAME = "isl_or_load"


@dataclass(frozen=True, slots=True)
class IslOrLoadConfig:
    isl: IslBoundingConfig
    load: PrefillLoadConfig

    @classmethod
    def from_settings(cls, cfg: ConditionalDisaggConfig) -> IslOrLoadConfig:
        return cls(isl=IslBoundingConfig.from_settings(cfg), load=PrefillLoadConfig.from_settings(cfg))


class IslOrLoad:
    name = NAME

    def __init__(self, config: IslOrLoadConfig) -> None:
        self.config = config
        self._isl = IslBounding(config.isl)
        self._load = PrefillLoad(config.load)

    def decide(self, ctx: RequestContext) -> Decision:
        by_isl = self._isl.decide(ctx)
        if by_isl.bypass:
            return by_isl
        by_load = self._load.decide(ctx)
        if by_load.bypass:
            return by_load
        return Decision(False, Outcome.DECLINED_POLICY, f"{by_isl.reason}; {by_load.reason}")
