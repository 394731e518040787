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

from protocol import ConfigError
from router.api_keys import ApiKeys

__all__ = ["ROUTE_INFO", "check_route_info", "route_info_mode", "route_shown"]

ROUTE_INFO = ("all", "operator", "off")


def check_route_info(given: str | None) -> None:
    """ConfigError naming --route-info and its values for a value not in ROUTE_INFO."""
    if given is not None and given not in ROUTE_INFO:
        raise ConfigError.one_of("route_info", given, ROUTE_INFO)


def route_info_mode(given: str | None, *, api_keys: bool) -> str:
    """--route-info as set, else its default for a router with (`api_keys`) or without API keys.
    Checked again here for a RouterConfig built in-process (tests, router/__init__.py's use), which
    no flag parse saw: any value but `all` and `off` would otherwise pass as `operator`."""
    if given is None:
        return "operator" if api_keys else "all"
    check_route_info(given)
    return given


def route_shown(mode: str, debug_keys: ApiKeys | None) -> Callable[[str | None], bool]:
    """Whether the answer to a request with this `Authorization` header value carries its route."""
    if mode == "all":
        return lambda authorization: True
    if mode == "off" or debug_keys is None:
        return lambda authorization: False
    return debug_keys.allows
