"""deploy/k8s: kustomize builds offline, every object validates against the Kubernetes schema, and
every kvswitch command in it parses with the CLI's own parser."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvswitch.nats_auth import NatsAuthPlan
from tests.deploy.commands import kv_endpoints, loopback_only, parse

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["sim", "vllm"]
K8S_VERSION = "1.32.0"


def _build(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects: `kubectl kustomize` when installed, else the files it names, read directly."""
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        out = subprocess.run([kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    docs: list[dict[str, Any]] = []
    for directory in (K8S / "base", K8S / overlay):
        for name in yaml.safe_load((directory / "kustomization.yaml").read_text())["resources"]:
            if not name.startswith(".."):
                docs += [d for d in yaml.safe_load_all((directory / name).read_text()) if d]
    return docs


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return _build(str(request.param))


def _by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        c for o in objects if o["kind"] in ("Deployment", "Job") for c in o["spec"]["template"]["spec"]["containers"]
    ]


def test_every_object_validates_against_the_kubernetes_schema(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_catches_a_wrong_field(objects: list[dict[str, Any]]) -> None:
    router = dict(_by_kind(objects, "Service")[0])
    router["spec"] = {**router["spec"], "replicas": 3}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, K8S_VERSION, strict=True)


def test_the_router_has_service_autoscaler_disruption_budget_and_readiness(objects: list[dict[str, Any]]) -> None:
    deployments = {o["metadata"]["name"]: o for o in _by_kind(objects, "Deployment")}
    router = deployments["router"]
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    labels = router["spec"]["template"]["metadata"]["labels"]
    (service,) = _by_kind(objects, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    (hpa,) = _by_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "router" and hpa["spec"]["minReplicas"] >= 2
    (pdb,) = _by_kind(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert all(o["metadata"].get("namespace") == "kvswitch" for o in objects if o["kind"] != "Namespace")


def test_every_kvswitch_command_parses_with_the_cli(objects: list[dict[str, Any]]) -> None:
    parsed = [parse(c["args"])[0] for c in _containers(objects) if c["image"].startswith("kvswitch:")]
    assert {"router", "shim", "secrets"} <= set(parsed)


def test_each_engine_publishes_where_its_sidecar_shim_listens_on_loopback_only(objects: list[dict[str, Any]]) -> None:
    engines = [o for o in _by_kind(objects, "Deployment") if o["metadata"]["name"].startswith("engine-")]
    assert len(engines) == 2
    for engine in engines:
        containers = {c["name"]: c for c in engine["spec"]["template"]["spec"]["containers"]}
        shim = parse(containers["shim"]["args"])[1]
        flag = next(a for a in containers["engine"]["args"] if a.startswith("--kv-events-config="))
        events, replay = kv_endpoints(flag.split("=", 1)[1])
        assert (events, replay) == (shim.kv_events, shim.kv_replay)
        assert loopback_only(events) and loopback_only(replay)
        assert "--host=127.0.0.1" in containers["engine"]["args"]
        assert shim.engine_url.startswith("http://127.0.0.1:")
        assert shim.nats_servers[0].startswith("tls://") and shim.etcd_endpoints[0].startswith("https://")
        assert len(shim.etcd_endpoints) == 3  # every member: the shim fails over by itself
        (seed,) = [v for v in engine["spec"]["template"]["spec"]["volumes"] if v["name"] == "nats"]
        assert [i["key"] for i in seed["secret"]["items"]] == [f"worker-{shim.role}-0.nk"]  # its own seed only


def test_pods_run_as_non_root_without_privilege(objects: list[dict[str, Any]]) -> None:
    for container in _containers(objects):
        if not container["image"].startswith("kvswitch:"):
            continue
        pod_or_container = container.get("securityContext", {})
        assert pod_or_container["allowPrivilegeEscalation"] is False
        assert pod_or_container["capabilities"]["drop"] == ["ALL"]


def test_helm_values_ask_for_three_members_and_tls() -> None:
    nats = yaml.safe_load((K8S / "helm" / "nats-values.yaml").read_text())
    assert nats["config"]["cluster"] == {
        "enabled": True,
        "replicas": 3,
        "tls": {"enabled": True, "secretName": "nats-tls"},
    }
    assert nats["config"]["nats"]["tls"]["enabled"] is True
    etcd = yaml.safe_load((K8S / "helm" / "etcd-values.yaml").read_text())
    assert etcd["replicaCount"] == 3
    assert etcd["auth"]["client"]["secureTransport"] is True and etcd["auth"]["peer"]["secureTransport"] is True


def test_generated_helm_permissions_merge_into_the_nats_chart_config() -> None:
    plan = NatsAuthPlan.generate("kvswitch", ["router"], ["prefill-0", "decode-0"])
    users = plan.helm_values()["config"]["merge"]["authorization"]["users"]
    assert len(users) == 3
    decode = next(u for u in users if u["nkey"] == plan.identity("worker", "decode-0").public_key)
    assert decode["permissions"]["publish"]["allow"] == ["kvswitch.kv.decode-0", "kvswitch.load.decode-0"]
