"""How every `kvswitch` subcommand refuses its flags: in one line, not argparse's usage dump (54
lines for the router) before its own words. A mistyped flag is named with the nearest flags of the
command; a value outside a flag's choices is said as the environment and `--config` paths say it
(protocol.errors.ConfigError), naming the variable where the command reads one."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from typing import Any, NoReturn

from kvswitch.environment import ENV_PREFIX, known_variables
from protocol.errors import ConfigError

__all__ = ["FlagParser", "long_flags", "unknown_flags"]


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals are one line, `PROG: WHY`, exit status 2 as argparse's.
    `reads_environment`: the command resolves its settings from `KVSWITCH_*` variables too (the
    router and the shim), so a choice flag of a setting names its variable. Subparsers
    (`kvswitch bench replay`) are of the same class, as argparse makes them, so they too refuse an
    abbreviated flag (`--router` for `--routers`): a script must name the flag, whose abbreviation a
    later flag can make ambiguous or another flag's."""

    def __init__(self, *args: Any, reads_environment: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.reads_environment = reads_environment

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")

    def parse_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        ns, unknown = self.parse_known_args(args, namespace)
        if unknown:
            chain = _chosen(self, ns)
            known = long_flags(*chain)
            near = ", ".join(unknown_flags(unknown, known, near_only=True))
            self.error(
                f"unrecognized arguments: {' '.join(unknown)}{': ' + near if near else ''}; "
                f"{chain[-1].prog} --help lists its flags"
            )
        return ns

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            # ArgumentError with no argument: its text alone reaches error(), not "argument --x: ".
            raise argparse.ArgumentError(None, self._bad_choice(action, value))

    def _bad_choice(self, action: argparse.Action, value: object) -> str:
        choices = [str(c) for c in action.choices or ()]
        setting = action.dest
        variable = ENV_PREFIX + setting.upper()
        if self.reads_environment and _setting_flag(setting) in action.option_strings and variable in known_variables():
            return str(ConfigError.one_of(setting, value, choices))
        # ConfigError's words for a flag no variable gives (a FLAG_ONLY setting's), or a positional
        # (`kvswitch bench`'s subcommand)
        named = f"{setting} ({'/'.join(action.option_strings)})" if action.option_strings else setting.replace("_", " ")
        return f"invalid {named} = {value!r}: allowed values: {', '.join(choices)}"


def _setting_flag(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def _chosen(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[argparse.ArgumentParser]:
    """`parser` and the subcommands `ns` records it chose under it (`kvswitch bench`, its `replay`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(ns, action.dest, None) in action.choices:
            return [parser, *_chosen(action.choices[getattr(ns, action.dest)], ns)]
    return [parser]


def _nearest(flag: str, known: Iterable[str]) -> list[str]:
    """The flags of `known` nearest `flag` (difflib's ratio, 0.6 at least, as get_close_matches), all
    of them on a tie: `--port` is as near `--etcd-port`, `--http-port` and `--nats-port`, and
    get_close_matches named the last alone, by its spelling."""
    scores = {k: difflib.SequenceMatcher(None, flag, k).ratio() for k in set(known)}
    best = max(scores.values(), default=0.0)
    return sorted(k for k, score in scores.items() if score == best) if best >= 0.6 else []


def long_flags(*parsers: argparse.ArgumentParser) -> list[str]:
    """The `--` flags of `parsers`, in their order: what a mistyped flag is matched against."""
    return [f for p in parsers for a in p._actions for f in a.option_strings if f.startswith("--")]


def unknown_flags(unknown: list[str], known: Iterable[str], *, near_only: bool = False) -> list[str]:
    """Each flag of `unknown` (what no parser took), with the nearest of the `known` flags where
    some are near: `--http-prot (did you mean --http-port?)`; `near_only`: only those."""
    known = list(known)
    said = []
    for flag in (u.split("=", 1)[0] for u in unknown if u.startswith("-")):
        near = _nearest(flag, known)
        either = f"{', '.join(near[:-1])} or {near[-1]}" if len(near) > 1 else near[0] if near else ""
        if near or not near_only:
            said.append(f"{flag} (did you mean {either}?)" if near else flag)
    return said
