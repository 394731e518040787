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
from kvswitch.environment import PROCESS_VARIABLES, check_environment, known_variables
from protocol.config import env_names
from protocol.errors import VariableError
from router.cli import ProcessSettings
from worker_shim.config import ShimConfig

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


def _service_links(service: str, ip: str, ports: list[tuple[str, int, str]]) -> dict[str, str]:
    """The variables a kubelet sets in every pod of the namespace for `service` (enableServiceLinks;
    pkg/kubelet/envvars): each port is (name, number, protocol)."""
    svc = service.upper().replace("-", "_")
    env = {f"{svc}_SERVICE_HOST": ip, f"{svc}_SERVICE_PORT": str(ports[0][1])}
    env |= {f"{svc}_SERVICE_PORT_{name.upper().replace('-', '_')}": str(port) for name, port, _ in ports if name}
    host = f"[{ip}]" if ":" in ip else ip
    env[f"{svc}_PORT"] = f"{ports[0][2].lower()}://{host}:{ports[0][1]}"
    for _, port, proto in ports:
        prefix = f"{svc}_PORT_{port}_{proto}"
        env |= {prefix: f"{proto.lower()}://{host}:{port}", f"{prefix}_PROTO": proto.lower()}
        env |= {f"{prefix}_PORT": str(port), f"{prefix}_ADDR": ip}
    return env


def test_a_kubernetes_service_link_is_refused_naming_its_service() -> None:
    """A Service named kvswitch-router gives every pod in its namespace KVSWITCH_ROUTER_* variables
    unless the pod spec sets enableServiceLinks: false (deploy/k8s does); until 2026-12-07 each was
    refused with the nearest setting's name, which sent the operator to unrelated variables."""
    env = _service_links("kvswitch-router", "10.96.0.7", [("http", 8080, "TCP")]) | {"KVSWITCH_ROUTING": "kv"}
    assert len(env) == 9
    with pytest.raises(VariableError) as err:
        check_environment(env)
    assert str(err.value) == (
        "KVSWITCH_ROUTER_SERVICE_HOST looks like a Kubernetes service link for Service 'kvswitch-router' (as do "
        "KVSWITCH_ROUTER_PORT, KVSWITCH_ROUTER_PORT_8080_TCP, KVSWITCH_ROUTER_PORT_8080_TCP_ADDR, "
        "KVSWITCH_ROUTER_PORT_8080_TCP_PORT, KVSWITCH_ROUTER_PORT_8080_TCP_PROTO, KVSWITCH_ROUTER_SERVICE_PORT, "
        "KVSWITCH_ROUTER_SERVICE_PORT_HTTP): set enableServiceLinks: false in the pod spec or rename the Service"
    )
    assert err.value.setting == "KVSWITCH_ROUTER_SERVICE_HOST"


@pytest.mark.parametrize(
    ("service", "ip", "ports"),
    [
        ("kvswitch", "10.96.0.1", [("", 80, "TCP")]),  # KVSWITCH_SERVICE_PORT: kvswitch's, not kvswitch-service's
        ("kvswitch-nats", "fd00::a", [("client", 4222, "TCP"), ("monitor", 8222, "TCP")]),  # a Helm release's
        ("kvswitch-dns", "10.96.0.10", [("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")]),
    ],
)
def test_every_variable_of_a_service_link_is_named_with_its_service(
    service: str, ip: str, ports: list[tuple[str, int, str]]
) -> None:
    env = _service_links(service, ip, ports)
    with pytest.raises(VariableError) as err:
        check_environment(env)
    said = str(err.value)
    assert said.count("looks like a Kubernetes service link") == 1
    assert f"for Service {service!r}" in said
    assert sorted(NAME.findall(said)) == sorted(env)


def test_service_links_and_typos_are_refused_together() -> None:
    env = _service_links("kvswitch", "10.96.0.1", [("", 80, "TCP")]) | {"KVSWITCH_DISAG": "never"}
    env |= {"KVSWITCH_HTPP_PORT": "8080", "KVSWITCH_NATS_PORT": "tcp://nats:4222"}  # link-shaped names, typos' values
    with pytest.raises(VariableError) as err:
        check_environment(env)
    assert str(err.value) == (
        "KVSWITCH_SERVICE_HOST looks like a Kubernetes service link for Service 'kvswitch' (as do KVSWITCH_PORT, "
        "KVSWITCH_PORT_80_TCP, KVSWITCH_PORT_80_TCP_ADDR, KVSWITCH_PORT_80_TCP_PORT, KVSWITCH_PORT_80_TCP_PROTO, "
        "KVSWITCH_SERVICE_PORT): set enableServiceLinks: false in the pod spec or rename the Service; "
        "KVSWITCH_DISAG is no kvswitch setting (did you mean KVSWITCH_DISAGG?); "
        "KVSWITCH_HTPP_PORT is no kvswitch setting (did you mean KVSWITCH_HTTP_PORT?); "
        "KVSWITCH_NATS_PORT is no kvswitch setting (did you mean KVSWITCH_NATS_PASSWORD?)"
    )


def test_the_process_variables_are_the_routers_and_the_shims() -> None:
    """Written out so that no process imports the router and the shim to check its environment."""
    assert env_names(ProcessSettings) | env_names(ShimConfig) == PROCESS_VARIABLES


def test_a_sim_with_the_routers_and_the_shims_variables_imports_neither() -> None:
    """One environment shared by every process (a ConfigMap) made `kvswitch sim --help` import the
    router and the shim to know their variables: 429 ms became 1,172 ms, 52 MB of memory 91 MB."""
    env = {**os.environ, "KVSWITCH_HTTP_PORT": "8080", "KVSWITCH_MODEL": "m", "KVSWITCH_ENGINE_URL": "http://e"}
    code = (
        "import contextlib, io, sys\n"
        "from kvswitch.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['sim', '--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('router', 'worker_shim')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "[]\n"


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
