"""docker-compose.yml: every kvswitch command parses with the CLI's own parser, the security is on,
host ports stay on 127.0.0.1, and the file validates with docker compose where it is installed.
The Grafana dashboard only charts metrics the router exports (and the shim's, named as agreed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.metrics import RouterMetrics, StateFigures
from tests.deploy.commands import loopback_only, parse

ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {f"KVSWITCH_ETCD_{r}_PASSWORD": f"test-{r.lower()}" for r in ("ROOT", "ROUTER", "WORKER")}


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])


def _kvswitch(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Services that run `kvswitch COMMAND`: the image's entrypoint, or a wrapper ending in it (the
    engines' hold-sigterm.sh); a network namespace's owner runs `sleep` from the same image."""
    return {
        n: s
        for n, s in services.items()
        if str(s.get("image", "")).startswith("kvswitch:") and s.get("entrypoint", ["kvswitch"])[-1] == "kvswitch"
    }


def test_every_kvswitch_command_parses_with_the_cli(services: dict[str, dict[str, Any]]) -> None:
    commands = {name: parse(s["command"])[0] for name, s in _kvswitch(services).items()}
    assert sorted(commands.values()) == sorted(["secrets", "secrets", "sim", "shim", "sim", "shim", "router", "router"])


def test_each_shim_listens_where_its_engine_publishes_on_loopback(services: dict[str, dict[str, Any]]) -> None:
    shims = {n: s for n, s in services.items() if s.get("command", [None])[0] == "shim"}
    assert len(shims) == 2
    for shim in shims.values():
        sims = [s for s in services.values() if s.get("command", [None])[0] == "sim"]
        (engine,) = [s for s in sims if s["network_mode"] == shim["network_mode"]]  # its namespace's engine
        sim_args = parse(engine["command"])[1]
        shim_args = parse(shim["command"])[1]
        assert sim_args.host == "127.0.0.1"
        assert (sim_args.kv_events_config.endpoint, sim_args.kv_events_config.replay_endpoint) == (
            shim_args.kv_events,
            shim_args.kv_replay,
        )
        assert loopback_only(shim_args.kv_events) and shim_args.engine_url.startswith("http://127.0.0.1:")
        assert shim["environment"]["KVSWITCH_ETCD_USER"] == "worker"


def test_security_is_on(services: dict[str, dict[str, Any]]) -> None:
    secrets = parse(services["secrets"]["command"])[1]
    for name, service in _kvswitch(services).items():
        command = parse(service["command"])
        if command[0] not in ("router", "shim"):
            continue
        env = service["environment"]
        assert env["KVSWITCH_NATS_SERVERS"].startswith("tls://") and env["KVSWITCH_NATS_TLS_CA"]
        assert env["KVSWITCH_ETCD_ENDPOINTS"].startswith("https://") and env["KVSWITCH_ETCD_TLS_CA"]
        assert env["KVSWITCH_ETCD_PASSWORD"].startswith("${")  # from the operator, never in the file
        seed = Path(command[1].nats_nkey_file).name
        identities = [f"router-{r}.nk" for r in secrets.routers] + [f"worker-{w}.nk" for w in secrets.workers]
        assert seed in identities, f"{name} uses {seed}, which `kvswitch secrets` does not write"
    nats_conf = (ROOT / "deploy" / "compose" / "nats.conf").read_text()
    assert "tls {" in nats_conf and 'include "secrets/nats-auth.conf"' in nats_conf
    assert "--cert-file=/secrets/tls/etcd.crt" in services["etcd"]["command"]
    # each server its own key (kvswitch.certs): with one, the etcd key made a NATS route (until 2026-12-07)
    assert (
        '"/etc/nats/secrets/tls/nats.key"' in nats_conf
        and "--key-file=/secrets/tls/etcd.key" in (services["etcd"]["command"])
    )


def test_host_ports_are_published_on_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published
    assert all(str(p).startswith("127.0.0.1:") for p in published), published


def test_the_monitoring_profile_runs_prometheus_and_grafana(services: dict[str, dict[str, Any]]) -> None:
    assert services["prometheus"]["profiles"] == ["monitoring"] == services["grafana"]["profiles"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {"router-1:8080", "router-2:8080"} <= targets
    assert {t.split(":")[0] for t in targets} <= services.keys()


def _router_metric_names() -> set[str]:
    """The sample names the router's /metrics can carry, from a rendering of it: a counter's
    `_total`, a histogram's `_bucket`, `_sum` and `_count`, a gauge's own. Names read from the
    source let the bare names of counters and histograms through, which Prometheus never has."""
    text = RouterMetrics(StateFigures).render().decode()
    names: set[str] = set()
    for name, kind in re.findall(r"# TYPE (kvswitch_router_\S+) (\S+)", text):
        if name.endswith("_created"):
            continue  # prometheus_client's creation time of an unlabelled histogram, not a metric of ours
        names |= {f"{name}_{s}" for s in ("bucket", "sum", "count")} if kind == "histogram" else {name}
    return names


def _shim_metric_names() -> set[str]:
    """The names worker_shim/metrics.py exports (kvswitch_shim_ + each _gauge's and _counter's
    name, a counter's with _total, and the families named in full). Until 2026-12-03 the dashboard
    was checked against a list written by hand, and charted four gauges the shim never had."""
    source = (ROOT / "worker_shim" / "metrics.py").read_text()
    gauges = re.findall(r'_gauge\(\s*"([a-z_]+)"', source)
    gauges += re.findall(r'GaugeMetricFamily\(\s*P \+ "([a-z_]+)"', source)
    counters = re.findall(r'_counter\(\s*"([a-z_]+)"', source)
    counters += re.findall(r'CounterMetricFamily\(\s*P \+ "([a-z_]+)"', source)
    return {f"kvswitch_shim_{g}" for g in gauges} | {f"kvswitch_shim_{c}_total" for c in counters}


def test_the_dashboard_charts_only_metrics_that_exist() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvswitch.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"kvswitch_[a-z_]+", e)}
    router = {m for m in used if m.startswith("kvswitch_router_")}
    assert router <= _router_metric_names(), router - _router_metric_names()
    shim = {m for m in used if m.startswith("kvswitch_shim_")}
    assert shim <= _shim_metric_names(), shim - _shim_metric_names()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("outcome", "bypass", "ttft", "itl", "index", "lag", "per-worker load", "shim health"):
        assert topic in titles, topic


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def test_docker_compose_config_validates() -> None:
    compose = _compose_command()
    if compose is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    for profile in ([], ["--profile", "monitoring"]):
        out = subprocess.run(
            [*compose, *profile, "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
            capture_output=True, text=True, timeout=60, env={**os.environ, **PASSWORDS},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    unset = {k: v for k, v in os.environ.items() if k not in PASSWORDS}
    out = subprocess.run(
        [*compose, "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True, text=True, timeout=60, env=unset,
    )  # fmt: skip
    assert out.returncode != 0 and "KVSWITCH_ETCD_" in out.stderr  # no default password to fall back on
