"""Every `kvswitch` subcommand refuses a bad flag in one line (kvswitch.flags): a mistyped one with
the nearest flags, a bad choice in the words of the environment and `--config` paths. Walkthrough
audit 2026-12-07: `kvswitch router --http-prot 8090` printed 54 lines of usage before argparse's
`unrecognized arguments`, with no "did you mean", and `--conditional-disagg-policy fastest` said
`invalid choice` where the README showed the variable's words, which only the variable got."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import router.cli
import runtime
from kvswitch.cli import SUBCOMMANDS, main, subcommand_parser


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`kvswitch ARGV...`'s one line on stderr, having checked its exit status 2."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n") and "usage:" not in err, err
    return err.rstrip("\n")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["router", "--http-prot", "8090"], "--http-prot (did you mean --http-port?)"),
        (["shim", "--http-prot", "8090"], "--http-prot (did you mean --http-port?)"),
        (["sim", "--prot", "8000"], "--prot (did you mean --port?)"),
        (["bench", "replay", "--trce", "t.jsonl"], "--trce (did you mean --trace?)"),
        (["plan", "--gpus", "4", "--policy", "kv"], "--policy (did you mean --policies?)"),
        (["secrets", "--out", "x", "--rotuers", "2"], "--rotuers (did you mean --routers?)"),
    ],
)
def test_a_mistyped_flag_is_one_line_with_the_nearest(
    argv: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # `--out x`, were it taken
    err = _refused(argv, capsys)
    help_of = " ".join(argv[:2]) if argv[0] == "bench" else argv[0]  # the subcommand's own --help
    unknown = " ".join(argv[-2:])
    want = f"kvswitch {argv[0]}: unrecognized arguments: {unknown}: {said}; kvswitch {help_of} --help lists its flags"
    assert err == want


def _choice_flags(name: str) -> list[argparse.Action]:
    return [a for a in subcommand_parser(name)._actions if a.choices is not None and a.option_strings]


def _not_run(*args: object, **kwargs: object) -> int:
    raise AssertionError("it started: the bad value was taken")


@pytest.mark.parametrize(
    ("name", "flag", "dest"),
    [(name, a.option_strings[0], a.dest) for name in ("router", "shim") for a in _choice_flags(name)],
)
def test_a_bad_choice_is_said_as_its_variable_says_it(
    name: str, flag: str, dest: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flag's refusal is the variable's, word for word, naming both."""
    by_flag = _refused([name, flag, "nope"], capsys)
    monkeypatch.setattr(runtime, "run_service", _not_run)
    monkeypatch.setattr(router.cli, "run_service", _not_run)
    monkeypatch.setenv(f"KVSWITCH_{dest.upper()}", "nope")
    assert main([name]) == 2
    by_variable = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    assert by_flag == by_variable
    assert f"({flag}, KVSWITCH_{dest.upper()}) = 'nope': allowed values: " in by_flag


def test_the_readmes_bad_choice_is_what_the_flag_says(capsys: pytest.CaptureFixture[str]) -> None:
    assert _refused(["router", "--conditional-disagg-policy", "fastest"], capsys) == (
        "kvswitch router: invalid conditional_disagg_policy (--conditional-disagg-policy, "
        "KVSWITCH_CONDITIONAL_DISAGG_POLICY) = 'fastest': allowed values: isl_bounding, prefill_load, isl_or_load, "
        "ttft_model, slo_aware"
    )


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        # the sim reads no KVSWITCH_ROLE (the shim does): its refusal names the flag alone
        (
            ["sim", "--role", "nope"],
            "kvswitch sim: invalid role (--role) = 'nope': allowed values: prefill, decode, agg",
        ),
        (
            ["bench", "replay", "--clock", "nope"],
            "kvswitch bench replay: invalid clock (--clock) = 'nope': allowed values: live, virtual",
        ),
        (
            ["bench", "replya"],
            "kvswitch bench: invalid bench command = 'replya': allowed values: chaos, replay, summary, compare, "
            "overhead, replicas, sweep",
        ),
    ],
)
def test_a_bad_choice_no_variable_gives_names_the_flag(
    argv: list[str], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _refused(argv, capsys) == want


def test_other_refusals_are_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        _refused(["router", "--http-port", "x"], capsys)
        == "kvswitch router: argument --http-port: invalid int value: 'x'"
    )
    assert _refused(["bench"], capsys).startswith("kvswitch bench: the following arguments are required: ")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["secrets", "--out", "x", "--router", "2"], "--router (did you mean --routers?)"),
        (["plan", "--gpus", "4", "--polic", "kv"], "--polic (did you mean --policies?)"),
        (["bench", "replay", "--spee", "2"], "--spee (did you mean --speed?)"),
    ],
)
def test_an_abbreviated_flag_is_refused(
    argv: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse took `--router 2` as `--routers 2`: an abbreviation a later flag can make ambiguous,
    or another flag's. Refused, as any unknown flag, naming it (commands that, had the flag been
    taken, fail rather than start a service)."""
    monkeypatch.chdir(tmp_path)  # `--out x`, were it taken
    err = _refused(argv, capsys)
    help_of = " ".join(argv[:2]) if argv[0] == "bench" else argv[0]
    unknown = " ".join(argv[-2:])
    assert (
        err
        == f"kvswitch {argv[0]}: unrecognized arguments: {unknown}: {said}; kvswitch {help_of} --help lists its flags"
    )


def _with_subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(p for a in subs for sub in a.choices.values() for p in _with_subcommands(sub))]


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_no_subcommand_takes_an_abbreviation(name: str) -> None:
    for parser in _with_subcommands(subcommand_parser(name)):
        assert parser.allow_abbrev is False, parser.prog


def test_up_refuses_an_abbreviated_flag_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvswitch up` hands the flags it does not know to its routers' parser: `--router` was its own
    `--routers` and is neither's."""
    assert main(["up", "--router", "x"]) == 2  # taken as --routers, `x` was refused, not a cluster started
    err = capsys.readouterr().err
    assert err.startswith("kvswitch up: unrecognized arguments: --router x: --router (did you mean --routers?) "), err
