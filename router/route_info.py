"""Who sees a routed answer's route (`--route-info`): its `x-kvswitch-decode-worker`,
`x-kvswitch-prefill` and `x-kvswitch-outcome` headers and the whole answer's `kvswitch` member.

The route follows the cached prefixes of other clients' prompts: under conditional disaggregation
a bypass (`bypass_isl`) or not (`declined_policy`) says whether the fleet holds a prompt's prefix,
and the worker chosen says which holds most of it. A client that may not read other clients'
prompts must not see it, as it may not see /debug/route (docs/security.md). So:

- `all`: every answer carries it. The default without API keys (a loopback router; the benchmarks,
  the demo and the tests read it).
- `operator`: only the answers to a request with an operator key (`--debug-api-keys-file`, the key
  /debug/* takes); without that file, none. The default with `--api-keys-file`.
- `off`: none.
"""

from __future__ import annotations

from collections.abc import Callable

from router.api_keys import ApiKeys

__all__ = ["ROUTE_INFO", "route_info_mode", "route_shown"]

ROUTE_INFO = ("all", "operator", "off")


def route_info_mode(given: str | None, *, api_keys: bool) -> str:
    """--route-info as set, else its default for a router with (`api_keys`) or without API keys."""
    if given is None:
        return "operator" if api_keys else "all"
    if given not in ROUTE_INFO:
        raise ValueError(f"route_info must be one of {', '.join(ROUTE_INFO)}, got {given!r}")
    return given


def route_shown(mode: str, debug_keys: ApiKeys | None) -> Callable[[str | None], bool]:
    """Whether the answer to a request with this `Authorization` header value carries its route."""
    if mode == "all":
        return lambda authorization: True
    if mode == "off" or debug_keys is None:
        return lambda authorization: False
    return debug_keys.allows
