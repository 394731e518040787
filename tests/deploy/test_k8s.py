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

from kvswitch.certs import write_tls
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


def test_the_autoscaler_alone_sets_the_router_count(objects: list[dict[str, Any]]) -> None:
    """A `replicas` on the Deployment beside its autoscaler set the count back to it on every
    `kubectl apply -k`; the autoscaler's minReplicas is the floor (2: one replica is not HA)."""
    router = next(o for o in _by_kind(objects, "Deployment") if o["metadata"]["name"] == "router")
    (hpa,) = _by_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "router"}
    assert "replicas" not in router["spec"]
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_the_upgrade_notes_drop_the_remembered_router_count_before_the_first_apply() -> None:
    """The manifests of before 2026-12-06 said `replicas: 2`, which a client-side `kubectl apply`
    keeps in its last-applied annotation: the first `apply -k` without it deletes the field and the
    Deployment falls to 1 router. docs/deployment.md's Upgrades must say to drop it first."""
    base = K8S / "base"
    namespace = yaml.safe_load((base / "kustomization.yaml").read_text())["namespace"]
    router = next(d for d in yaml.safe_load_all((base / "router.yaml").read_text()) if d["kind"] == "Deployment")
    upgrades = (ROOT / "docs" / "deployment.md").read_text().split("\n## Upgrades\n", 1)[1].split("\n## ", 1)[0]
    commands = [line for block in upgrades.split("```")[1::2] for line in block.splitlines()]
    edit = f"kubectl apply edit-last-applied deployment/{router['metadata']['name']} -n {namespace}"
    assert edit in commands, "docs/deployment.md, Upgrades: no command dropping the router's remembered replicas"


def test_the_router_disruption_budget_lets_a_drain_evict_unready_routers(objects: list[dict[str, Any]]) -> None:
    """/ready is 503 on every replica alike when NATS is down or no worker is routable: under the
    default policy (IfHealthyBudget) none could be evicted then, and `kubectl drain` hung."""
    (pdb,) = _by_kind(objects, "PodDisruptionBudget")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_routers_liveness_and_startup_probes_ask_only_whether_it_answers(objects: list[dict[str, Any]]) -> None:
    """/health answers from the moment the router listens, before NATS and etcd are reached
    (tests/router/test_start_door.py); /ready says whether it serves."""
    router = next(o for o in _by_kind(objects, "Deployment") if o["metadata"]["name"] == "router")
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity in bytes (`16Gi`, `512Mi`, `1G`, a plain number)."""
    text = str(quantity)
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), "")
    return int(float(text.removesuffix(unit)) * _UNITS.get(unit, 1))


def test_the_quantities_parse() -> None:
    assert [_bytes(q) for q in ("16Gi", "512Mi", "1G", 1024)] == [16 * 2**30, 512 * 2**20, 10**9, 1024]


def test_every_long_running_container_requests_cpu_and_memory(objects: list[dict[str, Any]]) -> None:
    """The scheduler places a pod by its requests: a container without any (the vLLM engines until
    2026-12-06) counts as needing nothing, and lands on a node without the memory to load its model."""
    missing = [
        f"{o['metadata']['name']}/{c['name']}: {sorted(c.get('resources', {}).get('requests', {}))}"
        for o in _by_kind(objects, "Deployment")
        for c in o["spec"]["template"]["spec"]["containers"]
        if not {"cpu", "memory"} <= c.get("resources", {}).get("requests", {}).keys()
    ]
    assert missing == [], missing


def test_a_memory_backed_volume_fits_in_its_containers_memory_request(objects: list[dict[str, Any]]) -> None:
    """A `medium: Memory` emptyDir (vLLM's /dev/shm) is tmpfs: what is written there counts against
    the memory of the container writing it, so its request must hold the volume and the process."""
    checked = 0
    for o in _by_kind(objects, "Deployment"):
        pod = o["spec"]["template"]["spec"]
        in_memory = {
            v["name"]: _bytes(v["emptyDir"]["sizeLimit"])
            for v in pod.get("volumes", [])
            if v.get("emptyDir", {}).get("medium") == "Memory"
        }
        for c in pod["containers"]:
            for mount in c.get("volumeMounts", []):
                if (size := in_memory.get(mount["name"])) is not None:
                    checked += 1
                    request = _bytes(c["resources"]["requests"]["memory"])
                    assert request > size, f"{o['metadata']['name']}/{c['name']}: {request} <= {mount['name']} {size}"
    vllm = [o for o in _by_kind(objects, "Deployment") if o["metadata"]["name"].startswith("engine-vllm")]
    assert checked == len(vllm)  # one /dev/shm each; the sim's pods have none


def test_every_container_with_a_writable_root_filesystem_is_named_in_the_security_doc(
    objects: list[dict[str, Any]],
) -> None:
    """docs/security.md said every pod runs with a read-only root filesystem while the vLLM engines
    did not: each image that does not must be named there as the exception it is."""
    lines = (ROOT / "docs" / "security.md").read_text().splitlines()
    row = next(line for line in lines if line.startswith("| the runtime image"))
    pods = [o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Deployment", "Job")]
    writable = {
        c["image"].rsplit(":", 1)[0]
        for pod in pods
        for c in [*pod.get("initContainers", []), *pod["containers"]]
        if c.get("securityContext", {}).get("readOnlyRootFilesystem") is not True
    }
    assert "kvswitch" not in writable
    assert all(f"`{image}`" in row for image in writable), (writable, row)


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
        # one name, the chart's client Service: gRPC balances over what it resolves to (several
        # names never connected: discovery.session.channel_target)
        assert shim.etcd_endpoints == ["https://etcd.kvswitch.svc.cluster.local:2379"]
        (seed,) = [v for v in engine["spec"]["template"]["spec"]["volumes"] if v["name"] == "nats"]
        assert [i["key"] for i in seed["secret"]["items"]] == [f"worker-{shim.role}-0.nk"]  # its own seed only


def test_pods_run_as_non_root_without_privilege(objects: list[dict[str, Any]]) -> None:
    for container in _containers(objects):
        if not container["image"].startswith("kvswitch:"):
            continue
        pod_or_container = container.get("securityContext", {})
        assert pod_or_container["allowPrivilegeEscalation"] is False
        assert pod_or_container["capabilities"]["drop"] == ["ALL"]


def test_every_pod_turns_kubernetes_service_links_off(objects: list[dict[str, Any]]) -> None:
    """kvswitch finds its peers by DNS. With service links on (the default) a Service named
    kvswitch-* in the namespace gives each pod KVSWITCH_ variables, which every kvswitch process
    refuses at start (kvswitch.environment): the next rollout would crash-loop."""
    pods = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]
    assert len(pods) >= 3
    for obj in pods:
        assert obj["spec"]["template"]["spec"].get("enableServiceLinks") is False, obj["metadata"]["name"]


def test_every_container_can_read_the_secret_files_it_mounts(objects: list[dict[str, Any]]) -> None:
    """The kubelet writes a Secret volume's files owned by root, with the mode the volume declares
    (`items[].mode`, else `defaultMode`, else 0644), in group root or, with the pod's fsGroup, in
    that group, which every container of the pod also holds. At 0400 root:root uid 10001 could not
    read its NATS seed or the API keys, and every kvswitch pod crash-looped."""
    unreadable, checked = [], 0
    for obj in objects:
        if obj["kind"] not in ("Deployment", "Job"):
            continue
        pod = obj["spec"]["template"]["spec"]
        pod_context = pod.get("securityContext", {})
        file_group = pod_context.get("fsGroup", 0)
        secrets = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
        for container in pod.get("initContainers", []) + pod["containers"]:
            context = {**pod_context, **container.get("securityContext", {})}
            uid = context.get("runAsUser")
            groups = {context.get("runAsGroup"), pod_context.get("fsGroup"), *pod_context.get("supplementalGroups", [])}
            for mount in container.get("volumeMounts", []):
                if (secret := secrets.get(mount["name"])) is None:
                    continue
                for item in secret.get("items", [{}]):
                    mode = item.get("mode", secret.get("defaultMode", 0o644))
                    checked += 1
                    if not (uid == 0 or mode & 0o004 or (mode & 0o040 and file_group in groups)):
                        name = f"{obj['metadata']['name']}/{container['name']}"
                        unreadable.append(f"{name}: {secret['secretName']} {oct(mode)} group {file_group}, uid {uid}")
    assert checked and not unreadable, unreadable


def test_the_documented_sequence_completes_the_etcd_auth_job_before_the_pods_start() -> None:
    """Routers and shims carry etcd credentials: one that reached etcd before the Job turned
    authentication on exited 2 and was restarted with back-off. Nothing in `apply -k` orders them."""
    job = yaml.safe_load((K8S / "base" / "etcd-auth-job.yaml").read_text())["metadata"]["name"]
    block = (ROOT / "docs" / "deployment.md").read_text().split("## Kubernetes", 1)[1].split("```")[1]
    commands = [line for line in block.splitlines() if line.startswith(("kubectl", "helm"))]

    def at(fragment: str) -> int:
        found = [i for i, line in enumerate(commands) if fragment in line]
        assert found, f"no {fragment!r} in docs/deployment.md's Kubernetes commands"
        return found[0]

    assert (
        at("helm install etcd")
        < at("apply -f deploy/k8s/base/etcd-auth-job.yaml")
        < at(f"wait --for=condition=complete job/{job}")
        < at("apply -k deploy/k8s/")
    )


def test_helm_values_ask_for_three_members_and_tls(tmp_path: Path) -> None:
    nats = yaml.safe_load((K8S / "helm" / "nats-values.yaml").read_text())
    # routes and peers each under their own identity, pinned to its name (kvswitch.certs): with the
    # clients' Secret, the etcd key joined the NATS cluster as a route (until 2026-12-07)
    assert nats["config"]["cluster"] == {
        "enabled": True,
        "replicas": 3,
        "tls": {
            "enabled": True,
            "secretName": "nats-route-tls",
            "dir": "/etc/nats-certs/cluster",
            "merge": {"ca_file": "/etc/nats-certs/cluster/ca.crt", "verify_and_map": True},
        },
        "merge": {"authorization": {"user": write_tls(tmp_path, ["nats"]).nats_route.subject()}},
    }
    assert nats["config"]["nats"]["tls"] == {"enabled": True, "secretName": "nats-tls"}
    etcd = yaml.safe_load((K8S / "helm" / "etcd-values.yaml").read_text())
    assert etcd["replicaCount"] == 3
    assert etcd["auth"]["client"]["secureTransport"] is True and etcd["auth"]["peer"]["secureTransport"] is True
    assert etcd["auth"]["client"]["existingSecret"] == "etcd-tls"
    assert etcd["auth"]["peer"]["existingSecret"] == "etcd-peer-tls"
    assert {"name": "ETCD_PEER_CERT_ALLOWED_CN", "value": write_tls(tmp_path, ["nats"]).etcd_peer.common_name()} in (
        etcd["extraEnvVars"]
    )


def test_generated_helm_permissions_merge_into_the_nats_chart_config() -> None:
    plan = NatsAuthPlan.generate("kvswitch", ["router"], ["prefill-0", "decode-0"])
    users = plan.helm_values()["config"]["merge"]["authorization"]["users"]
    assert len(users) == 3
    decode = next(u for u in users if u["nkey"] == plan.identity("worker", "decode-0").public_key)
    assert decode["permissions"]["publish"]["allow"] == ["kvswitch.kv.decode-0", "kvswitch.load.decode-0"]
