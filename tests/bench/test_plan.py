"""`kvswitch plan`: the candidates it tries, the ranking, and the winner's exact settings."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import msgspec
import pytest
import yaml

from bench.compare import CONFIGURATIONS
from bench.plan import Candidate, Result, candidates, rank, settings_text
from bench.summary import Percentiles, Slo, Summary, format_summary
from bench.virtual.fleet import settings_from_args
from kvswitch.cli import main, subcommand_parser


def test_agg_configurations_run_once_and_disaggregated_ones_on_every_split() -> None:
    got = candidates(4, [CONFIGURATIONS["kv"], CONFIGURATIONS["slo_aware"]], [1, 2, 3])
    assert got == [
        Candidate("kv", 0, 0, 4),
        Candidate("slo_aware", 1, 3, 0),
        Candidate("slo_aware", 2, 2, 0),
        Candidate("slo_aware", 3, 1, 0),
    ]
    assert [c.fleet for c in got] == ["4 agg", "1P+3D", "2P+2D", "3P+1D"]


def _summary(good: int, p90: float, *, goodput: float = 1.0, errors: int = 0, requests: int = 1233) -> Summary:
    return Summary(
        requests=requests, ok=requests - errors, errors=errors, duration_s=1.0, ttft_s=Percentiles(p90 / 2, p90, p90),
        itl_s=None, tpot_s=None, e2e_s=None, output_tokens_per_s=1.0, requests_per_s=1.0, goodput_rps=goodput,
        goodput_fraction=good / requests, send_lag_p99_s=None, prefill_mix={}, prefix_hit_rate=None,
        latency_scale=1.0, slo=Slo(),
    )  # fmt: skip


def test_rank_by_requests_in_slo_then_ttft_p90() -> None:
    a, b, c = Candidate("kv", 0, 0, 2), Candidate("kv_disagg", 1, 1, 0), Candidate("slo_aware", 1, 1, 0)
    ranked = rank([Result(a, _summary(3, 1.0)), Result(b, _summary(4, 2.0)), Result(c, _summary(4, 1.5))])
    assert [r.candidate for r in ranked] == [c, b, a]


def test_more_requests_in_slo_beat_a_higher_goodput_per_second() -> None:
    # 18 of 20 whose last request finished sooner has the higher goodput per second; 19 of 20 still wins
    few, more = Candidate("kv", 0, 0, 2), Candidate("slo_aware", 1, 1, 0)
    ranked = rank(
        [
            Result(few, _summary(18, 0.4, goodput=3.16, requests=20)),
            Result(more, _summary(19, 0.4, goodput=3.1, requests=20)),
        ]
    )
    assert [r.candidate for r in ranked] == [more, few]


def test_one_request_apart_in_goodput_per_second_still_ties_and_ttft_p90_decides() -> None:
    # the docs' example: 3.8395 and 3.8361 r/s are the same number of requests in SLO
    kv, slo_aware = Candidate("kv", 0, 0, 8), Candidate("slo_aware", 1, 7, 0)
    ranked = rank(
        [Result(kv, _summary(1151, 1.28, goodput=3.8395)), Result(slo_aware, _summary(1151, 1.24, goodput=3.8361))]
    )
    assert [r.candidate for r in ranked] == [slo_aware, kv]


def test_among_equals_fewer_errors_rank_before_a_lower_ttft() -> None:
    # shedding load as errors lowers TTFT p90 of the rest; it must not win a tie
    shed, kept = Candidate("slo_aware", 2, 1, 0), Candidate("kv", 0, 0, 3)
    ranked = rank(
        [
            Result(shed, _summary(0, 0.29, errors=10, requests=30)),
            Result(kept, _summary(0, 0.32, errors=2, requests=30)),
        ]
    )
    assert [r.candidate for r in ranked] == [kept, shed]


def test_the_winners_settings_are_the_routers_own_flags() -> None:
    text = settings_text(Candidate("slo_aware", 2, 6, 0), "h200:llama-3.1-8b", Slo(3.0, 0.05))
    flags = "--routing kv --disagg conditional --conditional-disagg --conditional-disagg-policy slo_aware"
    assert f"kvswitch up --prefill 2 --decode 6 --profile h200:llama-3.1-8b {flags}" in text
    assert "--slo-ttft-s 3 --slo-itl-s 0.05" in text
    assert "KVSWITCH_CONDITIONAL_DISAGG=true" in text and "KVSWITCH_CONDITIONAL_DISAGG_POLICY=slo_aware" in text
    assert "KVSWITCH_SLO_TTFT_S=3.0" in text and "x2" in text and "x6" in text
    # the flags printed are valid router settings, naming the SLOs the plan ranked with
    line = next(ln for ln in text.splitlines() if "router flags" in ln)
    settings = settings_from_args(line.split("...", 1)[1].split())
    assert settings.conditional.conditional_disagg_policy == "slo_aware" and settings.slo_ttft_s == 3.0


@pytest.mark.parametrize("configuration", ["kv", "kv_disagg", "slo_aware"])
def test_the_compose_router_command_is_docker_composes_with_the_winners_flags(configuration: str) -> None:
    # an environment variable cannot override docker-compose.yml's --conditional-disagg (the router
    # refuses the conflict), so plan prints the routers' whole command with its flags in that place
    text = settings_text(Candidate(configuration, 1, 1, 0), "h200:llama-3.1-8b", Slo(2.0, 0.025))
    printed = {
        ln.split(":", 1)[0].strip(): json.loads(ln.split("command: ", 1)[1])
        for ln in text.splitlines()
        if "command: [" in ln
    }
    compose = yaml.safe_load((Path(__file__).parents[2] / "docker-compose.yml").read_text())["services"]
    flags = text.split("router flags:   kvswitch router ... ", 1)[1].splitlines()[0].split()
    assert set(printed) == {"router-1", "router-2"}  # each with its own NATS identity
    for router, command in printed.items():
        theirs = compose[router]["command"]
        at = theirs.index("--conditional-disagg")
        assert command == [*theirs[:at], *flags, *theirs[at + 1 :]]
        subcommand_parser("router").parse_args(command[1:])  # `kvswitch router` takes these flags


def test_a_small_plan_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--gpus", "2", "--start", "980", "--limit", "20", "--scale-tokens", "0.125", "--jobs", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 agg" in out and "1P+1D" in out and "winner:" in out
    assert out.count("slo_aware") >= 1 and out.count("kv_disagg") >= 1


def test_with_no_request_in_slo_there_is_no_winner(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--gpus", "2", "--start", "980", "--limit", "20", "--scale-tokens", "0.125", "--jobs", "1"]
    assert main([*argv, "--slo-ttft", "0.001"]) == 1
    out = capsys.readouterr().out
    assert "no candidate meets the SLO" in out and "winner:" not in out and "kvswitch up" not in out


def test_requests_over_the_sims_max_model_len_are_errors_as_on_the_printed_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the shipped trace's first requests are 40,160, 36,640 and 23,769 prompt tokens: the first two are
    # over the sims' default max_model_len (32768), which `kvswitch up` and docker-compose.yml run
    out = tmp_path / "plan.json"
    assert main(["plan", "--gpus", "2", "--policies", "kv", "--limit", "3", "--jobs", "1", "--out", str(out)]) == 0
    [result] = json.loads(out.read_bytes())
    assert (result["summary"]["requests"], result["summary"]["errors"]) == (3, 2)


def test_the_engines_max_model_len_is_plans_flag_and_in_the_winners_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # at 65536 the two requests over the default 32768 are served (spread out, so none waits for room),
    # and the printed cluster runs them so
    out = tmp_path / "plan.json"
    argv = ["plan", "--gpus", "2", "--policies", "kv", "--limit", "3", "--jobs", "1", "--out", str(out)]
    assert main([*argv, "--rate", "0.001", "--max-model-len", "65536"]) == 0
    [result] = json.loads(out.read_bytes())
    assert (result["summary"]["requests"], result["summary"]["errors"]) == (3, 0)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "local cluster:" in ln)
    up = subcommand_parser("up").parse_known_args(line.split("kvswitch up ", 1)[1].split())[0]
    assert (up.agg, up.max_model_len) == (2, 65536)


def test_repeated_policies_and_splits_run_once(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--gpus", "3", "--start", "980", "--limit", "10", "--scale-tokens", "0.125", "--jobs", "1"]
    assert main([*argv, "--policies", "kv,kv_disagg,kv", "--splits", "1,1,2"]) == 0
    table = capsys.readouterr().out.split("winner:")[0]
    assert table.count(" kv_disagg ") == 2 and table.count(" kv ") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpus", "4", "--policies", "kv,nope"], "unknown nope"),
        (["--gpus", "4", "--policies", ","], "--policies: none given"),
        (["--gpus", "4", "--splits", "0,4"], "prefill counts must be in 1..3"),
        (["--gpus", "3", "--splits", "1,x"], "--splits: comma-separated prefill counts, got '1,x'"),
        (["--gpus", "1", "--splits", "1"], "--splits: a split needs >= 2 GPUs"),
        (["--gpus", "2", "--rate", "0"], "--rate must be > 0"),
        (["--gpus", "2", "--seed", "-1"], "--seed must be >= 0"),
        (["--gpus", "2", "--slo-ttft", "0"], "--slo-ttft must be > 0"),
        (["--gpus", "2", "--slo-itl", "-1"], "--slo-itl must be > 0"),
        (["--gpus", "2", "--max-model-len", "0"], "--max-model-len must be >= 1"),
        (["--gpus", "2", "--max-model-len", "1000000"], "--max-model-len 1000000 does not fit one engine's KV cache"),
        (["--gpus", "2", "--profile", "nope"], "--profile: unknown nope; allowed: h200:llama-3.1-8b"),
    ],
)
def test_bad_arguments_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "inf"], "--rate must be > 0 and finite, got inf"),
        (["--slo-ttft", "inf"], "--slo-ttft must be > 0 and finite, got inf"),
        (["--slo-itl", "inf"], "--slo-itl must be > 0 and finite, got inf"),
        (["--scale-tokens", "inf"], "--scale-tokens must be > 0 and finite, got inf"),
        (["--duration", "nan"], "--duration must be > 0 and finite, got nan"),
        (["--start", "nan"], "--start must be a finite number of seconds >= 0, got nan"),
        (["--start", "-5"], "--start must be a finite number of seconds >= 0, got -5"),
        (["--jobs", "0"], "--jobs must be >= 1, got 0"),
        (["--jobs", "-1"], "--jobs must be >= 1, got -1"),
        (["--out", "/proc/nope/x.json"], "--out /proc/nope/x.json: cannot create /proc/nope"),
        (["--trace", "/nonexistent"], "--trace /nonexistent: No such file or directory"),
    ],
)
def test_values_plan_cannot_run_with_are_refused_before_any_candidate(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, these ran every candidate (inf, nan, --jobs 0), or failed after them (--out), or named
    no flag (--trace) or the router's flag (--slo-ttft inf)."""
    assert main(["plan", "--gpus", "2", "--limit", "5", "--policies", "kv", *argv]) == 2
    out = capsys.readouterr()
    assert message in out.err and "[kv on" not in out.out + out.err, out


def test_out_naming_a_directory_is_refused_before_any_candidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--gpus", "2", "--limit", "5", "--policies", "kv", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: a directory" in capsys.readouterr().err


def test_an_empty_trace_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["plan", "--gpus", "2", "--trace", str(empty), "--limit", "20"]) == 2
    assert f"no records in the trace file {empty}" in capsys.readouterr().err


def test_a_winner_on_another_profile_prints_it_for_the_sims_and_the_shims() -> None:
    """Before, only the `kvswitch up` line named the profile: the compose sims ran their default model
    and the shims registered no timing profile, so the routers' cost model was not the one ranked."""
    text = settings_text(Candidate("kv_disagg", 1, 1, 0), "h200:qwen2.5-32b", Slo(2.0, 0.025), 16384)
    engines = next(ln for ln in text.splitlines() if ln.startswith("  engines:"))
    assert "each sim with `--profile h200:qwen2.5-32b --max-model-len 16384`" in engines
    assert "each shim with `--timing-profile h200:qwen2.5-32b`" in engines
    sim = engines.split("each sim with `", 1)[1].split("`")[0].split()
    assert subcommand_parser("sim").parse_args(sim).profile == "h200:qwen2.5-32b"
    shim = engines.split("each shim with `", 1)[1].split("`")[0].split()
    assert shim == ["--timing-profile", "h200:qwen2.5-32b"]
    # the default profile is the sims' and the routers' own: nothing to add
    default = settings_text(Candidate("kv_disagg", 1, 1, 0), "h200:llama-3.1-8b", Slo(2.0, 0.025))
    assert "--timing-profile" not in default and "each sim" not in default


def test_disaggregated_policies_named_for_one_gpu_are_refused_as_one_alone_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before, `--policies kv,slo_aware --gpus 1` ranked kv alone, exit 0, saying nothing of slo_aware."""
    argv = ["plan", "--gpus", "1", "--start", "980", "--limit", "5", "--scale-tokens", "0.125", "--jobs", "1"]
    for policies in ("kv,slo_aware", "slo_aware"):
        assert main([*argv, "--policies", policies]) == 2
        out = capsys.readouterr()
        assert "--policies slo_aware: a split needs --gpus >= 2" in out.err and "[kv on" not in out.err, out
    # the default policies: the splits are skipped, and said so
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "skipping kv_disagg, slo_aware: a split needs --gpus >= 2" in out.err and "winner: kv on 1 agg" in out.out


def test_empty_splits_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Before, `--splits ,` ran no split at all and said nothing."""
    assert main(["plan", "--gpus", "2", "--limit", "5", "--splits", ",", "--jobs", "1"]) == 2
    assert "--splits: none given, got ','" in capsys.readouterr().err


@pytest.mark.parametrize("policies", [[], ["--policies", "slo_aware"]], ids=["default", "slo_aware"])
def test_the_winners_reproduce_line_replays_its_row(
    policies: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review of 2026-12-06: replay raised its engines' max_model_len to the longest request where
    plan keeps the sims' 32768, so replaying a plan row by hand gave other figures (52 against 15
    in SLO). The slice has 3 requests over 32768: errors in plan's row, as in the replay. slo_aware:
    a disaggregated winner, whose line names --prefill and --decode."""
    argv = ["plan", "--gpus", "2", "--start", "0", "--duration", "4", "--jobs", "1", "--seed", "3", *policies]
    assert main([*argv, "--slo-itl", "0.0123456789", "--out", str(tmp_path / "plan.json")]) == 0
    printed = capsys.readouterr().out
    [line] = [ln.split("reproduce:", 1)[1].strip() for ln in printed.splitlines() if "reproduce:" in ln]
    assert "--max-model-len 32768" in line and "--seed 3 --router-seed 3" in line and "0.0123456789" in line
    winner = msgspec.json.decode((tmp_path / "plan.json").read_bytes(), type=list[Result])[0]
    if policies:
        assert winner.candidate.configuration == "slo_aware"
        assert "--prefill 1 --decode 1 --configuration slo_aware" in line
    assert winner.summary.errors >= 3  # the 3 over 32768 among them
    command = shlex.split(line)
    assert command[:3] == ["kvswitch", "bench", "replay"]
    main([*command[1:], "--out", str(tmp_path / "replay.jsonl"), "--no-progress"])
    assert format_summary(winner.summary) in capsys.readouterr().out


def _copies(text: str, role: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"  {role} copies:"))
    return line.split("one per worker: ", 1)[1].split(", ")


@pytest.mark.parametrize("winner", [Candidate("slo_aware", 2, 3, 0), Candidate("kv", 0, 0, 3)])
def test_the_compose_engine_lines_make_a_fleet_whose_shims_each_have_a_nats_identity(winner: Candidate) -> None:
    """Before, the line said to copy the shim-prefill trio xP as it stands: every copy kept `--worker-name
    prefill-0` and its nkey file (refused as a second prefill-0), and the secrets service's --workers,
    which makes each shim's nkey, was not mentioned; an aggregated winner had no compose line at all."""
    text = settings_text(winner, "h200:llama-3.1-8b", Slo(2.0, 0.025))
    compose = yaml.safe_load((Path(__file__).parents[2] / "docker-compose.yml").read_text())["services"]
    each = next(ln for ln in text.splitlines() if ln.startswith("    each copy NAME:"))
    assert "`--worker-name NAME`" in each and "`--nats-nkey-file /var/lib/kvswitch/worker-NAME.nk`" in each
    # the pattern is compose's own: its shims are prefill-0 and decode-0 with these files
    for name in ("prefill-0", "decode-0"):
        command = compose[f"shim-{name.split('-')[0]}"]["command"]
        assert command[command.index("--worker-name") + 1] == name
        assert command[command.index("--nats-nkey-file") + 1] == f"/var/lib/kvswitch/worker-{name}.nk"
    roles = ["agg"] if winner.agg else ["prefill", "decode"]
    names = [n for role in roles for n in _copies(text, role)]
    counts = [winner.agg] if winner.agg else [winner.prefill, winner.decode]
    assert [len(_copies(text, role)) for role in roles] == counts
    assert len(set(names)) == len(names) and all(n.startswith(tuple(roles)) for n in names)
    secrets = next(ln for ln in text.splitlines() if ln.startswith("  secrets:"))
    workers = json.loads(secrets.split("`--workers, ", 1)[1].split("`", 1)[0])
    assert workers.split(",") == names  # every shim's nkey is made, and no other
    assert "--workers" in compose["secrets"]["command"]
    if winner.agg:
        line = next(ln for ln in text.splitlines() if ln.startswith("  compose:        docker-compose.yml ships"))
        assert f"kvswitch up --agg {winner.agg}" in line and "`--role agg`" in line
