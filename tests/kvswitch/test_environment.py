"""Every `kvswitch` subcommand refuses, before it starts, a KVSWITCH_ variable that no kvswitch
process reads, naming the nearest one (kvswitch.environment); every variable some process reads,
as the deployments' shared environments set them, passes. Audit 2026-12-07: KVSWITCH_DISAG=never
started a router with disagg=conditional without a word."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvswitch.cli import SUBCOMMANDS, main
from kvswitch.environment import check_environment, known_variables
from protocol.errors import VariableError

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"KVSWITCH_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_])")  # not a prefix (`KVSWITCH_ETCD_*`)


@pytest.mark.parametrize("subcommand", list(SUBCOMMANDS))
def test_every_subcommand_refuses_a_misspelt_variable_before_anything(
    subcommand: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--help included: the refusal comes before any parser is built (sim's and up's list the
    timing tables of KVSWITCH_PROFILE_DIR)."""
    monkeypatch.setenv("KVSWITCH_DISAG", "never")
    assert main([subcommand, "--help"]) == 2
    out = capsys.readouterr()
    assert out.err == f"kvswitch {subcommand}: KVSWITCH_DISAG is no kvswitch setting (did you mean KVSWITCH_DISAGG?)\n"
    assert out.out == ""


@pytest.mark.parametrize(
    ("variable", "nearest"),
    [
        ("KVSWITCH_ROUTNG", "KVSWITCH_ROUTING"),  # the router's live settings
        ("KVSWITCH_TOKENISER", "KVSWITCH_TOKENIZER"),  # the router's process settings
        ("KVSWITCH_routing", "KVSWITCH_ROUTING"),  # names are read upper case
        ("KVSWITCH_ENGINE_URI", "KVSWITCH_ENGINE_URL"),  # the shim's
        ("KVSWITCH_ETCD_PASWORD", "KVSWITCH_ETCD_PASSWORD"),
        ("KVSWITCH_LOG_LEVL", "KVSWITCH_LOG_LEVEL"),  # process-wide ones
        ("KVSWITCH_FREE_PORT", "KVSWITCH_FREE_PORTS"),
    ],
)
def test_the_refusal_names_the_nearest_variable(variable: str, nearest: str) -> None:
    with pytest.raises(VariableError) as err:
        check_environment({variable: "x", "KVSWITCH_HTTP_PORT": "8080"})
    assert str(err.value) == f"{variable} is no kvswitch setting (did you mean {nearest}?)"
    assert err.value.setting == variable


def test_every_unknown_variable_is_named_and_no_value_shown() -> None:
    with pytest.raises(VariableError) as err:
        check_environment({"KVSWITCH_ETCD_PASWD": "s3cret", "KVSWITCH_XYZZY": "1", "KVSWITCH_ROUTING": "kv"})
    said = str(err.value)
    assert said == (
        "KVSWITCH_ETCD_PASWD is no kvswitch setting (did you mean KVSWITCH_ETCD_PASSWORD?); "
        "KVSWITCH_XYZZY is no kvswitch setting"
    )


def test_a_router_started_with_a_misspelt_variable_exits_2_naming_it() -> None:
    env = {**os.environ, "KVSWITCH_DISAG": "never"}
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "router", "--http-port", "0", "--nats-servers", "nats://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == "kvswitch router: KVSWITCH_DISAG is no kvswitch setting (did you mean KVSWITCH_DISAGG?)\n"


def test_a_profile_dir_that_is_no_directory_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path / "missing"))
    assert main(["router", "--help"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"kvswitch router: KVSWITCH_PROFILE_DIR = '{tmp_path / 'missing'}' names no directory"), said


def test_one_environment_shared_by_router_and_shims_passes() -> None:
    """A compose env_file or a ConfigMap given to every process: each process's settings, the
    router's and the shim's, and the process-wide variables."""
    env = {
        "KVSWITCH_NATS_SERVERS": "nats://nats:4222",
        "KVSWITCH_ETCD_ENDPOINTS": "http://etcd:2379",
        "KVSWITCH_ETCD_USER": "router",
        "KVSWITCH_ETCD_PASSWORD": "pw",
        "KVSWITCH_ROUTING": "kv",  # RouterSettings
        "KVSWITCH_CONDITIONAL_DISAGG_POLICY": "slo_aware",  # its nested conditional settings
        "KVSWITCH_HTTP_PORT": "8080",  # the router's and the shim's process settings
        "KVSWITCH_TOKENIZER": "/models/llama",
        "KVSWITCH_ENGINE_URL": "http://127.0.0.1:8000",  # the shim's alone
        "KVSWITCH_ROLE": "decode",
        "KVSWITCH_LOG_FORMAT": "json",
        "KVSWITCH_PROFILE_DIR": str(ROOT / "protocol" / "profiles"),
        "KVSWITCH_ETCD_ROOT_PASSWORD": "pw",  # kvswitch secrets'
        "KVSWITCH_NO_API_KEYS": "",  # a flag-only switch: the router refuses it naming its flag
    }
    check_environment(env)


def test_the_test_suite_s_own_environment_passes() -> None:
    check_environment()  # KVSWITCH_FREE_PORTS under xdist (tests/conftest.py), and whatever CI sets


def _deployment_files() -> list[Path]:
    files = [ROOT / "docker-compose.yml", ROOT / "Makefile"]
    return files + sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file() and p.suffix != ".json")


def test_every_variable_the_deployments_and_docs_set_is_known() -> None:
    """docker-compose.yml, deploy/ (k8s, Helm, compose) and the docs name only variables a process
    reads: each would otherwise refuse to start, or a doc send an operator to a variable refused."""
    known = known_variables()
    files = _deployment_files() + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    unknown = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for line in path.read_text().splitlines()
        if "is no kvswitch setting" not in line  # the refusal's own example
        for name in NAME.findall(line)
        if name not in known
    }
    assert not unknown, sorted(unknown)


def test_every_variable_the_code_reads_by_name_is_known() -> None:
    """A `"KVSWITCH_..."` string in the code (an os.environ read outside the settings schemas, as
    KVSWITCH_LOG_LEVEL's) must be known too, or its process would refuse its own variable."""
    known = known_variables()
    packages = ("protocol", "runtime", "discovery", "engine_sim", "worker_shim", "router", "kvswitch", "bench")
    read = {
        f"{path.relative_to(ROOT)}: {node.value}"
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)
        if node.value not in known
    }
    assert not read, sorted(read)
