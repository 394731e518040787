"""Every kvswitch command README.md and docs/*.md give parses with the real parser of the program it
names: `kvswitch SUB ...` with that subcommand's (and `kvswitch up`'s router flags with the
router's), `python -m MODULE ...` with the module's own, `make TARGET` against the Makefile's
targets. Parsing only: nothing starts."""

from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest

from engine_sim import SimConfigError
from kvswitch.cli import SUBCOMMANDS, main, subcommand_parser
from kvswitch.flags import FlagParser
from protocol import ConfigError
from tests.kvswitch.doc_commands import DocCommand, commands_in

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What reads as a command but is none, as (file, pattern of the text read, why).
NOT_COMMANDS = [
    ("README.md", r"kvswitch \w+ {2,}\S", "the list of subcommands `kvswitch --help` prints"),
    ("docs/design.md", r"kvswitch up / router", "a list of subcommands"),
    ("docs/router.md", r"kvswitch leg <role>", "a trace span's name"),
]
# Synopses: every flag they name must exist, but they are no command line to parse, as (file, start).
SYNOPSES = [("docs/benchmarks.md", "kvswitch plan --trace F --gpus N [--profile P]")]
# Code-block commands whose values are checked where they run, not here, as (file, start) with why.
NOT_RESOLVED = {
    (
        "docs/worker_shim.md",
        "kvswitch shim --engine vllm",
    ): "--model-path /models/llama: the engine host's model directory",
}
# Commands the docs give as wrong on purpose, as (file, text) with why: they must keep failing.
REFUSED: dict[tuple[str, str], str] = {}

# A placeholder the reader fills in (`--router-seed S`, `--workers W`): a value of the flag's type.
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
# What inline code may leave out, naming a command or one of its flags: the required arguments,
# or the value of the flag it ends with.
_MENTION = re.compile(r"the following arguments are required|expected (one|at least one) argument")


def _all_commands() -> list[DocCommand]:
    found = [c for path in DOCS for c in commands_in(path, ROOT)]
    return [c for c in found if not any(c.file == f and re.match(p, c.source) for f, p, _ in NOT_COMMANDS)]


COMMANDS = _all_commands()


class _Refused(Exception):
    """argparse's refusal, raised where it would print and exit."""


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _words(argv: tuple[str, ...]) -> list[str]:
    """The words a reader types: a bare `...` (more flags) left out, `[--flag value]`'s brackets dropped."""
    return [w.removeprefix("[").removesuffix("]") for w in argv if w not in ("...", "…")]


def _options(parser: argparse.ArgumentParser, words: list[str]) -> dict[str, argparse.Action]:
    """The flags `parser` takes, with those of the subcommands `words` choose."""
    options = dict(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in words:
                if word in action.choices:
                    options |= _options(action.choices[word], words)
    return options


def _fill(options: dict[str, argparse.Action], words: list[str]) -> list[str]:
    """A placeholder after a flag becomes a value it takes: a number, or its first choice."""
    filled = list(words)
    for i in range(1, len(words)):
        action = options.get(words[i - 1])
        if action is None or not _PLACEHOLDER.match(words[i]):
            continue
        if action.choices:
            filled[i] = str(next(iter(action.choices)))
        elif action.type in (int, float):
            filled[i] = "1"
    return filled


def _named_flags(words: list[str]) -> list[str]:
    """Every flag the words name (`--start/--duration` names two)."""
    return [f for w in words if w.startswith("--") for f in w.split("=", 1)[0].split("/")]


def _kvswitch_parsers(words: list[str]) -> list[argparse.ArgumentParser]:
    name = words[0]
    assert name in SUBCOMMANDS, f"no subcommand {name!r}: one of {', '.join(SUBCOMMANDS)}"
    parsers = [subcommand_parser(name)]
    if name == "up":  # `kvswitch up` hands the flags it does not know to its routers
        parsers.append(subcommand_parser("router"))
    return parsers


def _resolve(name: str, args: argparse.Namespace) -> None:
    """The values, by the program's own resolution (ranges argparse does not check): the router's,
    the shim's and the sim's, which start nothing."""
    if name == "router":
        from router.cli import build_config

        build_config(args)
    elif name == "shim":
        from worker_shim.cli import resolve_settings

        resolve_settings(args)
    elif name == "sim":
        from engine_sim.cli import config_from_args

        config_from_args(args)


def _parse_kvswitch(words: list[str], options: dict[str, argparse.Action], resolve: bool) -> None:
    parsers = _kvswitch_parsers(words)
    rest = _fill(options, words[1:])
    if len(parsers) == 2:
        _, extra = parsers[0].parse_known_args(rest)
        name, args = "router", parsers[1].parse_args(extra)
    else:
        name, args = words[0], parsers[0].parse_args(rest)
    if resolve:
        _resolve(name, args)


def _module_parser(module: str, rest: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser | None:
    """The parser `python -m MODULE` builds, run as __main__ up to its parse and no further; None
    for a module that takes no arguments."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"no module {module}"
    text = Path(spec.origin).read_text(encoding="utf-8")
    if "ArgumentParser" not in text and "FlagParser" not in text:
        return None

    def stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        patch.setattr(FlagParser, "parse_args", stop)  # bench.bench_router's, which has its own
        patch.setattr(sys, "argv", [module, *rest])
        # run as __main__ beside its imported copy (another test imported it): runpy warns of that
        patch.delitem(sys.modules, module, raising=False)
        with pytest.raises(_Parsed) as parsed:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    return parsed.value.parser


def _check(command: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's flags exist, and it parses (inline code: as far as it goes)."""
    program, words = command.argv[0], _words(command.argv[1:])
    if program == "make":
        text = (ROOT / "Makefile").read_text(encoding="utf-8")
        targets = {m.group(1) for m in re.finditer(r"^([a-z][a-z-]*):", text, re.MULTILINE)}
        missing = {w for w in words if "=" not in w and not w.startswith("-")} - targets
        assert not missing, f"no make target {', '.join(sorted(missing))}"
        return
    if program == "kvswitch" and words == ["--version"]:
        with pytest.raises(SystemExit) as stop:
            main(words)
        assert stop.value.code == 0
        return
    parser: argparse.ArgumentParser | None = None
    if program == "kvswitch":
        parsers = _kvswitch_parsers(words)
        options = {k: v for p in parsers for k, v in _options(p, words).items()}
    else:
        assert words[0] == "-m"
        module, words = words[1], words[2:]
        parser = _module_parser(module, words, monkeypatch)
        if parser is None:
            assert not words, f"{module} takes no arguments"
            return
        options = _options(parser, words)
    unknown = [f for f in _named_flags(words) if f not in options]
    assert not unknown, f"no flag {', '.join(unknown)}"
    if any(command.file == f and command.source.startswith(s) for f, s in SYNOPSES):
        return

    def refuse(self: argparse.ArgumentParser, message: str) -> Any:
        raise _Refused(message)

    monkeypatch.setattr(argparse.ArgumentParser, "error", refuse)
    monkeypatch.setattr(FlagParser, "error", refuse)  # the kvswitch parsers' own
    for variable, value in command.env.items():
        monkeypatch.setenv(variable, value)
    try:
        if program == "kvswitch":
            # inline code may name a command without what it needs to run: a whole command's values only
            resolve = not command.inline and not any(
                command.file == f and command.source.startswith(s) for f, s in NOT_RESOLVED
            )
            _parse_kvswitch(words, options, resolve)
        elif parser is not None:
            parser.parse_args(_fill(options, words))
    except _Refused as exc:
        if not (command.inline and _MENTION.search(str(exc))):
            raise
    except SystemExit as exc:  # --help
        assert exc.code == 0, exc


def test_the_docs_give_commands() -> None:
    """The extraction finds what it should: a floor against a change that finds nothing."""
    programs = {c.argv[0] for c in COMMANDS}
    assert programs == {"kvswitch", "python", "make"}
    assert sum(not c.inline for c in COMMANDS) > 80 and sum(c.inline for c in COMMANDS) > 250


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.text}"[:150] for c in COMMANDS])
def test_doc_command_parses(command: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = REFUSED.get((command.file, command.text))
    try:
        _check(command, monkeypatch)
    except (_Refused, AssertionError, ConfigError, SimConfigError) as exc:
        if reason is None:
            pytest.fail(f"{command.where}: `{command.text}`: {exc}")
        return
    assert reason is None, f"{command.where}: `{command.text}` parses, but the docs give it as refused ({reason})"
