"""isl_bounding: bypass the remote prefill when little of the prompt is left to prefill.

Rule (DESIGN.md, the seed's semantics exactly):

    eff_isl = isl - min(cached_tokens on the chosen decode worker, isl)
    bypass  iff eff_isl < eff_isl_threshold  AND  eff_isl / max(isl, 1) < eff_isl_ratio_threshold

Both comparisons are strict: a prompt exactly at either threshold is prefilled remotely.

Parameters (ConditionalDisaggConfig): eff_isl_threshold (tokens, default 2048, >= 0),
eff_isl_ratio_threshold (fraction, default 0.7, in [0, 1]).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import ConfigError
from protocol.config import ConditionalDisaggConfig
from router.policies.decision import Decision, Outcome
from router.request_context import RequestContext

__all__ = ["NAME", "IslBounding", "IslBoundingConfig"]

NAME = "isl_bounding"


@dataclass(frozen=True, slots=True)
class IslBoundingConfig:
    eff_isl_threshold: int = 2048
    eff_isl_ratio_threshold: float = 0.7

    def __post_init__(self) -> None:
        if self.eff_isl_threshold < 0:
            raise ConfigError("eff_isl_threshold", self.eff_isl_threshold, "must be >= 0")
        if not 0.0 <= self.eff_isl_ratio_threshold <= 1.0:
            raise ConfigError("eff_isl_ratio_threshold", self.eff_isl_ratio_threshold, "must be in [0, 1]")

    @classmethod
    def from_settings(cls, cfg: ConditionalDisaggConfig) -> IslBoundingConfig:
        return cls(eff_isl_threshold=cfg.eff_isl_threshold, eff_isl_ratio_threshold=cfg.eff_isl_ratio_threshold)


class IslBounding:
    name = NAME

    def __init__(self, config: IslBoundingConfig) -> None:
        self.config = config

    def decide(self, ctx: RequestContext) -> Decision:
        cached = ctx.cached_tokens(ctx.decode) if ctx.decode is not None else 0
        eff_isl = ctx.isl - min(cached, ctx.isl)
        ratio = eff_isl / max(ctx.isl, 1)
        c = self.config
        why = f"eff_isl={eff_isl} (isl {ctx.isl}, cached {cached}) ratio={ratio:.3f}"
        if eff_isl < c.eff_isl_threshold and ratio < c.eff_isl_ratio_threshold:
            return Decision(
                True, Outcome.BYPASS_ISL, f"{why} < {c.eff_isl_threshold} and < {c.eff_isl_ratio_threshold}"
            )
        return Decision(
            False,
            Outcome.DECLINED_POLICY,
            f"{why}: not both < {c.eff_isl_threshold} and < {c.eff_isl_ratio_threshold}",
        )
